"""Simulator pieces for host calibration and cluster placement: shared cores, per-message
overheads, the EP baselines' IR replay, node-aware placement and the NIC split."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from disagmoe.config import ModelConfig, ParallelConfig, TrainConfig
from disagmoe.distributed.ep_layout import EPLayout
from disagmoe.distributed.layout import Layout
from disagmoe.presets import CLUSTER_PRESETS, MODEL_PRESETS
from disagmoe.schedule.afpipe import build_afpipe
from disagmoe.schedule.baselines import build_baseline_schedule
from disagmoe.schedule.ir import Instr, Op
from disagmoe.simulator import (
    MessageOverheads,
    Network,
    Workload,
    simulate_baseline_schedule,
    simulate_disagg,
)
from disagmoe.simulator import simulate_schedule as simulate_afpipe
from disagmoe.simulator.engine import COMPUTE, DELAY, Program, run_program
from disagmoe.simulator.placement import nic_shares


@dataclass(frozen=True)
class StageCosts:
    fwd: float
    bwd: float

    def compute_s(self, op: Op, comp: str, layer: int) -> float:
        return self.fwd if op == Op.FWD else self.bwd


def test_cores_pool_shares_compute_across_ranks() -> None:
    prog = Program(num_ranks=4)
    for r in range(4):
        prog.add(COMPUTE, r, "fwd", 1.0, "attn", f"c{r}", [])
    assert run_program(prog, cores=2).makespan == pytest.approx(2.0)
    assert run_program(prog, cores=4).makespan == pytest.approx(1.0)
    assert run_program(prog, cores=8).makespan == pytest.approx(1.0)  # one op <= one core
    assert run_program(prog, share_compute=False).makespan == pytest.approx(1.0)


def test_a_background_compute_yields_its_gpu_and_resumes() -> None:
    """A background compute (a W) runs only while no other compute of its rank does: the
    others take the GPU as if it were idle, and it keeps the work it had done."""
    prog = Program(num_ranks=2)
    w = prog.add(COMPUTE, 0, "wgt", 1.0, "attn", "W", [])
    wait = prog.add(DELAY, 0, "fwd", 0.5, "other", "wait", [])
    f = prog.add(COMPUTE, 0, "fwd", 1.0, "attn", "F", [wait])
    other = prog.add(COMPUTE, 1, "fwd", 1.0, "attn", "F elsewhere", [])  # another rank's GPU
    prog.background = {w}
    t = run_program(prog)
    assert t.end[f] == pytest.approx(1.5)  # from 0.5 at full rate: the W paused
    assert t.end[w] == pytest.approx(2.0)  # 0.5 done before, 0.5 after the F
    assert t.end[other] == pytest.approx(1.0)
    prog.background = set()  # without it, both share the GPU from 0.5 on
    t = run_program(prog)
    assert t.end[w] == pytest.approx(1.5) and t.end[f] == pytest.approx(2.0)
    # in a pool of cores a background compute waits for every rank's others
    prog.background = {w}
    t = run_program(prog, cores=1)
    assert t.end[other] < t.end[w] and t.end[f] < t.end[w]
    assert t.end[w] == pytest.approx(3.0)


def test_message_overheads_add_to_every_hop_of_a_single_slot() -> None:
    """p = 1, one slot: 2L+1 forward and 2L+1 backward stages, 4L one-message hops, each
    paying post + latency + receive + hand-off."""
    model = ModelConfig(num_layers=4)
    layout = Layout.build(model, ParallelConfig(groups=1, attn_workers=1, expert_workers=1))
    net = Network.single_node(1e30, 0.25, layout.world_size)
    over = MessageOverheads(post_s=0.1, recv_s=0.05, handoff_s=0.02)
    result = simulate_afpipe(
        build_afpipe(layout, 1),
        layout,
        StageCosts(1.0, 2.0),
        Workload(model, 8, 1),
        net,
        sync=False,
        share_compute=False,
        overheads=over,
    )
    assert result.step_time_s == pytest.approx(9 * 3.0 + 16 * (0.25 + 0.1 + 0.05 + 0.02))


def _ep_layout(runtime: str, pp: int, num_micro: int, layers: int = 8) -> EPLayout:
    model = ModelConfig(num_layers=layers)
    train = TrainConfig(global_batch_size=2 * num_micro, micro_batch_size=2)
    return EPLayout.build(
        model, ParallelConfig(runtime=runtime, pp=pp, ep=1, virtual_stages=2), train, pp
    )


@pytest.mark.parametrize(("pp", "mb"), [(2, 4), (4, 8), (4, 4)])
def test_baseline_ir_replay_matches_1f1b_formula(pp: int, mb: int) -> None:
    """The `ep-1f1b` instruction lists (PyTorch's order) with F/B of 1/2 per layer and a
    free loss head: (M + p - 1)(F + B) per rank of L/p layers."""
    lay = _ep_layout("ep-1f1b", pp, mb)
    model = ModelConfig(num_layers=8)
    schedule = build_baseline_schedule(lay, model)

    def cost(ins: Instr) -> float:
        if ins.layer == model.num_layers or ins.comp != "A":
            return 0.0
        return 1.0 if ins.op == Op.FWD else 2.0

    result = simulate_baseline_schedule(
        schedule, cost, message_bytes=lambda m: 0.0, tokens_per_step=1
    )
    per = model.num_layers // pp
    assert result.step_time_s == pytest.approx((mb + pp - 1) * 3.0 * per)


def test_node_aware_placement_mixes_a_and_f_on_every_node() -> None:
    model = MODEL_PRESETS["qwen3-30b-a3b"]
    layout = Layout.build(model, ParallelConfig(groups=2, attn_workers=24, expert_workers=8))
    net = Network.from_cluster(CLUSTER_PRESETS["h800"])  # rank r on GPU r, 8 per node
    for node in range(8):
        roles = [layout.role(r) for r in range(64) if net.node_of(r) == node]
        assert sorted(r.comp for r in roles) == ["A"] * 6 + ["F"] * 2  # 24 : 8 on every node
        assert len({r.group for r in roles}) == 1  # a group keeps its own nodes
    with pytest.raises(ValueError, match="placement"):
        ParallelConfig(placement="random")


def test_nic_split_divides_the_group_pool() -> None:
    cluster = CLUSTER_PRESETS["h800"]
    layout = Layout.build(
        MODEL_PRESETS["qwen3-30b-a3b"], ParallelConfig(groups=1, attn_workers=48, expert_workers=16)
    )
    net = Network.from_cluster(cluster)
    shares = nic_shares(layout, net, 19, 13)
    assert sum(shares) == pytest.approx(64 * net.nic_bytes_per_gpu)
    a = sum(s for r, s in enumerate(shares) if layout.role(r).comp == "A")
    assert a / sum(shares) == pytest.approx(19 / 32)


def test_node_aware_placement_moves_dispatch_onto_nvlink() -> None:
    """p = 1, m = n = 8 on two nodes: packed puts the replicas on one node and the shards
    on the other (every M2N byte over IB); node-aware puts 4 + 4 on each (half on NVLink)."""
    model = MODEL_PRESETS["small"]
    cluster = CLUSTER_PRESETS["h800"]
    kw = dict(
        groups=1, attn_workers=8, expert_workers=8, seq_len=4096, micro_batch_size=1,
        num_micro_batches=16,
    )  # fmt: skip
    packed = simulate_disagg(model, cluster, placement="packed", **kw)  # type: ignore[arg-type]
    aware = simulate_disagg(model, cluster, **kw)  # type: ignore[arg-type]
    assert aware.step_time_s < packed.step_time_s
    with pytest.raises(ValueError, match="node-aware"):
        simulate_disagg(model, cluster, placement="packed", nic_split=(4, 4), **kw)  # type: ignore[arg-type]
