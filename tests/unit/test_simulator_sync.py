"""The EP replay's gradient all-reduces and step end: ring hops over shared NICs
(`simulator.network`), gradients in the weights' dtype (`simulate_ep(grad_bytes=)`),
buckets on the rank's network (`simulator.lower`), the optimizer's own STEP
(`bench.analysis`)."""

from __future__ import annotations

import dataclasses

import pytest

from disagmoe.config import ModelConfig
from disagmoe.presets import CLUSTER_PRESETS
from disagmoe.simulator import Network, simulate_ep
from disagmoe.simulator.engine import A2A

H800 = CLUSTER_PRESETS["h800"]
MODEL = ModelConfig(num_layers=4, num_experts=8, dim=16)


def _net(gpus_per_node: int, nics_per_node: int) -> Network:
    return Network(
        gpus_per_node=gpus_per_node,
        nics_per_node=nics_per_node,
        nic_bytes_per_s=1e6,
        nvlink_bytes_per_s=1e9,
        latency_s=0.0,
    )


def test_a_ring_crosses_a_node_once_spread_over_its_members_nics() -> None:
    """4 nodes of 2 GPUs, one NIC each (the emulated cluster): the ring over every rank
    leaves each node once (1 -> 2, 3 -> 4, ...) and has the NIC to itself; a ring over
    one GPU per node shares each NIC with the other GPU's ring. With a NIC per GPU the
    node's one crossing is spread over both members' NICs (half the time); a ring with
    one member per node crosses on that member's NIC."""
    shared = _net(2, 1)
    hop = 2 * 7 / 8 * 8e6  # bytes a rank sends in a ring all-reduce of 8 MB over 8
    assert shared.allreduce_s(list(range(8)), 8e6) == pytest.approx(hop / 1e6)
    assert shared.allreduce_s([0, 2, 4, 6], 8e6) == pytest.approx(2 * 3 / 4 * 8e6 / 0.5e6)
    assert shared.allreduce_s([0, 1, 4, 5], 8e6) == pytest.approx(2 * 3 / 4 * 8e6 / 1e6)
    own = _net(2, 2)
    assert own.allreduce_s(list(range(8)), 8e6) == pytest.approx(hop / 2e6)
    assert own.allreduce_s([0, 2, 4, 6], 8e6) == pytest.approx(2 * 3 / 4 * 8e6 / 1e6)
    assert shared.allreduce_s([0, 1], 8e6) == pytest.approx(8e6 / 1e9)  # NVLink
    wide = _net(8, 8)  # an H800-like node: 8 GPUs, a NIC each
    assert wide.allreduce_s(list(range(32)), 8e6) == pytest.approx(2 * 31 / 32 * 8e6 / 8e6)
    assert wide.ring_nic_fraction(list(range(32)), 5) == pytest.approx(1 / 8)
    assert wide.ring_nic_fraction([0, 8, 16, 24], 8) == pytest.approx(1.0)
    split = dataclasses.replace(wide, nic_share=tuple([2e6, 0.5e6] * 16))
    # the ring over the even ranks: 4 members per node at 2 MB/s each carry its crossing
    assert split.allreduce_s(list(range(0, 32, 2)), 8e6) == pytest.approx(2 * 15 / 16 * 8e6 / 8e6)


@dataclasses.dataclass
class Costs:
    """Attention F / B costs, experts free, one all-to-all cost for the one pp rank."""

    a2a: float

    @property
    def a2a_s(self) -> list[float]:
        return [self.a2a]

    def attn(self, layer: int, kind: str) -> float:
        return 1e-3 if kind == "F" else 2e-3

    def experts(self, kind: str, layer: int = -1) -> float:
        return 0.0


def _run(grad_bytes: int = 2, a2a: float = 0.0):
    return simulate_ep(
        "ep-1f1b", MODEL, H800, gpus=4, pp=1, ep=2, seq_len=8, micro_batch_size=1,
        num_micro_batches=8, sync=True, costs=Costs(a2a), net=_net(1, 1),
        grad_bytes=grad_bytes, every_rank=True,
    )  # fmt: skip


def _ops(result, prefix: str) -> list[int]:
    prog = result.program
    return [op for op in range(len(prog)) if prog.label[op].startswith(prefix)]


def test_ep_gradients_are_all_reduced_in_the_weights_dtype() -> None:
    """float32 weights all-reduce 4-byte gradients: every bucket takes twice its bf16
    time (no latency here)."""
    bf16, fp32 = _run(2), _run(4)
    a, b = _ops(bf16, "allreduce"), _ops(fp32, "allreduce")
    assert a and len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert fp32.program.work[y] == pytest.approx(2 * bf16.program.work[x])
        assert bf16.program.work[x] > 0.0


def test_ep_expert_gradients_ride_the_layer_buckets() -> None:
    """As `baselines.grad_buckets` runs them: with overlap the expert shards' all-reduce
    over their dp/ep replicas is in each MoE layer's bucket (nothing is left for SYNC), and
    the buckets move what one flat all-reduce at SYNC moves without overlap."""
    buckets = _run(4)
    flat = simulate_ep(
        "ep-1f1b", MODEL, H800, gpus=4, pp=1, ep=2, seq_len=8, micro_batch_size=1,
        num_micro_batches=8, sync=True, costs=Costs(0.0), net=_net(1, 1), every_rank=True,
        overlap_sync=False,
    )  # fmt: skip
    for rank in range(4):
        mine = [op for op in _ops(buckets, "allreduce") if buckets.program.rank[op] == rank]
        (sync,) = [op for op in _ops(buckets, "SYNC") if buckets.program.rank[op] == rank]
        (alone,) = [op for op in _ops(flat, "SYNC") if flat.program.rank[op] == rank]
        assert buckets.program.work[sync] == 0.0
        total = sum(buckets.program.work[op] for op in mine)
        assert total == pytest.approx(flat.program.work[alone])  # experts included


def test_a_run_that_reduced_its_experts_at_sync_is_replayed_so() -> None:
    """`expert_buckets=False` (a saved run whose trace has a "SYNC experts" with bytes,
    `bench.analysis._experts_at_sync`): the buckets carry the dense gradients alone and
    SYNC the expert shards', after the rank's last op; together they move what the
    bucketed run moves."""
    from disagmoe.bench.analysis import _experts_at_sync

    buckets = _run(4)
    late = simulate_ep(
        "ep-1f1b", MODEL, H800, gpus=4, pp=1, ep=2, seq_len=8, micro_batch_size=1,
        num_micro_batches=8, sync=True, costs=Costs(0.0), net=_net(1, 1), every_rank=True,
        grad_bytes=4, expert_buckets=False,
    )  # fmt: skip
    for rank in range(4):
        work = late.program.work
        (sync,) = [op for op in _ops(late, "SYNC") if late.program.rank[op] == rank]
        dense = sum(work[op] for op in _ops(late, "allreduce") if late.program.rank[op] == rank)
        both = sum(
            buckets.program.work[op]
            for op in _ops(buckets, "allreduce")
            if buckets.program.rank[op] == rank
        )
        assert work[sync] > 0.0 and dense + work[sync] == pytest.approx(both)
    event = {"name": "SYNC experts", "args": {"bytes": 64}}
    assert _experts_at_sync([event]) and not _experts_at_sync([{**event, "args": {"bytes": 0}}])


def test_a_bucket_shares_the_rank_network_with_the_all_to_alls_beside_it() -> None:
    """The buckets of the last backward are collectives on the rank's network: while an
    all-to-all of the same backward is in flight, a bucket moves at half its rate."""
    result = _run(4, a2a=5e-3)
    prog, tl = result.program, result.timeline
    buckets = [op for op in _ops(result, "allreduce") if prog.rank[op] == 0]
    assert buckets and all(prog.kind[op] == A2A for op in buckets)
    a2as = [
        op
        for op in range(len(prog))
        if prog.rank[op] == 0 and prog.kind[op] == A2A and op not in buckets
    ]

    def overlaps(op: int) -> bool:
        return any(tl.start[x] < tl.end[op] and tl.start[op] < tl.end[x] for x in a2as)

    stretched = [op for op in buckets if overlaps(op)]
    assert stretched
    for op in stretched:
        assert tl.end[op] - tl.start[op] > prog.work[op] * (1 + 1e-9)


def test_the_step_adds_the_least_step_over_ranks() -> None:
    """STEP all-reduces over the world: rank 1 finished early and waited 2 s inside it;
    the optimizer's own time is the last rank's STEP."""
    from disagmoe.bench.analysis import _least_step_s

    def ev(rank: int, step: int, dur_s: float) -> dict:
        return {"cat": "sync", "name": "STEP", "pid": rank, "dur": dur_s * 1e6,
                "args": {"step": step}}  # fmt: skip

    events = [ev(0, 1, 0.1), ev(1, 1, 2.1), ev(0, 2, 0.3), ev(1, 2, 2.0), ev(0, 3, 0.2)]
    assert _least_step_s(events) == pytest.approx(0.2)  # median of 0.1, 0.3, 0.2


def test_the_compute_fit_takes_the_computations_that_ran_alone() -> None:
    """An F&B pair takes turns on its rank's one device, so each span holds both
    computations' work: a forward of 1 s and a backward of 3 s alone, then a pair whose
    spans are both 4 s long; the fit is 1 s per forward and 3 s per backward FLOP count."""
    from disagmoe.bench.ep_fit import seconds_per_flop

    def ev(name: str, cat: str, t0: float, t1: float) -> dict:
        return {"cat": cat, "name": name, "pid": 0, "ts": t0 * 1e6, "dur": (t1 - t0) * 1e6,
                "args": {"stage": 0, "step": 1}}  # fmt: skip

    events = [
        ev("F s0 mb0", "fwd", 0.0, 1.0),
        ev("B s0 mb0", "bwd", 2.0, 5.0),
        ev("F s0 mb1", "fwd", 6.0, 10.0),
        ev("B s0 mb1", "bwd", 6.0, 10.0),
    ]
    rates = seconds_per_flop(events, lambda stage, kind: 10.0 if kind == "F" else 20.0)
    assert rates == pytest.approx({"F": 0.1, "B": 0.15})


def test_an_emulated_split_backward_waits_in_its_input_gradient() -> None:
    """Emulated compute waits on the input-gradient path: the replay of an emulated run
    prices a split backward's I as the whole backward and its W as free; a real run's
    I and W split the backward's FLOPs."""
    from disagmoe.bench.ep_fit import FittedEP
    from disagmoe.simulator import Workload
    from disagmoe.simulator.ep import EPCosts

    base = EPCosts(Workload(MODEL, 8, 1), 1.0, [0.0])
    rates = {"F": 2.0, "B": 3.0}
    emulated, real = FittedEP(base, rates, [0.0], emulated=True), FittedEP(base, rates, [0.0])
    for cost, whole in ((lambda m, k: m.attn(1, k), base.attn(1, "B")),
                        (lambda m, k: m.experts(k), base.experts("B"))):  # fmt: skip
        assert cost(emulated, "I") == pytest.approx(3.0 * whole)
        assert cost(emulated, "W") == 0.0
        assert cost(emulated, "B") == cost(real, "B") == pytest.approx(3.0 * whole)
        assert 0.0 < cost(real, "I") < cost(real, "B") and cost(real, "W") > 0.0


def test_a_chunked_layers_input_gradient_is_fitted_with_its_experts_whole_backward() -> None:
    """A chunked MoE layer computes its expert weight gradients inside its backward
    (`schedule.baselines`), so the fit of a real run counts an I as the attention's input
    gradients plus the experts' whole backward, and a W as the attention's alone."""
    from disagmoe.bench.ep_fit import fitted_ep_rates
    from disagmoe.distributed.ep_layout import EPLayout
    from disagmoe.simulator import Workload
    from disagmoe.simulator.ep import EPCosts

    lay = EPLayout.of("ep-dualpipev", MODEL, world=2, pp=1, ep=2, num_micro_batches=4, v=2)
    flops = EPCosts(Workload(MODEL, 8, 1), 1.0, [0.0])
    layers = lay.layers_of_stage(0)

    def ev(name: str, t0: float, t1: float) -> dict:
        return {"cat": "bwd", "name": name, "pid": 0, "ts": t0 * 1e6, "dur": (t1 - t0) * 1e6,
                "args": {"stage": 0, "step": 1}}  # fmt: skip

    for chunked, expert_i in ((False, "I"), (True, "B")):
        want = sum(flops.attn(l, "I") + flops.experts(expert_i) for l in layers)
        rates = fitted_ep_rates([ev("I s0 mb0", 0.0, 2.0)], lay, flops, chunked)
        assert rates["B"] == pytest.approx(2.0 / want)  # (the V's stage 1 has the head)
        if chunked:
            w = sum(flops.attn(l, "W") for l in layers)
            rates = fitted_ep_rates([ev("W s0 mb0", 0.0, 2.0)], lay, flops, chunked)
            assert rates["B"] == pytest.approx(2.0 / w)


def test_by_default_both_simulators_all_reduce_float32_gradients() -> None:
    """`simulate` and the planner run mixed precision (float32 master weights), so an
    unspecified `grad_bytes` is 4 in the EP replay and in AF-Pipe's SYNC prices."""
    from disagmoe.config import ParallelConfig
    from disagmoe.distributed.layout import Layout
    from disagmoe.simulator.costs import AnalyticCosts, Workload
    from disagmoe.simulator.replay import afpipe_pricing

    default = simulate_ep(
        "ep-1f1b", MODEL, H800, gpus=4, pp=1, ep=2, seq_len=8, micro_batch_size=1,
        num_micro_batches=8, sync=True, costs=Costs(0.0), net=_net(1, 1), every_rank=True,
    )  # fmt: skip
    fp32 = _run(4)
    for prefix in ("allreduce", "SYNC"):
        assert [default.program.work[op] for op in _ops(default, prefix)] == pytest.approx(
            [fp32.program.work[op] for op in _ops(fp32, prefix)]
        )
    layout = Layout.build(MODEL, ParallelConfig(groups=1, attn_workers=2, expert_workers=2))
    workload = Workload(MODEL, 8, 1)
    costs = AnalyticCosts.for_cluster(workload, H800)

    def sync_s(**kw: int) -> float:
        pricing = afpipe_pricing(layout, costs, workload, _net(1, 1), overlap_sync=False, **kw)
        assert pricing.sync_s is not None
        return pricing.sync_s(0)

    assert sync_s() > 0.0
    assert sync_s() == pytest.approx(sync_s(grad_bytes=4))
    assert sync_s() == pytest.approx(2 * sync_s(grad_bytes=2))


def test_the_compute_fit_prices_the_loss_head_apart_from_the_blocks() -> None:
    """With the head's stage named, the blocks' rates come from the other stages and the
    head gets its own: the head stage's seconds beyond its blocks at those rates, over the
    head's FLOPs (none left: a rate of 0); the replay prices the head layer at it."""
    from disagmoe.bench.ep_fit import FittedEP, seconds_per_flop
    from disagmoe.simulator import Workload
    from disagmoe.simulator.ep import EPCosts

    def ev(name: str, cat: str, stage: int, t0: float, t1: float) -> dict:
        return {"cat": cat, "name": name, "pid": stage, "ts": t0 * 1e6,
                "dur": (t1 - t0) * 1e6, "args": {"stage": stage, "step": 1}}  # fmt: skip

    events = [
        ev("F s0 mb0", "fwd", 0, 0.0, 1.0),
        ev("B s0 mb0", "bwd", 0, 4.0, 7.0),
        ev("F s1 mb0", "fwd", 1, 1.0, 2.5),  # blocks 1 s, head 0.5 s
        ev("B s1 mb0", "bwd", 1, 2.5, 5.5),  # blocks 3 s, head nothing
    ]

    def blocks(stage: int, kind: str) -> float:
        return 10.0 if kind == "F" else 20.0

    def head(kind: str) -> float:
        return 5.0 if kind == "F" else 10.0

    rates = seconds_per_flop(events, blocks, (1, head))
    assert rates == pytest.approx({"F": 0.1, "B": 0.15, "head F": 0.1, "head B": 0.0})
    # without the head's stage every stage is one fit, the head's FLOPs counted
    one = seconds_per_flop(events, lambda stage, kind: blocks(stage, kind) + head(kind) * stage)
    assert one == pytest.approx({"F": 2.5 / 25, "B": 6.0 / 50})
    base = EPCosts(Workload(MODEL, 8, 1), 1.0, [0.0])
    fitted = FittedEP(base, rates, [0.0])
    last = MODEL.num_layers
    assert fitted.attn(last, "F") == pytest.approx(0.1 * base.attn(last, "F"))
    assert fitted.attn(last, "B") == 0.0
    assert fitted.attn(1, "B") == pytest.approx(0.15 * base.attn(1, "B"))


def test_a_chunked_runs_expert_calls_are_fitted_apart_from_its_attention() -> None:
    """A chunked run traces each expert call: the fit takes their median seconds as one
    call's price (forward and backward) and the stage spans less the calls for the
    attention's rate; the replay prices a chunk at the call, `experts` at the run's chunk
    count times it, and another chunk count as a share of that."""
    from disagmoe.bench.ep_fit import FittedEP, fitted_ep_rates
    from disagmoe.distributed.ep_layout import EPLayout
    from disagmoe.simulator import Workload
    from disagmoe.simulator.ep import EPCosts

    lay = EPLayout.of("ep-overlap", MODEL, world=2, pp=1, ep=2, num_micro_batches=4, v=1)
    flops = EPCosts(Workload(MODEL, 8, 1), 1.0, [0.0])
    moe = [l for l in lay.layers_of_stage(0) if MODEL.is_moe_layer(l)]

    def ev(name: str, cat: str, t0: float, t1: float) -> dict:
        return {"cat": cat, "name": name, "pid": 0, "ts": t0 * 1e6, "dur": (t1 - t0) * 1e6,
                "args": {"stage": 0, "step": 1}}  # fmt: skip

    calls = 2 * len(moe)  # two chunks per MoE layer, 0.5 s forward and 0.25 s backward each
    events = [ev("F s0 mb0", "fwd", 0.0, 10.0), ev("B s0 mb0", "bwd", 10.0, 30.0)]
    events += [ev(f"experts l c{n}", "compute", 1.0 + n, 1.5 + n) for n in range(calls)]
    events += [ev(f"experts.bwd l c{n}", "compute", 11.0 + n, 11.25 + n) for n in range(calls)]
    rates = fitted_ep_rates(events, lay, flops, chunked=True)
    assert rates["experts F"] == pytest.approx(0.5) and rates["experts B"] == pytest.approx(0.25)
    layers = lay.layers_of_stage(0)
    attn_f = sum(flops.attn(l, "F") for l in layers) + flops.attn(MODEL.num_layers, "F")
    assert rates["F"] == pytest.approx((10.0 - 0.5 * calls) / attn_f)
    fitted = FittedEP(flops, rates, [0.0], chunks=2)
    assert fitted.experts_chunk("F", 2) == pytest.approx(0.5)
    assert fitted.experts("B") == pytest.approx(0.5)
    assert fitted.experts_chunk("B", 4) == pytest.approx(0.125)
    # one rate for everything where no call is traced
    plain = fitted_ep_rates(events[:2], lay, flops, chunked=True)
    assert "experts F" not in plain
    assert plain["F"] == pytest.approx(10.0 / (attn_f + len(moe) * flops.experts("F")))
