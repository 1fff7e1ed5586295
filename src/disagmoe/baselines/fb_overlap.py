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
on this rank); the pipeline sends stay separate actions of the list, after the pair.
"""

from __future__ import annotations

import threading
from typing import Any

from ..schedule.pipelines import Overlap, Step, combined_1f1b
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


def run_overlapped(action: Action, ctx: PipelineContext) -> None:
    """An `OVERLAP_F_B` action: its forward on a thread of its own, its backward here."""
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

    thread = threading.Thread(target=forward, name="fwd", daemon=True)
    thread.start()
    try:
        _backward(sched, bwd)
    finally:
        thread.join()
    if failed:
        raise failed[0]


def enable_fb_overlap(schedule: PipelineScheduleRuntime) -> None:
    """Run `schedule`'s OVERLAP_F_B actions with their halves at once (module doc)."""
    schedule.register_custom_function(OVERLAP_F_B, run_overlapped)


def _torch_action(step: Step) -> Action:
    if isinstance(step, Overlap):
        return Action(
            -1, OVERLAP_F_B, None, (_torch_action(step.forward), _torch_action(step.backward))
        )
    kind = {"F": FORWARD, "B": FULL_BACKWARD}[step.kind]
    return Action(step.stage, kind, step.mb)


class ScheduleCombined1F1B(PipelineScheduleRuntime):
    """`ep-combined`: one stage per rank, run in `schedule.pipelines.combined_1f1b`'s order
    (the order as data, lowered to PyTorch's runtime with its pipeline sends and
    receives), with its F&B pairs at once."""

    def __init__(
        self, stage: TracedStage, n_microbatches: int, loss_fn: Any, scale_grads: bool = False
    ) -> None:
        super().__init__([stage], n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
        order = combined_1f1b(stage.group_size, n_microbatches)
        self.pipeline_order: dict[int, list[Action | None]] = {
            rank: [_torch_action(step) for step in steps] for rank, steps in enumerate(order)
        }
        prepare_schedule_with_comms(self, self.pipeline_order)
        enable_fb_overlap(self)
