"""The step-time lower bound of a measured run, from its trace (`simulator.bound`'s terms):
what each rank sent to whom (`send_bytes`), what it computed, and, for a pipeline of
stages, the fill and drain its layout cannot avoid (`pipeline_fill`, and on each NIC
`hand_over_windows`), and for data-parallel
replicas the gradient reduction no order can start before the final backward
(`last_buckets`, after the drain from the stages above, `drains_from_above`; all in
`trace_bound(fill=True)`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from ..simulator.bound import Bound, worker_bound
from ..trace import (
    Interval,
    overlap_length,
    parse_event_name,
    total_length,
    union_intervals,
)
from .bucket_windows import (
    before_last_buckets,
    bucket_key,
    compute_s,
    final_backward_start,
    last_buckets,
    stage_buckets,
)
from .stage_view import stage_view

Event = dict[str, Any]


def send_bytes(e: Event) -> list[tuple[int, float]]:
    """(destination rank, bytes) of one traced send: a message, a pipeline p2p, an
    all-to-all (bytes per member), or a gradient all-reduce (ring in member order: each
    member sends 2 (g - 1) / g of the buffer to the next one)."""
    args = e["args"]
    if e["cat"] == "sync":
        peers = args.get("peers") or []
        if len(peers) < 2 or e["pid"] not in peers:
            return []
        g = len(peers)
        nxt = peers[(peers.index(e["pid"]) + 1) % g]
        return [(nxt, 2.0 * (g - 1) / g * args.get("bytes", 0))]
    if e["cat"] != "send":
        return []
    if "dst" in args:
        return [(args["dst"], float(args.get("bytes", 0)))]
    return [
        (r, float(b))
        for r, b in zip(args.get("peers", []), args.get("peer_bytes", []), strict=True)
    ]


def pipeline_fill(
    events: list[Event], hop_s: Callable[[Event], float] | None = None
) -> dict[int, tuple[float, float]]:
    """{rank: (head s, tail s)} of one step of a pipeline of stages (the ep-* runtimes'
    `stage` events; empty for a run without them).

    A rank whose first stage (in forward order: stage index) is f cannot start its
    first forward before stages 0..f-1 have each run one micro-batch's forward and handed
    it on, and the step cannot end before, after its last backward, stages f..1 have each
    handed an input gradient down and stages f-1..0 run it (B, or I where the runtime
    splits the weight gradient W off). Each stage's forward / backward is the least
    compute any of its micro-batches took on any rank holding it with the device to itself
    (blocking waits inside excluded), or where none had, the least of their time alone
    (`_alone_s`); each hand-over (`send act sK`: stage K to K + 1,
    `send grad sK`: stage K to K - 1) the least `hop_s` of its sends: one message alone on
    its link (None: transfers left out; a stage handing over on its own rank, a V turn,
    sends nothing and costs nothing). So head and tail hold under any order of the
    runtime's operations at this layout and micro-batch count."""
    return _fills(_stage_costs(events, hop_s))


def _fills(costs: _StageCosts) -> dict[int, tuple[float, float]]:
    """`pipeline_fill` from its stage costs."""
    fwd, bwd, hops, stages = costs
    out = {}
    for rank, held in stages.items():
        first = min(held)
        out[rank] = (
            sum(fwd.get(s, 0.0) + hops.get(("act", s), 0.0) for s in range(first)),
            sum(bwd.get(s, 0.0) + hops.get(("grad", s + 1), 0.0) for s in range(first)),
        )
    return out


def hand_over_windows(
    events: list[Event], hop_s: Callable[[Event], float] | None = None
) -> dict[tuple[str, int], tuple[float, float]]:
    """{(kind, sending stage): (head s, tail s)} of a pipeline's hand-overs in one step
    (`pipeline_fill`'s stages, least computes and hops), and ("sync", K) for the gradient
    all-reduces of stage K (STEP's as K = 0, -1 where the bucket names no stage). None of them can start before `head`: the
    forwards that produce an activation (stage 0 up to K), for an input gradient all the
    forwards and then the backwards from the last stage down to K, for an all-reduce all
    the forwards and the backwards above K; after any one arrives the step cannot end
    before `tail` more: the rest of its micro-batch's forward and all of its backward (an
    activation), the backwards below it (an input gradient), nothing (an all-reduce)."""
    fwd, bwd, hops, _ = _stage_costs(events, hop_s)
    n = max(fwd, default=-1) + 1

    def run(kind: str, stages: range) -> float:  # computes and the hand-overs between them
        costs, key = (fwd, "act") if kind == "F" else (bwd, "grad")
        inner = stages[:-1] if kind == "F" else stages[1:]
        return sum(costs.get(t, 0.0) for t in stages) + sum(hops.get((key, t), 0.0) for t in inner)

    if n == 0:
        return {}
    forward = run("F", range(n))
    windows = {("sync", -1): (forward, 0.0)}
    for k in range(n):
        down_to = forward + run("B", range(k, n))
        rest = run("F", range(k + 1, n)) + run("B", range(n))
        windows["act", k] = (run("F", range(k + 1)), rest)
        windows["grad", k] = (down_to, run("B", range(k)))
        # a stage's first gradient bucket is final early in its backward: only the stages
        # above have run theirs
        above = forward + run("B", range(k + 1, n)) + hops.get(("grad", k + 1), 0.0)
        windows["sync", k] = (above, 0.0)
    return windows


def _hand_over(e: Event) -> tuple[str, int] | None:
    """("act" / "grad", sending stage) of a pipeline's hand-over ("send act s3 mb1"), else
    None."""
    if e["cat"] != "send" or "stage" not in e["args"] or not e["name"].startswith("send "):
        return None
    kind = e["name"].split()[1]
    return (kind, int(e["args"]["stage"])) if kind in ("act", "grad") else None


_StageCosts = tuple[
    dict[int, float], dict[int, float], dict[tuple[str, int], float], dict[int, set[int]]
]


def _stage_costs(events: list[Event], hop_s: Callable[[Event], float] | None) -> _StageCosts:
    """`pipeline_fill`'s terms: each stage's least forward and backward (B or I) compute,
    blocking waits excluded, of the runs alone on their device if it has any; each hand-over's least `hop_s` ({(kind, sending stage)}); the
    stages each rank holds."""
    waits: dict[int, list[Interval]] = defaultdict(list)
    for e in events:
        if e["args"].get("blocking"):
            waits[e["pid"]].append((e["ts"], e["ts"] + e["dur"]))
    merged = {pid: union_intervals(spans) for pid, spans in waits.items()}
    computes: dict[int, list[Event]] = defaultdict(list)
    for e in events:
        if e["cat"] in ("fwd", "bwd", "wgt") and "stage" in e["args"]:
            computes[e["pid"]].append(e)
    least: dict[tuple[str, int, bool], float] = {}  # (F / B, stage, ran alone) -> least s
    hops: dict[tuple[str, int], float] = {}
    stages: dict[int, set[int]] = defaultdict(set)
    for e in events:
        key = _hand_over(e)
        if key is not None and hop_s is not None:
            t = hop_s(e)
            hops[key] = min(hops.get(key, t), t)
        if e["cat"] not in ("fwd", "bwd") or "stage" not in e["args"]:
            continue
        what, stage = parse_event_name(e["name"]).what, int(e["args"]["stage"])
        if what not in ("F", "B", "I"):
            continue
        own, solo = _alone_s(e, merged.get(e["pid"], []), computes[e["pid"]])
        if what == "F":
            stages[e["pid"]].add(stage)
        slot = ("F" if what == "F" else "B", stage, solo)
        least[slot] = min(least.get(slot, own), own)

    def cost(kind: str) -> dict[int, float]:  # a run alone if any, else the least own part
        found = {s for k, s, _ in least if k == kind}
        return {s: least.get((kind, s, True), least.get((kind, s, False), 0.0)) for s in found}

    return cost("F"), cost("B"), hops, stages


def _alone_s(e: Event, waits: list[Interval], others: list[Event]) -> tuple[float, bool]:
    """A computation's seconds that are its own for sure: its span less its blocking waits
    and the time another computation of its rank was in flight (two in flight take turns
    on the one device: each span holds some of the other's work, and any wait for the
    device); and whether no other computation was in flight at any time of it."""
    t0, t1 = e["ts"], e["ts"] + e["dur"]
    busy = [(f["ts"], f["ts"] + f["dur"]) for f in others if f is not e]
    busy = [(max(a, t0), min(b, t1)) for a, b in busy if a < t1 and t0 < b]
    away = union_intervals([*busy, *((a, b) for a, b in waits if a < t1 and t0 < b)])
    span = [(t0, t1)]
    return (total_length(span) - overlap_length(span, away)) / 1e6, not busy


def _add_drains(
    evs: list[Event],
    by_rank: dict[int, list[Event]],
    compute: dict[int, float],
    serial: dict[int, float],
    hop: Callable[[Event], float],
    node_of: Callable[[int], int],
    node_bytes_per_s: Sequence[float],
) -> None:
    """`trace_bound(fill=True)`'s waits, into each rank's compute (`worker_bound` adds STEP
    after it): the pipeline's fill before the rank and its drain after it, where the drain
    outlasts STEP (`pipeline_fill`), and its last backward's wait for the ranks above it
    (`drains_from_above`). Then the all-reduces no order can start early, at their bytes to
    other nodes over the node's rate, alone or with the same buckets of the node's other
    ranks (from the earliest of them): the `last_buckets`, after every computation that
    precedes them and after the final backward `drains_from_above` gives; and, where it
    gives one, every bucket of that backward's stage, once that backward can start (each of
    its layers' gradients takes the final micro-batch's share only then)."""
    fills = pipeline_fill(evs, hop)
    above = drains_from_above(evs, by_rank, hop)
    last_ready: dict[int, tuple[float, float]] = {}  # rank -> (earliest start, bytes out)
    stage_ready: dict[int, tuple[float, float]] = {}
    for rank, mine in by_rank.items():
        head, tail = fills.get(rank, (0.0, 0.0))
        compute[rank] += head + max(tail - serial.get(rank, 0.0), 0.0)
        arrive, end = above.get(rank, (0.0, 0.0))
        compute[rank] = max(compute[rank], end)
        last, stage = last_buckets(mine)
        if not last:
            continue
        src = node_of(rank)

        def out_bytes(buckets: list[Event], src: int = src) -> float:
            return sum(n for e in buckets for dst, n in send_bytes(e) if node_of(dst) != src)

        own = head + compute_s(mine, partial(before_last_buckets, stage=stage))
        last_ready[rank] = (max(own, end), out_bytes(last))
        if stage >= 0:
            start = max(arrive, head + final_backward_start(mine, stage))
            stage_ready[rank] = (start, out_bytes(stage_buckets(mine, stage)))
    for ready in (last_ready, stage_ready):
        nodes: dict[int, list[int]] = defaultdict(list)
        for rank in ready:
            nodes[node_of(rank)].append(rank)
        for node, ranks in nodes.items():
            rate = node_bytes_per_s[node]
            together = min(ready[r][0] for r in ranks) + sum(ready[r][1] for r in ranks) / rate
            for r in ranks:
                compute[r] = max(compute[r], ready[r][0] + ready[r][1] / rate, together)


def drains_from_above(
    evs: list[Event],
    by_rank: dict[int, list[Event]],
    hop: Callable[[Event], float] | None = None,
) -> dict[int, tuple[float, float]]:
    """{rank: (s, s)}: the earliest the last backward of a rank's lowest stage f can start
    and end, from the ranks above it in its own pipeline (empty for a run without stages).

    Following the activations up from f: a rank q that holds the stage reached as its own
    lowest stage g ends its last backward of g after all its forwards and backwards (each
    micro-batch's backward of g is the last of q's work on it, and q has one device;
    weight gradients W left out), which start after q's fill (`pipeline_fill`); from there
    one micro-batch goes down to f: each stage's least backward and each input gradient's
    hand-over (`hop`), then f's own least backward ends it. The walk follows a pipeline's
    links only (one sender, one receiver: q's micro-batches are all the rank's), so not
    AF-Pipe's many-to-many exchanges; a stage handed to the same rank (a V's turn) sends
    nothing and ends it. So a stage-0 replica's last gradient
    buckets wait for the last stage's work and the drain below it, not only for their own
    rank's."""
    costs = _stage_costs(evs, hop)
    _, bwd, hops, stages = costs
    lowest = {rank: min(held) for rank, held in stages.items()}
    to: dict[tuple[int, int], set[int]] = defaultdict(set)  # (rank, stage) -> next ranks
    into: dict[tuple[int, int], set[int]] = defaultdict(set)  # (rank, stage) -> senders
    for e in evs:
        key = _hand_over(e)
        if key is not None and key[0] == "act":
            for d, _ in send_bytes(e):
                to[e["pid"], key[1]].add(d)
                into[d, key[1] + 1].add(e["pid"])
    # a link of one pipeline: one sender, one receiver (AF-Pipe's exchanges are many-to-many)
    holder = {
        (r, s): next(iter(ds))
        for (r, s), ds in to.items()
        if len(ds) == 1 and len(into[next(iter(ds)), s + 1]) == 1
    }
    fills = _fills(costs)

    def not_weight(e: Event) -> bool:
        return e["cat"] != "wgt" and not e["name"].startswith("W ")

    out = {}
    for rank, f in lowest.items():
        best, cur, stage = 0.0, rank, f
        while (cur, stage) in holder and stage < max(bwd, default=-1):
            cur, stage = holder[cur, stage], stage + 1
            if lowest[cur] != stage:
                continue
            down = hops.get(("grad", f + 1), 0.0) + sum(
                bwd.get(t, 0.0) + hops.get(("grad", t + 1), 0.0) for t in range(f + 1, stage)
            )
            best = max(best, fills[cur][0] + compute_s(by_rank[cur], not_weight) + down)
        if best > 0.0:
            out[rank] = (best, best + bwd.get(f, 0.0))
    return out


def _network_fills(
    evs: list[Event],
    node_of: Callable[[int], int],
    hop: Callable[[Event], float],
    rates: Sequence[float],
) -> dict[tuple[int, str], float]:
    """{(node, "out" / "in"): s} the node's NIC direction needs in a step of a pipeline of
    stages (`trace_bound(fill=True)`), from the windows of the kinds of traffic it carries
    (`hand_over_windows`: no transfer of a kind starts before its head, the step ends no
    sooner than its tail after one arrives). For any set S of kinds, the direction carries
    S's bytes after S's least head and before S's least tail:
    `min head + bytes(S) / rate + min tail`; the largest over S (the best S holds every
    kind whose head and tail are at least its own: one per pair of thresholds). With S all
    it carries, the NIC stays idle before its first hand-over and after its last; a kind
    that is no hand-over (an all-to-all) can start and end anywhere (head, tail 0). Empty
    for a run without stages."""
    windows = hand_over_windows(evs, hop)
    if not windows:
        return {}
    carried: dict[tuple[int, str], dict[tuple[str, int] | None, float]] = defaultdict(
        lambda: defaultdict(float)
    )
    for e in evs:
        crossing = [(d, b) for d, b in send_bytes(e) if node_of(d) != node_of(e["pid"])]
        if not crossing:
            continue
        kind = _hand_over(e)
        if e["cat"] == "sync":
            bucket = bucket_key(e["name"])
            # STEP: after stage 0's backward; a bucket of no stage (AF-Pipe's): any time
            # after a forward
            kind = ("sync", bucket[0] if bucket else 0)
        for d, nbytes in crossing:
            carried[node_of(e["pid"]), "out"][kind] += nbytes
            carried[node_of(d), "in"][kind] += nbytes
    out = {}
    for (node, side), held in carried.items():
        spans = [(*(windows.get(k, (0.0, 0.0)) if k else (0.0, 0.0)), b) for k, b in held.items()]
        out[node, side] = max(
            h + sum(b for hk, tk, b in inside) / rates[node] + t
            for h in {h for h, _, _ in spans}
            for t in {t for _, t, _ in spans}
            if (inside := [(hk, tk, b) for hk, tk, b in spans if hk >= h and tk >= t])
        )
    return out


def trace_bound(
    events: list[Event],
    step_times: dict[int, float],
    node_of: Callable[[int], int],
    node_bytes_per_s: Sequence[float],
    *,
    fill: bool = False,
) -> Bound:
    """The step-time lower bound (`simulator.bound`) of a measured run, from its trace.

    Per measured step and rank: compute = its compute lanes minus blocking waits, the
    optimizer STEP apart (serial: the step's least STEP over ranks, as a rank that
    finishes early waits inside its STEP's reductions for the others); network = the busier direction of its node's NIC:
    bytes its node's ranks send to / receive from other nodes (messages, pipeline p2p,
    all-to-all splits, the gradient all-reduce as a ring) / the node's rate. Traffic inside
    a node (loopback) is not counted. Median over the steps of each step's bound.

    With `fill`, a pipeline rank's compute also waits for the pipeline to fill before it
    and drain after it (`pipeline_fill`, each hand-over between nodes at least its bytes
    at the sending node's rate): head + compute + max(tail, STEP); and a data-parallel
    replica's step cannot end before the all-reduce of the gradient buckets its final
    backward completes (`last_buckets`) has run after it and after the drain from the
    stages above it (`drains_from_above`), then STEP (`_add_drains`). The
    bound of the run's layout and micro-batch count, not of its hardware alone. A node's
    NIC direction also carries each set of its kinds of traffic inside their windows
    (`_network_fills`): it stays idle before its first pipeline hand-over can leave and
    after its last arrives, and after its last activation the rest of that micro-batch
    must run. An AF-Pipe run
    is a pipeline of its layers' attention and experts (`stage_view`), and its attention
    replicas' last bucket counts the same way.
    """

    def hop(e: Event) -> float:  # one pipeline message alone on its node's NIC
        src = node_of(e["pid"])
        return sum(
            nbytes / node_bytes_per_s[src] for dst, nbytes in send_bytes(e) if node_of(dst) != src
        )

    per_step: dict[int, list[Event]] = defaultdict(list)
    for e in events:
        step = e.get("args", {}).get("step")
        if e.get("ph") == "X" and step in step_times:
            per_step[step].append(e)
    bounds = []
    for evs in per_step.values():
        by_rank: dict[int, list[Event]] = defaultdict(list)
        out: dict[int, float] = defaultdict(float)
        into: dict[int, float] = defaultdict(float)
        for e in evs:
            by_rank[e["pid"]].append(e)
            for dst, nbytes in send_bytes(e):
                src_node, dst_node = node_of(e["pid"]), node_of(dst)
                if src_node != dst_node:
                    out[src_node] += nbytes
                    into[dst_node] += nbytes
        compute, network, serial = {}, {}, {}
        staged = stage_view(evs) if fill else evs
        nic = _network_fills(staged, node_of, hop, node_bytes_per_s) if fill else {}
        for rank, mine in by_rank.items():
            compute[rank] = compute_s(mine)
            serial[rank] = (
                sum(e["dur"] for e in mine if e["cat"] == "sync" and e["name"] == "STEP") / 1e6
            )
            node, rate = node_of(rank), node_bytes_per_s[node_of(rank)]
            network[rank] = max(
                out[node] / rate, into[node] / rate, nic.get((node, "out"), 0.0),
                nic.get((node, "in"), 0.0),
            )  # fmt: skip
        # STEP holds the world's loss and norm reductions: a rank done early waits in it
        # for the last one. The step's least STEP (the last rank's) is the optimizer's own.
        stepped = {e["pid"] for e in evs if e["cat"] == "sync" and e["name"] == "STEP"}
        least = min((serial[r] for r in stepped), default=0.0)
        serial = {r: least if r in stepped else 0.0 for r in serial}
        if fill:
            _add_drains(staged, by_rank, compute, serial, hop, node_of, node_bytes_per_s)
        bounds.append(worker_bound(compute, network, serial))
    if not bounds:
        return Bound(0.0, "compute", "-", 0.0, 0.0, 0.0)
    return sorted(bounds, key=lambda b: b.seconds)[(len(bounds) - 1) // 2]


__all__ = [
    "drains_from_above",
    "hand_over_windows",
    "last_buckets",
    "pipeline_fill",
    "send_bytes",
    "stage_buckets",
    "trace_bound",
]
