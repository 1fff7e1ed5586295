"""Expert-parallel MoE layer: route / dispatch / compute / combine with all-to-all.

Every rank of an EP group (size `ep`) runs the attention and router of its own
micro-batch, then:

* dispatch — `split_by_owner` gives, per EP peer j, the tokens routed to j's
  experts (each token at most once per peer) and the (row, local expert,
  weight) assignments. Counts are exchanged first with one int64
  all-to-all, then the payload in one byte all-to-all (`Dispatch`): per peer the
  token rows and combine weights (floats, differentiable) followed by the
  assignments' (row, expert id) int64 pairs.
  Dropless: every routed token is sent, however uneven the counts (zero too).
  Every exchange (counts and ints too) is traced with its peers and the bytes sent to
  each (`peer_bytes`), so the bench's bound counts every byte a rank sends.
* compute  — the received rows of all peers are concatenated and run through
  the same `Experts` module (grouped GEMM) as the single-process model.
* combine  — the weighted expert outputs go back with a float all-to-all
  (split sizes swapped) and are summed into the sender's token rows.

Gradients: `Dispatch` and `AllToAll` are autograd Functions whose backward is the
reverse all-to-all of the floats, so the expert shard's weight gradients sum the tokens
of all `ep` peers, and the peers get the gradients of their dispatched rows and weights.

`ep-overlap`'s chunked variant (Tutel/Comet style) is `baselines.moe_overlap`.

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
    sum_rows,
)
from ..trace import Tracer


@dataclass
class EPComm:
    """What an MoE layer needs to talk to its EP group.

    Lanes: a stage's forward runs on the "fwd" lane, its backward (I, B, W, and a
    recomputed forward inside it) on the "bwd" lane (`use_lane`, set by the stage per
    computation and thread). Where a forward and a backward of two micro-batches run at
    once (`baselines.fb_overlap`), the backward lane's exchanges go on `bwd_group`, a
    second process group over the same ranks, so that each group sees its collectives in
    one order on every member; otherwise every exchange goes on `group`. Chunked expert
    compute (`baselines.moe_overlap`) posts its asynchronous all-to-alls on `overlap_group`,
    the backward lane's on `overlap_bwd_group` where it has one. The micro-batch is the
    current lane's (per thread)."""

    group: dist.ProcessGroup | None  # None when ep == 1 (no exchange)
    ep: int
    tracer: Tracer
    overlap_group: dist.ProcessGroup | None = None
    chunks: int = 1
    step: int = 0
    bwd_group: dist.ProcessGroup | None = None
    overlap_bwd_group: dist.ProcessGroup | None = None
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

    def async_group(self) -> dist.ProcessGroup:
        """The group of the calling thread's lane for asynchronous all-to-alls (class doc)."""
        if self.overlap_bwd_group is not None and getattr(self.local, "lane", "fwd") == "bwd":
            return self.overlap_bwd_group
        assert self.overlap_group is not None
        return self.overlap_group


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


def pack_pieces(
    floats: list[torch.Tensor], ints: list[torch.Tensor]
) -> tuple[torch.Tensor, list[int]]:
    """One byte buffer holding, per peer, its float piece then its int piece; (the
    buffer, the bytes per peer)."""
    parts, sizes = [], []
    for f, i in zip(floats, ints, strict=True):
        parts += [f.contiguous().view(torch.uint8), i.contiguous().view(torch.uint8)]
        sizes.append(parts[-2].numel() + parts[-1].numel())
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8), sizes


def unpack_pieces(
    got: torch.Tensor, f_counts: list[int], i_counts: list[int], dtype: torch.dtype
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """`pack_pieces` inverted on the received bytes: per peer its `f_counts` floats of
    `dtype` (views: every piece is a whole number of floats, so the offsets are aligned)
    and its `i_counts` int64s (copied out: their offsets need not be multiples of 8)."""
    fe, floats, ints, pos = torch.empty(0, dtype=dtype).element_size(), [], [], 0
    for f, i in zip(f_counts, i_counts, strict=True):
        floats.append(got[pos : pos + f * fe].view(dtype))
        ints.append(got[pos + f * fe : pos + f * fe + 8 * i].clone().view(torch.int64))
        pos += f * fe + 8 * i
    return floats, ints


class Dispatch(torch.autograd.Function):
    """One byte all-to-all of floats (differentiable) and int64s (not), laid out by
    `pack_pieces` (`splits`: floats and ints per peer, sent, then received). Returns the
    float piece received from each peer, then the int pieces concatenated. The backward
    sends the floats' gradient back in a float all-to-all."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        ints: torch.Tensor,
        splits: tuple[list[int], list[int], list[int], list[int]],
        comm: EPComm,
        layer: int,
    ) -> tuple[torch.Tensor, ...]:
        f_splits, i_splits, f_recv, i_recv = splits
        step, mb = comm.step, comm.micro_batch
        ctx.meta = (f_recv, f_splits, comm, layer, step, mb, x.new_zeros(0))
        f_pieces = x.split(f_splits)
        i_pieces = ints.split(i_splits)
        send, in_bytes = pack_pieces(list(f_pieces), list(i_pieces))
        fe = x.element_size()
        out_bytes = [f * fe + 8 * i for f, i in zip(f_recv, i_recv, strict=True)]
        got = _traced_exchange(send, out_bytes, in_bytes, comm, "dispatch", layer, step, mb)
        fs, is_ = unpack_pieces(got, f_recv, i_recv, x.dtype)
        recv_i = torch.cat(is_) if is_ else ints.new_zeros(0)
        ctx.mark_non_differentiable(recv_i)
        return (*fs, recv_i)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        f_recv, f_splits, comm, layer, step, mb, empty = ctx.meta
        pieces = [
            g.reshape(-1) if g is not None else empty.new_zeros(n)
            for g, n in zip(grads[:-1], f_recv, strict=True)
        ]
        grad = torch.cat(pieces) if pieces else empty
        g = _traced_exchange(grad, f_splits, f_recv, comm, "dispatch.bwd", layer, step, mb)
        return g, None, None, None, None


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


def receiver_plan(
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
    H = u_TH.shape[-1]
    d = plan_dispatch(routing, comm, layer)
    send_f = torch.cat([torch.cat([u_TH[p.token_ids].reshape(-1), p.weights_A]) for p in d.plans])
    send_i = torch.cat([torch.cat([p.rows_A, p.experts_A]) for p in d.plans])
    splits = (
        [r * H + a for r, a in zip(d.send_rows, d.send_asg, strict=True)],
        [2 * a for a in d.send_asg],
        [r * H + a for r, a in zip(d.recv_rows, d.recv_asg, strict=True)],
        [2 * a for a in d.recv_asg],
    )
    *recv_f, recv_i = Dispatch.apply(send_f, send_i, splits, comm, layer)
    xs = [f[: r * H].view(r, H) for f, r in zip(recv_f, d.recv_rows, strict=True)]
    ws = [f[r * H :] for f, r in zip(recv_f, d.recv_rows, strict=True)]
    plan = receiver_plan(d.recv_rows, d.recv_asg, recv_i, ws)
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
    return sum_rows(back.view(-1, H), token_ids, u_TH)
