"""The compute fit of an ep-* run's replay (`bench.analysis.predict_ep`): seconds per FLOP
of its stage computations, read off its trace, and the `EPCostModel` that prices the
replay's instructions with them.

A chunked run (`config.runs_chunked`) traces each expert call of its chunks apart
("experts ..." / "experts.bwd ...", category "compute"): the fit takes those calls'
median seconds as they are ("experts F", "experts B") and the stage spans less them for
the attention's rate. One rate for both would move the calls' fixed part onto the
attention, which no all-to-all hides: with emulated compute a call waits a fixed 34 ms
of trace at `small`, 0.4 Gbit/s, 8 workers (40.7 ms a forward chunk at 8 chunks, 89 ms
a layer's attention forward), and the one-rate replay put ep-combined 22% over its run.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from statistics import median
from typing import Any

from ..distributed.ep_layout import EPLayout
from ..simulator.ep import EPCosts
from ..trace import (
    Interval,
    overlap_length,
    parse_event_name,
    total_length,
    union_intervals,
)

Event = dict[str, Any]


@dataclass(frozen=True)
class FittedEP:
    """`EPCostModel` with analytic FLOPs times fitted seconds per FLOP (forward, backward).

    `emulated`: the run's compute was emulated (`models.emulated`), whose backward wait
    is an autograd node on the input-gradient path: a split backward's I (the input
    gradient, `stage_backward_input`) holds the whole backward and its W nothing
    (ep-dualpipev at `pp 4`, 0.4 Gbit/s: I 0.275 s, W 0.000 s on every stage but the first,
    whose I has no input to reach and whose W holds it all, trace seconds). The replay
    prices I as the whole backward and W as free; on the first stage that puts the
    backward in I instead of W, which no other rank waits for."""

    base: EPCosts
    s_per_flop: dict[str, float]
    a2a_s: list[float]
    emulated: bool = False
    chunks: int = 1  # the run's expert calls per micro-batch and layer ("experts F" fitted)

    def _kind(self, kind: str) -> str:
        return "B" if self.emulated and kind == "I" else kind

    def attn(self, layer: int, kind: str) -> float:
        if self.emulated and kind == "W":
            return 0.0
        rate = rate_of(kind)
        if layer == self.base.workload.model.num_layers:  # the loss head: its own rate if fitted
            rate = f"head {rate}" if f"head {rate}" in self.s_per_flop else rate
        return self.base.attn(layer, self._kind(kind)) * self.s_per_flop[rate]

    def experts(self, kind: str, layer: int = -1) -> float:
        if self.emulated and kind == "W":
            return 0.0
        if f"experts {rate_of(kind)}" in self.s_per_flop:
            return self.experts_chunk(kind, self.chunks) * self.chunks
        return self.base.experts(self._kind(kind), layer) * self.s_per_flop[rate_of(kind)]

    def experts_chunk(self, kind: str, chunks: int) -> float:
        """One of `chunks` expert calls: the run's median call where it ran `chunks`
        (a backward's I or W its FLOP share of the measured whole backward), else a
        `chunks`-th of `experts`."""
        call = self.s_per_flop.get(f"experts {rate_of(kind)}")
        if call is None or chunks != self.chunks:
            return self.experts(kind) / chunks
        if self.emulated and kind == "W":
            return 0.0
        kind = self._kind(kind)
        return call * self.base.experts(kind) / self.base.experts(rate_of(kind))


def rate_of(kind: str) -> str:
    return "F" if kind == "F" else "B"


def seconds_per_flop(
    events: list[Event],
    stage_flops: Callable[[int, str], float],
    head: tuple[int, Callable[[str], float]] | None = None,
    apart: Callable[[Event], bool] | None = None,
) -> dict[str, float]:
    """Seconds per FLOP of an ep-* run's forward ("F") and backward ("B": B, I, W) stage
    computations: their spans less the blocking all-to-alls inside them, over their FLOPs
    (`stage_flops(stage, kind)`).

    With `head` (the stage that also runs the loss head, and the head's FLOPs per kind;
    `stage_flops` then counts the blocks only) the blocks' rates are the other stages' and
    the head gets rates of its own ("head F", "head B"): what the head stage's computations
    take beyond its blocks at those rates, over the head's FLOPs (at least 0). The FLOPs
    misprice the head where its seconds do not follow them: with emulated compute the
    blocks wait for calibrated times while the head computes for real, at the host's
    speed (0.4 Gbit/s `small` at `pp 8`: every stage's forward 170 ms of trace, the last
    one's included, though it holds 1.2x the others' FLOPs).

    Events that `apart` takes (a chunked run's expert calls) are not the stages' own
    either: their spans are left out as the blocking waits are (`stage_flops` then counts
    what is left)."""
    blocking: dict[int, list[Interval]] = defaultdict(list)
    for e in events:
        if e["args"].get("blocking") or (apart is not None and apart(e)):
            blocking[e["pid"]].append((e["ts"], e["ts"] + e["dur"]))
    waits = {pid: union_intervals(spans) for pid, spans in blocking.items()}
    # Two computations of one rank in flight at once (an F&B pair of ep-combined /
    # ep-dualpipev) take turns on its one device, so each span holds the other's work:
    # the fit takes the computations that ran alone (all of a kind that never did).
    stage_events = [e for e in events if e["cat"] in ("fwd", "bwd", "wgt") and "stage" in e["args"]]
    by_rank: dict[int, list[Event]] = defaultdict(list)
    for e in stage_events:
        by_rank[e["pid"]].append(e)

    def alone(e: Event) -> bool:
        t0, t1 = e["ts"], e["ts"] + e["dur"]
        return not any(
            f is not e and f["ts"] < t1 and t0 < f["ts"] + f["dur"] for f in by_rank[e["pid"]]
        )

    fit: dict[str, list[Event]] = defaultdict(list)
    for e in stage_events:
        fit[family(e)].append(e)
    head_stage = head[0] if head else -1
    seconds: dict[tuple[str, bool], float] = defaultdict(float)  # (family, head stage)
    work: dict[tuple[str, bool], float] = defaultdict(float)
    head_work: dict[str, float] = defaultdict(float)
    for fam, group in fit.items():
        solo = [e for e in group if alone(e)]
        for e in solo or group:
            span = [(e["ts"], e["ts"] + e["dur"])]
            own = (total_length(span) - overlap_length(span, waits.get(e["pid"], []))) / 1e6
            kind, stage = parse_event_name(e["name"]).what, e["args"]["stage"]
            key = (fam, stage == head_stage)
            seconds[key] += own
            work[key] += stage_flops(stage, kind)
            if head and stage == head_stage:
                head_work[fam] += head[1](kind)
    rates: dict[str, float] = {}
    for f in ("F", "B"):
        if not head:  # every stage in one fit
            total = work[f, False] + work[f, True]
            rates[f] = (seconds[f, False] + seconds[f, True]) / total if total else 0.0
            continue
        rates[f] = seconds[f, False] / work[f, False] if work[f, False] else 0.0
        rest = max(0.0, seconds[f, True] - rates[f] * work[f, True])
        rates[f"head {f}"] = rest / head_work[f] if head_work[f] else 0.0
    return rates


def family(e: Event) -> str:
    """The fitted rate an ep-* stage computation takes: forward ("F") or backward ("B")."""
    return "F" if parse_event_name(e["name"]).what == "F" else "B"


def expert_call(e: Event) -> bool:
    """A chunked run's expert call, traced apart from its stage ("experts ...",
    "experts.bwd ...": `baselines.moe_overlap`)."""
    return e["cat"] == "compute" and e["name"].split(" ", 1)[0] in ("experts", "experts.bwd")


def expert_call_seconds(events: list[Event]) -> dict[str, float]:
    """Median seconds of a chunked run's expert calls, forward ("experts F") and backward
    ("experts B"); empty where none is traced. The median, as a call of an F&B pair may
    wait for its rank's device while the other computes (`models.emulated`)."""
    calls: dict[str, list[float]] = defaultdict(list)
    for e in events:
        if expert_call(e):
            calls["experts B" if e["name"].startswith("experts.bwd") else "experts F"].append(
                e["dur"] / 1e6
            )
    return {k: float(median(v)) for k, v in calls.items()}


def fitted_ep_rates(
    events: list[Event], lay: EPLayout, flops: EPCosts, chunked: bool = False
) -> dict[str, float]:
    """`seconds_per_flop` of an ep-* run of layout `lay`, its FLOPs from
    `flops` (at 1 FLOP/s); where it has more than one stage, the loss head apart from the
    blocks. `chunked` (`config.runs_chunked`): the MoE layers ran chunked, so a split
    backward's I holds the experts' whole backward and its W none of it
    (`schedule.baselines`); where the run traced its expert calls (`expert_call_seconds`,
    both directions) they are fitted apart and the stages' rates are the rest's."""
    model = flops.workload.model
    calls = expert_call_seconds(events)
    apart = expert_call if {"experts F", "experts B"} <= calls.keys() else None
    expert_kind = {"I": "B", "W": ""} if chunked else {}

    def block_flops(stage: int, kind: str) -> float:
        total = 0.0
        for layer in lay.layers_of_stage(stage):
            total += flops.attn(layer, kind)
            if apart is None and model.is_moe_layer(layer) and (of := expert_kind.get(kind, kind)):
                total += flops.experts(of)
        return total

    def head_flops(kind: str) -> float:
        return flops.attn(model.num_layers, kind)

    if lay.num_stages > 1:
        rates = seconds_per_flop(events, block_flops, (lay.num_stages - 1, head_flops), apart)
    else:
        rates = seconds_per_flop(
            events, lambda stage, kind: block_flops(stage, kind) + head_flops(kind), apart=apart
        )
    return {**rates, **calls} if apart is not None else rates
