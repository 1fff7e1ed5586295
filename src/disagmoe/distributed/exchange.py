"""Point-to-point messages of variable size: a header that says what follows, then payloads.

A message is a list of tensors. Its **header** is one byte buffer on the channel's header
group: the message's identity, each tensor's dtype and shape, and — "inline" — the bytes
of every host tensor that fits (`INLINE_BYTES`, 64 KiB, in all: a message of host tensors
up to that size, such as routing metadata, token counts or a whole small activation,
costs one send and one receive). Only the header's used bytes travel: the receiver posts each
header receive into a buffer of the largest size (`HEADER_BYTES`; a gloo receive may be
larger than its send) and copies the inline tensors out, so the buffer is reused at
once and a received tensor holds exactly its own bytes. Each remaining tensor is a
**payload**: sent as it is, without a copy, on the channel's payload group, and received
into a buffer the receiver allocates from the header ("counts first, then payloads").
Empty tensors (a worker that routed no token to a shard) cost nothing. Only `isend` /
`irecv` — no collective.

Payloads may live on an accelerator and travel over the device backend while headers
stay on a host group: the receiver reads nothing but headers on the host, and a payload
is never copied to the host (device tensors are never inlined).

A `Receiver` posts the header receives of a whole batch (a step's messages of its stream,
up to `window`) before the first arrives — posting a receive while data streams in costs
gloo several times more — and posts a payload's receives as soon as its header arrives:
with gloo a send leaves only once its receive is posted, so headers are never held up
behind the receiver, and a payload can start while the previous one is still on the wire.

What a message costs on the host is kept to a few operations (docs/design-notes.md, "What
a message costs"): headers are encoded with `struct` and one `memmove` per inline tensor
into reused buffers (`HeaderPool`; the receiver's landing buffers likewise), and host
payloads of 128 KiB and more are received into buffers reused once nothing holds them
(`ReceiveBuffers`: a fresh one costs a page fault per 4 KiB while the data comes in).
"""

from __future__ import annotations

import ctypes
import functools
import math
import struct
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from ..device import HOST
from ..torch_private import storage_use_count
from .topology import Channel

IDENT_LEN = 5  # a message names itself, e.g. (kind, layer, slot, exchange chunk, step)
META_WORDS = 64  # int64 fields: identity, tensor count, per tensor (dtype, where, ndim, *shape)
INLINE_BYTES = 64 << 10  # host tensors' bytes that may travel inside the header
HEADER_BYTES = META_WORDS * 8 + INLINE_BYTES  # the largest header (only its used bytes travel)
DTYPES = (
    torch.float64,
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
)
_CODE = {dtype: code for code, dtype in enumerate(DTYPES)}
_INLINE, _PAYLOAD = 0, 1


class CommTimeout(RuntimeError):
    pass


class ProtocolError(RuntimeError):
    """A received message is not the one the schedule expects (lost or reordered message)."""

    def __init__(self, message: str, got: tuple[int, ...]) -> None:
        super().__init__(message)
        self.got = got


def _align(nbytes: int) -> int:
    return (nbytes + 7) // 8 * 8


# libc's memmove called holding the GIL (`ctypes.memmove` releases it, and getting it back
# from a busy lane costs more than the copy of a few KB).
_memmove = ctypes.PyDLL(None).memmove
_memmove.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_memmove.restype = ctypes.c_void_p


@functools.cache
def _words(count: int) -> struct.Struct:
    """`count` int64 header fields, in the machine's byte order (both ends are one kind of host)."""
    return struct.Struct(f"={count}q")


class HeaderBuffer:
    """A header's host memory: as numpy (written by `encode_header`), as the tensor that is
    sent or received into, and its address (inline tensors are copied in and out with one
    `memmove` each). Only the pages a message uses are ever touched."""

    __slots__ = ("address", "array", "tensor")

    def __init__(self) -> None:
        self.array = np.empty(HEADER_BYTES, dtype=np.uint8)
        self.tensor = torch.from_numpy(self.array)
        self.address = self.array.ctypes.data


class HeaderPool:
    """Header buffers for sending, reused once a send that used one has completed (a fresh
    buffer and its torch wrapper cost as much as encoding the header).

    `take` and `give` may be called from different threads (deque ends are atomic).
    """

    def __init__(self, keep: int = 1024) -> None:
        self.keep = keep
        self._free: deque[HeaderBuffer] = deque()

    def take(self) -> HeaderBuffer:
        try:
            return self._free.pop()
        except IndexError:
            return HeaderBuffer()

    def give(self, buf: HeaderBuffer) -> None:
        if len(self._free) < self.keep:
            self._free.append(buf)


def encode_header(
    tensors: list[torch.Tensor],
    ident: tuple[int, ...] = (0,) * IDENT_LEN,
    out: HeaderBuffer | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The message's header — the used bytes of `out` (or of a fresh buffer): the fields
    and the inline tensors — and the tensors that travel as payloads, in order.

    Plain byte copies on host memory (`struct`, `memmove`): a few microseconds, not one
    torch op per field. Bytes of the field area that no field covers are left as they
    were (the receiver reads only what the fields describe).
    """
    assert len(ident) == IDENT_LEN
    buf = out if out is not None else HeaderBuffer()
    fields = [*ident, len(tensors)]
    payloads: list[torch.Tensor] = []
    pos = META_WORDS * 8
    for t in tensors:
        nbytes = t.nbytes
        inline = t.is_cpu and pos + nbytes <= HEADER_BYTES
        if inline and nbytes:
            src = t if t.is_contiguous() else t.contiguous()
            _memmove(buf.address + pos, src.data_ptr(), nbytes)
            pos += _align(nbytes)
        elif not inline:
            payloads.append(t.detach().contiguous())
        fields += [_CODE[t.dtype], _INLINE if inline else _PAYLOAD, t.dim(), *t.shape]
    if len(fields) > META_WORDS:
        raise ValueError(f"message header needs {len(fields)} fields > {META_WORDS}")
    _words(len(fields)).pack_into(buf.array.data, 0, *fields)
    return buf.tensor[:pos], payloads


def decode_header(
    header: torch.Tensor | np.ndarray,
) -> tuple[tuple[int, ...], list[tuple[torch.dtype, bool, tuple[int, ...]]]]:
    """(identity, [(dtype, inline, shape)]) of a header buffer."""
    if isinstance(header, torch.Tensor):
        header = header.numpy()
    fields = _words(META_WORDS).unpack_from(header.data)
    ident = tuple(fields[:IDENT_LEN])
    count, pos, specs = fields[IDENT_LEN], IDENT_LEN + 1, []
    for _ in range(count):
        code, where, ndim = fields[pos : pos + 3]
        specs.append((DTYPES[code], where == _INLINE, tuple(fields[pos + 3 : pos + 3 + ndim])))
        pos += 3 + ndim
    return ident, specs


@functools.cache
def _group_rank(group: dist.ProcessGroup, rank: int) -> int:
    return dist.get_group_rank(group, rank)


def _isend(t: torch.Tensor, dst: int, group: dist.ProcessGroup) -> dist.Work:
    """`dist.isend` without its per-call Python checks: the process group's own `send`
    (the same backend call; a third of the CPU time per message on this host)."""
    return group.send([t], _group_rank(group, dst), 0)


def _irecv(t: torch.Tensor, src: int, group: dist.ProcessGroup) -> dist.Work:
    return group.recv([t], _group_rank(group, src), 0)


def send_message(
    tensors: list[torch.Tensor],
    dst: int,
    channel: Channel,
    ident: tuple[int, ...] = (0,) * IDENT_LEN,
    header: HeaderBuffer | None = None,
) -> tuple[list[dist.Work], int]:
    """Post the header's and the payloads' sends; the caller waits on the returned works
    (the first is the header's: `header`, from a `HeaderPool`, may be reused once it ends).
    Also returns the bytes that travel: the header's used bytes (its fields and the inline
    tensors) and the payloads'.

    On an accelerator a payload's send is queued on the posting thread's current stream
    (NCCL): post it from the lane whose stream produced the payload."""
    buf, payloads = encode_header(tensors, ident, header)
    works = [_isend(buf, dst, channel.header)]
    works += [_isend(t, dst, channel.payload) for t in payloads if t.numel() > 0]
    return works, buf.numel() + sum(t.nbytes for t in payloads)


@functools.cache
def _timedelta(seconds: float) -> timedelta:
    return timedelta(seconds=seconds)


Describe = str | Callable[[], str]  # what a wait is for, in errors (built only for one)


def _text(what: Describe) -> str:
    return what if isinstance(what, str) else what()


def wait_work(
    work: dist.Work, timeout_s: float, what: Describe, late: str = "nothing arrived"
) -> None:
    """`work.wait` with a timeout; CommTimeout naming `what` when it fails (`late`: what a
    timeout means, in the message)."""
    try:
        ok = work.wait(_timedelta(timeout_s))
    except RuntimeError as err:
        if "Timed out" in str(err):
            raise CommTimeout(f"{_text(what)}: {late} within {timeout_s:g} s") from err
        raise CommTimeout(f"{_text(what)}: {err}") from err
    if ok is False:
        raise CommTimeout(f"{_text(what)}: no data after {timeout_s:.0f} s")


@dataclass(slots=True)
class Incoming:
    """A message whose header has arrived and whose payload receives are posted."""

    tensors: list[torch.Tensor]  # inline ones filled; payload ones filled once `works` end
    works: list[dist.Work]  # the payloads' receives (none for an all-inline message)
    arrived: float  # wall-clock time (us) the header arrived
    waited_us: float  # how long `Receiver.next` waited for the header

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def wait(self, timeout_s: float, what: Describe) -> list[torch.Tensor]:
        """The message's tensors once its payloads are in. Host payloads: block until they
        are, with a timeout that names the message. Device payloads: make the calling
        thread's current stream wait for them, without blocking the host — NCCL's
        `Work.wait` blocks the host when given a timeout and only orders the stream
        without one; a payload that never comes is then the process group's own timeout
        (its watchdog), as for every collective."""
        if self.works and any(t.device != HOST for t in self.tensors):
            for work in self.works:
                work.wait()
            return self.tensors
        for work in self.works:
            wait_work(work, timeout_s, what, "its header arrived, its payload did not complete")
        return self.tensors


# Host receive buffers of at least this size are reused (`ReceiveBuffers`); smaller ones
# come from malloc's free lists, already touched.
REUSE_MIN_BYTES = 128 << 10
REUSE_MAX_BYTES = 128 << 20  # what one receiver keeps for reuse, at most


class ReceiveBuffers:
    """Host buffers for received payloads, reused once nothing else holds them.

    A fresh buffer of a few MiB costs its first touch — a page fault per 4 KiB page while
    the receive writes into it (`benchmarks/exchange_overhead.py`: about 400 faults and 1-2
    ms per 8 MiB message, a third of the transfer). This keeps the storages it handed out
    (up to `keep_bytes` in all, per exact byte size, so that what the activation meter counts
    is what a fresh buffer would be) and hands one out again when its use count says that
    only this cache still holds it: the consumer and autograd dropped every tensor on it.

    The storages of a size are a queue, and a request takes the first free one from the
    front, moving each one it finds still held to the back: messages are mostly consumed in
    the order they came, so the front one is mostly free and a request costs the same with
    4 kept buffers as with 128 (a scan from the start of a list cost 15-25 us per 1 MiB
    message with 128 kept, passing the ones handed out since). One held long — an
    activation kept until its backward — is looked at once and then waits at the back. Only
    when every kept buffer is held does a request look at them all (and allocate a fresh
    one), as the scan did.
    Used by one receive lane (not thread-safe); on an accelerator the device's caching
    allocator does this instead.
    """

    def __init__(self, keep_bytes: int = REUSE_MAX_BYTES) -> None:
        self.keep_bytes = keep_bytes
        self.kept = 0
        self._by_size: dict[int, deque[torch.UntypedStorage]] = {}

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < REUSE_MIN_BYTES:
            return torch.empty(shape, dtype=dtype)
        kept = self._by_size.get(nbytes)
        if kept is None:
            kept = self._by_size[nbytes] = deque()
        for _ in range(len(kept)):
            storage = kept[0]
            kept.rotate(-1)  # to the back: handed out now, or still held
            if storage_use_count(storage) == 1:  # only `kept` holds it
                return torch.empty(0, dtype=dtype).set_(storage, 0, shape, ())  # contiguous
        t = torch.empty(shape, dtype=dtype)
        if self.kept + nbytes <= self.keep_bytes:
            kept.append(t.untyped_storage())
            self.kept += nbytes
        return t


class Receiver:
    """Receives the messages of one (sender, channel) stream in order.

    `start(count)` begins a batch of `count` messages (one step's), posting up to `window`
    header receives ahead; `next` waits for the next header, checks the message's identity,
    copies its inline tensors out and posts its payloads' receives on `device`. Header
    landing buffers are reused once decoded: at most `window` of them, of which a message
    touches only the pages it used.
    """

    def __init__(
        self, src: int, channel: Channel, *, window: int = 512, device: torch.device | None = None
    ) -> None:
        self.src = src
        self.channel = channel
        self.window = window
        self.device = device or HOST
        self.posted: deque[tuple[HeaderBuffer, dist.Work]] = deque()
        self.unposted = 0
        self.buffers = ReceiveBuffers() if self.device == HOST else None
        self._landing: list[HeaderBuffer] = []

    def start(self, count: int) -> None:
        assert not self.posted and not self.unposted, "the previous batch is not finished"
        self.unposted = count
        while self.unposted and len(self.posted) < self.window:
            self._post()

    def stop(self) -> None:
        """Forget the batch's receives not taken (after a failure). Their buffers are not
        reused: a receive still posted may yet write into one."""
        self.posted.clear()
        self.unposted = 0

    def _post(self) -> None:
        header = self._landing.pop() if self._landing else HeaderBuffer()
        self.posted.append((header, _irecv(header.tensor, self.src, self.channel.header)))
        self.unposted -= 1

    def next(
        self, timeout_s: float, what: Describe, expect: tuple[int, ...] | None = None
    ) -> Incoming:
        """Wait for the next header, check it is `expect`, post its payload receives."""
        t_wait = time.time_ns() / 1000.0
        header, work = self.posted.popleft()
        wait_work(work, timeout_s, what)
        arrived = time.time_ns() / 1000.0
        ident, specs = decode_header(header.array)
        if expect is not None and ident != tuple(expect):
            self._release(header)
            raise ProtocolError(
                f"{_text(what)}: got message {ident} instead of {tuple(expect)} "
                "(lost or reordered)",
                ident,
            )
        tensors, works = [], []
        pos = META_WORDS * 8
        for dtype, inline, shape in specs:
            if inline:
                t = torch.empty(shape, dtype=dtype)
                nbytes = t.nbytes
                if nbytes:
                    _memmove(t.data_ptr(), header.address + pos, nbytes)
                tensors.append(t)
                pos += _align(nbytes)
                continue
            if self.buffers is not None:
                t = self.buffers.empty(shape, dtype)
            else:
                t = torch.empty(shape, dtype=dtype, device=self.device)
            if t.numel():
                works.append(_irecv(t, self.src, self.channel.payload))
            tensors.append(t)
        self._release(header)
        return Incoming(tensors, works, arrived, arrived - t_wait)

    def _release(self, header: HeaderBuffer) -> None:
        """`header` was read: it lands the next header of the batch, if one is left."""
        self._landing.append(header)
        if self.unposted:
            self._post()
