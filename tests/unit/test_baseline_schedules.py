"""Schedules of the ep-* baselines as data: PyTorch's orders, the IR export and its replay."""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Callable
from unittest import mock

import pytest
import torch.distributed.pipelining.schedules as pt
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleInterleaved1F1B,
)
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

from disagmoe.config import EP_RUNTIMES, ModelConfig, ParallelConfig, TrainConfig
from disagmoe.distributed.ep_layout import EPLayout, split_layers
from disagmoe.presets import model_preset
from disagmoe.schedule.baselines import build_baseline_schedule, pytorch_order
from disagmoe.schedule.ir import Instr, Op, Schedule
from disagmoe.schedule.pipelines import (
    Action,
    Overlap,
    Step,
    actions,
    combined_1f1b,
    dualpipev,
    interleaved_1f1b,
    max_in_flight,
    one_f_one_b,
    pipeline_order,
)
from disagmoe.schedule.semantics import Chunked, InOrderProgram
from disagmoe.simulator import SimResult, simulate_baseline_schedule


def replay(schedule: Schedule, cost: Callable[[Instr], float]) -> SimResult:
    """Run every rank's list in order under `schedule.semantics` (through the simulator);
    all-to-alls cost `cost` too, messages are free. Raises on a deadlock."""
    return simulate_baseline_schedule(
        schedule, cost, message_bytes=lambda m: 0.0, tokens_per_step=1, a2a_s=cost
    )


def _layout(
    runtime: str,
    world: int,
    pp: int,
    ep: int,
    num_micro: int,
    model: ModelConfig | None = None,
    v: int = 2,
) -> EPLayout:
    model = model or ModelConfig()
    train = TrainConfig(global_batch_size=2 * num_micro, micro_batch_size=2)
    return EPLayout.build(
        model, ParallelConfig(runtime=runtime, pp=pp, ep=ep, virtual_stages=v), train, world
    )


def _executed_1f1b(pp: int, n: int) -> dict[int, list[tuple[int, str, int]]]:
    """Run PyTorch's Schedule1F1B loop on mock stages and record the stage calls it makes."""
    order: dict[int, list[tuple[int, str, int]]] = {}
    for rank in range(pp):
        stage = mock.create_autospec(PipelineStage, instance=True)
        stage.group_rank, stage.group_size, stage.num_stages = rank, pp, pp
        stage.stage_index, stage.is_first, stage.is_last = rank, rank == 0, rank == pp - 1
        calls: list[tuple[int, str, int]] = []
        stage.forward_one_chunk.side_effect = lambda i, *a, _c=calls, _r=rank, **k: _c.append(
            (_r, "F", i)
        )
        stage.backward_one_chunk.side_effect = lambda i, *a, _c=calls, _r=rank, **k: _c.append(
            (_r, "B", i)
        )
        sched = Schedule1F1B(stage, n, loss_fn=None)
        sched._has_backward = True
        with (
            mock.patch.object(pt, "_batch_p2p", return_value=[]),
            mock.patch.object(sched, "_initialize_stage"),
        ):
            sched._step_microbatches([()] * n, [{}] * n, None, None, return_outputs=False)
        order[rank] = calls
    return order


def _flat(orders: list[list[Step]]) -> dict[int, list[tuple[int, str, int]]]:
    return {
        r: [(a.stage, a.kind, a.mb) for step in steps for a in actions(step)]
        for r, steps in enumerate(orders)
    }


@pytest.mark.parametrize(("pp", "n"), [(1, 3), (2, 2), (2, 5), (4, 4), (4, 9)])
def test_1f1b_order_is_what_pytorch_executes(pp: int, n: int) -> None:
    assert _flat(one_f_one_b(pp, n)) == _executed_1f1b(pp, n)


def _torch_step(action: pt._Action | None) -> Step | None:
    """PyTorch's compute action as a `pipelines` step (None for idle and communication)."""
    if action is None:
        return None
    if action.sub_actions is not None:
        forward, backward = (_torch_step(sub) for sub in action.sub_actions)
        assert isinstance(forward, Action) and isinstance(backward, Action)
        return Overlap(forward, backward)
    if not action.is_compute_op:
        return None
    assert action.microbatch_index is not None
    kind = action.computation_type.value
    return Action(kind, action.stage_index, action.microbatch_index)


@pytest.mark.parametrize(
    ("runtime", "pp", "n", "v"),
    [
        ("ep-interleaved", 2, 4, 2),
        ("ep-interleaved", 4, 8, 2),
        ("ep-interleaved", 4, 12, 3),
        ("ep-interleaved", 4, 6, 3),
        ("ep-interleaved", 4, 16, 4),
        ("ep-dualpipev", 2, 4, 2),
        ("ep-dualpipev", 2, 8, 2),
        ("ep-dualpipev", 3, 12, 2),
        ("ep-dualpipev", 4, 8, 2),
        ("ep-dualpipev", 5, 20, 2),
    ],
)
def test_orders_are_pytorchs_pipeline_order(runtime: str, pp: int, n: int, v: int) -> None:
    """Interleaved 1F1B and DualPipeV: the steps (with DualPipeV's overlapped F/B pairs) that
    PyTorch's schedule class builds and executes."""
    cls = ScheduleInterleaved1F1B if runtime == "ep-interleaved" else ScheduleDualPipeV
    ops = get_schedule_ops(cls, pp, n, v)
    theirs = [[s for a in ops[r] if (s := _torch_step(a)) is not None] for r in range(pp)]
    ours = interleaved_1f1b(pp, n, v) if runtime == "ep-interleaved" else dualpipev(pp, n)
    assert ours == theirs


@pytest.mark.parametrize(
    ("runtime", "pp", "n"),
    [
        ("ep-1f1b", 2, 4),
        ("ep-combined", 1, 4),
        ("ep-combined", 2, 4),
        ("ep-combined", 4, 9),
        ("ep-interleaved", 2, 4),
        ("ep-interleaved", 4, 8),
        ("ep-dualpipev", 2, 4),
        ("ep-dualpipev", 4, 8),
        ("ep-overlap", 4, 6),
    ],
)
def test_orders_cover_every_stage_and_micro_batch_once(runtime: str, pp: int, n: int) -> None:
    layout = _layout(runtime, pp, pp, 1, n, ModelConfig(num_layers=8))
    order = pytorch_order(layout)
    where = layout.stage_to_pp_rank()
    for r, acts in order.items():
        assert all(where[s] == r for s, _, _ in acts), (
            "an action ran on a rank that lacks its stage"
        )
        seen: set[tuple[int, str, int]] = set()
        for s, kind, mb in acts:
            if kind in ("B", "I"):
                assert (s, "F", mb) in seen, f"{kind}{mb} of stage {s} before its forward"
            if kind == "W":
                assert (s, "I", mb) in seen
            seen.add((s, kind, mb))
        counts = Counter((s, "F" if k == "F" else "B") for s, k, _ in acts if k in ("F", "B", "I"))
        assert set(counts.values()) == {n}
    if runtime == "ep-dualpipev":
        kinds = {k for acts in order.values() for _, k, _ in acts}
        assert {"I", "W"} <= kinds  # zero-bubble split backward
        assert layout.stages_of(0) == [0, 2 * pp - 1]  # the V: first and last stage on rank 0
    held = [layout.layers_of_rank(r) for r in range(pp)]
    assert sorted(l for h in held for l in h) == list(range(8))  # every layer on one rank
    assert all(h == sorted(h) for h in held)
    if runtime == "ep-dualpipev" and pp == 2:  # 4 stages of 2 layers, V: 0,3 | 1,2
        assert held == [[0, 1, 6, 7], [2, 3, 4, 5]]


@pytest.mark.parametrize("runtime", EP_RUNTIMES)
def test_export_matches_messages_and_replays(runtime: str) -> None:
    model = model_preset("tiny-shared")
    layout = _layout(runtime, 4, 2, 2, 8, model)
    sched = build_baseline_schedule(layout, model)
    sends = Counter(i.msg for r in sched.ranks for i in r if i.op == Op.SEND)
    recvs = Counter(i.msg for r in sched.ranks for i in r if i.op == Op.RECV)
    assert sends == recvs and sends and set(sends.values()) == {1}
    for rank, instrs in enumerate(sched.ranks):
        for i in instrs:
            if i.op == Op.A2A:
                assert rank in i.group and len(i.group) == 2
            if i.msg is not None:
                assert rank in (i.msg.src, i.msg.dst)
    # every EP group issues its all-to-alls in one order (else the real run would hang)
    for instrs in sched.ranks:
        mine = [(i.comp, i.layer, i.slot) for i in instrs if i.op == Op.A2A]
        for peer in next(i.group for i in instrs if i.op == Op.A2A):
            theirs = [(i.comp, i.layer, i.slot) for i in sched.ranks[peer] if i.op == Op.A2A]
            assert mine == theirs
    # per micro-batch: every layer's attention and experts forward and backward once per replica
    dense_layers = model.num_dense_layers
    for instrs in sched.ranks[:1]:
        fwd_f = [i for i in instrs if i.op == Op.FWD and i.comp == "F"]
        assert all(i.layer >= dense_layers for i in fwd_f)
    result = replay(sched, lambda i: 1.0 if i.is_compute or i.op == Op.A2A else 0.0)
    assert len(result.workers) == 4 and min(w["busy_s"] for w in result.workers) > 0


def test_1f1b_replay_has_the_published_bubble() -> None:
    """Uniform stage costs f, b: 1F1B takes (M + p - 1)(f + b) (one layer per stage, no EP)."""
    pp, n = 4, 6
    model = ModelConfig(num_layers=4)
    sched = build_baseline_schedule(_layout("ep-1f1b", pp, pp, 1, n, model), model)

    def cost(i: Instr) -> float:
        if i.layer == model.num_layers:  # fold the head into the last stage's layer cost
            return 0.0
        return {Op.FWD: 0.5, Op.BWD: 1.0}.get(i.op, 0.0)  # FWD A + FWD F = 1, BWD = 2

    assert replay(sched, cost).step_time_s == pytest.approx((n + pp - 1) * (1.0 + 2.0))


def test_replay_detects_a_deadlock() -> None:
    model = ModelConfig()
    sched = build_baseline_schedule(_layout("ep-1f1b", 2, 2, 1, 2, model), model)
    swapped = (tuple(reversed(sched.ranks[0])), sched.ranks[1])
    broken = dataclasses.replace(sched, ranks=swapped)
    with pytest.raises(RuntimeError, match="deadlock"):
        replay(broken, lambda i: 1.0)


def test_split_layers_and_layout_checks() -> None:
    assert split_layers(5, 2) == [[0, 1, 2], [3, 4]]
    layout = _layout("ep-1f1b", 8, 2, 2, 8)
    assert (layout.dp, layout.ep, layout.num_local_micro_batches) == (4, 2, 2)
    assert layout.coords(7) == (1, 3, 1, 1)
    assert layout.ep_group_ranks(1, 1) == [6, 7]
    with pytest.raises(ValueError, match="micro-batches per replica"):
        _layout("ep-dualpipev", 2, 2, 1, 2)
    with pytest.raises(ValueError, match="tie_embeddings"):
        _layout("ep-1f1b", 2, 2, 1, 4, ModelConfig(tie_embeddings=True))
    with pytest.raises(ValueError, match="exceed model.num_layers"):
        _layout("ep-interleaved", 4, 4, 1, 8, ModelConfig(num_layers=4))


@pytest.mark.parametrize(("pp", "n"), [(1, 1), (1, 4), (2, 2), (3, 7)])
def test_combined_1f1b_pairs_1f1bs_steady_state(pp: int, n: int) -> None:
    """Combined 1F1B: per rank, 1F1B's forwards and backwards in their order, one forward
    more before the first backward, then the steady state as F&B pairs (the forward of
    micro-batch w + i beside the backward of micro-batch i), then the drain."""
    for rank, steps in enumerate(combined_1f1b(pp, n)):
        warmup = min(pp - rank, n)
        flat = [a for step in steps for a in actions(step)]
        assert [a.mb for a in flat if a.kind == "F"] == list(range(n))
        assert [a.mb for a in flat if a.kind == "B"] == list(range(n))
        assert steps[:warmup] == [Action("F", rank, i) for i in range(warmup)]
        pairs = [s for s in steps if isinstance(s, Overlap)]
        assert pairs == [
            Overlap(Action("F", rank, warmup + i), Action("B", rank, i)) for i in range(n - warmup)
        ]
        in_flight = max(
            sum(1 for a in flat[: k + 1] if a.kind == "F")
            - sum(1 for a in flat[:k] if a.kind == "B")
            for k in range(len(flat))
        )
        assert in_flight == warmup + (1 if n > warmup else 0)  # 1F1B's + 1 at most


def _ordered_actions(
    runtime: str, pp: int, n: int, rank: int, v: int = 1, warmup: int = 0
) -> list[str]:
    """The action list (compute and pipeline p2p) `ScheduleOrdered` runs on `rank`, whose
    `v` stages are `c*pp + rank`."""
    from disagmoe.baselines.fb_overlap import ScheduleOrdered

    stages = []
    for c in range(v):
        stage = mock.create_autospec(PipelineStage, instance=True)
        index = c * pp + rank
        stage.group_rank, stage.group_size, stage.num_stages = rank, pp, pp * v
        stage.stage_index, stage.is_first, stage.is_last = index, index == 0, index == pp * v - 1
        stages.append(stage)
    sched = ScheduleOrdered(stages, n, None, runtime, warmup=warmup)
    return [str(a) for a in sched.pipeline_order_with_comms[rank]]


def test_interleaved_runs_its_order_with_a_warm_up_on_pytorchs_runtime() -> None:
    """`ep-interleaved` runs `interleaved_1f1b` (a warm-up of 2 forwards more here) on
    PyTorch's pipeline runtime, every stage's receives in the list."""
    pp, n, v, warmup = 2, 4, 2, 2
    want = _flat(interleaved_1f1b(pp, n, v, warmup))
    for rank in range(pp):
        acts = _ordered_actions("ep-interleaved", pp, n, rank, v, warmup)
        found = [re.fullmatch(r"(\d+)([FB])(\d+)", a) for a in acts]
        computes = [(int(m[1]), m[2], int(m[3])) for m in found if m]
        assert computes == want[rank]
        assert sum("RECV_F" in a for a in acts) == n * (v - (1 if rank == 0 else 0))


@pytest.mark.parametrize("runtime", ["ep-1f1b", "ep-overlap"])
def test_1f1b_runs_its_order_with_receives_ahead_of_need(runtime: str) -> None:
    """`ep-1f1b` runs 1F1B's order on PyTorch's pipeline runtime: the last stage posts the
    next activation's receive before its backward (`Schedule1F1B` posts it after that
    backward, fused with the backward's send, and waits for both)."""
    pp, n = 2, 4
    for rank in range(pp):
        acts = _ordered_actions(runtime, pp, n, rank)
        computes = [
            (rank, a[1], int(a[2:])) for a in acts if a[1:2] in ("F", "B") and a[2:].isdigit()
        ]
        assert computes == _flat(one_f_one_b(pp, n))[rank]
    last = _ordered_actions(runtime, pp, n, pp - 1)
    for mb in range(1, n):
        assert last.index(f"1RECV_F{mb}") < last.index(f"1B{mb - 1}")


def test_a_longer_warm_up_holds_more_micro_batches_and_at_the_count_is_gpipe() -> None:
    """`parallel.pipeline_warmup` w: rank r of 1F1B warms up with p - 1 - r + w forwards
    (then the steady state's first forward comes before its first backward) and holds w
    micro-batches more (up to the count); at w >= the count every
    forward runs first (GPipe's order). Combined 1F1B pairs after its longer warm-up. The
    runtimes without a 1F1B warm-up refuse one."""
    pp, n = 3, 6
    plain, warmed = one_f_one_b(pp, n), one_f_one_b(pp, n, 2)
    for rank, steps in enumerate(warmed):
        kinds = [a.kind for step in steps for a in actions(step)]
        assert kinds.index("B") == (pp - 1 - rank + 2) + 1
        assert max_in_flight(steps) == max_in_flight(plain[rank]) + 2
        assert sorted(_flat([steps])[0]) == sorted(_flat([plain[rank]])[0])
    for steps in one_f_one_b(pp, n, n):
        assert [a.kind for step in steps for a in actions(step)] == ["F"] * n + ["B"] * n
    for rank, steps in enumerate(combined_1f1b(pp, n, 1)):
        ahead = pp - rank + 1  # combined 1F1B's own warm-up (p - r) and one more
        assert all(isinstance(s, Action) and s.kind == "F" for s in steps[:ahead])
        assert sum(isinstance(s, Overlap) for s in steps) == n - ahead
    assert pipeline_order("ep-combined", pp, n, 1, 1) == combined_1f1b(pp, n, 1)
    with pytest.raises(ValueError, match="pipeline_warmup"):
        pipeline_order("ep-dualpipev", 2, 4, 2, 1)


@pytest.mark.parametrize(("pp", "n", "v", "extra"), [(2, 4, 2, 1), (4, 8, 2, 4), (4, 12, 3, 2)])
def test_interleaved_warm_up_moves_only_where_forwards_and_backwards_meet(
    pp: int, n: int, v: int, extra: int
) -> None:
    """`parallel.pipeline_warmup` w on interleaved 1F1B: each rank runs w stage forwards more
    before its first backward and holds w more; its forwards, and its backwards, keep
    their order; at w >= the micro-batch count every forward runs first (breadth-first)."""
    plain, warmed = interleaved_1f1b(pp, n, v), interleaved_1f1b(pp, n, v, extra)
    assert pipeline_order("ep-interleaved", pp, n, v, extra) == warmed
    for rank in range(pp):
        old, new = _flat([plain[rank]])[0], _flat([warmed[rank]])[0]
        for kind in ("F", "B"):
            assert [a for a in new if a[1] == kind] == [a for a in old if a[1] == kind]
        first_b = [a[1] for a in new].index("B")
        assert first_b == min([a[1] for a in old].index("B") + extra, v * n)
        assert max_in_flight(warmed[rank]) == min(max_in_flight(plain[rank]) + extra, v * n)
    for steps in interleaved_1f1b(pp, n, v, n):
        assert [a.kind for step in steps for a in actions(step)] == ["F"] * v * n + ["B"] * v * n


@pytest.mark.parametrize("chunks", [1, 2])
def test_chunked_dualpipev_computes_expert_weight_grads_in_its_input_backward(
    chunks: int,
) -> None:
    """A chunked MoE layer's autograd function computes the expert weight gradients with
    the input gradients (`baselines.moe_overlap`): the list has no `W F` there, and the
    in-order program prices that layer's I-time expert backward as a whole backward ("B")."""
    model = model_preset("tiny-shared")
    layout = _layout("ep-dualpipev", 4, 2, 2, 8, model)
    sched = build_baseline_schedule(layout, model, overlap_chunks=chunks)
    assert sched.meta["a2a_chunks"] == chunks
    for rank, instrs in enumerate(sched.ranks):
        wgt = Counter(i.comp for i in instrs if i.op == Op.WGT)
        assert wgt["A"] > 0 and (wgt["F"] > 0) == (chunks == 1)
        prog = InOrderProgram.build(sched, rank)
        kinds = {
            task.kind
            for seg in prog.segments
            for _, tasks in seg.lanes
            for task in tasks
            if isinstance(task.work, Chunked) or (task.work.is_compute and task.work.comp == "F")
            if task.kind in ("B", "I")
        }
        assert kinds == ({"B"} if chunks > 1 else {"B", "I"})
