"""What the executor's lanes share (`runtime.executor`): the per-step state, the lane threads
kept for the whole run, and each compute and outgoing message with what running it needs
worked out once, when the executor is built.

One `StepState` per optimizer step: a lock, the mailbox of messages whose header is in,
the computes done, one condition per compute lane so that an arrival wakes only the
lane that waits for it, and one `Turn` per incoming stream: whether its receive lane or
its consuming compute lane takes its next header. A `Lane` is a thread that runs its body
once per step, inside its stream's context on an accelerator (`runtime.streams`); the
"wgt" lane (deferred weight gradients) runs in the background: a lower CPU priority for
its thread, a low-priority stream on a device (`schedule.semantics`).
"""

from __future__ import annotations

import os
import queue
import sys
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from ..distributed.exchange import Incoming, Receiver
from ..schedule.ir import Instr, Msg
from ..schedule.semantics import TaskKey
from .streams import Stamp


def recv_lane_name(src: int, channel: str) -> str:
    """The receive lane (thread, stream) of the stream from `src` on `channel`."""
    return f"recv{src}{channel}"


@dataclass(frozen=True, slots=True)
class Output:
    """An outgoing message, with what posting it needs worked out once."""

    msg: Msg
    kind: int  # index in KINDS (the first field of its identity)
    event: str  # its send event's name
    drop: tuple[str, int, int, int]  # what a fault-injection key names: kind, layer, slot, chunk


@dataclass(frozen=True, slots=True)
class Compute:
    """A compute instruction of a lane, with what running it needs worked out once."""

    index: int  # in the rank's list
    instr: Instr
    name: str  # its trace event's name
    task: TaskKey
    inputs: tuple[Msg, ...]
    local: tuple[TaskKey, ...]
    cross: tuple[TaskKey, ...]  # those of `local` that run on the other lane
    outputs: tuple[Output, ...]
    outgoing: list[Msg]  # the outputs' messages, as the worker takes them


@dataclass(slots=True)
class Turn:
    """Who takes the headers of one incoming (sender, channel) stream during a step.

    Its receive lane takes them while `pull` is false: it posts a message's payload
    receives as soon as its header is in, so that the payload moves while the consuming
    lane computes. After a message with no payload (all of it inline in the header) the
    receive lane sets `pull` and parks: there is nothing to post early, and the consuming
    lane takes the stream's next headers itself when it waits for them, so such a message
    crosses no thread. A message with a payload taken that way hands the turn back
    (`pull` false, the receive lane woken) and marks the stream `mixed`: for the rest of
    the step the receive lane keeps the turn after messages without a payload too, so a
    stream whose messages straddle the inline limit (a dispatch of about 64 KiB) posts
    every payload's receive as its header comes, not when the consumer asks for it. Exactly
    one of the two calls `receiver.next` at a time: the receive lane only while `pull` is
    false, the consumer only while it is true, and each flips it only after its own take.
    Changed under `StepState.lock`.
    """

    msgs: list[Msg]  # the stream's messages this step, in FIFO order
    receiver: Receiver
    lane: str  # the compute lane that consumes the stream
    parked: threading.Condition  # on StepState.lock: the receive lane waits on it while `pull`
    next: int = 0  # index in `msgs` of the next header to take
    pull: bool = False  # the consuming lane takes the next header
    mixed: bool = False  # a payload came after a message without one: the lane keeps the turn

    @property
    def done(self) -> bool:
        return self.next == len(self.msgs)


@dataclass
class StepState:
    """What the lanes share during one step: one lock, and one condition per waiter so that
    an arrival wakes only the lane that consumes it, and only when that lane waits for it
    (a wake-up costs a GIL hand-off)."""

    step: int
    lanes: tuple[str, ...] = ("fwd", "bwd")  # the rank's compute lanes
    lock: threading.Lock = field(default_factory=threading.Lock)
    mailbox: dict[Msg, Incoming] = field(default_factory=dict)  # header in, not yet consumed
    done: set[TaskKey] = field(default_factory=set)
    errors: list[BaseException] = field(default_factory=list)
    finished: int = 0  # lanes that finished this step
    sends_closed: threading.Event = field(default_factory=threading.Event)  # all sends posted
    wake: dict[str, threading.Condition] = field(default_factory=dict)  # compute lane -> cond
    needs: dict[str, set[TaskKey]] = field(default_factory=dict)  # lane -> local deps it waits for
    awaits: dict[str, set[Msg]] = field(default_factory=dict)  # lane -> messages it waits for
    events: dict[TaskKey, Any] = field(default_factory=dict)  # compute -> its stream event
    spans: list[tuple[str, str, Stamp, Stamp, dict[str, Any]]] = field(default_factory=list)
    turns: dict[tuple[int, str], Turn] = field(default_factory=dict)  # (src, channel) -> turn
    ended: threading.Condition = field(init=False)  # run_step waits on it

    def __post_init__(self) -> None:
        self.ended = threading.Condition(self.lock)
        self.wake = {lane: threading.Condition(self.lock) for lane in self.lanes}
        self.needs = {lane: set() for lane in self.lanes}
        self.awaits = {lane: set() for lane in self.lanes}

    def deliver(self, turn: Turn, msg: Msg, incoming: Incoming, *, by_lane: bool) -> None:
        """Under `lock`: `msg` (the turn's next) into the mailbox, and the turn to whom takes
        the stream's next header: the receive lane after a message with a payload, the
        consuming lane after one without unless the stream is `mixed` (`Turn`). `by_lane`:
        the receive lane took it (and wakes the consumer if it waits for it)."""
        turn.next += 1
        self.mailbox[msg] = incoming
        if incoming.works:
            if turn.pull:
                turn.pull = False
                turn.mixed = True
                turn.parked.notify()
        elif not turn.mixed:
            turn.pull = True
        if turn.done and turn.pull:
            turn.parked.notify()  # (the receive lane ends its step)
        if by_lane and msg in self.awaits[turn.lane]:
            self.wake[turn.lane].notify()

    def fail(self, err: BaseException) -> None:
        with self.lock:
            self.errors.append(err)
            for cond in (*self.wake.values(), self.ended):
                cond.notify_all()
            for turn in self.turns.values():
                turn.parked.notify_all()


# How much a background lane's thread lowers its scheduling priority (a nice value above
# its process's): the kernel then gives it the CPU mostly while the other lanes wait.
BACKGROUND_NICE = 10


def lower_thread_priority(nice: int = BACKGROUND_NICE) -> bool:
    """Make the calling thread yield the CPU to its process's other threads: `nice` added to
    its nice value (Linux keeps one per thread; raising it needs no privilege). Elsewhere,
    or when the kernel refuses, nothing. Whether it was lowered."""
    if not sys.platform.startswith("linux"):
        return False
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError:
        return False
    return True


class Lane:
    """A thread kept for the whole run that runs `body(step_state)` once per step, inside
    `context` (its stream made current: `LaneStreams.on`). A `background` lane's thread
    runs at a lower CPU priority (`lower_thread_priority`), as its stream does on a device."""

    def __init__(
        self,
        name: str,
        body: Callable[[StepState], None],
        context: AbstractContextManager[None] | None = None,
        *,
        background: bool = False,
    ) -> None:
        self.body = body
        self.context = context or nullcontext()
        self.background = background
        self.inbox: queue.Queue[StepState | None] = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        if self.background:
            lower_thread_priority()
        with self.context:
            while (st := self.inbox.get()) is not None:
                try:
                    self.body(st)
                except BaseException as err:
                    st.fail(err)
                with st.lock:
                    st.finished += 1
                    st.ended.notify_all()


DropKey = tuple[str, int, int, int, int | None]  # kind, layer, slot, step, chunk (None: any)


def drop_key(spec: str) -> DropKey | None:
    """`train.drop_message` ("KIND:LAYER:SLOT:STEP[:CHUNK]", validated by the config) as a
    key; None when empty. Without CHUNK every exchange chunk of the message is dropped."""
    if not spec:
        return None
    kind, *nums = spec.split(":")
    layer, slot, step = (int(x) for x in nums[:3])
    return kind, layer, slot, step, int(nums[3]) if len(nums) > 3 else None


def dropped(key: DropKey, out: Output, step: int) -> bool:
    """Whether fault injection `key` drops `out` in `step`."""
    kind, layer, slot, at, chunk = key
    return (
        step == at
        and out.drop[:3] == (kind, layer, slot)
        and (chunk is None or chunk == out.drop[3])
    )
