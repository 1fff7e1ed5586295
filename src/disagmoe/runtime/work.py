"""What the executor (`runtime.executor`) needs from the rank's compute and from its trainer:
the worker behind FWD and BWD instructions (`runtime.stages`) and the hooks behind SYNC and
STEP."""

from __future__ import annotations

from typing import Protocol

import torch

from ..schedule.ir import Msg

Payload = list[torch.Tensor]


class StageWorker(Protocol):
    """The compute behind FWD, BWD and W instructions (`runtime.stages`)."""

    def forward(
        self,
        layer: int,
        slot: int,
        received: dict[Msg, Payload],
        outgoing: list[Msg],
        *,
        keep: bool = True,
        chunk: int = -1,
    ) -> dict[Msg, Payload]:
        """`keep=False`: no backward follows (a forward-only list), keep nothing for one.
        `chunk`: the instruction's exchange chunk (`Instr.chunk`, -1: not chunked)."""
        ...

    def backward(
        self,
        layer: int,
        slot: int,
        received: dict[Msg, Payload],
        outgoing: list[Msg],
        *,
        chunk: int = -1,
        defer: bool = False,
    ) -> dict[Msg, Payload]:
        """`defer`: the input gradients only; `weight_grads` computes the rest (a W)."""
        ...

    def weight_grads(self, layer: int, slot: int, *, chunk: int = -1) -> None:
        """The W of (layer, slot, chunk): the weight gradients its BWD deferred."""
        ...

    def kept_for_weights(self, layer: int, slot: int, *, chunk: int = -1) -> Payload:
        """The gradients a deferred BWD of (layer, slot, chunk) keeps for its W (the meter
        holds them until the W)."""
        ...

    def kept(self, layer: int, slot: int, *, chunk: int = -1) -> Payload:
        """The tensors the FWD of (layer, slot, chunk) keeps for its BWD beyond its messages
        (the meter holds them with the FWD's received and sent payloads)."""
        ...


class StepHooks(Protocol):
    """What SYNC and STEP instructions do (the trainer: gradient all-reduce, optimizer)."""

    def sync(self, step: int) -> int:
        """Reduce gradients; return the bytes all-reduced (0 if nothing was)."""
        ...

    def optimizer_step(self, step: int) -> None: ...
