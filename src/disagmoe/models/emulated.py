"""Emulated compute: the model's heavy math replaced by calibrated waits.

`emulate_compute(module, costs)` turns every `AttentionBlock` and `Experts` under
`module` into `EmulatedAttentionBlock` / `EmulatedExperts`: they do not compute;
each sleeps for its cost-model duration in forward and in backward and returns
tensors of the right shapes (the attention output is its input; routing is uniformly
random top-k; expert outputs are their inputs). Everything else is real: the
runtimes' code, the messages and their sizes, the optimizer. A sleeping lane holds
no CPU and releases the GIL, as a GPU kernel would, so many workers fit on a few
cores and what is measured is the runtime's overlap of compute and communication,
not the CPU's arithmetic. Losses and gradients are meaningless.

One device per worker: a worker process has one `DEVICE`, and its waits take turns on it
(a lock), as kernels of one GPU share its compute units; communication overlaps freely.
An AF-Pipe worker's forward and backward lanes may both be inside a computation, but
never both inside a calibrated wait. The time a lane waits for the device is added to its
thread's device waits (`trace.add_device_wait`): the executor traces it with
the computation (`device_wait_us`), whose own seconds are its span less that wait.

Durations are `fixed + per_row * rows` seconds (rows: tokens for attention,
(token, expert) assignments for experts), usually measured on this machine with
`calibrate` and multiplied by a time scale (see `disagmoe bench --compute emulated`).
A runtime applies the swap to the modules it runs when `train.emulate_compute`
names a costs file (`training.setup.apply_variants`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..costs.compute import ComputeCosts
from ..trace import add_device_wait
from .model import AttentionBlock, AttnOutput
from .moe import Assignments, Experts, Routing
from .parts import in_layers


@dataclass
class Device:
    """The one accelerator of a worker process: emulated computations hold it in turn."""

    lock: threading.Lock = field(default_factory=threading.Lock)

    def occupy(self, seconds: float) -> None:
        """Hold the device for `seconds` (sleeping: no CPU, the GIL released); the time
        spent waiting for it first is this thread's device wait."""
        if seconds <= 0.0:
            return
        if not self.lock.acquire(blocking=False):
            t0 = time.perf_counter()
            self.lock.acquire()
            add_device_wait((time.perf_counter() - t0) * 1e6)
        try:
            time.sleep(seconds)
        finally:
            self.lock.release()


DEVICE = Device()  # this process's worker (one worker per process, as torchrun starts them)


class _Wait(torch.autograd.Function):
    """Identity that holds the device `fwd_s` in forward and `bwd_s` in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fwd_s: float, bwd_s: float) -> torch.Tensor:  # type: ignore[override]
        ctx.bwd_s = bwd_s
        DEVICE.occupy(fwd_s)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        DEVICE.occupy(ctx.bwd_s)
        return grad, None, None


def wait(x: torch.Tensor, fwd_s: float, bwd_s: float) -> torch.Tensor:
    """`x`, after `fwd_s` seconds; its gradient passes back after `bwd_s` seconds."""
    return _Wait.apply(x, fwd_s, bwd_s)  # type: ignore[no-any-return]


def random_top_k(
    rows: int, num_experts: int, top_k: int, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniformly random distinct top-k experts per row, equal weights tied to `like`.

    The weights depend on `like` (times zero) so that they have a gradient path,
    as the router's weights do.
    """
    indices = torch.rand(rows, num_experts).topk(top_k, dim=-1).indices
    weights = torch.full((rows, top_k), 1.0 / top_k, dtype=like.dtype)
    weights = weights + like.reshape(rows, -1)[:, :1] * 0.0
    return indices, weights


class EmulatedAttentionBlock(AttentionBlock):
    """An `AttentionBlock` that waits instead of computing (made by `emulate_compute`).

    Its output is its input after `costs.attn_fwd(T)` seconds, with uniformly random
    top-k routing on MoE layers; gradients flow back to the input after
    `costs.attn_bwd(T)` seconds. Its parameters stay, unused (their gradients are
    zero-filled by the runtime).
    """

    costs: ComputeCosts
    recompute: str = "none"

    def forward(
        self, x_BSH: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor
    ) -> AttnOutput:
        T = x_BSH.shape[0] * x_BSH.shape[1]
        fwd = self.costs.attn_fwd(T)
        h = wait(x_BSH, fwd, self.costs.attn_bwd(T) + (fwd if self.recompute == "full" else 0.0))
        if self.router is None:
            return AttnOutput(residual_BSH=h, u_TH=None, routing=None, aux=None)
        u_TH = h.reshape(T, h.shape[-1])
        indices, weights = random_top_k(T, self.num_experts, self.router.top_k, u_TH)
        probs = torch.zeros(T, self.num_experts, dtype=h.dtype)
        routing = Routing(indices_TK=indices, weights_TK=weights, probs_TE=probs)
        return AttnOutput(residual_BSH=h, u_TH=u_TH, routing=routing, aux=h.sum() * 0.0)


class EmulatedExperts(Experts):
    """`Experts` that wait instead of computing (made by `emulate_compute`): the output is
    the input after `costs.expert_fwd(A)` seconds for A assignments; the combine
    weights keep a gradient path, as the real combine's do."""

    costs: ComputeCosts
    recompute: str = "none"

    def forward(self, x_RH: torch.Tensor, plan: Assignments) -> torch.Tensor:
        A = plan.rows_A.numel()
        fwd = self.costs.expert_fwd(A)
        y = wait(x_RH, fwd, self.costs.expert_bwd(A) + (fwd if self.recompute == "full" else 0.0))
        return y + plan.weights_A.sum() * 0.0


def emulate_compute(
    module: nn.Module,
    costs: ComputeCosts,
    recompute: str = "none",
    layers: Collection[int] | None = None,
) -> None:
    """Make every `AttentionBlock` and `Experts` under `module` (itself included) wait
    `costs` instead of computing. With `recompute` "full" each backward also waits the
    forward's duration (the forward a real run reruns, `models.recompute`), only under
    `layers` where given (`train.recompute_layers`, `models.parts.in_layers`); the
    calibrated costs do not separate the attention core, so "attn" is not emulated.

    In place: each such module changes class to its emulated variant (as FSDP2's
    `fully_shard` does), so it stays the same object with the same parameters and
    submodules — parameter names, optimizer state and checkpoints are unchanged, and
    every holder of a reference (the model, a worker's parts) sees the swap. Modules
    built later from these (e.g. `Experts.narrow`) are real again: swap the modules a
    worker runs once it has built them.
    """
    for path, sub in module.named_modules():
        if isinstance(sub, AttentionBlock):
            sub.__class__ = EmulatedAttentionBlock
        elif isinstance(sub, Experts):
            sub.__class__ = EmulatedExperts
        if isinstance(sub, EmulatedAttentionBlock | EmulatedExperts):
            sub.costs = costs
            sub.recompute = recompute if in_layers(path, layers) else "none"
