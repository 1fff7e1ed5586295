"""The overlapped gradient all-reduce (`schedule.sync`): where each bucket is issued, the
same order on replicas with different lists, and the simulator's step against the
closed form of its tail."""

from __future__ import annotations

import pytest

from disagmoe.config import ModelConfig, ParallelConfig
from disagmoe.distributed.layout import Layout
from disagmoe.schedule.afpipe import build_afpipe
from disagmoe.schedule.ir import Op
from disagmoe.schedule.semantics import RankProgram
from disagmoe.schedule.sync import sync_buckets
from disagmoe.simulator import Network, Workload, simulate_schedule

from .test_simulator import StageCosts

TINY = ModelConfig(num_layers=4)


def _layout(p: int, m: int, n: int = 1) -> Layout:
    return Layout.build(TINY, ParallelConfig(groups=p, attn_workers=m, expert_workers=n))


def test_buckets_descend_and_each_is_issued_after_its_layers_last_backward() -> None:
    layout = _layout(1, 2)
    schedule = build_afpipe(layout, 3)
    for rank in layout.attn_replicas(0):
        program = RankProgram.build(schedule, rank)
        bwd = [ins for _, ins in program.lanes["bwd"]]
        buckets = sync_buckets(program)
        assert [b.layer for b in buckets] == [4, 3, 2, 1, 0]
        seen = -1
        for k, b in enumerate(buckets):
            pos = [ins.task for ins in bwd].index(b.after)
            assert pos >= seen  # issue points follow the lane
            seen = pos
            done = {ins.layer for ins in bwd[pos + 1 :]}
            assert not done & {c.layer for c in buckets[: k + 1]}  # final: no BWD of them after
            assert bwd[pos].layer in {c.layer for c in buckets[: k + 1]}
        assert buckets[-1].after == bwd[-1].task  # the last one after the rank's last BWD
    for rank in layout.expert_shards(0):  # expert ranks: nothing to all-reduce
        assert sync_buckets(RankProgram.build(schedule, rank)) == []
    forward_only = build_afpipe(layout, 3, forward_only=True)
    assert sync_buckets(RankProgram.build(forward_only, layout.attn_rank(0, 0))) == []


@pytest.mark.parametrize(("p", "m", "micro"), [(1, 3, 8), (2, 2, 3), (1, 2, 3)])
def test_replicas_with_different_lists_issue_the_same_buckets_in_the_same_order(
    p: int, m: int, micro: int
) -> None:
    """Uneven steps: some replicas run a slot fewer; the bucket order does not follow."""
    layout = _layout(p, m)
    slots = layout.slots_of_replica(0, micro)
    schedule = build_afpipe(layout, slots, num_micro_batches=micro)
    for g in range(p):
        replicas = layout.attn_replicas(g)
        lists = [schedule.ranks[r] for r in replicas]
        assert len({len(instrs) for instrs in lists}) > 1  # the lists do differ
        orders = {
            tuple(b.layer for b in sync_buckets(RankProgram.build(schedule, r))) for r in replicas
        }
        assert orders == {tuple(sorted(layout.layers_of(replicas[0]), reverse=True))}


def _sync_replay(overlap: bool, bytes_per_s: float) -> tuple[float, list[tuple[str, float, float]]]:
    """p=1, m=2, n=1, 2 slots, compute 1 s forward / 2 s backward, one node at
    `bytes_per_s`: (step, A rank 0's (label, start, end) of its bwd and sync lanes)."""
    layout = _layout(1, 2)
    net = Network.single_node(bytes_per_s, 0.0, layout.world_size)
    result = simulate_schedule(
        build_afpipe(layout, 2),
        layout,
        StageCosts(1.0, 2.0, TINY.num_layers),
        Workload(TINY, 8, 1),
        net,
        share_compute=False,
        overlap_sync=overlap,
    )
    prog, tl = result.program, result.timeline
    assert prog is not None and tl is not None
    ops = [
        (prog.label[op], tl.start[op], tl.end[op])
        for op in range(len(prog.kind))
        if prog.rank[op] == 0 and prog.lane[op] in ("sync", "bwd")
    ]
    return result.step_time_s, ops


def test_simulator_overlaps_buckets_with_the_backward_and_keeps_only_the_last_tail() -> None:
    """Off: SYNC all-reduces everything after the rank's last op. On: bucket l3 starts
    before the rank's last BWD ends; the step is shorter by exactly the all-reduce of all
    but layer 0's bucket (the buckets before it are hidden behind the backward)."""
    bw = 1e6
    step_off, ops_off = _sync_replay(False, bw)
    step_on, ops_on = _sync_replay(True, bw)
    last_bwd_end = max(end for label, _, end in ops_on if label.startswith("B"))
    starts = {label: start for label, start, _ in ops_on}
    assert starts["allreduce l3"] < last_bwd_end
    assert not any(label.startswith("allreduce") for label, _, _ in ops_off)
    layout = _layout(1, 2)
    workload = Workload(TINY, 8, 1)
    net = Network.single_node(bw, 0.0, layout.world_size)
    replicas = layout.attn_replicas(0)

    def ring_s(layers: list[int]) -> float:
        params = sum(workload.attn_param_count(l) for l in layers)
        return net.allreduce_s(replicas, params * 4)  # float32 gradients

    assert ring_s([4, 3, 2, 1]) > 0.01  # a tail worth removing
    assert step_on == pytest.approx(step_off - (ring_s([0, 1, 2, 3, 4]) - ring_s([0])), abs=1e-9)
    # the bound counts the same all-reduce bytes: the buckets sum to the flat one
    assert sum(ring_s([l]) for l in range(5)) == pytest.approx(ring_s(list(range(5))))


def test_bucket_issue_point_is_a_backward_of_the_rank() -> None:
    layout = _layout(2, 2)
    schedule = build_afpipe(layout, 2)
    for rank in layout.attn_replicas(1):
        program = RankProgram.build(schedule, rank)
        tasks = {ins.task for _, ins in program.lanes["bwd"] if ins.op == Op.BWD}
        assert all(b.after in tasks for b in sync_buckets(program))


@pytest.mark.parametrize("tied", [False, True])
def test_every_parameter_of_an_attention_rank_is_in_exactly_one_bucket(tied: bool) -> None:
    """Layer L's bucket holds the final norm and LM head, layer 0's the embedding; a tied
    embedding / LM head (touched by the BWDs of layers 0 and L) waits for layer 0's, the
    bucket issued last."""
    import dataclasses

    from disagmoe.config import RunConfig, TrainConfig
    from disagmoe.presets import model_preset
    from disagmoe.runtime.grad_sync import OverlappedSync
    from disagmoe.runtime.stages import AttnWorker, build_worker
    from disagmoe.trace import Tracer
    from disagmoe.training.objective import LossScale

    model = dataclasses.replace(model_preset("tiny"), tie_embeddings=tied)
    cfg = RunConfig(
        model=model,
        parallel=ParallelConfig(attn_workers=2, expert_workers=1),
        train=TrainConfig(dtype="float64", seq_len=16, global_batch_size=8, micro_batch_size=2),
    )
    layout = Layout.build(cfg.model, cfg.parallel)
    rank = layout.attn_rank(0, 1)
    worker = build_worker(cfg, layout, rank, LossScale.for_run(cfg.model, cfg.train))
    assert isinstance(worker, AttnWorker)
    program = RankProgram.build(build_afpipe(layout, 2), rank)
    sync = OverlappedSync(worker, program, None, [0, 1], Tracer(rank, "A"))  # type: ignore[arg-type]
    names = {id(p): n for n, p in worker.named_parameters()}
    held = [names[id(p)] for _, ps in sync.buckets for p in ps]
    assert sorted(held) == sorted(names.values())  # all of them, once
    by_layer = {layer: {names[id(p)] for p in ps} for layer, ps in sync.buckets}
    L = model.num_layers
    assert [layer for layer, _ in sync.buckets] == list(range(L, -1, -1))
    assert "embed.weight" in by_layer[0] and "norm.weight" in by_layer[L]
    assert ("lm_head.weight" in by_layer[L]) is not tied  # tied: one parameter, embed.weight
    for l in range(L):
        assert all(n.startswith((f"layers.{l}.", "embed.")) for n in by_layer[l])
    assert sync.uncovered([p for _, p in worker.named_parameters()]) == []
