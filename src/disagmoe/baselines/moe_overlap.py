"""The MoE layer of `ep-overlap` (Tutel / Comet operator-level overlap) and of
`ep-combined` and `ep-dualpipev` with more than one chunk: `ep_moe` with the expert
compute chunked and pipelined with asynchronous all-to-alls.

`OverlappedExperts` splits the dispatched rows of every peer into `chunks` pieces, each
chunk's dispatch carrying its rows, combine weights and assignment ints in one byte
all-to-all (`baselines.moe.pack_pieces`, after one blocking exchange of the counts): all
dispatch all-to-alls are posted asynchronously on a dedicated process group
(`EPComm.async_group`: one per lane where a forward and a backward run at once), chunk
c's expert GEMMs run while chunks c+1.. are in flight, and chunk c's combine is posted
as soon as it is computed. Its backward pipelines the reverse exchanges the same way.
Attention is not overlapped. Every asynchronous all-to-all is traced from its post to
its completion with its peers and the bytes sent to each.

Shape legend as in `baselines.moe`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..models import Assignments, Experts, Routing, split_by_owner, split_experts, sum_rows
from ..trace import Tracer
from .moe import EPComm, pack_pieces, receiver_plan, traced_exchange, unpack_pieces


def _chunk_bounds(rows: int, chunks: int) -> list[tuple[int, int]]:
    base, extra = divmod(rows, chunks)
    out, lo = [], 0
    for c in range(chunks):
        hi = lo + base + (1 if c < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


@dataclass
class _Piece:
    """Peer j's rows [lo, hi) of chunk c, with the assignments that fall in them."""

    token_ids: torch.Tensor
    rows_A: torch.Tensor  # relative to lo
    experts_A: torch.Tensor
    weights_A: torch.Tensor


def _pieces(plan: Assignments, chunks: int) -> list[_Piece]:
    out = []
    for lo, hi in _chunk_bounds(plan.token_ids.numel(), chunks):
        mask = (plan.rows_A >= lo) & (plan.rows_A < hi)
        out.append(
            _Piece(
                plan.token_ids[lo:hi],
                plan.rows_A[mask] - lo,
                plan.experts_A[mask],
                plan.weights_A[mask],
            )
        )
    return out


def overlapped_moe(
    experts: Experts, u_TH: torch.Tensor, routing: Routing, comm: EPComm, layer: int
) -> torch.Tensor:
    """`ep_moe` with the expert compute chunked and pipelined with async all-to-alls."""
    assert comm.group is not None
    H, C, ep = u_TH.shape[-1], comm.chunks, comm.ep
    plans = split_by_owner(routing, split_experts(routing.probs_TE.shape[-1], ep))
    pieces = [_pieces(p, C) for p in plans]  # [peer][chunk]
    # Counts first: per (chunk, peer) rows and assignments, one int64 all-to-all.
    send_counts = torch.tensor(
        [
            [pieces[j][c].token_ids.numel(), pieces[j][c].rows_A.numel()]
            for j in range(ep)
            for c in range(C)
        ],
        dtype=torch.int64,
    )
    recv_counts = traced_exchange(
        send_counts.reshape(-1), [2 * C] * ep, [2 * C] * ep, comm, "counts", layer
    ).view(ep, C, 2)
    # Each chunk's dispatch carries its assignments' (row, expert id) pairs too.
    send_ints = [
        [torch.cat([pieces[j][c].rows_A, pieces[j][c].experts_A]) for j in range(ep)]
        for c in range(C)
    ]
    # Differentiable send buffer laid out [chunk][peer][rows*H | weights].
    send_f = torch.cat(
        [
            torch.cat([u_TH[pieces[j][c].token_ids].reshape(-1), pieces[j][c].weights_A])
            for c in range(C)
            for j in range(ep)
        ]
    )
    send_counts_v = send_counts.view(ep, C, 2)
    y_flat = OverlappedExperts.apply(
        send_f, experts, comm, layer, send_counts_v, recv_counts, send_ints, H
    )
    token_ids = torch.cat([pieces[j][c].token_ids for c in range(C) for j in range(ep)])
    return sum_rows(y_flat.view(-1, H), token_ids, u_TH)


@dataclass
class _Posted:
    """An asynchronous all_to_all_single in flight: its receive buffer, when it was posted,
    its work handle and the bytes this rank sends to each member of the group."""

    buf: torch.Tensor
    t_post: float
    work: Any
    peer_bytes: list[int]


def _post(
    out: torch.Tensor,
    x: torch.Tensor,
    out_sizes: list[int],
    in_sizes: list[int],
    group: dist.ProcessGroup | None,
) -> _Posted:
    """Post one async all_to_all_single of `x` (split by `in_sizes`) into `out`."""
    t_post = Tracer.now_us()
    work = dist.all_to_all_single(out, x, out_sizes, in_sizes, group=group, async_op=True)
    return _Posted(out, t_post, work, [n * x.element_size() for n in in_sizes])


def _post_dispatch(
    send_f: torch.Tensor,
    ints: list[list[torch.Tensor]],
    f_in: list[list[int]],
    out_bytes: list[list[int]],
    group: dist.ProcessGroup | None,
) -> list[_Posted]:
    """Every chunk's dispatch as one async byte all-to-all (`pack_pieces`: per peer its
    floats, then its ints), all posted at once like `_post_chunks`: `send_f` is laid out
    [chunk][peer] with `f_in[c][j]` floats each, `ints[c][j]` is its ints."""
    pieces = send_f.split([n for sizes in f_in for n in sizes])
    out, k = [], 0
    for c, ints_c in enumerate(ints):
        send, in_bytes = pack_pieces(list(pieces[k : k + len(ints_c)]), ints_c)
        k += len(ints_c)
        out.append(_post(send.new_empty(sum(out_bytes[c])), send, out_bytes[c], in_bytes, group))
    return out


def _post_chunks(
    flat: torch.Tensor,
    out_sizes: list[list[int]],
    in_sizes: list[list[int]],
    group: dist.ProcessGroup | None,
) -> list[_Posted]:
    """One async all_to_all_single per chunk c of `flat` (laid out chunk after chunk, chunk c
    split by `in_sizes[c]`), all posted at once so that they complete in order on `group`."""
    pieces = flat.split([sum(s) for s in in_sizes])
    return [
        _post(
            flat.new_empty(sum(out_sizes[c])), piece.contiguous(), out_sizes[c], in_sizes[c], group
        )
        for c, piece in enumerate(pieces)
    ]


class OverlappedExperts(torch.autograd.Function):
    """Chunk-pipelined dispatch -> experts -> combine; input/output laid out [chunk][peer]."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        send_f: torch.Tensor,
        experts: Experts,
        comm: EPComm,
        layer: int,
        send_counts: torch.Tensor,  # [ep, C, 2] rows, assignments I send to peer j in chunk c
        recv_counts: torch.Tensor,  # [ep, C, 2] rows, assignments peer j sends me in chunk c
        send_ints: list[list[torch.Tensor]],  # [chunk][peer] (row, expert id) pairs I send
        H: int,
    ) -> torch.Tensor:
        ep, C = send_counts.shape[0], send_counts.shape[1]
        group = comm.async_group()
        sc, rc = send_counts.tolist(), recv_counts.tolist()
        in_sizes = [[sc[j][c][0] * H + sc[j][c][1] for j in range(ep)] for c in range(C)]
        out_sizes = [[rc[j][c][0] * H + rc[j][c][1] for j in range(ep)] for c in range(C)]
        fe = send_f.element_size()
        out_bytes = [
            [n * fe + 16 * rc[j][c][1] for j, n in enumerate(out_sizes[c])] for c in range(C)
        ]
        where = (layer, comm.step, comm.micro_batch)
        tag = f"l{layer} mb{comm.micro_batch}"
        # Post every chunk's dispatch at once; they complete in order on the a2a group.
        posted = _post_dispatch(send_f.detach(), send_ints, in_sizes, out_bytes, group)
        leaves, outs, combines = [], [], []
        for c in range(C):
            _wait(posted[c], comm, f"a2a dispatch {tag} c{c}", where)
            floats, ints = unpack_pieces(
                posted[c].buf, out_sizes[c], [2 * rc[j][c][1] for j in range(ep)], send_f.dtype
            )
            leaf = torch.cat(floats).requires_grad_(True)
            t0 = Tracer.now_us()
            with torch.enable_grad():  # the chunk's own graph, backpropagated in `backward`
                xs, ws, off = [], [], 0
                for j in range(ep):
                    r, a = rc[j][c]
                    xs.append(leaf[off : off + r * H].view(r, H))
                    ws.append(leaf[off + r * H : off + r * H + a])
                    off += r * H + a
                plan = receiver_plan(
                    [rc[j][c][0] for j in range(ep)],
                    [rc[j][c][1] for j in range(ep)],
                    torch.cat(ints),
                    ws,
                )
                y = experts(torch.cat(xs), plan)
            comm.tracer.add(
                f"experts {tag} c{c}",
                "compute",
                t0,
                Tracer.now_us(),
                layer=layer,
                micro_batch=where[2],
                step=where[1],
            )
            leaves.append(leaf)
            outs.append(y)
            combines.append(
                _post(
                    y.new_empty(sum(sc[j][c][0] for j in range(ep)) * H),
                    y.detach().reshape(-1),
                    [sc[j][c][0] * H for j in range(ep)],
                    [rc[j][c][0] * H for j in range(ep)],
                    group,
                )
            )
        for c, posted_c in enumerate(combines):
            _wait(posted_c, comm, f"a2a combine {tag} c{c}", where)
        ctx.state = (leaves, outs, comm, where, sc, rc, H, tag)
        return torch.cat([p.buf for p in combines])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        leaves, outs, comm, where, sc, rc, H, tag = ctx.state
        ep, C, group = len(sc), len(sc[0]), comm.async_group()
        mine = [[sc[j][c][0] * H for j in range(ep)] for c in range(C)]
        theirs = [[rc[j][c][0] * H for j in range(ep)] for c in range(C)]
        posted = _post_chunks(grad.contiguous(), theirs, mine, group)
        returns = []
        for c in range(C):
            _wait(posted[c], comm, f"a2a combine.bwd {tag} c{c}", where)
            t0 = Tracer.now_us()
            if outs[c].requires_grad:
                torch.autograd.backward(outs[c], posted[c].buf.view_as(outs[c]))
            g = leaves[c].grad if leaves[c].grad is not None else torch.zeros_like(leaves[c])
            comm.tracer.add(
                f"experts.bwd {tag} c{c}",
                "compute",
                t0,
                Tracer.now_us(),
                layer=where[0],
                micro_batch=where[2],
                step=where[1],
            )
            returns.append(
                _post(
                    grad.new_empty(sum(sc[j][c][0] * H + sc[j][c][1] for j in range(ep))),
                    g,
                    [sc[j][c][0] * H + sc[j][c][1] for j in range(ep)],
                    [rc[j][c][0] * H + rc[j][c][1] for j in range(ep)],
                    group,
                )
            )
        for c, posted_c in enumerate(returns):
            _wait(posted_c, comm, f"a2a dispatch.bwd {tag} c{c}", where)
        return torch.cat([p.buf for p in returns]), None, None, None, None, None, None, None


def _wait(posted: _Posted, comm: EPComm, name: str, where: tuple[int, int, int]) -> None:
    """Wait for an async all-to-all; trace its in-flight span ("send", with its peers and
    the bytes sent to each) and the blocking wait ("recv")."""
    layer, step, mb = where
    t0 = Tracer.now_us()
    posted.work.wait()
    t1 = Tracer.now_us()
    comm.tracer.add(
        name,
        "send",
        posted.t_post,
        t1,
        layer=layer,
        micro_batch=mb,
        step=step,
        bytes=sum(posted.peer_bytes),
        peers=dist.get_process_group_ranks(comm.overlap_group or comm.group),
        peer_bytes=posted.peer_bytes,
    )
    comm.tracer.add(
        f"wait {name}", "recv", t0, t1, layer=layer, micro_batch=mb, step=step, blocking=True
    )
