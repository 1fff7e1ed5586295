"""Point-to-point messages of variable size: a header that says what follows, then payloads.

A message is a list of tensors. Its **header** is one fixed-size byte buffer on the
channel's header group: the message's identity, each tensor's dtype and shape, and —
"inline" — the bytes of every small host tensor that fits (`INLINE_BYTES` in all), so
a message of small tensors (routing metadata, token counts, or a whole tiny message)
costs one send and one receive. Each remaining tensor is a **payload**: sent as it is,
without a copy, on the channel's payload group, and received into a buffer the receiver
allocates from the header ("counts first, then payloads"). Empty tensors (a worker that
routed no token to a shard) cost nothing. Only `isend` / `irecv` — no collective.

Payloads may live on an accelerator and travel over the device backend while headers
stay on a host group: the receiver reads nothing but headers on the host, and a payload
is never copied to the host (device tensors are never inlined).

A `Receiver` posts the header receives of a whole batch (a step's messages of its stream,
up to `window`) before the first arrives — posting a receive while data streams in costs
gloo several times more — and posts a payload's receives as soon as its header arrives:
with gloo a send leaves only once its receive is posted, so headers are never held up
behind the receiver, and a payload can start while the previous one is still on the wire.
"""

from __future__ import annotations

import functools
import math
import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from ..device import HOST
from .topology import Channel

IDENT_LEN = 4  # a message names itself, e.g. (kind, layer, slot, step)
META_WORDS = 64  # int64 fields: identity, tensor count, per tensor (dtype, where, ndim, *shape)
INLINE_BYTES = 4096  # host tensors' bytes that may travel inside the header
HEADER_BYTES = META_WORDS * 8 + INLINE_BYTES
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


def encode_header(
    tensors: list[torch.Tensor], ident: tuple[int, ...] = (0, 0, 0, 0)
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The message's header buffer and the tensors that travel as payloads, in order.

    Built with numpy on host memory: a few microseconds, not one torch op per field.
    """
    assert len(ident) == IDENT_LEN
    header = np.zeros(HEADER_BYTES, dtype=np.uint8)
    fields = [*ident, len(tensors)]
    payloads: list[torch.Tensor] = []
    pos = META_WORDS * 8
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        inline = t.device == HOST and pos + nbytes <= HEADER_BYTES
        if inline and nbytes:
            header[pos : pos + nbytes] = t.detach().reshape(-1).view(torch.uint8).numpy()
            pos += _align(nbytes)
        elif not inline:
            payloads.append(t.detach().contiguous())
        fields += [_CODE[t.dtype], _INLINE if inline else _PAYLOAD, t.dim(), *t.shape]
    if len(fields) > META_WORDS:
        raise ValueError(f"message header needs {len(fields)} fields > {META_WORDS}")
    header[: len(fields) * 8] = np.asarray(fields, dtype=np.int64).view(np.uint8)
    return torch.from_numpy(header), payloads


def decode_header(
    header: torch.Tensor,
) -> tuple[tuple[int, ...], list[tuple[torch.dtype, bool, tuple[int, ...]]]]:
    """(identity, [(dtype, inline, shape)]) of a header buffer."""
    fields = header.numpy()[: META_WORDS * 8].view(np.int64).tolist()
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
    ident: tuple[int, ...] = (0, 0, 0, 0),
) -> list[dist.Work]:
    """Post the header's and the payloads' sends; the caller waits on the returned works."""
    header, payloads = encode_header(tensors, ident)
    works = [_isend(header, dst, channel.header)]
    works += [_isend(t, dst, channel.payload) for t in payloads if t.numel() > 0]
    return works


def _wait(work: dist.Work, timeout_s: float, what: str) -> None:
    try:
        ok = work.wait(timedelta(seconds=timeout_s))
    except RuntimeError as err:
        if "Timed out" in str(err):
            raise CommTimeout(f"{what}: nothing arrived within {timeout_s:g} s") from err
        raise CommTimeout(f"{what}: {err}") from err
    if ok is False:
        raise CommTimeout(f"{what}: no data after {timeout_s:.0f} s")


@dataclass
class Incoming:
    """A message whose header has arrived and whose payload receives are posted."""

    tensors: list[torch.Tensor]  # inline ones filled; payload ones filled once `works` end
    works: list[dist.Work]  # the payloads' receives (none for an all-inline message)
    arrived: float  # wall-clock time (us) the header arrived

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def wait(self, timeout_s: float, what: str) -> list[torch.Tensor]:
        """Block until the payloads are in; the message's tensors."""
        for work in self.works:
            _wait(work, timeout_s, what)
        return self.tensors


class Receiver:
    """Receives the messages of one (sender, channel) stream in order.

    `start(count)` begins a batch of `count` messages (one step's), posting up to `window`
    header receives ahead; `next` waits for the next header, checks the message's identity
    and posts its payloads' receives on `device`.
    """

    def __init__(
        self, src: int, channel: Channel, *, window: int = 4096, device: torch.device | None = None
    ) -> None:
        self.src = src
        self.channel = channel
        self.window = window
        self.device = device or HOST
        self.posted: deque[tuple[torch.Tensor, dist.Work]] = deque()
        self.unposted = 0

    def start(self, count: int) -> None:
        assert not self.posted and not self.unposted, "the previous batch is not finished"
        self.unposted = count
        while self.unposted and len(self.posted) < self.window:
            self._post()

    def _post(self) -> None:
        header = torch.empty(HEADER_BYTES, dtype=torch.uint8)
        self.posted.append((header, _irecv(header, self.src, self.channel.header)))
        self.unposted -= 1

    def next(self, timeout_s: float, what: str, expect: tuple[int, ...] | None = None) -> Incoming:
        """Wait for the next header, check it is `expect`, post its payload receives."""
        header, work = self.posted.popleft()
        _wait(work, timeout_s, what)
        arrived = time.time_ns() / 1000.0
        if self.unposted:
            self._post()
        ident, specs = decode_header(header)
        if expect is not None and ident != tuple(expect):
            raise ProtocolError(
                f"{what}: got message {ident} instead of {tuple(expect)} (lost or reordered)",
                ident,
            )
        tensors, works = [], []
        pos = META_WORDS * 8
        for dtype, inline, shape in specs:
            if inline:
                nbytes = math.prod(shape) * dtype.itemsize
                tensors.append(header[pos : pos + nbytes].view(dtype).view(shape))
                pos += _align(nbytes)
                continue
            t = torch.empty(shape, dtype=dtype, device=self.device)
            if t.numel():
                works.append(_irecv(t, self.src, self.channel.payload))
            tensors.append(t)
        return Incoming(tensors, works, arrived)
