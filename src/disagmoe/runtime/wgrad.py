"""A backward in two parts: input gradients now, weight gradients later (deferred W).

Where a rank's list has a W for a backward (`schedule.semantics`, "Deferred weight
gradients"), the worker's BWD runs `backward_inputs`: the gradients of the compute's
inputs — what its outgoing messages carry — and nothing else, keeping the autograd graph
and, at every node where the paths to the inputs and to a weight part, the gradient that
reached it. The W runs `backward_weights`: from those nodes to the weights, the weight
GEMMs alone (each node's input-gradient half already ran), accumulated into `.grad` as a
whole backward would. Nothing is computed twice, so the two parts cost what the whole
backward costs; the values are the whole backward's.

The graph walk is PyTorch's own (`torch.distributed.pipelining._backward`: the reverse
graph, the parameter groups with their intermediate nodes, and `stage_backward_weight`,
which its zero-bubble schedules run), through `torch_private`, which checks it against the
pinned torch version (pyproject). A compute with no input to send a gradient for (the first
attention layer, whose input is the token ids) keeps its whole backward for the W.

Not with activation recompute (a checkpointed region recomputes in the first part and
would again in the second) nor emulated compute (its waits sit on the input path): the
run's configuration is refused (`config.RunConfig`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, Node

from ..torch_private import (
    construct_reverse_graph,
    get_param_groups,
    grad_fn_or_grad_acc,
    load_pipelining,
    stage_backward_weight,
)

load_pipelining()  # as when this module imported torch's directly: not in the first timed W


@dataclass
class Deferred:
    """What a BWD left for its W: PyTorch's parameter groups with the gradients captured at
    their intermediate nodes, or (`whole`) the roots and gradients of the whole backward."""

    params: list[nn.Parameter]
    groups: list[dict[str, Any]] = field(default_factory=list)
    whole: tuple[list[GradientEdge], list[torch.Tensor]] | None = None

    def tensors(self) -> list[torch.Tensor]:
        """The gradients kept for the W (what it holds beyond the forward's activations,
        which the graph keeps until the W too): the captured ones, or the whole backward's."""
        if self.whole is not None:
            return list(self.whole[1])
        return [
            g
            for group in self.groups
            for grads in group["grads"]
            for g in grads
            if isinstance(g, torch.Tensor)
        ]


def _node(root: torch.Tensor | GradientEdge) -> Node | None:
    return root.node if isinstance(root, GradientEdge) else grad_fn_or_grad_acc(root)


def backward_inputs(
    roots: Sequence[GradientEdge | None],
    grads: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    params: list[nn.Parameter],
) -> Deferred:
    """The gradients of `inputs` (accumulated into their `.grad`) from `roots` (gradient
    edges of the outputs; None: an output without one) with `grads`; what is left of the
    backward for `params`, for `backward_weights`."""
    pairs = [(t, g) for t, g in zip(roots, grads, strict=True) if t is not None]
    leaves = [x for x in inputs if x.requires_grad]
    if not pairs:
        return Deferred(params)
    outs, out_grads = [t for t, _ in pairs], [g for _, g in pairs]
    if not leaves:  # nothing to send: the whole backward is the W's
        return Deferred(params, whole=(outs, out_grads))
    reverse = construct_reverse_graph([n for n in map(_node, outs) if n])
    weights = [n for n in map(grad_fn_or_grad_acc, [p for p in params if p.requires_grad]) if n]
    groups = get_param_groups([n for n in map(grad_fn_or_grad_acc, leaves) if n], weights, reverse)
    handles = []
    kept = []
    for group in groups:
        if not group["intermediates"]:
            if any(w in reverse for w in group["params"]):
                raise RuntimeError(
                    "a parameter's gradient does not pass through the compute's inputs; "
                    "its backward cannot be split (set schedule.split_backward = off)"
                )
            continue  # a parameter this compute does not touch
        nodes = list(group["intermediates"])
        group["intermediates"] = nodes
        group["grads"] = [() for _ in nodes]  # a node autograd does not reach gives none
        for i, node in enumerate(nodes):

            def capture(grad_inputs: Any, group: dict[str, Any] = group, i: int = i) -> None:
                group["grads"][i] = grad_inputs

            handles.append(node.register_prehook(capture))
        kept.append(group)
    try:
        dinputs = torch.autograd.grad(outs, leaves, out_grads, retain_graph=True, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    for x, d in zip(leaves, dinputs, strict=True):
        if d is not None:
            x.grad = d if x.grad is None else x.grad + d
    return Deferred(params, groups=kept)


def backward_weights(deferred: Deferred) -> None:
    """The weight gradients `backward_inputs` left, accumulated into the parameters' `.grad`
    (the graph is freed)."""
    if deferred.whole is not None:
        torch.autograd.backward(*deferred.whole)
    elif deferred.groups:
        stage_backward_weight(iter(deferred.params), deferred.groups)
