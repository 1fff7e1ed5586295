"""Runs one rank's instruction list with compute and communication overlapped.

Lanes (threads, started once and kept for the whole run; on an accelerator each compute
and receive lane runs on its own stream, `runtime.streams`):

* "fwd"  — the rank's FWD instructions in list order,
* "bwd"  — its BWD instructions in list order,
* "wgt"  — its W instructions (deferred weight gradients) in list order, in the
           background: a lower CPU priority for its thread, the lowest-priority stream on
           a device, so it computes where the other lanes leave the worker idle (only in
           lists that have Ws),
* "recv" — one thread per incoming (sender, channel) stream: it takes the stream's headers
           in FIFO order, posts each message's payload receives at once (while the previous
           payload may still be on the wire) and puts the message into the mailbox; the
           compute that consumes it waits for its payload (`Incoming.wait`). After a message
           that has no payload (all inline in its header) it parks, and the consuming lane
           takes that stream's next headers itself when it waits for them: a small message
           then crosses no thread (`lanes.Turn`); a payload hands the turn back;
* "send" — sends are posted (`isend`) by the compute lane right after the producing
           compute, from the producer's thread (and stream); one thread sees them complete
           (`runtime.outbox`);
* "sync" — SYNC and STEP, through the trainer's `StepHooks`, once the rest is done.

So an F worker can send the backward result of micro-batch i, compute the forward of
micro-batch j and receive a gradient for micro-batch q at once. When a compute may
start is `schedule.semantics.RankProgram.ready` (its input messages in the mailbox — their
headers in; it then waits for their payloads, which follow their headers on the wire — its
local dependencies done), the same rule the validator and the simulator apply. Every
wait has a timeout; on timeout the error names the rank, its role, the instruction and
the missing messages.
"""

from __future__ import annotations

import functools
import math
import sys
import time
from collections.abc import Callable
from threading import Condition
from typing import Any

import torch

from ..device import stream_backend
from ..distributed.exchange import CommTimeout, Incoming, ProtocolError, Receiver
from ..distributed.topology import Topology
from ..schedule.ir import MESSAGE_KINDS, Instr, Msg, Op, compute_event_name
from ..schedule.semantics import BACKGROUND_LANES, RankProgram, TaskKey, consumer_lane
from ..trace import Tracer, message_event_name, message_label, take_device_wait_us
from ..training.memory import ActivationMeter
from .lanes import Compute, Lane, Output, StepState, Turn, drop_key, recv_lane_name
from .outbox import Outbox
from .streams import LaneStreams
from .work import Payload, StageWorker, StepHooks, run_compute

KINDS = tuple(MESSAGE_KINDS)
# The lanes are Python threads: a receive thread whose message just arrived must get the
# GIL back from a computing lane quickly, or every message pays up to one switch interval
# (CPython's default 5 ms) per handoff, several times — longer than the transfer itself.
GIL_SWITCH_INTERVAL_S = 2e-4
_ANOTHER_LANE = "another lane failed"
# A lost message is reported by the compute that waits for it (after the timeout, naming
# the message and its sender). The receive lanes, and a consumer waiting for a payload
# whose header came, wait longer: with gloo a receive that times out closes its
# connection, which both directions between two ranks share (one group per channel), so an
# early receive timeout on one rank would make its peer report a closed connection instead
# of what it was waiting for.
_BACKSTOP = 2.0


class HangError(RuntimeError):
    """A wait on communication exceeded the configured timeout."""


class Executor:
    def __init__(
        self,
        program: RankProgram,
        role: str,
        topo: Topology,
        worker: StageWorker,
        hooks: StepHooks,
        tracer: Tracer,
        *,
        timeout_s: float,
        drop_message: str = "",
        meter: ActivationMeter | None = None,
        streams: LaneStreams | None = None,
    ) -> None:
        """`streams`: the lanes' streams; by default those of `device.stream_backend` for
        `topo.device` (none on the CPU)."""
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        assert program.rank == topo.rank, (program.rank, topo.rank)
        self.rank = topo.rank
        self.role = role
        self.topo = topo
        self.worker = worker
        self.hooks = hooks
        self.tracer = tracer
        self.timeout_s = timeout_s
        self.drop = drop_key(drop_message)  # fault injection "KIND:LAYER:SLOT:STEP[:CHUNK]"
        self.program = program
        self.meter = meter  # counts what a FWD keeps until its BWD (training.memory)
        self._backstop = _BACKSTOP * timeout_s + 10.0
        incoming = [m for msgs in self.program.streams.values() for m in msgs]
        self.consumer_lane = {m: consumer_lane(m) for m in incoming}  # the lane it wakes
        self.recv_event = {
            m: message_event_name("recv", message_label(m.kind, m.layer, m.slot, m.chunk))
            for m in incoming
        }
        self.task_lane = {ins.task: lane for lane, instrs in program.lanes.items()
                          for _, ins in instrs}  # fmt: skip
        self.compute_lanes = program.running_lanes  # (a list without Ws has no "wgt" lane)
        self.computes = {lane: [self._compute(i, ins) for i, ins in program.lanes[lane]]
                         for lane in self.compute_lanes}  # fmt: skip
        self.stream_of = {m: (m.src, m.channel) for m in incoming}  # its (src, channel) turn
        for key, msgs in program.streams.items():  # (a channel's kinds share one consumer lane)
            assert len({self.consumer_lane[m] for m in msgs}) == 1, key
        self.receivers = {
            (src, channel): Receiver(src, topo.stream(src, self.rank, channel), device=topo.device)
            for src, channel in program.streams
        }
        lanes = [*self.compute_lanes, *(recv_lane_name(*key) for key in program.streams)]
        self.streams = streams or LaneStreams(stream_backend(topo.device), lanes)
        self.outbox = Outbox(
            topo, role, tracer, sends_any=any(program.outputs.values()), drop=self.drop
        )
        self.lanes: list[Lane] = []  # started on the first step

    def _compute(self, index: int, instr: Instr) -> Compute:
        task = instr.task
        outputs = tuple(
            Output(
                m,
                KINDS.index(m.kind),
                message_event_name("send", message_label(m.kind, m.layer, m.slot, m.chunk)),
                (m.kind, m.layer, m.slot, m.chunk),
            )
            for m in self.program.outputs.get(task, ())
        )
        return Compute(
            index,
            instr,
            str(instr),
            task,
            tuple(self.program.inputs.get(task, ())),
            tuple(self.program.local.get(task, ())),
            tuple(t for t in self.program.local.get(task, ()) if self.task_lane[t] != instr.lane),
            outputs,
            [o.msg for o in outputs],
        )

    # ------------------------------------------------------------------ lanes

    def _start_lanes(self) -> None:
        """Receive lanes first, then the compute lanes, then send completion: `run_step`
        counts on this order."""
        for src, channel in self.program.streams:
            name = recv_lane_name(src, channel)
            on = self.streams.on(name)
            self.lanes.append(Lane(name, self._bind_recv((src, channel)), on))
        for lane in self.compute_lanes:
            background = lane in BACKGROUND_LANES
            compute = self._bind_compute(lane)
            self.lanes.append(Lane(lane, compute, self.streams.on(lane), background=background))
        self.lanes.append(Lane("send", self.outbox.complete))

    def _bind_recv(self, key: tuple[int, str]) -> Callable[[StepState], None]:
        return lambda st: self._recv_lane(st, st.turns[key])

    def _bind_compute(self, lane: str) -> Callable[[StepState], None]:
        return lambda st: self._compute_lane(st, lane)

    def _receiving(self, msg: Msg) -> str:
        return f"rank {self.rank} {self.role}: receiving {msg} from rank {msg.src}"

    def _recv_lane(self, st: StepState, turn: Turn) -> None:
        """Headers of one stream in order while the lane has its turn; each message's
        payload receives are posted at once and the message goes into the mailbox right
        away: its consumer waits for the payload (`_take`). Parked while the consuming lane
        has the turn (`lanes.Turn`)."""
        receiver = turn.receiver
        receiver.start(len(turn.msgs))
        try:
            while True:
                with st.lock:
                    while turn.pull and not turn.done and not st.errors:
                        turn.parked.wait()
                    if turn.done or st.errors:
                        return
                    msg = turn.msgs[turn.next]
                incoming = self._take_header(st, msg, receiver, self._backstop)
                with st.lock:
                    st.deliver(turn, msg, incoming, by_lane=True)
        finally:
            receiver.stop()

    def _take_header(
        self, st: StepState, msg: Msg, receiver: Receiver, timeout_s: float
    ) -> Incoming:
        """The next header of `receiver`'s stream, which must be `msg`'s (its payload
        receives posted); called without `st.lock`, by whichever lane has the turn."""
        what = functools.partial(self._receiving, msg)
        expect = (KINDS.index(msg.kind), msg.layer, msg.slot, msg.chunk, st.step)  # as sent
        try:
            incoming = receiver.next(timeout_s, what, expect=expect)
        except ProtocolError as err:
            kind, layer, slot, chunk, got_step = err.got
            got = Msg(KINDS[kind], layer, slot, msg.src, self.rank, chunk)
            raise ProtocolError(
                f"{what()}: got {got} of step {got_step + 1} "
                f"instead (a message was lost or reordered)",
                err.got,
            ) from None
        if not incoming.works:
            self._trace_recv(st.step, msg, incoming, incoming.arrived)
        return incoming

    def _trace_recv(self, step: int, msg: Msg, incoming: Incoming, end: float) -> None:
        """The receive of `msg`: from its header's arrival until its payload is in (for a
        message with payloads: until its consumer has it, `_take`)."""
        self.tracer.add(
            self.recv_event[msg],
            "recv",
            incoming.arrived,
            end,
            src=msg.src,
            layer=msg.layer,
            slot=msg.slot,
            step=step,
            waited_us=round(incoming.waited_us, 1),
            bytes=incoming.nbytes,
        )

    def _wait_ready(self, st: StepState, work: Compute, lane: str) -> dict[Msg, Payload]:
        """Block until `work` may run; its input messages. On timeout, the error names the
        first missing message and its sender, or the local dependencies (a lane waiting only
        for the other lane waits once more, so that the lane waiting for a message reports)."""
        arrived = st.mailbox.__contains__
        with st.lock:
            if not self._ready(st, work):
                self._block(st, work, lane, arrived)
            taken = [(m, st.mailbox.pop(m)) for m in work.inputs]
        return {m: self._take(st, work, m, incoming) for m, incoming in taken}

    @staticmethod
    def _ready(st: StepState, work: Compute) -> bool:
        """`RankProgram.ready` of `work` (with its inputs and dependencies looked up once)."""
        mailbox, done = st.mailbox, st.done
        for m in work.inputs:
            if m not in mailbox:
                return False
        for t in work.local:  # noqa: SIM110 (a loop costs less than all() of a generator)
            if t not in done:
                return False
        return True

    def _block(
        self, st: StepState, work: Compute, lane: str, arrived: Callable[[Msg], bool]
    ) -> None:
        """Wait (holding `st.lock`) until `work` is ready; HangError after the timeout."""
        deadline, extended = time.monotonic() + self.timeout_s, False
        wake, needs, awaits = st.wake[lane], st.needs[lane], st.awaits[lane]
        needs.update(work.local)
        awaits.update(work.inputs)
        try:
            while not self._ready(st, work):
                if st.errors:
                    raise RuntimeError(_ANOTHER_LANE)
                turn = self._pullable(st, work)
                if turn is not None:
                    self._pull(st, work, turn, deadline, arrived)
                    continue
                if time.monotonic() > deadline:
                    missing, tasks = self.program.waiting_for(work.instr, st.done, arrived)
                    if not missing and not extended:
                        deadline, extended = deadline + self.timeout_s, True
                        continue
                    raise HangError(self._hang_report(work, missing, tasks))
                wake.wait(0.05)
        finally:
            needs.clear()
            awaits.clear()

    def _pullable(self, st: StepState, work: Compute) -> Turn | None:
        """The turn of a stream that one of `work`'s missing inputs comes on, if this lane
        (the stream's consumer) takes its headers now."""
        mailbox, turns, stream_of = st.mailbox, st.turns, self.stream_of
        for m in work.inputs:
            if m not in mailbox:
                turn = turns[stream_of[m]]
                if turn.pull:
                    return turn
        return None

    def _pull(
        self,
        st: StepState,
        work: Compute,
        turn: Turn,
        deadline: float,
        arrived: Callable[[Msg], bool],
    ) -> None:
        """Take the next header of `turn`'s stream on this (the consuming) lane, releasing
        `st.lock` while it comes; HangError when nothing came by `deadline`."""
        msg = turn.msgs[turn.next]
        st.lock.release()
        try:
            # whole seconds: `wait_work` caches one timedelta per timeout it is given
            remaining = float(max(math.ceil(deadline - time.monotonic()), 1))
            incoming = self._take_header(st, msg, turn.receiver, remaining)
        except CommTimeout:
            st.lock.acquire()
            missing, tasks = self.program.waiting_for(work.instr, st.done, arrived)
            raise HangError(self._hang_report(work, missing or [msg], tasks)) from None
        except BaseException:
            st.lock.acquire()
            raise
        st.lock.acquire()
        st.deliver(turn, msg, incoming, by_lane=False)

    def _take(self, st: StepState, work: Compute, msg: Msg, incoming: Incoming) -> Payload:
        """A message of `work`'s, once its payload is in. On CUDA the wait makes this lane's
        stream wait for the receive; on CPU it blocks (the receive lane is already taking
        the next header)."""
        if not incoming.works:
            return incoming.tensors
        what = functools.partial(self._needed, work, msg)
        tensors = incoming.wait(self._backstop, what)
        self._trace_recv(st.step, msg, incoming, Tracer.now_us())
        if self.streams.active:  # allocated on the receive lane's stream, used on this one
            self.streams.adopt(work.instr.lane, tensors)
        return tensors

    def _needed(self, work: Compute, msg: Msg) -> str:
        return f"{self._receiving(msg)} (instruction {work.index}, {work.instr}, needs it)"

    def _hang_report(self, work: Compute, missing: list[Msg], tasks: list[TaskKey]) -> str:
        who = f"rank {self.rank} {self.role}"
        index, instr = work.index, work.instr
        if not missing:
            waits = ", ".join(f"{compute_event_name(*t)}" for t in tasks)
            return (
                f"{who}: instruction {index} ({instr}) waited {self.timeout_s:.0f} s for "
                f"{waits} of its own"
            )
        first, others = missing[0], missing[1:]
        also = f"; also waiting for {', '.join(str(m) for m in others)}" if others else ""
        return (
            f"{who}: receiving {first} from rank {first.src}: nothing arrived within "
            f"{self.timeout_s:g} s (instruction {index}, {instr}, needs it{also})"
        )

    def _compute_lane(self, st: StepState, lane: str) -> None:
        """The lane's computes in order, each posting its outputs' sends right after it.
        The FWDs of a forward-only list run without autograd: grad mode is per thread, set
        off on this lane's for the step."""
        if self.program.forward_only:
            with torch.no_grad():
                self._run_lane(st, lane)
        else:
            self._run_lane(st, lane)

    def _run_lane(self, st: StepState, lane: str) -> None:
        step, streams, post = st.step, self.streams, self.outbox.post
        for work in self.computes[lane]:
            received = self._wait_ready(st, work, lane)
            instr = work.instr
            if streams.active:
                self._join_streams(st, work, lane)
            t0 = streams.stamp(lane)
            out = run_compute(self.worker, self.meter, self.program, instr, received, work.outgoing)
            t1 = streams.stamp(lane)
            args: dict[str, Any] = {
                "layer": instr.layer,
                "slot": instr.slot,
                "step": step,
                "index": work.index,
            }
            if instr.chunk >= 0:
                args["chunk"] = instr.chunk  # as the simulator's trace has it
            waited = take_device_wait_us()
            if waited:  # another lane held the worker's device (emulated compute)
                args["device_wait_us"] = waited
            st.spans.append((work.name, lane, t0, t1, args))  # traced when the step ends
            for o in work.outputs:  # posted from this lane's thread (and stream)
                post(o, out[o.msg], step)
            with st.lock:
                st.done.add(work.task)
                if streams.active:
                    st.events[work.task] = t1  # after the compute, on this lane's stream
                for other, cond in st.wake.items():  # wake the other lane if it waits for this
                    if other != lane and work.task in st.needs[other]:
                        cond.notify()

    def _join_streams(self, st: StepState, work: Compute, lane: str) -> None:
        """Before `work` runs on `lane`'s stream: wait for the events of its dependencies on
        other lanes, and adopt what its FWD kept for a BWD, or its BWD for a W
        (`runtime.streams`)."""
        with st.lock:
            events = [st.events[t] for t in work.cross]
        self.streams.after(lane, events)
        instr = work.instr
        if instr.op == Op.BWD:
            kept = self.worker.kept(instr.layer, instr.slot, chunk=instr.chunk)
            self.streams.adopt(lane, kept)
        elif instr.op == Op.WGT:  # the gradients its BWD captured on the "bwd" lane
            kept = self.worker.kept_for_weights(instr.layer, instr.slot, chunk=instr.chunk)
            self.streams.adopt(lane, kept)

    def _trace_computes(self, st: StepState) -> None:
        """The step's compute spans, into the tracer (with streams: resolved from their
        events, which waits for the step's kernels once)."""
        for name, lane, t0, t1, args in st.spans:
            self.tracer.add(name, lane, self.streams.host_us(t0), self.streams.host_us(t1), **args)
        st.spans.clear()

    # ------------------------------------------------------------------- step

    def run_step(self, step: int) -> None:
        """Execute this rank's instruction list for one optimizer step: computes and messages
        on their lanes, then SYNC and STEP through the hooks (`schedule.semantics`)."""
        if not self.lanes:
            self._start_lanes()
        st = StepState(step, self.compute_lanes)
        st.turns = {
            key: Turn(msgs, self.receivers[key], self.consumer_lane[msgs[0]], Condition(st.lock))
            for key, msgs in self.program.streams.items()
        }
        self.streams.begin_step()
        for lane in self.lanes:
            lane.inbox.put(st)
        own = len(self.program.streams) + len(self.compute_lanes)
        with st.lock:  # the receive and compute lanes finish on their own ...
            while st.finished < own and not st.errors:
                st.ended.wait(0.1)
            st.sends_closed.set()  # ... then send completion, once it has seen every send
            while st.finished < len(self.lanes) and not st.errors:
                st.ended.wait(0.1)
        if not st.errors or not self.streams.active:  # (a failed step's kernels may never end)
            self.streams.end_step()
            self._trace_computes(st)
        if st.errors:
            primary = next((e for e in st.errors if str(e) != _ANOTHER_LANE), st.errors[0])
            raise primary
        for _, instr in self.program.finals:
            t0 = Tracer.now_us()
            extra: dict[str, Any] = {}
            if instr.op == Op.SYNC:
                nbytes = self.hooks.sync(step)
                if nbytes:  # the all-reduce's members (this group's A replicas), for bounds
                    layout = self.topo.layout
                    extra["peers"] = layout.attn_replicas(layout.role(self.rank).group)
                self.tracer.add(
                    "SYNC grads", "sync", t0, Tracer.now_us(), step=step, bytes=nbytes, **extra
                )
            else:
                nbytes = self.hooks.optimizer_step(step)
                if nbytes:  # the norm's and the losses' all-reduces: over the whole world
                    extra = {"bytes": nbytes, "peers": list(range(self.topo.layout.world_size))}
                self.tracer.add("STEP", "sync", t0, Tracer.now_us(), step=step, **extra)
