"""The LM head and cross-entropy over chunks of tokens, keeping no [tokens, vocab] tensor.

Shapes: T tokens, H model dim, V vocabulary, C tokens per chunk.

    loss = scale * sum_t CE(h_t @ W^T, target_t)        h_TH normed hidden states, W_VH

The plain path (`lm_head(norm(x))`, then `F.cross_entropy`) has autograd keep the logits'
log-probabilities, T*V floats at >= fp32, from the forward until the backward. Here the
forward runs chunk by chunk under `no_grad` and keeps only its inputs (h, W, targets); the
backward recomputes each chunk's logits, forms `(softmax - onehot) * scale * grad`, and
accumulates the chunk's rows of dh and its share of dW. At most one chunk's logits (C*V,
plus an fp32 copy below fp32) exist at a time, in the forward and in the backward; the
price is one more head GEMM (the backward reruns the forward's). A split backward
(`runtime.wgrad`, PyTorch's I/W) reruns the logits in each part and computes in each only
the gradient it takes (`torch_private.engine_reaches`): dh in the first, dW in the second.

Precision, as the plain path runs under the same settings: the logits in the compute dtype
(autocast's, else h's), upcast to fp32 below fp32 (as `training.objective.LossScale.ce`),
and the logits' gradient cast back to the compute dtype before its two GEMMs, as autograd
would. dW sums the chunks' partial GEMMs in >= fp32 and is returned in W's dtype (a
float32 master weight under mixed precision gets the sum in fp32). Targets equal to
`IGNORE_INDEX` count nothing, as in `F.cross_entropy`.
"""

from __future__ import annotations

from typing import Any

import torch

from ..torch_private import engine_reaches

IGNORE_INDEX = -100  # F.cross_entropy's default
_AUTOCAST_ELIGIBLE = (torch.float32, torch.bfloat16, torch.float16)  # autocast casts these


def _compute_dtype(h: torch.Tensor) -> torch.dtype:
    """The dtype the plain head's GEMM runs in: autocast's when it is on, else h's."""
    kind = h.device.type
    if torch.is_autocast_enabled(kind) and h.dtype in _AUTOCAST_ELIGIBLE:
        return torch.get_autocast_dtype(kind)
    return h.dtype


def _upcast(logits: torch.Tensor) -> torch.Tensor:
    return logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits


def _chunk_logits(h_CH: torch.Tensor, w_VH: torch.Tensor) -> torch.Tensor:
    return _upcast(h_CH @ w_VH.t())


class _ChunkedHeadLoss(torch.autograd.Function):
    """h_TH (compute dtype), w_VH (any float dtype), targets_T -> scalar loss (module doc)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        h_TH: torch.Tensor,
        w_VH: torch.Tensor,
        targets_T: torch.Tensor,
        scale: float,
        chunk: int,
    ) -> torch.Tensor:
        ctx.save_for_backward(h_TH, w_VH, targets_T)
        ctx.scale, ctx.chunk = scale, chunk
        w = w_VH.to(h_TH.dtype)
        total = None
        for lo in range(0, h_TH.shape[0], chunk):
            logits = _chunk_logits(h_TH[lo : lo + chunk], w)
            t = targets_T[lo : lo + chunk]
            valid = t != IGNORE_INDEX
            picked = logits.gather(1, torch.where(valid, t, 0).unsqueeze(1)).squeeze(1)
            ce = torch.where(valid, torch.logsumexp(logits, dim=1) - picked, 0.0).sum()
            total = ce if total is None else total + ce
        if total is None:  # no tokens
            total = torch.zeros((), dtype=_upcast(h_TH.new_empty(0)).dtype, device=h_TH.device)
        return total * scale

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None]:
        h_TH, w_VH, targets_T = ctx.saved_tensors
        # a split backward (`runtime.wgrad`, PyTorch's I/W) takes one of the two at a time
        (h_node, _), (w_node, _) = ctx.next_functions[:2]
        need_h = ctx.needs_input_grad[0] and engine_reaches(h_node)
        need_w = ctx.needs_input_grad[1] and engine_reaches(w_node)
        w = w_VH.to(h_TH.dtype)
        dh = torch.empty_like(h_TH) if need_h else None
        acc_dtype = torch.promote_types(h_TH.dtype, torch.float32)
        dw = torch.zeros(w.shape, dtype=acc_dtype, device=w.device) if need_w else None
        with torch.no_grad():
            g = grad * ctx.scale  # d loss / d (sum of CE), as the plain path's `* scale`
            for lo in range(0, h_TH.shape[0], ctx.chunk):
                h = h_TH[lo : lo + ctx.chunk]
                t = targets_T[lo : lo + ctx.chunk]
                probs = torch.softmax(_chunk_logits(h, w), dim=1)
                valid = t != IGNORE_INDEX
                rows = torch.arange(t.shape[0], device=t.device)
                probs[rows, torch.where(valid, t, 0)] -= 1.0
                # in place: a chunk's logits exist once at >= fp32 (+ once in h's dtype below)
                dlogits = probs.mul_(torch.where(valid, g, 0.0).unsqueeze(1)).to(h.dtype)
                if dh is not None:
                    dh[lo : lo + ctx.chunk] = dlogits @ w
                if dw is not None:
                    dw += dlogits.t() @ h
        return dh, None if dw is None else dw.to(w_VH.dtype), None, None, None


def chunked_head_loss(
    h_BSH: torch.Tensor,
    weight_VH: torch.Tensor,
    targets_BS: torch.Tensor,
    *,
    scale: float,
    chunk_tokens: int,
) -> torch.Tensor:
    """`scale * sum_t CE(h_t @ weight^T, target_t)` over chunks of at most `chunk_tokens`
    tokens (module doc): the value and gradients of `F.cross_entropy(lm_head(h), targets,
    reduction="sum") * scale` under the same autocast state, without keeping the logits.

    `h_BSH` is the final norm's output; `weight_VH` the LM head's weight (a tied embedding
    is the same parameter and gets the same gradient). Returns a 0-dim tensor in fp32 when
    the compute dtype is below fp32, else in it.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    h_TH = h_BSH.reshape(-1, h_BSH.shape[-1])
    h_TH = h_TH.to(_compute_dtype(h_TH))  # autocast's cast of the GEMM's input, differentiable
    with torch.autocast(h_TH.device.type, enabled=False):
        loss = _ChunkedHeadLoss.apply(h_TH, weight_VH, targets_BS.reshape(-1), scale, chunk_tokens)
    assert isinstance(loss, torch.Tensor)
    return loss
