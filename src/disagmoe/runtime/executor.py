"""Runs one rank's instruction list with compute and communication overlapped.

Lanes (threads on CPU; on GPU they would be CUDA streams):

* "fwd"  — the rank's FWD instructions in list order,
* "bwd"  — its BWD instructions in list order,
* "recv" — two threads per (sender, channel) stream: one takes the stream's headers
           in FIFO order and posts each payload's receive at once (while the previous
           payload may still be on the wire), one waits for the payloads in order and
           puts them into a mailbox,
* "send" — sends are posted (`isend`) by the compute lane right after the
           producing compute; one thread waits for their completion;
* "sync" — SYNC and STEP, through the trainer's `StepHooks`, once the rest is done.

So an F worker can send the backward result of micro-batch i, compute the
forward of micro-batch j and receive a gradient for micro-batch q at once.
When a compute may start is `schedule.semantics.RankProgram.ready` (its
input messages in the mailbox, its local dependencies done), the same rule
the validator and the simulator apply. Every wait has a timeout; on timeout the
error names the rank, its role, the instruction and the missing messages.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from ..distributed.exchange import CommTimeout, ProtocolError, Receiver, send_message
from ..distributed.topology import Topology
from ..schedule.ir import MESSAGE_KINDS, Instr, Msg, Op, Schedule, compute_event_name
from ..schedule.semantics import RankProgram, TaskKey
from .observe import Tracer, message_event_name, message_label

Payload = list[torch.Tensor]
KINDS = tuple(MESSAGE_KINDS)
# The lanes are Python threads: a receive thread whose message just arrived must get the
# GIL back from a computing lane quickly, or every message pays up to one switch interval
# (CPython's default 5 ms) per handoff, several times — longer than the transfer itself.
GIL_SWITCH_INTERVAL_S = 2e-4


class StageWorker(Protocol):
    """The compute behind FWD and BWD instructions (`runtime.stages`)."""

    def forward(
        self, layer: int, slot: int, received: dict[Msg, Payload], outgoing: list[Msg]
    ) -> dict[Msg, Payload]: ...
    def backward(
        self, layer: int, slot: int, received: dict[Msg, Payload], outgoing: list[Msg]
    ) -> dict[Msg, Payload]: ...


class StepHooks(Protocol):
    """What SYNC and STEP instructions do (the trainer: gradient all-reduce, optimizer)."""

    def sync(self, step: int) -> int:
        """Reduce gradients; return the bytes all-reduced (0 if nothing was)."""
        ...

    def optimizer_step(self, step: int) -> None: ...


def _ident(msg: Msg, step: int) -> tuple[int, int, int, int]:
    """What a message says it is, checked by the receiver: (kind, layer, slot, step)."""
    return (KINDS.index(msg.kind), msg.layer, msg.slot, step)


class HangError(RuntimeError):
    """A wait on communication exceeded the configured timeout."""


@dataclass
class _Shared:
    cond: threading.Condition
    mailbox: dict[Msg, Payload]
    done: set[TaskKey]
    errors: list[BaseException]


class Executor:
    def __init__(
        self,
        schedule: Schedule,
        topo: Topology,
        worker: StageWorker,
        hooks: StepHooks,
        tracer: Tracer,
        *,
        dtype: torch.dtype,
        timeout_s: float,
        drop_message: str = "",
    ) -> None:
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        self.rank = topo.rank
        self.role = schedule.roles[self.rank]
        self.topo = topo
        self.worker = worker
        self.hooks = hooks
        self.tracer = tracer
        self.dtype = dtype
        self.timeout_s = timeout_s
        self.drop = drop_message  # fault injection "KIND:LAYER:SLOT:STEP"
        self.program = RankProgram.build(schedule, self.rank)

    # ------------------------------------------------------------------ lanes

    def _recv_lane(
        self, sh: _Shared, src: int, channel: str, msgs: list[Msg], step: int, posted: queue.Queue
    ) -> None:
        """Headers of one stream in order; each message's payload receive is posted at once."""
        receiver = Receiver(src, self.topo.stream(src, self.rank, channel), self.dtype, len(msgs))
        try:
            for msg in msgs:
                t_wait = Tracer.now_us()
                what = f"rank {self.rank} {self.role}: receiving {msg} from rank {src}"
                try:
                    incoming = receiver.post(self.timeout_s, what, expect=_ident(msg, step))
                except ProtocolError as err:
                    kind, layer, slot, got_step = err.got
                    raise ProtocolError(
                        f"{what}: got {KINDS[kind]}[l{layer},s{slot}] of step {got_step + 1} "
                        f"instead (a message was lost or reordered)",
                        err.got,
                    ) from None
                posted.put((msg, incoming, what, t_wait))
        finally:
            posted.put(None)

    def _deliver_lane(self, sh: _Shared, src: int, step: int, posted: queue.Queue) -> None:
        """Payloads of one stream in order, into the mailbox."""
        while (item := posted.get()) is not None:
            msg, incoming, what, t_wait = item
            payload = incoming.wait(self.timeout_s, what)
            self.tracer.add(
                message_event_name("recv", message_label(msg.kind, msg.layer, msg.slot)),
                "recv",
                incoming.arrived,
                Tracer.now_us(),
                src=src,
                layer=msg.layer,
                slot=msg.slot,
                step=step,
                waited_us=round(incoming.arrived - t_wait, 1),
                bytes=sum(t.numel() * t.element_size() for t in payload),
            )
            with sh.cond:
                sh.mailbox[msg] = payload
                sh.cond.notify_all()

    def _send_waiter(self, sh: _Shared, pending: queue.Queue, step: int) -> None:
        while True:
            item = pending.get()
            if item is None:
                return
            msg, works, t0, nbytes = item
            for work in works:
                try:
                    work.wait()
                except RuntimeError as err:
                    reason = str(err).splitlines()[0][:200]
                    raise CommTimeout(
                        f"rank {self.rank} {self.role}: sending {msg} to rank {msg.dst}: {reason}"
                    ) from err
            self.tracer.add(
                message_event_name("send", message_label(msg.kind, msg.layer, msg.slot)),
                "send",
                t0,
                Tracer.now_us(),
                dst=msg.dst,
                layer=msg.layer,
                slot=msg.slot,
                step=step,
                bytes=nbytes,
            )

    def _wait_ready(self, sh: _Shared, index: int, instr: Instr) -> dict[Msg, Payload]:
        deadline = time.monotonic() + self.timeout_s
        arrived = sh.mailbox.__contains__
        with sh.cond:
            while not self.program.ready(instr, sh.done, arrived):
                if sh.errors:
                    raise RuntimeError("another lane failed")
                if time.monotonic() > deadline:
                    missing, tasks = self.program.waiting_for(instr, sh.done, arrived)
                    peers = sorted({m.src for m in missing})
                    waits = [str(m) for m in missing]
                    if missing:
                        waits[-1] += f" from rank(s) {peers}"
                    waits += [f"{compute_event_name(*t)} of its own" for t in tasks]
                    raise HangError(
                        f"rank {self.rank} {self.role}: instruction {index} ({instr}) waited "
                        f"{self.timeout_s:.0f} s for {', '.join(waits)}"
                    )
                sh.cond.wait(0.05)
            return {m: sh.mailbox.pop(m) for m in self.program.inputs.get(instr.task, ())}

    def _compute_lane(self, sh: _Shared, lane: str, pending: queue.Queue, step: int) -> None:
        for index, instr in self.program.lanes[lane]:
            received = self._wait_ready(sh, index, instr)
            outgoing = self.program.outputs.get(instr.task, [])
            t0 = Tracer.now_us()
            fn = self.worker.forward if instr.op == Op.FWD else self.worker.backward
            out = fn(instr.layer, instr.slot, received, outgoing)
            t1 = Tracer.now_us()
            self.tracer.add(
                str(instr),
                lane,
                t0,
                t1,
                layer=instr.layer,
                slot=instr.slot,
                step=step,
                index=index,
            )
            for msg in outgoing:
                if self.drop == f"{msg.kind}:{msg.layer}:{msg.slot}:{step}":
                    continue  # fault injection: this message is lost
                payload = out[msg]
                group = self.topo.stream(self.rank, msg.dst, msg.channel)
                nbytes = sum(t.numel() * t.element_size() for t in payload)
                works = send_message(payload, msg.dst, group, _ident(msg, step))
                pending.put((msg, works, Tracer.now_us(), nbytes))
            with sh.cond:
                sh.done.add(instr.task)
                sh.cond.notify_all()

    # ------------------------------------------------------------------- step

    def run_step(self, step: int) -> None:
        """Execute this rank's instruction list for one optimizer step: computes and messages
        on their lanes, then SYNC and STEP through the hooks (`schedule.semantics`)."""
        sh = _Shared(threading.Condition(), {}, set(), [])
        pending: queue.Queue = queue.Queue()

        def guard(fn, *args) -> None:  # type: ignore[no-untyped-def]
            try:
                fn(*args)
            except BaseException as err:
                with sh.cond:
                    sh.errors.append(err)
                    sh.cond.notify_all()

        recv_threads = []
        for (src, ch), msgs in self.program.streams.items():
            posted: queue.Queue = queue.Queue()
            recv_threads += [
                threading.Thread(
                    target=guard,
                    args=(self._recv_lane, sh, src, ch, msgs, step, posted),
                    daemon=True,
                ),
                threading.Thread(
                    target=guard, args=(self._deliver_lane, sh, src, step, posted), daemon=True
                ),
            ]
        sender = threading.Thread(
            target=guard, args=(self._send_waiter, sh, pending, step), daemon=True
        )
        lanes = [
            threading.Thread(
                target=guard, args=(self._compute_lane, sh, lane, pending, step), daemon=True
            )
            for lane in ("fwd", "bwd")
        ]
        for t in [*recv_threads, sender, *lanes]:
            t.start()
        for t in lanes:
            while t.is_alive():
                t.join(0.1)
                if sh.errors:
                    break
            if sh.errors:
                break
        pending.put(None)
        if not sh.errors:
            for t in [*recv_threads, sender]:
                t.join()
        if sh.errors:
            primary = next((e for e in sh.errors if str(e) != "another lane failed"), sh.errors[0])
            raise primary
        for _, instr in self.program.finals:
            t0 = Tracer.now_us()
            if instr.op == Op.SYNC:
                nbytes = self.hooks.sync(step)
                self.tracer.add("SYNC grads", "sync", t0, Tracer.now_us(), step=step, bytes=nbytes)
            else:
                self.hooks.optimizer_step(step)
                self.tracer.add("STEP", "sync", t0, Tracer.now_us(), step=step)
