"""Point-to-point messages of variable size: a fixed-size header, then the payload.

A message is a list of tensors of two kinds — "float" (the run's dtype) and
int64. The header carries the message's identity and each tensor's kind and
shape, so a receiver can allocate buffers before the payload arrives ("counts
first, then payloads"); all float tensors travel as one flat buffer and all
int tensors as another. Empty tensors (a worker that routed no token to a
shard) are fine.

Headers and payloads travel on the stream's two dedicated 2-rank groups, each
FIFO: a `Receiver` posts the receives of all its headers up front, so a
sender's header is never held up waiting for the receiver to ask for it (with
gloo, a send waits for the receiver's "ready" notice, which would otherwise
queue behind payload data on a busy link). Only `isend` / `irecv` — no
collective.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .topology import Stream

HEADER_LEN = 64
_FLOAT, _INT = 0, 1


class CommTimeout(RuntimeError):
    pass


IDENT_LEN = 4  # a message names itself, e.g. (kind, layer, slot, step)


class ProtocolError(RuntimeError):
    """A received message is not the one the schedule expects (lost or reordered message)."""

    def __init__(self, message: str, got: tuple[int, ...]) -> None:
        super().__init__(message)
        self.got = got


def encode_header(
    tensors: list[torch.Tensor], ident: tuple[int, ...] = (0, 0, 0, 0)
) -> torch.Tensor:
    assert len(ident) == IDENT_LEN
    fields = [*ident, len(tensors)]
    for t in tensors:
        fields += [_INT if t.dtype == torch.int64 else _FLOAT, t.dim(), *t.shape]
    if len(fields) > HEADER_LEN:
        raise ValueError(f"message header needs {len(fields)} fields > {HEADER_LEN}")
    return torch.tensor(fields + [0] * (HEADER_LEN - len(fields)), dtype=torch.int64)


def decode_header(
    header: torch.Tensor,
) -> tuple[tuple[int, ...], list[tuple[int, tuple[int, ...]]]]:
    fields = header.tolist()
    ident = tuple(fields[:IDENT_LEN])
    count, pos, specs = fields[IDENT_LEN], IDENT_LEN + 1, []
    for _ in range(count):
        kind, ndim = fields[pos], fields[pos + 1]
        specs.append((kind, tuple(fields[pos + 2 : pos + 2 + ndim])))
        pos += 2 + ndim
    return ident, specs


def send_message(
    tensors: list[torch.Tensor],
    dst: int,
    stream: Stream,
    ident: tuple[int, ...] = (0, 0, 0, 0),
) -> list[dist.Work]:
    """Post the header and payload sends; the caller waits on the returned works."""
    works = [_posted(dist.isend(encode_header(tensors, ident), dst, group=stream.header))]
    floats = [t.reshape(-1) for t in tensors if t.dtype != torch.int64]
    ints = [t.reshape(-1) for t in tensors if t.dtype == torch.int64]
    for parts in (floats, ints):
        flat = torch.cat(parts) if parts else None
        if flat is not None and flat.numel() > 0:
            works.append(_posted(dist.isend(flat.contiguous(), dst, group=stream.payload)))
    return works


def _posted(work: dist.Work | None) -> dist.Work:
    assert work is not None, "point-to-point op returned no work handle"
    return work


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

    specs: list[tuple[int, tuple[int, ...]]]
    flats: tuple[torch.Tensor, torch.Tensor]  # float buffer, int buffer
    works: list[dist.Work]
    arrived: float  # wall-clock time (us) the header arrived

    def wait(self, timeout_s: float, what: str) -> list[torch.Tensor]:
        """Block until the payload is in; the message's tensors (views of two flat buffers)."""
        for work in self.works:
            _wait(work, timeout_s, what)
        flat_f, flat_i = self.flats
        out, pos_f, pos_i = [], 0, 0
        for kind, shape in self.specs:
            size = math.prod(shape)
            if kind == _FLOAT:
                out.append(flat_f[pos_f : pos_f + size].view(shape))
                pos_f += size
            else:
                out.append(flat_i[pos_i : pos_i + size].view(shape))
                pos_i += size
        return out


class Receiver:
    """Receives the `count` messages of one stream in order; all headers are posted at once.

    `post` waits for the next header and posts that message's payload receives without
    waiting for the previous payload: with gloo a payload leaves the sender only once
    its receive is posted, so posting it while the previous payload is still on the
    wire keeps the link busy back to back instead of idling for one round trip (through
    the, possibly congested, reverse direction) per message.
    """

    def __init__(self, src: int, stream: Stream, float_dtype: torch.dtype, count: int) -> None:
        self.src = src
        self.stream = stream
        self.float_dtype = float_dtype
        self.headers = [torch.empty(HEADER_LEN, dtype=torch.int64) for _ in range(count)]
        self.works = [_posted(dist.irecv(h, src, group=stream.header)) for h in self.headers]
        self.next = 0

    def post(self, timeout_s: float, what: str, expect: tuple[int, ...] | None = None) -> Incoming:
        """Wait for the next header, check it is `expect`, post its payload receives."""
        k = self.next
        self.next += 1
        _wait(self.works[k], timeout_s, what)
        arrived = time.time_ns() / 1000.0
        ident, specs = decode_header(self.headers[k])
        if expect is not None and ident != tuple(expect):
            raise ProtocolError(
                f"{what}: got message {ident} instead of {tuple(expect)} (lost or reordered)",
                ident,
            )
        n_float = sum(math.prod(shape) for kind, shape in specs if kind == _FLOAT)
        n_int = sum(math.prod(shape) for kind, shape in specs if kind == _INT)
        flats = (
            torch.empty(n_float, dtype=self.float_dtype),
            torch.empty(n_int, dtype=torch.int64),
        )
        works = [
            _posted(dist.irecv(flat, self.src, group=self.stream.payload))
            for flat in flats
            if flat.numel() > 0
        ]
        return Incoming(specs, flats, works, arrived)
