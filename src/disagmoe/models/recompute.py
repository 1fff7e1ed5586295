"""Activation recompute as module variants (`train.recompute`, docs/design-notes.md).

`apply_recompute(module, mode)` changes, in place, the class of the modules under `module`
to a variant that saves less for backward and recomputes the rest; like `models.emulated`
and FSDP2's `fully_shard`, each module stays the same object with the same parameters,
names and submodules, so the runtimes, optimizers and checkpoints never notice. The
variants run `torch.utils.checkpoint` (non-reentrant) around one unit of compute:

* ``attn`` — `Attention` becomes `CoreRecomputedAttention`: the attention core
  (scaled-dot-product attention of q, k, v after RoPE) saves nothing of its own; its
  backward recomputes the core from q, k, v, which the checkpoint keeps. Everything else
  (projections, norms, router, experts) saves as usual.
* ``full`` — `AttentionBlock` becomes `RecomputedAttentionBlock` and `Experts`
  `RecomputedExperts`: each keeps only its inputs — an A component its layer input
  x [B, S, H] (and the RoPE tables), an expert shard the rows it received x [R, H] with
  their assignments (rows, local experts, combine weights) — and reruns its forward in
  backward. The embedding, the final norm, the LM head and the loss are not recomputed.
* ``none`` — nothing changes.

`layers` (`train.recompute_layers`, `config.recomputed_layers`) limits a mode to the
modules under some decoder layers, found by their full-model paths (``layers.3.experts``):
the first N layers a worker holds recompute, the others save as usual.

Exactness: a recompute reruns the same kernels on the same inputs, so it reproduces every
value bit for bit, the router's top-k included; PyTorch's checkpoint also checks that each
recomputed tensor has the shape, dtype and device of the one it stands for (a different
routing would change the expert shapes and fail loudly). The forward draws no random
numbers (there is no dropout), so no RNG state is kept; a variant that adds randomness
must draw from a generator of its own. The variants hold no state and have no side
effects, so running a forward twice changes nothing but time; the rerun runs under
`moe.recomputing`, in which routers record no statistics (`RoutingStats`). Only modules
of exactly the base class are swapped: an emulated block (`models.emulated`) stays
emulated.
"""

from __future__ import annotations

from collections.abc import Collection
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..config import RECOMPUTE
from .layers import Attention
from .model import AttentionBlock, AttnOutput
from .moe import Assignments, Experts, recomputing
from .parts import in_layers


def _checkpointed(fn: Any, *args: Any) -> Any:
    # No RNG state is saved or restored: the model draws no random numbers (no dropout), and
    # restoring the global generator from the backward lane would race with the forward
    # lane, which runs concurrently in the disaggregated executor. The rerun is marked
    # `recomputing` (thread-local: that lane only), so routers do not count tokens twice.
    return checkpoint(
        fn,
        *args,
        use_reentrant=False,
        preserve_rng_state=False,
        context_fn=lambda: (nullcontext(), recomputing()),
    )


class CoreRecomputedAttention(Attention):
    """`Attention` whose core saves nothing for backward; the backward recomputes it."""

    def core(
        self, q_BNSD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor
    ) -> torch.Tensor:
        out: torch.Tensor = _checkpointed(super().core, q_BNSD, k_BKSD, v_BKSD)
        return out


class RecomputedAttentionBlock(AttentionBlock):
    """`AttentionBlock` that keeps only its inputs and reruns its forward in backward."""

    def forward(
        self, x_BSH: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor
    ) -> AttnOutput:
        out: AttnOutput = _checkpointed(super().forward, x_BSH, cos_SD, sin_SD)
        return out


class RecomputedExperts(Experts):
    """`Experts` that keep only their rows and assignments and rerun in backward."""

    def forward(self, x_RH: torch.Tensor, plan: Assignments) -> torch.Tensor:
        # The assignment tensors are passed one by one so that the checkpoint keeps them
        # as inputs (it keeps top-level tensor arguments only).
        out: torch.Tensor = _checkpointed(
            self._compute, x_RH, plan.token_ids, plan.rows_A, plan.experts_A, plan.weights_A
        )
        return out

    def _compute(
        self,
        x_RH: torch.Tensor,
        token_ids: torch.Tensor,
        rows_A: torch.Tensor,
        experts_A: torch.Tensor,
        weights_A: torch.Tensor,
    ) -> torch.Tensor:
        return super().forward(x_RH, Assignments(token_ids, rows_A, experts_A, weights_A))


_VARIANTS: dict[str, dict[type[nn.Module], type[nn.Module]]] = {
    "none": {},
    "attn": {Attention: CoreRecomputedAttention},
    "full": {AttentionBlock: RecomputedAttentionBlock, Experts: RecomputedExperts},
}


def apply_recompute(module: nn.Module, mode: str, layers: Collection[int] | None = None) -> None:
    """Give every attention core (``attn``) or every attention block and expert shard
    (``full``) under `module`, itself included, its recomputing variant, in place; with
    `layers`, only those under one of these decoder layers (by their full-model paths,
    `models.parts.layer_of`: `train.recompute_layers`)."""
    if mode not in _VARIANTS:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {mode!r}")
    variants = _VARIANTS[mode]
    for path, sub in module.named_modules():
        variant = variants.get(type(sub))
        if variant is not None and in_layers(path, layers):
            sub.__class__ = variant
