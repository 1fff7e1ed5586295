"""Autograd across workers without keeping the messages (`runtime.stages`).

A received tensor that needs a gradient enters the stage's graph through a tap (`tap`: the
identity forward, a view; its backward catches the tensor's gradient in a `Caught` box)
or, for the combined rows, through `add_rows` (an index-add that saves the token ids only,
where `torch.index_add`'s backward would save the rows); the backward starts from the
gradient edges of the stage's outputs (`root`: `torch.autograd.graph.GradientEdge`, the
node an output's gradient enters, not the output). Nothing of the stage holds a message
then: a received payload lives while an op of the forward uses it (longer only where an
op saves it, which the memory meter counts), a sent one until its send completes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

Root = GradientEdge | None  # where an output's gradient enters the graph (None: it has none)


class Caught:
    """The gradient a tap caught for one received tensor (summed over the tap's backward
    passes), with the tensor's metadata for a zero gradient when none came."""

    __slots__ = ("device", "dtype", "grad", "shape")

    def __init__(self, t: torch.Tensor) -> None:
        self.shape, self.dtype, self.device = t.shape, t.dtype, t.device
        self.grad: torch.Tensor | None = None

    def grad_or_zeros(self) -> torch.Tensor:
        if self.grad is not None:
            return self.grad
        return torch.zeros(self.shape, dtype=self.dtype, device=self.device)


class _Tap(torch.autograd.Function):
    """A received tensor into the graph: the forward is the identity (a view), the backward
    puts the tensor's gradient into its `Caught` box. It makes the output differentiable
    through `anchor` (an empty leaf: the input whose gradient a split backward computes,
    `runtime.wgrad`) and saves nothing, so nothing keeps the tensor but the ops that save it."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, t: torch.Tensor, box: Caught) -> torch.Tensor:
        ctx.box = box
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        box: Caught = ctx.box
        box.grad = grad if box.grad is None else box.grad + grad
        return grad.new_zeros(0), None, None


class _AddRows(torch.autograd.Function):
    """`x.index_add(0, ids, y.to(x.dtype))` for received rows `y`, their gradient caught in
    `box`: the same values both ways as the index-add (whose backward would save `y`);
    this one saves the ids only."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, ids: torch.Tensor, y: torch.Tensor, box: Caught
    ) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.box = box
        return x.index_add(0, ids, y.to(x.dtype))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (ids,) = ctx.saved_tensors
        box: Caught = ctx.box
        g = grad.index_select(0, ids).to(box.dtype)
        box.grad = g if box.grad is None else box.grad + g
        return grad, None, None, None


def anchor(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros(0, dtype=like.dtype, device=like.device, requires_grad=True)


def tap(anchor: torch.Tensor, t: torch.Tensor, box: Caught) -> torch.Tensor:
    if not t.is_floating_point():
        return t
    out: torch.Tensor = _Tap.apply(anchor, t, box)
    return out


def root(t: torch.Tensor) -> Root:
    """The gradient edge of an output the backward starts from (None: no gradient)."""
    return get_gradient_edge(t) if t.requires_grad else None


def backward(roots: list[Root], grads: list[torch.Tensor]) -> None:
    pairs = [(r, g) for r, g in zip(roots, grads, strict=True) if r is not None]
    if pairs:
        torch.autograd.backward([r for r, _ in pairs], [g for _, g in pairs])


def add_rows(x: torch.Tensor, ids: torch.Tensor, y: torch.Tensor, box: Caught) -> torch.Tensor:
    """`x.index_add(0, ids, y.to(x.dtype))`, `y`'s gradient caught in `box` (`_AddRows`)."""
    out: torch.Tensor = _AddRows.apply(x, ids, y, box)
    return out
