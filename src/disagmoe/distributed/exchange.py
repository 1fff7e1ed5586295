"""Point-to-point messages of variable size: a fixed-size header, then the payload.

A message is a list of tensors of two kinds — "float" (the run's dtype) and
int64. The header carries each tensor's kind and shape, so a receiver can
allocate buffers before the payload arrives ("counts first, then payloads");
all float tensors travel as one flat buffer and all int tensors as another.
Empty tensors (a worker that routed no token to a shard) are fine.

Only `isend` / `irecv` on the stream's dedicated 2-rank group are used — no
collective.
"""

from __future__ import annotations

import math
import time
from datetime import timedelta

import torch
import torch.distributed as dist

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
    group: dist.ProcessGroup,
    ident: tuple[int, ...] = (0, 0, 0, 0),
) -> list[dist.Work]:
    """Post the header and payload sends; the caller waits on the returned works."""
    works = [_posted(dist.isend(encode_header(tensors, ident), dst, group=group))]
    floats = [t.reshape(-1) for t in tensors if t.dtype != torch.int64]
    ints = [t.reshape(-1) for t in tensors if t.dtype == torch.int64]
    for parts in (floats, ints):
        flat = torch.cat(parts) if parts else None
        if flat is not None and flat.numel() > 0:
            works.append(_posted(dist.isend(flat.contiguous(), dst, group=group)))
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


def recv_message(
    src: int,
    group: dist.ProcessGroup,
    float_dtype: torch.dtype,
    timeout_s: float,
    what: str = "",
    arrived: list[float] | None = None,
    expect: tuple[int, ...] | None = None,
) -> list[torch.Tensor]:
    """Receive one message from `src` on `group` (blocking, with a timeout).

    If `arrived` is given, the wall-clock time (us) at which the
    header arrived is appended to it, separating waiting from transfer time.
    """
    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    _wait(_posted(dist.irecv(header, src, group=group)), timeout_s, what)
    if arrived is not None:
        arrived.append(time.time_ns() / 1000.0)
    ident, specs = decode_header(header)
    if expect is not None and ident != tuple(expect):
        raise ProtocolError(
            f"{what}: got message {ident} instead of {tuple(expect)} (lost or reordered)", ident
        )
    sizes = [math.prod(shape) for _, shape in specs]
    n_float = sum(s for (k, _), s in zip(specs, sizes, strict=True) if k == _FLOAT)
    n_int = sum(s for (k, _), s in zip(specs, sizes, strict=True) if k == _INT)
    flat_f = torch.empty(n_float, dtype=float_dtype)
    flat_i = torch.empty(n_int, dtype=torch.int64)
    for flat in (flat_f, flat_i):
        if flat.numel() > 0:
            _wait(_posted(dist.irecv(flat, src, group=group)), timeout_s, what)
    out, pos_f, pos_i = [], 0, 0
    for (kind, shape), size in zip(specs, sizes, strict=True):
        if kind == _FLOAT:
            out.append(flat_f[pos_f : pos_f + size].view(shape))
            pos_f += size
        else:
            out.append(flat_i[pos_i : pos_i + size].view(shape))
            pos_i += size
    return out
