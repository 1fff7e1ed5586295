"""Every private torch API the project touches, in one place, checked against the pinned torch.

Private means an underscore name (`torch._grouped_mm`, `sched._stages`), a private module
(`torch.distributed.pipelining._backward`), or a name a private class owns, even one without
an underscore (`_PipelineScheduleRuntime.fwd_recv_ops`). No release promises to keep any
of these. Outside this module the code calls the wrappers below and never names a private
torch API itself (`tests/unit/test_torch_private.py` reads the source to make sure).

Upgrading torch: run `torch_private.check.check_private_apis()` (or that test file) on the new version. Each
problem names the API, the new and the pinned version and the wrapper here that needs
work. The check also looks at what our code relies on beyond the name: parameter names
and order, the fields of a record, an attribute a constructor sets, one small call.

This module imports only torch, so any module may import it. `torch.distributed.pipelining`
(about 2 s to import) loads on first use: a wrapper of its internals imports it when called,
and its classes are attributes of this module that load when first read (`__getattr__`).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.autograd.graph import Node
    from torch.distributed.pipelining.schedules import FORWARD as FORWARD
    from torch.distributed.pipelining.schedules import FULL_BACKWARD as FULL_BACKWARD
    from torch.distributed.pipelining.schedules import OVERLAP_F_B as OVERLAP_F_B
    from torch.distributed.pipelining.schedules import _Action as Action
    from torch.distributed.pipelining.schedules import _PipelineContext as PipelineContext
    from torch.distributed.pipelining.schedules import _PipelineSchedule as PipelineSchedule
    from torch.distributed.pipelining.schedules import (
        _PipelineScheduleRuntime as PipelineScheduleRuntime,
    )
    from torch.distributed.pipelining.stage import _PipelineStageBase as PipelineStageBase

__all__ = [
    "FORWARD",
    "FULL_BACKWARD",
    "OVERLAP_F_B",
    "STAGE_HOOKS",
    "TORCH_PINNED",
    "Action",
    "PipelineContext",
    "PipelineSchedule",
    "PipelineScheduleRuntime",
    "PipelineStageBase",
    "compute_loss",
    "construct_reverse_graph",
    "engine_reaches",
    "get_loss",
    "get_param_groups",
    "grad_fn_or_grad_acc",
    "grouped_mm",
    "has_grouped_mm",
    "load_pipelining",
    "module_parameters",
    "prepare_schedule_with_comms",
    "receives_at_start",
    "schedule_num_microbatches",
    "schedule_stages",
    "stage_backward_weight",
    "storage_use_count",
    "view_base",
    "wait_batch_p2p",
]

TORCH_PINNED = "2.13.0"  # pyproject.toml's torch pin: the version these wrappers were checked with
SOURCE = "src/disagmoe/torch_private/"

_BACKWARD = "torch.distributed.pipelining._backward"
_SCHEDULES = "torch.distributed.pipelining.schedules"
_STAGE = "torch.distributed.pipelining.stage"
_RUNTIME = f"{_SCHEDULES}._PipelineScheduleRuntime"
_PIPELINE_STAGE = "torch.distributed.pipelining.PipelineStage"

# Classes and constants of the pipeline runtime, loaded when first read (module doc).
_LAZY = {
    "Action": (_SCHEDULES, "_Action"),
    "PipelineContext": (_SCHEDULES, "_PipelineContext"),
    "PipelineSchedule": (_SCHEDULES, "_PipelineSchedule"),
    "PipelineScheduleRuntime": (_SCHEDULES, "_PipelineScheduleRuntime"),
    "PipelineStageBase": (_STAGE, "_PipelineStageBase"),
    "FORWARD": (_SCHEDULES, "FORWARD"),
    "FULL_BACKWARD": (_SCHEDULES, "FULL_BACKWARD"),
    "OVERLAP_F_B": (_SCHEDULES, "OVERLAP_F_B"),
}


def __getattr__(name: str) -> Any:
    """The pipeline runtime's private classes and constants under public names:

    * `Action` (`_Action`): one entry of a rank's action list (stage, computation type,
      micro-batch, sub-actions); `baselines.fb_overlap` builds the one-stage-per-rank
      runtimes' lists from it.
    * `PipelineContext` (`_PipelineContext`): what the runtime passes a custom function
      (the schedule, the micro-batches' args and targets); `run_overlapped` reads it.
    * `PipelineScheduleRuntime` (`_PipelineScheduleRuntime`): the runtime that runs action
      lists and custom functions; `ScheduleOrdered` subclasses it (`ep-1f1b`, `ep-overlap`,
      `ep-combined`), and `ep-combined` and `ep-dualpipev` run their F&B pairs at once
      through it.
    * `PipelineSchedule`, `PipelineStageBase`: the base classes, as `baselines.trainer`'s
      type hints.
    * `FORWARD`, `FULL_BACKWARD`, `OVERLAP_F_B`: computation types (values "F", "B", ...),
      which `baselines.fb_overlap` builds actions of and records as our kind letters.

    Gone or changed, every `ep-*` baseline but `ep-interleaved` fails to build or run.
    """
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --- kernels, storages, tensors, modules ---------------------------------------------


def has_grouped_mm() -> bool:
    """Whether this torch has `torch._grouped_mm`; without it `models.moe.grouped_mm` runs one
    GEMM per expert (the same values, slower: no grouped kernel)."""
    return hasattr(torch, "_grouped_mm")


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """`torch._grouped_mm(x, w, offs=offs)`: rows of `x` [A, I] by group, group e's rows
    (up to the int32 cumulative count `offs[e]`) times `w[e]` [I, O]; [A, O].

    The experts' bf16 GEMMs (`models.moe.grouped_mm`). Changed, expert compute in bf16
    fails or computes wrong values; gone, it falls back (`has_grouped_mm`)."""
    return torch._grouped_mm(x, w, offs=offs)


def storage_use_count(storage: torch.UntypedStorage) -> int:
    """How many references hold `storage` (`torch._C._storage_Use_Count` of its `_cdata`):
    1 when only the caller's holds it.

    `distributed.exchange`'s buffer pool reuses a receive buffer once no tensor views it.
    Gone, receives fail; wrong, a buffer still in use is overwritten."""
    return int(torch._C._storage_Use_Count(storage._cdata))


def engine_reaches(node: Node | None) -> bool:
    """Inside a backward: whether the backward running now reaches `node`, a next function
    of the node being run (`torch._C._will_engine_execute_node`): always in a whole
    backward; in a partial one (`autograd.grad` to some inputs, as `runtime.wgrad` and
    PyTorch's split I/W run) only on a path to them, a leaf's node among those inputs
    included (torch refuses to say for those; a captured leaf is reached). None: no.

    `models.loss_head` skips the GEMM of a gradient nobody takes. Gone or wrong, a split
    backward fails its exactness tests (or computes both gradients in both parts)."""
    if node is None:
        return False
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError as err:  # a leaf's node passed to autograd.grad: captured
        if "leaf node" in str(err):
            return True
        raise


def view_base(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor `tensor` is a view of, or None (`Tensor._base`).

    `training.checkpoint` saves a copy of a view (an expert's slice of a fused weight) so
    only the slice is written. Gone, checkpoint saves fail."""
    return tensor._base


def module_parameters(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """`module`'s own parameter registry (`nn.Module._parameters`), name -> parameter; the
    dict itself, so an assignment replaces a parameter in place.

    `models.init` materialises meta parameters through it (a tied parameter stays one).
    Gone, building any model's weights fails."""
    return module._parameters


# --- the split backward (torch.distributed.pipelining._backward) ----------------------


def load_pipelining() -> None:
    """Import `torch.distributed.pipelining` now (about 2 s), so that a module whose calls
    use it pays when it is imported, not inside its first timed call."""
    importlib.import_module(_BACKWARD)


def _backward_module() -> Any:
    return importlib.import_module(_BACKWARD)


def grad_fn_or_grad_acc(tensor: torch.Tensor) -> Node | None:
    """The autograd node a gradient of `tensor` enters: its `grad_fn`, or a leaf's
    gradient accumulator (`_backward._get_grad_fn_or_grad_acc`); used by `runtime.wgrad`
    like the next three. Gone or changed, `schedule.split_backward = on` fails."""
    node: Node | None = _backward_module()._get_grad_fn_or_grad_acc(tensor)
    return node


def construct_reverse_graph(roots: list[Node]) -> dict[Node, list[Node]]:
    """The autograd graph below `roots` with its edges reversed (`_backward`'s)."""
    reverse: dict[Node, list[Node]] = _backward_module().construct_reverse_graph(roots)
    return reverse


def get_param_groups(
    inputs: list[Node], params: list[Node], reverse: dict[Node, list[Node]]
) -> list[dict[str, Any]]:
    """`_backward.get_param_groups`: the parameters grouped by the intermediate nodes where
    their paths and the inputs' part; each group a dict with "params" and "intermediates"
    (`runtime.wgrad.backward_inputs` adds the "grads" it captures there)."""
    groups: list[dict[str, Any]] = _backward_module().get_param_groups(inputs, params, reverse)
    return groups


def stage_backward_weight(weights: Iterator[nn.Parameter], groups: list[dict[str, Any]]) -> None:
    """The weight gradients from `groups`' captured "grads", accumulated into `weights`'
    `.grad` (`_backward.stage_backward_weight`, what torch's zero-bubble schedules run)."""
    _backward_module().stage_backward_weight(weights, groups)


# --- the pipeline runtime (torch.distributed.pipelining.schedules) --------------------


def wait_batch_p2p(works: list[Any]) -> None:
    """Wait for a batch of posted pipeline p2p ops (`schedules._wait_batch_p2p`), as the
    runtime does before a computation; `baselines.fb_overlap` mirrors it. Gone, the
    `ep-combined` and `ep-dualpipev` steps fail (as for all wrappers of this section)."""
    importlib.import_module(_SCHEDULES)._wait_batch_p2p(works)


def schedule_stages(schedule: PipelineScheduleRuntime) -> list[PipelineStageBase]:
    """The stages `schedule` runs on this rank (`_stages`)."""
    stages: list[PipelineStageBase] = schedule._stages
    return stages


def schedule_num_microbatches(schedule: PipelineScheduleRuntime) -> int:
    """The micro-batches of one `schedule.step` (`_n_microbatches`): a stage's last
    backward (`last_backward`, when gradients are finalised) is its that-many-th."""
    return int(schedule._n_microbatches)


def compute_loss(
    schedule: PipelineScheduleRuntime,
    stage: PipelineStageBase,
    output: Any,
    target_mbs: list[Any] | None,
    mb: int,
) -> None:
    """On the last stage, the loss of micro-batch `mb`'s `output`, kept for its backward
    (`_maybe_compute_loss`); elsewhere nothing."""
    schedule._maybe_compute_loss(stage, output, target_mbs, mb)


def get_loss(schedule: PipelineScheduleRuntime, stage: PipelineStageBase, mb: int) -> Any:
    """On the last stage, the loss `compute_loss` kept for micro-batch `mb`; elsewhere None
    (`_maybe_get_loss`)."""
    return schedule._maybe_get_loss(stage, mb)


def prepare_schedule_with_comms(
    schedule: PipelineScheduleRuntime, actions: dict[int, list[Action | None]]
) -> None:
    """Lower every rank's compute-only action list to the one `schedule` runs, with its
    pipeline sends and receives (`_prepare_schedule_with_comms`)."""
    schedule._prepare_schedule_with_comms(actions)


COMM_KINDS = ("SEND_F", "SEND_B", "RECV_F", "RECV_B")


def receives_at_start(schedule: PipelineSchedule) -> None:
    """Every pipeline receive of `schedule`'s lowered action lists (`pipeline_order_with_comms`,
    PyTorch's runtime only) posted at the start of the step, in the order the lowering put
    them; sends and computations stay where they are.

    gloo moves a payload only once its receiver has posted the receive, and PyTorch's
    lowering posts a receive just before the computation that consumes it: a stage that
    forwards micro-batch k and then posts the receive of k + 1 waits for all of k + 1's
    transfer after its compute, so a hand-over never overlaps the receiver's compute (and a
    receive's notice went behind the sends the rank had queued to that peer). Each receive
    has its own buffer (the stage makes one per micro-batch before the first step) and is
    only waited for by its computation, where it stood; the receives from one peer keep
    their order, which is how gloo matches them to the peer's sends, so nothing else
    changes and nothing can hang that did not before. The simulator's replay posts every
    receive at once too."""
    orders = getattr(schedule, "pipeline_order_with_comms", None)
    if orders is None:
        return
    for rank, actions in orders.items():

        def is_receive(action: Any) -> bool:
            kind = getattr(getattr(action, "computation_type", None), "name", "")
            return kind.startswith("RECV")

        orders[rank] = [
            *(a for a in actions if is_receive(a)),
            *(a for a in actions if not is_receive(a)),
        ]


# The PipelineStage methods `baselines.stage.TracedStage` overrides (to trace them), with
# the leading parameters the runtime passes. Renamed, the trace and the executed order
# miss their computations silently; with other parameters, the stage fails.
STAGE_HOOKS: dict[str, tuple[str, ...]] = {
    "forward_one_chunk": ("fwd_chunk_id", "args", "kwargs", "save_forward_output"),
    "backward_one_chunk": ("bwd_chunk_id", "loss", "full_backward", "last_backward"),
    "backward_weight_one_chunk": ("bwd_chunk_id", "last_backward"),
    "get_fwd_recv_ops": ("fwd_chunk_id",),
    "get_bwd_recv_ops": ("bwd_chunk_id",),
    "get_fwd_send_ops": ("fwd_chunk_id",),
    "get_bwd_send_ops": ("bwd_chunk_id",),
}
