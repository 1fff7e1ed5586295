"""Numeric precision of a run: the dtype parameters live in and the dtype compute runs in.

* `train.dtype` is the **compute** dtype; `train.param_dtype` the dtype of the weights,
  their gradients and AdamW's moments ("" = float32 when `dtype` is bfloat16, else
  `dtype`).
* Equal (float64, float32, or `--dtype bfloat16 --param-dtype bfloat16`, pure low
  precision): no autocast, every tensor in that dtype.
* `--dtype bfloat16` alone is **mixed precision**: float32 master weights, float32
  gradients (so gradient all-reduces run in float32) and float32 optimizer state; the
  forward runs under `torch.autocast(device_type, dtype=bfloat16)` (matmuls in bf16,
  norms, softmax and losses in float32, the residual stream in float32, as in the
  reference model under the same autocast). The activations one worker sends another
  for experts — dispatched tokens, routing weights, expert outputs — travel in the
  compute dtype (`message`); the residual hand-over keeps the residual stream's dtype.

Autocast state is thread-local: each forward enters it where it runs (the disagg
executor's compute lanes are threads), never once around a whole step. Backward needs
no autocast (it runs in the dtypes the forward recorded); a recomputing checkpoint
replays the forward under the autocast state it was saved with.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..config import TrainConfig
from .objective import torch_dtype


@dataclass(frozen=True)
class Precision:
    param: torch.dtype
    compute: torch.dtype
    device_type: str  # of the run's device (autocast's first argument)

    @classmethod
    def for_run(cls, train: TrainConfig, device: torch.device) -> Precision:
        return cls(torch_dtype(param_dtype_name(train)), torch_dtype(train.dtype), device.type)

    @property
    def mixed(self) -> bool:
        return self.param != self.compute

    def autocast(self) -> contextlib.AbstractContextManager[object]:
        """Enter around a forward: autocast to the compute dtype when mixed, else nothing."""
        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.compute)

    def message(self, t: torch.Tensor) -> torch.Tensor:
        """`t` as it travels between workers: floating point in the compute dtype when mixed
        (a differentiable cast: its backward brings the gradient back to `t`'s dtype)."""
        if self.mixed and t.is_floating_point():
            return t.to(self.compute)
        return t


def param_dtype_name(train: TrainConfig) -> str:
    """`train.param_dtype` resolved (module doc)."""
    if train.param_dtype:
        return train.param_dtype
    return "float32" if train.dtype == "bfloat16" else train.dtype
