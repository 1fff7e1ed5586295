"""Simulator: AF-Pipe replay against closed forms, validator gate, symmetry reduction, speed."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import pytest

from disagmoe.config import ModelConfig, ParallelConfig
from disagmoe.distributed.layout import Layout
from disagmoe.presets import CLUSTER_PRESETS, MODEL_PRESETS
from disagmoe.schedule.afpipe import build_afpipe, build_afpipe_graph
from disagmoe.schedule.graph import list_schedule
from disagmoe.schedule.ir import Op, Schedule
from disagmoe.simulator import (
    BREAKDOWN_KEYS,
    Network,
    ScheduleRejected,
    Workload,
    simulate_disagg,
    simulate_schedule,
)
from disagmoe.trace import LANES

TINY = ModelConfig(num_layers=4)


@dataclass(frozen=True)
class StageCosts:
    """Every A and F stage costs `fwd` forward and `bwd` backward; the loss head `head`x that."""

    fwd: float
    bwd: float
    num_layers: int
    head: float = 0.0

    def compute_s(self, op: Op, comp: str, layer: int) -> float:
        scale = self.head if layer == self.num_layers else 1.0
        return scale * (self.fwd if op == Op.FWD else self.bwd)


def _layout(model: ModelConfig, p: int, m: int = 1, n: int = 1) -> Layout:
    return Layout.build(model, ParallelConfig(groups=p, attn_workers=m, expert_workers=n))


def _replay(
    model: ModelConfig, p: int, slots: int, costs: StageCosts, latency: float, share: bool = False
) -> float:
    layout = _layout(model, p)
    net = Network.single_node(1e30, latency, layout.world_size)  # bytes are free
    result = simulate_schedule(
        build_afpipe(layout, slots),
        layout,
        costs,
        Workload(model, 8, 1),
        net,
        share_compute=share,
        sync=False,
    )
    return result.step_time_s


@pytest.mark.parametrize(
    ("layers", "slots", "fwd", "bwd", "latency"),
    [
        (4, 8, 1.0, 2.0, 0.5),
        (4, 3, 1.0, 2.0, 0.5),
        (8, 16, 1.0, 2.0, 0.5),
        (4, 8, 1.0, 1.0, 0.0),
        (6, 5, 0.3, 0.6, 0.1),
    ],
)
def test_afpipe_chain_matches_closed_form(
    layers: int, slots: int, fwd: float, bwd: float, latency: float
) -> None:
    """p = L groups (one layer per group): the ring unrolls into a chain of 2L stages.

    Slot 0 reaches the (free) loss head after 2L stages and 2L hops; the backward
    chain is bottlenecked by its first stage (bwd >= fwd), which then runs all S
    backward tasks back to back, and the last slot still crosses 2L - 1 stages:
        T = 2L*fwd + (S + 2L - 1)*bwd + 4L*latency.
    """
    model = ModelConfig(num_layers=layers)
    got = _replay(model, layers, slots, StageCosts(fwd, bwd, layers), latency)
    want = 2 * layers * fwd + (slots + 2 * layers - 1) * bwd + 4 * layers * latency
    assert got == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize(
    ("layers", "groups", "slots"), [(4, 1, 8), (4, 2, 8), (8, 2, 16), (8, 4, 16)]
)
def test_afpipe_ring_reproduces_generator_timeline(layers: int, groups: int, slots: int) -> None:
    """With the generator's own nominal costs (F 1, B 2, latency 0.5) and independent lanes the
    replay of the emitted lists ends exactly when the generator's list schedule ends."""
    model = ModelConfig(num_layers=layers)
    timeline = list_schedule(build_afpipe_graph(_layout(model, groups), slots, 0), 0.5)
    got = _replay(model, groups, slots, StageCosts(1.0, 2.0, layers, head=1.0), 0.5)
    assert got == pytest.approx(max(timeline.end.values()), rel=1e-9)


def test_single_slot_is_the_critical_path() -> None:
    """One micro-batch: 2L+1 forward and 2L+1 backward stages, 4L hops, shared GPU or not."""
    for share in (False, True):
        got = _replay(TINY, 2, 1, StageCosts(1.0, 2.0, 4, head=1.0), 0.25, share)
        assert got == pytest.approx(9 * 3.0 + 16 * 0.25)


def _deadlocked(schedule: Schedule) -> Schedule:
    """Rank 0 runs the forward of layer 2 before that of layer 0 (which layer 2 depends on)."""
    instrs = list(schedule.ranks[0])
    first = next(k for k, i in enumerate(instrs) if i.op == Op.FWD and i.layer == 0)
    later = next(k for k, i in enumerate(instrs) if i.op == Op.FWD and i.layer == 2 and i.slot == 0)
    instrs[first], instrs[later] = instrs[later], instrs[first]
    return dataclasses.replace(schedule, ranks=(tuple(instrs), *schedule.ranks[1:]))


def test_deadlocking_schedule_is_reported_not_simulated() -> None:
    layout = _layout(TINY, 2)
    bad = _deadlocked(build_afpipe(layout, 2))
    net = Network.single_node(1e9, 0.0, layout.world_size)
    with pytest.raises(ScheduleRejected, match="deadlock"):
        simulate_schedule(bad, layout, StageCosts(1.0, 2.0, 4), Workload(TINY, 8, 1), net)


def test_reduced_replay_matches_full_replay() -> None:
    """One replica + one shard with bundled messages predicts the full m x n schedule
    (rank-order placement: every replica and every shard sees the same node locality).
    Not exact in general: see docs/simulator.md, "Symmetry reduction"."""
    model = MODEL_PRESETS["small"]
    cluster = dataclasses.replace(CLUSTER_PRESETS["h800"], gpus_per_node=4, nics_per_node=4)
    kw = dict(
        groups=2,
        attn_workers=2,
        expert_workers=4,
        seq_len=4096,
        micro_batch_size=1,
        num_micro_batches=8,
        placement="packed",
    )
    full = simulate_disagg(model, cluster, reduce=False, **kw)
    reduced = simulate_disagg(model, cluster, reduce=True, **kw)
    assert reduced.num_workers == full.num_workers == 12
    assert reduced.step_time_s == pytest.approx(full.step_time_s, rel=0.02)
    for key in ("attn", "ffn"):
        assert reduced.breakdown[key] == pytest.approx(full.breakdown[key], rel=1e-6)


@pytest.mark.parametrize("placement", ["packed", "node-aware"])
def test_reduced_replay_equals_full_replay_under_fair_links(placement: str) -> None:
    """p = 1, m = n = 8 on 8-GPU nodes: every replica and every shard sees the same node
    locality, so a bundle's real messages share ports as the full replay's do (a bundle
    counts as its real flows, `simulator.links`) and the two replays agree to rounding.
    The FIFO link model does not: there the full replay's messages queue one by one
    (reduced vs full: -4% packed, +25% node-aware).

    The A gradients' ring all-reduce, node-aware: its replicas sit on both nodes, and each
    node's one crossing is spread over its four replicas' NICs (`lower`, `ring_bucket`),
    a flow per channel, so every member's hop is priced alike; the full replay's ring
    waits for its slowest member: within 0.5%. Packed, every hop stays on the node."""
    kw = dict(
        groups=1,
        attn_workers=8,
        expert_workers=8,
        seq_len=4096,
        micro_batch_size=1,
        num_micro_batches=32,
        placement=placement,
    )
    model, cluster = MODEL_PRESETS["small"], CLUSTER_PRESETS["h800"]
    for overlap_sync in (False, True):
        full = simulate_disagg(model, cluster, reduce=False, overlap_sync=overlap_sync, **kw)
        reduced = simulate_disagg(model, cluster, reduce=True, overlap_sync=overlap_sync, **kw)
        assert reduced.config["reduced"] and not full.config["reduced"]
        exact = not overlap_sync or placement == "packed"
        rel = 1e-9 if exact else 0.005
        assert reduced.step_time_s == pytest.approx(full.step_time_s, rel=rel)


@pytest.mark.parametrize(("m", "n", "micro", "cap"), [(3, 3, 8, 0), (2, 3, 5, 2), (3, 4, 9, 0)])
def test_reduced_replay_of_uneven_splits(m: int, n: int, micro: int, cap: int) -> None:
    """Uneven splits (16 experts on n = 3 shards; m not dividing the micro-batches: two
    replica classes, one without the last slot). With bytes free the reduced replay
    equals the full one; on a real network (the members of a class sit on nodes
    differently here, which a bundle averages) its compute is the full replay's and the
    tokens are the M micro-batches'."""
    model = MODEL_PRESETS["small"]
    real = dataclasses.replace(CLUSTER_PRESETS["h800"], gpus_per_node=4, nics_per_node=4)
    free = dataclasses.replace(real, nic_gbps=1e9, nvlink_gbps=1e9)
    kw = dict(
        groups=2,
        attn_workers=m,
        expert_workers=n,
        seq_len=4096,
        micro_batch_size=1,
        num_micro_batches=micro,
        placement="packed",
        max_in_flight=cap,
    )
    for cluster in (free, real):
        full = simulate_disagg(model, cluster, reduce=False, **kw)
        reduced = simulate_disagg(model, cluster, reduce=True, **kw)
        assert reduced.num_workers == full.num_workers == 2 * (m + n)
        for result in (full, reduced):
            assert result.tokens_per_s == pytest.approx(micro * 4096 / result.step_time_s)
        for key in ("attn", "ffn"):
            assert reduced.breakdown[key] == pytest.approx(full.breakdown[key], rel=1e-6)
        if cluster is free:
            assert reduced.step_time_s == pytest.approx(full.step_time_s, rel=1e-6)


def test_breakdown_adds_up_and_trace_has_run_format(tmp_path) -> None:  # type: ignore[no-untyped-def]
    result = simulate_disagg(
        MODEL_PRESETS["small"],
        CLUSTER_PRESETS["h800"],
        groups=2,
        attn_workers=2,
        expert_workers=2,
        seq_len=2048,
        micro_batch_size=2,
        num_micro_batches=8,
    )
    assert set(BREAKDOWN_KEYS) <= set(result.breakdown)
    for w in result.workers:
        total = w["attn"] + w["ffn"] + w["other"] + w["comm_exposed"] + w["bubble"]
        assert total == pytest.approx(result.step_time_s, rel=1e-9)
    assert result.tokens_per_s == pytest.approx(8 * 2 * 2048 / result.step_time_s)
    path = tmp_path / "trace.json"
    result.write_trace(path)
    events = json.loads(path.read_text())["traceEvents"]
    pids = {e["pid"] for e in events if e["ph"] == "X"}
    assert pids == set(range(8))
    compute = [e for e in events if e["ph"] == "X" and e["cat"] in ("fwd", "bwd")]
    assert all(e["tid"] == LANES.index(e["cat"]) and "layer" in e["args"] for e in compute)
    assert len(compute) == sum(
        1
        for i in build_afpipe(_layout(MODEL_PRESETS["small"], 2, 2, 2), 4).ranks
        for x in i
        if x.is_compute
    )
