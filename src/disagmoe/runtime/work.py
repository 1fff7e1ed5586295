"""What the executor (`runtime.executor`) needs from the rank's compute and from its trainer:
the worker behind FWD, BWD and W instructions (`runtime.stages`), what one such instruction
does to it (`run_compute`), and the hooks behind SYNC and STEP."""

from __future__ import annotations

from typing import Protocol

import torch

from ..schedule.ir import Instr, Msg, Op
from ..schedule.semantics import RankProgram
from ..training.memory import ActivationMeter

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
        """The tensors the FWD of (layer, slot, chunk) keeps for its BWD besides what
        autograd saves (the meter holds them until the BWD)."""
        ...


class StepHooks(Protocol):
    """What SYNC and STEP instructions do (the trainer: gradient all-reduce, optimizer)."""

    def sync(self, step: int) -> int:
        """Reduce gradients; return the bytes all-reduced (0 if nothing was)."""
        ...

    def optimizer_step(self, step: int) -> int:
        """Clip and step; return the bytes all-reduced over the whole world (the global
        gradient norm and the losses; 0 if nothing was)."""
        ...


def run_compute(
    worker: StageWorker,
    meter: ActivationMeter | None,
    program: RankProgram,
    instr: Instr,
    received: dict[Msg, Payload],
    outgoing: list[Msg],
) -> dict[Msg, Payload]:
    """The worker's FWD, BWD or W of `program`'s list; with a meter, what a FWD saves and
    keeps is counted (on the calling lane's thread) until the matching BWD has run (its W
    where it defers one, with the gradients kept for it). The FWDs of a forward-only list
    run without autograd (grad mode is per thread: the caller sets it on its lane's) and
    keep nothing (`schedule.semantics`)."""
    layer, slot, chunk = instr.layer, instr.slot, instr.chunk
    if program.forward_only:  # under no_grad (`Executor._compute_lane`)
        return worker.forward(layer, slot, received, outgoing, keep=False, chunk=chunk)
    task = (layer, slot, chunk)
    if instr.op == Op.WGT:  # the weight gradients its BWD deferred: the slot's last use
        worker.weight_grads(layer, slot, chunk=chunk)
        if meter is not None:
            meter.release(task)
        return {}
    if instr.op == Op.BWD:
        defer = (instr.comp, layer, slot) in program.split
        out = worker.backward(layer, slot, received, outgoing, chunk=chunk, defer=defer)
        if meter is not None and defer:  # the captured gradients too, until the W
            meter.hold(task, [worker.kept_for_weights(layer, slot, chunk=chunk)])
        elif meter is not None:
            meter.release(task)
        return out
    if meter is None:
        return worker.forward(layer, slot, received, outgoing, chunk=chunk)
    with meter.saving():
        out = worker.forward(layer, slot, received, outgoing, chunk=chunk)
    # what the stash keeps; its messages it does not (`runtime.stages`): a received payload
    # an op saved is counted as saved, a sent one is the outbox's until its send completes
    meter.hold(task, [worker.kept(layer, slot, chunk=chunk)])
    return out
