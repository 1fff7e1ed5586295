"""F&B overlap: the forward of one micro-batch and the backward of another, run at once.

DualPipe's point (DeepSeek-V3, and Megatron-LM's combined 1F1B): while one micro-batch's
all-to-all is on the wire, the other micro-batch computes, so each one's communication
hides under the other's compute. PyTorch's pipelining runtime emits such pairs as
`OVERLAP_F_B` actions but runs their two halves one after the other; `run_overlapped`,
registered for `OVERLAP_F_B`, runs the forward on a thread of its own (named "fwd")
while the calling thread runs the backward, and returns when both are done.

What makes two concurrent halves safe:

* each half's all-to-alls go on its lane's process group (`EPComm.use_lane`, set by the
  stage per computation: forward on the EP group, backward on a second group over the same
  ranks), and every member of an EP group runs the same action list, so each group sees
  its collectives in one order on every member;
* the halves touch disjoint state: the forward writes its own micro-batch's cache and
  (on the last stage) appends the next loss, the backward pops another micro-batch's cache
  and reads an earlier loss; autograd runs the backward's graph on the calling thread while
  the forward builds a new one; parameters do not change within a step;
* one device per worker: the two halves' compute shares it (a GPU's streams share its
  compute units; emulated compute takes turns, `models.emulated`).

The two halves mirror what PyTorch's runtime does for a FORWARD and a FULL_BACKWARD action
(wait for the pipeline receive, compute, hand a V turn's output to the neighbouring stage
on this rank). Each half posts its own pipeline send as it ends (`TracedStage.send_early`),
not after the pair, where the list's SEND actions stand: the forward's as soon as the
forward is done, the backward's as soon as the backward is done, or, where both go to the
same rank (DualPipeV: both of a pair's neighbours are on the next rank), once both are
done, so that rank receives them in the list's order (one connection, matched in order).
"""

from __future__ import annotations

import threading
from functools import partial
from typing import Any

from ..schedule.pipelines import Overlap, Step, pipeline_order
from ..torch_private import (
    FORWARD,
    FULL_BACKWARD,
    OVERLAP_F_B,
    Action,
    PipelineContext,
    PipelineScheduleRuntime,
    compute_loss,
    get_loss,
    prepare_schedule_with_comms,
    schedule_num_microbatches,
    schedule_stages,
    wait_batch_p2p,
)
from .stage import TracedStage


def _forward(sched: PipelineScheduleRuntime, action: Action, ctx: PipelineContext) -> None:
    stages: dict[int, TracedStage] = {s.stage_index: s for s in schedule_stages(sched)}  # type: ignore[misc]
    stage, mb = stages[action.stage_index], action.microbatch_index
    assert mb is not None and ctx.arg_mbs is not None and ctx.kwarg_mbs is not None
    if not stage.is_first and action.stage_index - 1 not in stages:
        wait_batch_p2p(sched.fwd_recv_ops.pop((action.stage_index, mb)))
    output = stage.forward_one_chunk(mb, ctx.arg_mbs[mb], ctx.kwarg_mbs[mb], False)
    compute_loss(sched, stage, output, ctx.target_mbs, mb)
    if action.stage_index + 1 in stages:  # the V turn: the next stage is on this rank
        stages[action.stage_index + 1].set_local_fwd_input(output, mb)
    elif not stage.is_last:
        stage.send_early("act", mb)


def _backward(sched: PipelineScheduleRuntime, action: Action) -> None:
    stages: dict[int, TracedStage] = {s.stage_index: s for s in schedule_stages(sched)}  # type: ignore[misc]
    stage, mb = stages[action.stage_index], action.microbatch_index
    assert mb is not None
    if not stage.is_last and action.stage_index + 1 not in stages:
        wait_batch_p2p(sched.bwd_recv_ops.pop((action.stage_index, mb)))
    loss = get_loss(sched, stage, mb)
    sched.backward_counter[action.stage_index] += 1
    last = sched.backward_counter[action.stage_index] == schedule_num_microbatches(sched)
    stage.backward_one_chunk(mb, loss=loss, full_backward=True, last_backward=last)
    if action.stage_index - 1 in stages:
        stages[action.stage_index - 1].set_local_bwd_input(stage.get_local_bwd_output(mb), mb)


def _remote(stage_to_rank: list[int], stage: int, to: int) -> int | None:
    """The rank a pipeline send from `stage` to stage `to` goes to (None: none, or this rank)."""
    if not 0 <= to < len(stage_to_rank) or stage_to_rank[to] == stage_to_rank[stage]:
        return None
    return stage_to_rank[to]


def run_overlapped(action: Action, ctx: PipelineContext, stage_to_rank: list[int]) -> None:
    """An `OVERLAP_F_B` action: its forward on a thread of its own, its backward here, each
    half's pipeline send posted as it ends (module doc)."""
    sched = ctx.schedule_ref
    assert isinstance(sched, PipelineScheduleRuntime) and action.sub_actions is not None
    fwd, bwd = action.sub_actions
    assert fwd.computation_type == FORWARD and bwd.computation_type == FULL_BACKWARD, action
    for sub in (fwd, bwd):  # the executed order records the pair as the list has it
        stage = next(s for s in schedule_stages(sched) if s.stage_index == sub.stage_index)
        assert isinstance(stage, TracedStage) and sub.microbatch_index is not None
        stage.record(sub.computation_type.value, sub.microbatch_index)
    failed: list[BaseException] = []

    def forward() -> None:
        try:
            _forward(sched, fwd, ctx)
        except BaseException as err:  # re-raised on the calling thread
            failed.append(err)

    to = _remote(stage_to_rank, bwd.stage_index, bwd.stage_index - 1)
    after_forward = to is not None and to == _remote(
        stage_to_rank, fwd.stage_index, fwd.stage_index + 1
    )
    stage = next(s for s in schedule_stages(sched) if s.stage_index == bwd.stage_index)
    assert isinstance(stage, TracedStage) and bwd.microbatch_index is not None
    thread = threading.Thread(target=forward, name="fwd", daemon=True)
    thread.start()
    try:
        _backward(sched, bwd)
        if to is not None and not after_forward:
            stage.send_early("grad", bwd.microbatch_index)
    finally:
        thread.join()
    if failed:
        raise failed[0]
    if after_forward:
        stage.send_early("grad", bwd.microbatch_index)


def enable_fb_overlap(schedule: PipelineScheduleRuntime, stage_to_rank: list[int]) -> None:
    """Run `schedule`'s OVERLAP_F_B actions with their halves at once (module doc);
    `stage_to_rank`: the pipeline rank of every stage."""
    schedule.register_custom_function(
        OVERLAP_F_B, partial(run_overlapped, stage_to_rank=stage_to_rank)
    )


def _torch_action(step: Step) -> Action:
    if isinstance(step, Overlap):
        return Action(
            -1, OVERLAP_F_B, None, (_torch_action(step.forward), _torch_action(step.backward))
        )
    kind = {"F": FORWARD, "B": FULL_BACKWARD}[step.kind]
    return Action(step.stage, kind, step.mb)


class ScheduleOrdered(PipelineScheduleRuntime):
    """A rank's stages run in the order `schedule.pipelines.pipeline_order` gives the runtime
    (`ep-1f1b` and `ep-overlap`: 1F1B; `ep-combined`: combined 1F1B; `ep-interleaved`:
    interleaved 1F1B, `virtual_stages` stages per rank, stage `c*pp + r` on rank r; each
    with `warmup` forwards more in its warm-up, `parallel.pipeline_warmup`), lowered to
    PyTorch's runtime with its pipeline sends and receives: a receive is posted where the
    lowering places it, as soon as its sender's computation is in the list, not after this
    rank's computation before it (as `Schedule1F1B` does), and a send is waited for at the
    step's end only, so messages move under the computations between. F&B pairs run at
    once."""

    def __init__(
        self,
        stages: list[TracedStage],
        n_microbatches: int,
        loss_fn: Any,
        runtime: str,
        scale_grads: bool = False,
        warmup: int = 0,
    ) -> None:
        super().__init__(stages, n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
        pp = stages[0].group_size
        order = pipeline_order(runtime, pp, n_microbatches, len(stages), warmup)
        self.pipeline_order: dict[int, list[Action | None]] = {
            rank: [_torch_action(step) for step in steps] for rank, steps in enumerate(order)
        }
        prepare_schedule_with_comms(self, self.pipeline_order)
        enable_fb_overlap(self, [s % pp for s in range(pp * len(stages))])
