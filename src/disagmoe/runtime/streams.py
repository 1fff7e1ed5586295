"""The executor's lanes on accelerator streams: one stream per lane, events between them.

On an accelerator (`device.stream_backend`) every lane thread of `runtime.executor` —
"fwd", "bwd", "wgt" and each receive lane — makes its own stream current for its whole
life (`LaneStreams.on`), so the kernels a lane queues do not wait behind another lane's.
The "wgt" lane's stream (deferred weight gradients) has the lowest priority and the
others the highest, so its kernels fill the device where the others leave it idle. Not
yet for a W's own kernels, though: autograd queues those on the stream of their forward
op (below), the "fwd" lane's, so on a device the W's priority reaches only what it
queues itself until backwards get streams of their own (the GPU path).
Hand-offs between lanes are made explicit:

* a received payload is allocated and its receive posted on the receive lane; its
  consumer's `Incoming.wait` makes the consumer's stream wait for the receive (what
  `Work.wait` does on NCCL), and `adopt` records the tensor on the consumer's stream
  (`record_stream`) so that the caching allocator does not hand its memory to the receive
  lane again while the consumer's kernels still read it;
* a message's payload is produced on a compute lane and its send posted from that same
  thread: NCCL makes its own stream wait for the posting thread's current stream — the
  producer's — and keeps the tensor alive itself, so sends need no event;
* a compute that depends on a compute of the other lane (`RankProgram.local`, e.g. a
  backward on the forward it differentiates) waits on the event `done` recorded after
  that compute on its stream (`after`); what the forward kept for the backward
  (`StageWorker.kept`) is adopted by the backward's stream before it runs. Autograd runs
  each backward kernel on the stream of its forward op and syncs with the calling
  stream at the start and end of `backward()` (PyTorch's stream semantics of backward
  passes), so the saved tensors of autograd need nothing more;
* SYNC and STEP run on the stream of the thread that runs the step: it waits for every
  lane's stream once the lanes are done (`end_step`), and every lane's stream waits for
  it when the next step begins (`begin_step`): the all-reduce reads finished gradients
  and the next forward the updated weights.

Compute spans are timed with events recorded around the compute on the lane's stream
(`stamp`) and turned into host microseconds once the step's work is done (`host_us`): one
synchronisation per step, none per compute. Send and receive spans stay host times (when
a receive was taken, when a send was posted and seen complete on the host).

On the CPU there is no backend: every method does nothing, `stamp` is the wall clock, and
the executor runs the same code. This module names no device; `device.py` provides the
backend. It has not yet run on a GPU.
"""

from __future__ import annotations

import time
from collections.abc import Container, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from ..schedule.semantics import BACKGROUND_LANES

Stamp = Any  # a host time in microseconds (no backend) or a recorded event


class StreamBackend(Protocol):
    """What `LaneStreams` asks of a device (`device.AcceleratorStreams`; tests: a fake)."""

    def new_stream(self, background: bool = False) -> Any:
        """A stream; a `background` one yields to the others (a lower priority)."""
        ...

    def use(self, stream: Any) -> Any:
        """A context manager making `stream` current on the calling thread."""
        ...

    def record(self, stream: Any | None) -> Any:
        """A timing event recorded now on `stream` (None: the thread's current stream)."""
        ...

    def wait(self, stream: Any | None, event: Any) -> None:
        """Make `stream` (None: the thread's current one) wait for `event` (queued, the host
        does not block)."""
        ...

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None: ...
    def synchronize(self, event: Any) -> None:
        """Block the host until `event` has happened."""
        ...

    def elapsed_ms(self, start: Any, end: Any) -> float: ...
    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` lives on the backend's device (host tensors need no stream)."""
        ...


def _now_us() -> float:
    return time.time_ns() / 1000.0


class LaneStreams:
    """The streams of one executor's lanes (see the module doc); no-ops without a backend."""

    def __init__(
        self,
        backend: StreamBackend | None,
        lanes: Iterable[str],
        background: Container[str] = BACKGROUND_LANES,
    ) -> None:
        """A stream per lane; those of `background` lanes at a low priority (their kernels
        take the device while the others' do not: `schedule.semantics`)."""
        self.backend = backend
        self.streams: dict[str, Any] = (
            {lane: backend.new_stream(lane in background) for lane in lanes}
            if backend is not None
            else {}
        )
        self._origin: tuple[Any, float] | None = None  # (event, its host time) of this step

    @property
    def active(self) -> bool:
        return self.backend is not None

    @contextmanager
    def on(self, lane: str) -> Iterator[None]:
        """Make `lane`'s stream current on the calling thread while the context lasts."""
        if self.backend is None:
            yield
            return
        with self.backend.use(self.streams[lane]):
            yield

    def adopt(self, lane: str, tensors: Iterable[torch.Tensor]) -> None:
        """`lane` uses device tensors allocated on another lane's stream: record them on
        `lane`'s stream so that their memory is not reused before its kernels ran."""
        if self.backend is None:
            return
        stream = self.streams[lane]
        for t in tensors:
            if self.backend.holds(t):
                self.backend.record_stream(t, stream)

    def done(self, lane: str) -> Any | None:
        """An event after what `lane` queued so far (for `after`); None without a backend."""
        if self.backend is None:
            return None
        return self.backend.record(self.streams[lane])

    def after(self, lane: str, events: Iterable[Any]) -> None:
        """Make `lane`'s stream wait for `events` (`done` of computes on other lanes)."""
        if self.backend is None:
            return
        for event in events:
            self.backend.wait(self.streams[lane], event)

    def begin_step(self) -> None:
        """Before the lanes start a step (on the thread that runs SYNC and STEP): every lane's
        stream waits for what that thread queued (the previous optimizer step), and the
        step's time origin is pinned, an event whose host time is known (one wait)."""
        if self.backend is None:
            return
        origin = self.backend.record(None)
        for stream in self.streams.values():
            self.backend.wait(stream, origin)
        self.backend.synchronize(origin)
        self._origin = (origin, _now_us())

    def end_step(self) -> None:
        """Once the lanes have queued the step's computes: the calling thread's stream waits
        for every lane's (the gradient all-reduce and the optimizer step read what the
        backward lanes wrote)."""
        if self.backend is None:
            return
        for stream in self.streams.values():
            self.backend.wait(None, self.backend.record(stream))

    def stamp(self, lane: str) -> Stamp:
        """Now, on `lane`: the wall clock without a backend, else an event on its stream."""
        if self.backend is None:
            return _now_us()
        return self.backend.record(self.streams[lane])

    def host_us(self, stamp: Stamp) -> float:
        """The host time (us) of a `stamp`; with a backend, waits for its event (call once
        the step's work is queued, not per compute)."""
        if self.backend is None:
            return float(stamp)
        assert self._origin is not None, "begin_step first"
        origin, origin_us = self._origin
        self.backend.synchronize(stamp)
        return origin_us + 1000.0 * self.backend.elapsed_ms(origin, stamp)
