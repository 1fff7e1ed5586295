"""Expert-parallel MoE layer: route / dispatch / compute / combine with all-to-all.

Every rank of an EP group (size `ep`) runs the attention and router of its own
micro-batch, then:

* dispatch — `split_by_owner` gives, per EP peer j, the tokens routed to j's
  experts (each token at most once per peer) and the (row, local expert,
  weight) assignments. Counts are exchanged first with one int64
  all-to-all, then the payloads: one float all-to-all (token rows and combine
  weights, differentiable) and one int64 all-to-all (rows, expert ids).
  Dropless: every routed token is sent, however uneven the counts (zero too).
  Every exchange (counts and ints too) is traced with its peers and the bytes sent to
  each (`peer_bytes`), so the bench's bound counts every byte a rank sends.
* compute  — the received rows of all peers are concatenated and run through
  the same `Experts` module (grouped GEMM) as the single-process model.
* combine  — the weighted expert outputs go back with a float all-to-all
  (split sizes swapped) and are summed into the sender's token rows.

Gradients: `AllToAll` is an autograd Function whose backward is the reverse
all-to-all, so the expert shard's weight gradients sum the tokens of all `ep`
peers, and the peers get the gradients of their dispatched rows and weights.

`OverlappedExperts` (runtime `ep-overlap`, Tutel/Comet style) splits the
dispatched rows of every peer into `chunks` pieces and pipelines them: all
dispatch all-to-alls are posted asynchronously on a dedicated process group,
chunk c's expert GEMMs run while chunks c+1.. are in flight, and chunk c's
combine is posted as soon as it is computed. Its backward pipelines the
reverse exchanges the same way. Attention is not overlapped.

Shape legend: T tokens of the local micro-batch, H model dim, R rows a peer
sends/receives, A assignments.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..models import (
    Assignments,
    Experts,
    Routing,
    flatten_routing,
    split_by_owner,
    split_experts,
)
from ..runtime.observe import Tracer


@dataclass
class EPComm:
    """What an MoE layer needs to talk to its EP group.

    Lanes: a stage's forward runs on the "fwd" lane, its backward (I, B, W, and a
    recomputed forward inside it) on the "bwd" lane (`use_lane`, set by the stage per
    computation and thread). Where a forward and a backward of two micro-batches run at
    once (`baselines.fb_overlap`), the backward lane's exchanges go on `bwd_group`, a
    second process group over the same ranks, so that each group sees its collectives in
    one order on every member; otherwise every exchange goes on `group`. The micro-batch
    is the current lane's (per thread)."""

    group: dist.ProcessGroup | None  # None when ep == 1 (no exchange)
    ep: int
    tracer: Tracer
    overlap_group: dist.ProcessGroup | None = None
    chunks: int = 1
    step: int = 0
    bwd_group: dist.ProcessGroup | None = None
    local: threading.local = field(default_factory=threading.local, repr=False)

    @property
    def micro_batch(self) -> int:
        return int(getattr(self.local, "micro_batch", 0))

    @micro_batch.setter
    def micro_batch(self, mb: int) -> None:
        self.local.micro_batch = mb

    @contextmanager
    def use_lane(self, lane: str, micro_batch: int) -> Iterator[None]:
        """Run the calling thread's exchanges as `lane`'s ("fwd" / "bwd") for `micro_batch`."""
        before = (getattr(self.local, "lane", "fwd"), self.micro_batch)
        self.local.lane, self.micro_batch = lane, micro_batch
        try:
            yield
        finally:
            self.local.lane, self.micro_batch = before

    def lane_group(self) -> dist.ProcessGroup:
        """The process group of the calling thread's lane (module doc)."""
        if self.bwd_group is not None and getattr(self.local, "lane", "fwd") == "bwd":
            return self.bwd_group
        assert self.group is not None
        return self.group


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def exchange(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """Blocking all_to_all_single of a 1-D tensor with the given split sizes."""
    out = x.new_empty(sum(out_splits))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def _traced_exchange(
    x: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    comm: EPComm,
    name: str,
    layer: int,
    step: int,
    mb: int,
) -> torch.Tensor:
    """`exchange` over the EP group, traced as a blocking all-to-all on the send lane with
    the bytes sent to each member (`in_splits`: what this rank sends to each)."""
    group = comm.lane_group()
    t0 = Tracer.now_us()
    out = exchange(x, out_splits, in_splits, group)
    comm.tracer.add(
        f"a2a {name} l{layer} mb{mb}",
        "send",
        t0,
        Tracer.now_us(),
        layer=layer,
        micro_batch=mb,
        step=step,
        bytes=_nbytes(x),
        blocking=True,
        peers=dist.get_process_group_ranks(group),
        peer_bytes=[n * x.element_size() for n in in_splits],
    )
    return out


def traced_exchange(
    x: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    comm: EPComm,
    name: str,
    layer: int,
) -> torch.Tensor:
    """A non-differentiable exchange (counts, assignment ints) of the current micro-batch."""
    return _traced_exchange(
        x, out_splits, in_splits, comm, name, layer, comm.step, comm.micro_batch
    )


class AllToAll(torch.autograd.Function):
    """Differentiable all_to_all_single of a 1-D tensor; backward is the reverse exchange."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        comm: EPComm,
        name: str,
        layer: int,
    ) -> torch.Tensor:
        step, mb = comm.step, comm.micro_batch
        ctx.meta = (out_splits, in_splits, comm, name, layer, step, mb)
        return _traced_exchange(x, out_splits, in_splits, comm, name, layer, step, mb)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        out_splits, in_splits, comm, name, layer, step, mb = ctx.meta
        g = _traced_exchange(grad, in_splits, out_splits, comm, f"{name}.bwd", layer, step, mb)
        return g, None, None, None, None, None


@dataclass
class DispatchPlan:
    """Sender side of one MoE layer: per peer, its token ids and assignments."""

    plans: list[Assignments]
    send_rows: list[int]
    send_asg: list[int]
    recv_rows: list[int]
    recv_asg: list[int]


def plan_dispatch(routing: Routing, comm: EPComm, layer: int) -> DispatchPlan:
    """Split the routing per EP peer and exchange the counts (rows, assignments) first."""
    plans = split_by_owner(routing, split_experts(routing.probs_TE.shape[-1], comm.ep))
    send_rows = [p.token_ids.numel() for p in plans]
    send_asg = [p.rows_A.numel() for p in plans]
    counts = torch.tensor(
        [[r, a] for r, a in zip(send_rows, send_asg, strict=True)], dtype=torch.int64
    )
    assert comm.group is not None
    ep = comm.ep
    recv = traced_exchange(counts.reshape(-1), [2] * ep, [2] * ep, comm, "counts", layer)
    recv = recv.view(ep, 2)
    return DispatchPlan(plans, send_rows, send_asg, recv[:, 0].tolist(), recv[:, 1].tolist())


def _receiver_plan(
    rows_per_src: list[int], asg_per_src: list[int], ints: torch.Tensor, weights: list[torch.Tensor]
) -> Assignments:
    """Concatenate the assignments received from every peer, rows offset per source."""
    rows, experts, pos, offset = [], [], 0, 0
    for r, a in zip(rows_per_src, asg_per_src, strict=True):
        rows.append(ints[pos : pos + a] + offset)
        experts.append(ints[pos + a : pos + 2 * a])
        pos += 2 * a
        offset += r
    return Assignments(
        token_ids=torch.arange(offset),
        rows_A=torch.cat(rows) if rows else ints.new_zeros(0),
        experts_A=torch.cat(experts) if experts else ints.new_zeros(0),
        weights_A=torch.cat(weights) if weights else ints.new_zeros(0).float(),
    )


def ep_moe(
    experts: Experts, u_TH: torch.Tensor, routing: Routing, comm: EPComm, layer: int
) -> torch.Tensor:
    """Routed-expert output [T, H] of this rank's tokens (dispatch, compute, combine)."""
    if comm.group is None:  # ep == 1: every expert is local
        return experts(u_TH, flatten_routing(routing))
    if comm.overlap_group is not None:
        return overlapped_moe(experts, u_TH, routing, comm, layer)
    H = u_TH.shape[-1]
    d = plan_dispatch(routing, comm, layer)
    send_f = torch.cat([torch.cat([u_TH[p.token_ids].reshape(-1), p.weights_A]) for p in d.plans])
    send_i = torch.cat([torch.cat([p.rows_A, p.experts_A]) for p in d.plans])
    recv_f = AllToAll.apply(
        send_f,
        [r * H + a for r, a in zip(d.recv_rows, d.recv_asg, strict=True)],
        [r * H + a for r, a in zip(d.send_rows, d.send_asg, strict=True)],
        comm,
        "dispatch",
        layer,
    )
    recv_i = traced_exchange(
        send_i, [2 * a for a in d.recv_asg], [2 * a for a in d.send_asg], comm, "ints", layer
    )
    xs, ws, pos = [], [], 0
    for r, a in zip(d.recv_rows, d.recv_asg, strict=True):
        xs.append(recv_f[pos : pos + r * H].view(r, H))
        ws.append(recv_f[pos + r * H : pos + r * H + a])
        pos += r * H + a
    plan = _receiver_plan(d.recv_rows, d.recv_asg, recv_i, ws)
    y_RH = experts(torch.cat(xs), plan)
    back = AllToAll.apply(
        y_RH.reshape(-1),
        [r * H for r in d.send_rows],
        [r * H for r in d.recv_rows],
        comm,
        "combine",
        layer,
    )
    token_ids = torch.cat([p.token_ids for p in d.plans])
    return u_TH.new_zeros(u_TH.shape).index_add(0, token_ids, back.view(-1, H))


# ------------------------------------------------------------------------------ ep-overlap


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
    send_ints = torch.cat(
        [
            torch.cat([pieces[j][c].rows_A, pieces[j][c].experts_A])
            for j in range(ep)
            for c in range(C)
        ]
    )
    recv_ints = traced_exchange(
        send_ints,
        [2 * int(recv_counts[j, :, 1].sum()) for j in range(ep)],
        [2 * sum(pieces[j][c].rows_A.numel() for c in range(C)) for j in range(ep)],
        comm,
        "ints",
        layer,
    )
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
        send_f, experts, comm, layer, send_counts_v, recv_counts, recv_ints, H
    )
    token_ids = torch.cat([pieces[j][c].token_ids for c in range(C) for j in range(ep)])
    return u_TH.new_zeros(u_TH.shape).index_add(0, token_ids, y_flat.view(-1, H))


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
        recv_ints: torch.Tensor,
        H: int,
    ) -> torch.Tensor:
        ep, C = send_counts.shape[0], send_counts.shape[1]
        group = comm.overlap_group
        sc, rc = send_counts.tolist(), recv_counts.tolist()
        in_sizes = [[sc[j][c][0] * H + sc[j][c][1] for j in range(ep)] for c in range(C)]
        out_sizes = [[rc[j][c][0] * H + rc[j][c][1] for j in range(ep)] for c in range(C)]
        where = (layer, comm.step, comm.micro_batch)
        tag = f"l{layer} mb{comm.micro_batch}"
        # Post every chunk's dispatch at once; they complete in order on the a2a group.
        posted = _post_chunks(send_f.detach(), out_sizes, in_sizes, group)
        # Assignment ints per (peer, chunk), in the sender's [peer][chunk] order.
        ints_of: dict[tuple[int, int], torch.Tensor] = {}
        pos = 0
        for j in range(ep):
            for c in range(C):
                a = rc[j][c][1]
                ints_of[(j, c)] = recv_ints[pos : pos + 2 * a]
                pos += 2 * a
        leaves, outs, combines = [], [], []
        for c in range(C):
            _wait(posted[c], comm, f"a2a dispatch {tag} c{c}", where)
            leaf = posted[c].buf.detach().requires_grad_(True)
            t0 = Tracer.now_us()
            with torch.enable_grad():  # the chunk's own graph, backpropagated in `backward`
                xs, ws, ints, off = [], [], [], 0
                for j in range(ep):
                    r, a = rc[j][c]
                    xs.append(leaf[off : off + r * H].view(r, H))
                    ws.append(leaf[off + r * H : off + r * H + a])
                    ints.append(ints_of[(j, c)])
                    off += r * H + a
                plan = _receiver_plan(
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
        ep, C, group = len(sc), len(sc[0]), comm.overlap_group
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
