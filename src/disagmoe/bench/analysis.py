"""What a measured run's trace says: compute, exposed communication, bubble; and what the
simulator predicts for the same run from a cost table built out of that trace.

Per rank and measured step (trace lanes of `trace`):

* compute  = union of the fwd / bwd / compute lanes and the optimizer STEP, minus the
  blocking waits on all-to-alls inside them (the ep-* stages block in collectives; an
  event flagged `blocking` is communication, not compute);
* comm     = union of the send / recv lanes and the gradient all-reduces (SYNC, and the
  per-layer buckets that overlap the backward: `runtime.grad_sync`); on the receiving
  rank an AF-Pipe message counts from its sender's post to its receive span's end (its
  flight: a message whose tensors travel inline in the header has a receive span of
  one instant, the header's arrival); the bench's ranks share one host clock;
* exposed  = comm not covered by compute on that rank;
* bubble   = step time minus (compute ∪ comm): the rank waits with nothing in flight.

Values are means over ranks and measured steps. The step time is rank 0's wall time of
the step (metrics.jsonl), which includes the loss / norm reductions.

Prediction: compute seconds come from the trace (AF-Pipe: each rank's compute
instruction its median over the measured steps and each message its measured bytes —
`replay="own"`, the default — or one median per (op, component, layer kind) and the
workload's average bytes, `"pooled"`; ep-*: seconds per FLOP of forward and of backward
fitted over the stage computations), the network is the emulated one (the tbf rate per
NIC, loopback inside a node). Both simulate the gradient all-reduces (AF-Pipe: the A
buckets as ring hops over the ports the exchange uses; ep-*: the buckets on the network
beside the all-to-alls; SYNC after every rank's last op) and add the optimizer's own STEP
(`_least_step_s`). AF-Pipe replays the lists its run executed (the caller passes the
config with what `auto` picked, `bench.runner.ran_schedule`).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ..config import ClusterConfig, RunConfig, runs_chunked
from ..distributed.ep_layout import EPLayout
from ..distributed.layout import Layout
from ..schedule.ir import Instr, Msg, compute_event_name
from ..simulator import Network, TableCosts, Workload, simulate_ep, simulate_schedule
from ..simulator.ep import EPCosts
from ..simulator.links import LinkModel
from ..trace import (
    COMM_LANES,
    COMPUTE_LANES,
    HOST_WORK,
    Interval,
    event_spans,
    overlap_length,
    own_seconds,
    parse_event_name,
    subtract_intervals,
    total_length,
    union_intervals,
)
from ..training.precision import param_dtype_name
from .ep_fit import FittedEP, fitted_ep_rates
from .overheads import fit_message_overheads

Event = dict[str, Any]
TCP_EFFICIENCY = 0.94  # goodput / tbf rate of a bulk TCP stream (headers, acks)
LOOPBACK_BYTES_PER_S = 1.5e9  # gloo over a namespace's local route, measured order


@dataclass(frozen=True)
class Breakdown:
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    bubble_s: float


def rank_breakdown(
    events: list[Event], step_s: float, inbound: Sequence[Interval] = ()
) -> Breakdown:
    """Breakdown of one rank's events of one step (seconds); `inbound`: the flights of
    the messages it received (trace microseconds), communication too."""
    compute = event_spans(
        e
        for e in events
        if e["cat"] in COMPUTE_LANES or (e["cat"] == "sync" and e["name"] in HOST_WORK)
    )
    compute = subtract_intervals(
        compute, event_spans(e for e in events if e["args"].get("blocking"))
    )
    comm = event_spans(
        e
        for e in events
        if e["cat"] in COMM_LANES or (e["cat"] == "sync" and e["name"] not in HOST_WORK)
    )
    if inbound:
        comm = union_intervals([*comm, *inbound])
    compute_s, comm_s = total_length(compute) / 1e6, total_length(comm) / 1e6
    exposed = comm_s - overlap_length(compute, comm) / 1e6
    busy = compute_s + exposed
    return Breakdown(compute_s, comm_s, exposed, max(step_s - busy, 0.0))


def trace_breakdown(events: list[Event], step_times: dict[int, float]) -> Breakdown:
    """Mean breakdown over ranks and the given steps ({trace step index: step seconds})."""
    by_key: dict[tuple[int, int], list[Event]] = defaultdict(list)
    for e in events:
        step = e.get("args", {}).get("step")
        if e.get("ph") == "X" and step in step_times:
            by_key[(e["pid"], step)].append(e)
    inbound = _flights(events)
    parts = [
        rank_breakdown(evs, step_times[step], inbound.get((rank, step), ()))
        for (rank, step), evs in by_key.items()
    ]
    if not parts:
        return Breakdown(0.0, 0.0, 0.0, 0.0)
    return Breakdown(
        *(statistics.fmean(getattr(p, f) for p in parts) for f in Breakdown.__dataclass_fields__)
    )


def _flights(events: list[Event]) -> dict[tuple[int, int], list[Interval]]:
    """{(receiving rank, step): [(sender's post, receive end)]} of the AF-Pipe messages:
    a send and a receive of one message share name (after the verb), sender, receiver
    and step."""
    posted: dict[tuple[Any, ...], float] = {}
    for e in events:
        if e.get("cat") == "send" and "dst" in e.get("args", {}):
            a = e["args"]
            posted[(e["name"][5:], e["pid"], a["dst"], a.get("step"))] = float(e["ts"])
    flights: dict[tuple[int, int], list[Interval]] = defaultdict(list)
    for e in events:
        if e.get("cat") == "recv" and "src" in e.get("args", {}):
            a = e["args"]
            t0 = posted.get((e["name"][5:], a["src"], e["pid"], a.get("step")))
            end = float(e["ts"]) + float(e.get("dur", 0.0))
            if t0 is not None and t0 < end:
                flights[(e["pid"], a.get("step"))].append((t0, end))
    return flights


def _least_step_s(events: list[Event]) -> float:
    """Median over steps of the least STEP over ranks: the optimizer's own time. STEP
    all-reduces the gradient norm and the losses over the world, so a rank that finishes
    early waits inside it for the last one; the last rank's STEP (the least) does not
    wait (`bench.bound.trace_bound` takes the same)."""
    least: dict[int, float] = {}
    for e in events:
        if e["cat"] == "sync" and e["name"] == "STEP":
            step, seconds = e["args"].get("step", -1), e["dur"] / 1e6
            least[step] = min(least.get(step, seconds), seconds)
    return statistics.median(least.values()) if least else 0.0


def emulated_network(
    nic_gbps: float, ranks_per_node: int, loopback: bool, *, per_rank: bool = False
) -> Network:
    """The emulated cluster as the simulator sees it: `nic_gbps` per worker.

    A node's NIC is one token bucket that its ranks share (`bench.netns`), so by default
    it is one NIC per node at `ranks_per_node x nic_gbps`: a rank may use the whole
    bucket while its node-mates are quiet (with node-aware placement an A and an F
    worker share it, busy at different times). `per_rank`: one NIC per rank at
    `nic_gbps`, for per-rank rates (`Network.nic_share`, the NIC split).
    """
    if loopback:
        return Network.single_node(LOOPBACK_BYTES_PER_S, 50e-6, ranks_per_node)
    nics = ranks_per_node if per_rank else 1
    return Network(
        gpus_per_node=ranks_per_node,
        nics_per_node=nics,
        nic_bytes_per_s=nic_gbps * ranks_per_node / nics * 1e9 / 8 * TCP_EFFICIENCY,
        nvlink_bytes_per_s=LOOPBACK_BYTES_PER_S,
        latency_s=100e-6,
    )


def _workload(cfg: RunConfig) -> Workload:
    return Workload.of_run(cfg)


Replay = Literal["own", "pooled"]  # what a replay prices computes and messages with


def predict_disagg(
    cfg: RunConfig,
    world: int,
    events: list[Event],
    net: Network,
    link_model: LinkModel = "fair",
    replay: Replay = "own",
    overheads: bool = False,
) -> float:
    """Simulated step seconds of an AF-Pipe run, its own instruction lists replayed over
    `net`. `replay` says what they cost:

    * "own": each rank's compute instruction its median over the measured steps (ranks
      that computed slower in the run stay slower), each message its measured bytes
      (routing makes some shards' messages larger than the average); what the run did,
      so the error is the simulator's model of overlap and links alone;
    * "pooled": one median per (op, component, layer kind), the workload's average bytes:
      a cost table as the planner would use it.

    `overheads`: with the run's per-message host costs too (`bench.overheads`).

    The A gradients' buckets are simulated as the runtime runs them (`runtime.grad_sync`:
    a ring all-reduce per layer during the backward, on the NIC the exchange uses,
    `simulator.lower`), in the run's weight dtype, and the step ends at the last rank's
    SYNC plus the optimizer's own STEP (`_least_step_s`), as `predict_ep`'s does."""
    from ..runtime.disagg import run_schedule
    from ..simulator.choose import run_order

    workload = _workload(cfg)
    # seconds of each whole compute: an exchange-chunked expert compute ("FF l3 s1 c0",
    # one event per chunk) is the sum of its chunks, as the table prices whole computes
    # and the replay gives a chunk its share (`simulator.costs.chunk_compute_s`)
    whole: dict[tuple[Any, ...], float] = defaultdict(float)
    for index, e in enumerate(events):
        if e["cat"] in ("fwd", "bwd", "wgt"):
            name = parse_event_name(e["name"])
            layer = e["args"]["layer"]
            of = (e["pid"], e["args"].get("step"), name.slot) if name.chunk is not None else index
            whole[(name.op, name.comp, layer, of)] += own_seconds(e)
    groups: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for (op, comp, layer, _), seconds in whole.items():
        groups[(op, comp, workload.layer_kind(comp, layer))].append(seconds)
    table = {k: statistics.median(v) for k, v in groups.items()}
    # the run's placement: its roles depend on the ranks per node it ran with
    layout = Layout.build(
        cfg.model, cfg.parallel, world, ranks_per_node=cfg.parallel.ranks_per_node or world
    )
    schedule = run_schedule(cfg, layout, choose=run_order)
    own = replay == "own"
    # Emulated compute: computations are priced net of their waits for the worker's one
    # device, so the replay shares it between lanes; real compute's spans already hold the
    # contention of their run (the host's cores).
    sim = simulate_schedule(
        schedule, layout, TableCosts(workload, table), workload, net,
        share_compute=bool(cfg.train.emulate_compute),
        link_model=link_model, overlap_sync=cfg.parallel.overlap_grad_sync,
        grad_bytes={"float64": 8, "float32": 4}.get(param_dtype_name(cfg.train), 2),
        overheads=fit_message_overheads(events) if overheads else None,
        rank_compute_s=_instruction_medians(events) if own else None,
        measured_bytes=_message_bytes(events) if own else None,
    )  # fmt: skip
    return sim.step_time_s + _least_step_s(events)


def _instruction_medians(events: list[Event]) -> Callable[[int, Instr], float | None]:
    """A compute's median seconds over the measured steps, per rank and instruction (an
    exchange chunk's own span: its event is the chunk's), less its waits for the device."""
    spans: dict[tuple[int, str], list[float]] = defaultdict(list)
    for e in events:
        if e["cat"] in ("fwd", "bwd", "wgt"):
            spans[(e["pid"], e["name"])].append(own_seconds(e))
    medians = {key: statistics.median(v) for key, v in spans.items()}

    def seconds(rank: int, ins: Instr) -> float | None:
        name = compute_event_name(ins.op.value, ins.comp, ins.layer, ins.slot, ins.chunk)
        return medians.get((rank, name))

    return seconds


def _message_bytes(events: list[Event]) -> Callable[[Msg], float | None]:
    """A message's median bytes over the measured steps, per (sender, receiver, message)."""
    sizes: dict[tuple[Any, ...], list[float]] = defaultdict(list)
    for e in events:
        if e["cat"] == "send" and "dst" in e["args"]:
            name, a = parse_event_name(e["name"]), e["args"]
            chunk = name.chunk if name.chunk is not None else -1
            key = (name.what, a["layer"], a["slot"], e["pid"], a["dst"], chunk)
            sizes[key].append(float(a.get("bytes", 0)))
    medians = {key: statistics.median(v) for key, v in sizes.items()}

    def nbytes(msg: Msg) -> float | None:
        return medians.get((msg.kind, msg.layer, msg.slot, msg.src, msg.dst, msg.chunk))

    return nbytes


def predict_ep(
    cfg: RunConfig, world: int, events: list[Event], net: Network, link_model: LinkModel = "fifo"
) -> float:
    """Simulated step seconds of an ep-* run: measured compute rate, emulated network.

    Every rank is simulated and, by default, a NIC carries one pipeline message at a time
    (`fifo`): an emulated NIC is a token bucket with a short FIFO queue (`bench.netns`),
    and a flow that holds it keeps most of it against a newcomer, so the dp replicas of a
    stage that share a node's NIC take it in turn. In the runs each cross-node
    activation moves at the node's whole rate (262144 bytes in 0.080 s at 3.1 MB/s,
    `--nic-gbit 0.4` at 8 workers) and the replicas run one message apart (0.085 s at 16
    workers, 131072 bytes at 1.56 MB/s); fair sharing in lockstep puts ep-1f1b's step 38%
    over the measured one at 16 workers. AF-Pipe's replay shares links fairly: its
    executor posts every message of a compute at once (`isend` on a process group per
    channel and direction, so a dispatch keeps a TCP connection per receiver busy on the
    sender's NIC together); a pipeline message of an ep-* run is one payload on the
    pair's one gloo connection, so a NIC holds a flow or two at a time. At `--nic-gbit 0.1` two
    such flows do share a node's egress (docs/simulator.md, "Fidelity of the EP
    replay"), which neither discipline models.

    The gradient all-reduces are simulated as the runtime runs them, in the run's weight
    dtype (float32 gradients: 205824 bytes per `small` layer bucket in the traces): the
    dense buckets during each stage's last backward, sharing the rank's network with its
    all-to-alls, and the expert shards' in the same buckets, or at SYNC after the rank's
    last op where the trace shows a "SYNC experts" of its bytes (runs saved before the
    runtime bucketed them: `_experts_at_sync`). The step ends
    at the last rank's SYNC plus the optimizer's own STEP (`_least_step_s`): a rank that
    finishes early waits for the last one inside STEP's world all-reduce, and that wait
    is the replay's own."""
    workload = _workload(cfg)
    lay = EPLayout.build(cfg.model, cfg.parallel, cfg.train, world)
    flops = EPCosts(workload, 1.0, [0.0])  # seconds == FLOPs at 1 FLOP/s
    model = cfg.model
    chunked = runs_chunked(lay.runtime, cfg.parallel.overlap_chunks)
    s_per_flop = fitted_ep_rates(events, lay, flops, chunked)
    # one dispatch (or combine): per-peer distinct tokens + weights, over NIC / loopback
    per_peer = workload.message_bytes("dispatch", model.num_dense_layers, lay.ep)
    a2a = []
    for pp_rank in range(lay.pp):
        me = lay.rank_of(pp_rank, 0)
        peers = [r for r in lay.ep_group_ranks(pp_rank, 0) if r != me]
        remote = sum(1 for r in peers if not net.same_node(r, me))
        local = len(peers) - remote
        a2a.append(
            net.latency_s
            + max(
                local * per_peer / net.nvlink_bytes_per_s, remote * per_peer / net.nic_bytes_per_gpu
            )
            if peers
            else 0.0
        )
    costs = FittedEP(
        flops, s_per_flop, a2a, emulated=bool(cfg.train.emulate_compute),
        chunks=cfg.parallel.overlap_chunks if chunked else 1,
    )  # fmt: skip
    sim = simulate_ep(
        cfg.parallel.runtime, model, ClusterConfig(), gpus=world, pp=lay.pp, ep=lay.ep,
        seq_len=cfg.train.seq_len, micro_batch_size=cfg.train.micro_batch_size,
        num_micro_batches=cfg.train.num_micro_batches, chunks=cfg.parallel.virtual_stages,
        overlap_chunks=cfg.parallel.overlap_chunks, sync=True, costs=costs, net=net,
        link_model=link_model, act_bytes=workload.act_bytes, every_rank=True,
        overlap_sync=cfg.parallel.overlap_grad_sync,
        grad_bytes={"float64": 8, "float32": 4}.get(param_dtype_name(cfg.train), 2),
        expert_buckets=not _experts_at_sync(events), warmup=lay.warmup,
    )  # fmt: skip
    return sim.step_time_s + _least_step_s(events)


def _experts_at_sync(events: list[Event]) -> bool:
    """Whether the run all-reduced its expert gradients at SYNC (a traced "SYNC experts"
    with bytes), not in the backward's buckets."""
    return any(e["name"] == "SYNC experts" and e["args"].get("bytes", 0) > 0 for e in events)


def predict(
    cfg: RunConfig,
    world: int,
    events: list[Event],
    net: Network,
    link_model: LinkModel = "fair",
    replay: Replay = "own",
    overheads: bool = False,
) -> float:
    """Simulator's step seconds for a measured run (events of its measured steps only);
    `link_model` (AF-Pipe runs: ep-* runs take `predict_ep`'s) as in `simulator.links`;
    `replay` and `overheads` (AF-Pipe runs) as in `predict_disagg`."""
    if cfg.parallel.runtime == "disagg":
        return predict_disagg(cfg, world, events, net, link_model, replay, overheads)
    return predict_ep(cfg, world, events, net)


__all__ = [
    "Breakdown",
    "Replay",
    "emulated_network",
    "predict",
    "trace_breakdown",
]
