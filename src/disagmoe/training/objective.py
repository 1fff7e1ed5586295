"""The training objective and optimizer, shared by every runtime.

Loss of one optimizer step (global batch of G sequences, S targets each, M
micro-batches, L_moe MoE layers):

    loss = (1 / (G*S)) * sum_tokens CE  +  coef / (M * L_moe) * sum_{mb, l} aux_{mb,l}

Each micro-batch contributes its share (`LossScale.micro_batch`), so gradients
accumulated over micro-batches — on one process or summed over workers — are
the gradients of `loss`. The balance loss is per layer and micro-batch
(Megatron-style), not over the whole global batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig, TrainConfig
from ..device import HOST, adamw_kwargs
from ..models.loss_head import chunked_head_loss


@dataclass(frozen=True)
class LossScale:
    token_scale: float  # 1 / (G * S)
    aux_scale: float  # coef / (M * L_moe)
    chunk_tokens: int = 0  # train.loss_chunk_tokens: the loss head's chunks (0: unchunked)

    @classmethod
    def for_run(cls, model: ModelConfig, train: TrainConfig) -> LossScale:
        num_moe = max(model.num_moe_layers, 1)
        return cls(
            token_scale=1.0 / (train.global_batch_size * train.seq_len),
            aux_scale=model.aux_loss_coef / (train.num_micro_batches * num_moe),
            chunk_tokens=train.loss_chunk_tokens,
        )

    def head_ce(
        self, h_BSH: torch.Tensor, lm_head: nn.Linear, targets_BS: torch.Tensor
    ) -> torch.Tensor:
        """`ce` of `lm_head(h_BSH)`, from the final norm's output: with `chunk_tokens` > 0
        over chunks of that many tokens, keeping no logits for the backward
        (`models.loss_head`: the same value and gradients), else through the logits."""
        if self.chunk_tokens == 0:
            return self.ce(lm_head(h_BSH), targets_BS)
        return chunked_head_loss(
            h_BSH,
            lm_head.weight,
            targets_BS,
            scale=self.token_scale,
            chunk_tokens=self.chunk_tokens,
        )

    def ce(self, logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
        """This micro-batch's share of the mean cross-entropy (computed in >= float32)."""
        logits = logits_BSV.reshape(-1, logits_BSV.shape[-1])
        if logits.dtype in (torch.bfloat16, torch.float16):
            logits = logits.float()
        return F.cross_entropy(logits, targets_BS.reshape(-1), reduction="sum") * self.token_scale

    def aux(self, aux_values: Iterable[torch.Tensor]) -> torch.Tensor | None:
        values = list(aux_values)
        if not values or self.aux_scale == 0.0:
            return None
        return (
            torch.stack([v.float() if v.dtype == torch.bfloat16 else v for v in values]).sum()
            * self.aux_scale
        )


def lr_at(train: TrainConfig, step: int) -> float:
    """Learning rate of optimizer step `step` (0-based); the one schedule every runtime uses.

    Warmup: steps `0 .. warmup_steps-1` ramp linearly, `lr * (step + 1) / warmup_steps`.
    Then, over the `span = steps - warmup_steps` remaining steps:

    * `constant` — `lr`;
    * `cosine` — `min_lr + (lr - min_lr) * (1 + cos(pi * t / span)) / 2` at `t` steps after
      warmup (reaches `min_lr` at `step == steps`);
    * `wsd` (warmup, stable, decay) — `lr` until the last `decay = max(1, round(
      decay_fraction * span))` steps, which decay linearly so that the last step
      (`steps - 1`) runs at `min_lr`.
    """
    if train.warmup_steps and step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    if train.lr_schedule == "constant":
        return train.lr
    span = max(train.steps - train.warmup_steps, 1)
    done = max(step - train.warmup_steps, 0)
    if train.lr_schedule == "cosine":
        progress = min(done / span, 1.0)
        return train.min_lr + (train.lr - train.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))
    assert train.lr_schedule == "wsd", train.lr_schedule
    decay = max(1, round(train.decay_fraction * span))
    into_decay = done - (span - decay) + 1  # 1 on the first decaying step
    if into_decay <= 0:
        return train.lr
    return train.lr + (train.min_lr - train.lr) * min(into_decay / decay, 1.0)


def build_optimizer(
    named_params: Iterable[tuple[str, torch.nn.Parameter]], train: TrainConfig
) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices (>= 2-D), none on norm weights; fused on an
    accelerator (`device.adamw_kwargs`, by where the parameters live)."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for _, param in sorted(named_params, key=lambda kv: kv[0]):
        (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": train.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    first = next(iter(decay + no_decay), None)
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=train.lr,
        betas=(train.beta1, train.beta2),
        eps=train.adam_eps,
        **adamw_kwargs(first.device if first is not None else HOST),
    )


def fill_missing_grads(params: Iterable[torch.nn.Parameter]) -> None:
    """Zero-fill grads of parameters that saw no tokens this step.

    An expert worker whose experts got no tokens must still take the same AdamW
    step (weight decay, moments) as the reference, which sees a zero gradient.
    """
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)


def clip_gradients(
    params: list[torch.nn.Parameter],
    counted: list[bool],
    max_norm: float,
    reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Clip by the global L2 norm; returns the norm before clipping (a float64 0-dim tensor
    on the parameters' device: no host read, the caller reads it with the step's losses).

    `counted[i]` says whether this process counts parameter i toward the norm
    (a parameter replicated on several workers is counted by one of them);
    `reduce_sum` sums the squared norm over workers. Above `max_norm`, gradients are
    scaled by `max_norm / (norm + 1e-6)` on the device.
    """
    sq = loss_total(params[0].device if params else HOST)
    for param, count in zip(params, counted, strict=True):
        if count and param.grad is not None:
            sq += param.grad.detach().double().pow(2).sum()
    if reduce_sum is not None:
        sq = reduce_sum(sq)
    norm = sq.sqrt()
    if max_norm > 0:
        # 1 unless norm > max_norm (a NaN norm leaves the gradients as they are, so the
        # loop can name the ranks whose own gradients are non-finite)
        factor = torch.where(norm > max_norm, max_norm / (norm + 1e-6), torch.ones_like(norm))
        for param in params:
            if param.grad is not None:
                param.grad.mul_(factor)
    return norm


def loss_total(device: torch.device) -> torch.Tensor:
    """A float64 zero on `device` to sum loss shares into without reading them on the host."""
    return torch.zeros((), dtype=torch.float64, device=device)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}[name]


@dataclass
class StepResult:
    """What one optimizer step reports (losses summed over every worker)."""

    loss: float
    ce_loss: float
    aux_loss: float
    grad_norm: float
    grads: dict[str, torch.Tensor] = field(default_factory=dict)


def finish_step(
    *,
    step: int,
    train: TrainConfig,
    named_params: list[tuple[str, torch.nn.Parameter]],
    counted: list[bool],
    optimizer: torch.optim.Optimizer,
    ce: torch.Tensor | float,
    aux: torch.Tensor | float,
    capture_grads: bool,
    reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> StepResult:
    """The end of every runtime's step, once gradients are complete and synchronised.

    Captures the gradients (tests), clips by the global norm, sets the learning rate,
    takes the AdamW step, and sums this worker's loss shares over all workers. `ce` and
    `aux` may be device tensors (`loss_total`): the norm and both sums are read on the
    host once, together, after the optimizer step was queued.
    """
    params = [p for _, p in named_params]
    grads = (
        {n: p.grad.detach().clone() for n, p in named_params if p.grad is not None}
        if capture_grads
        else {}
    )
    norm = clip_gradients(params, counted, train.grad_clip, reduce_sum)
    set_lr(optimizer, lr_at(train, step))
    optimizer.step()
    device = norm.device
    totals = torch.stack([torch.as_tensor(v, dtype=torch.float64).to(device) for v in (ce, aux)])
    if reduce_sum is not None:
        totals = reduce_sum(totals)
    norm_value, ce_sum, aux_sum = torch.cat([norm.reshape(1), totals]).tolist()
    return StepResult(ce_sum + aux_sum, ce_sum, aux_sum, norm_value, grads)
