"""Process groups of a disaggregated run, built once and passed explicitly.

* two 2-rank groups per (sender, receiver, channel) message stream of the
  schedule — the dedicated send/receive groups of docs/design.md §2.3, so that
  forward activations and backward gradients between the same two workers
  never queue behind each other. Of each pair, one carries the fixed-size
  headers and one the payloads: each is FIFO on its own, so a receiver can
  post the headers of all its messages ahead of time, on any backend;
* per attention group, the group of its m data-parallel replicas (gradient
  all-reduce);
* the world group (loss/metrics reduction, global gradient norm).

Every rank must call `Topology.build` with the same schedule: process-group
creation is collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..schedule.ir import Op, Schedule
from .layout import Layout, Role


@dataclass(frozen=True)
class Stream:
    """The process groups of one (sender, receiver, channel) stream."""

    header: dist.ProcessGroup
    payload: dist.ProcessGroup


@dataclass
class Topology:
    layout: Layout
    rank: int
    role: Role
    streams: dict[tuple[int, int, str], Stream]  # (src, dst, channel) -> its groups
    replica_group: dist.ProcessGroup | None  # this A rank's replicas (None for F ranks)

    @classmethod
    def build(cls, layout: Layout, schedule: Schedule) -> Topology:
        rank = dist.get_rank()
        keys = sorted(
            {
                (i.msg.src, i.msg.dst, i.msg.channel)
                for instrs in schedule.ranks
                for i in instrs
                if i.op == Op.SEND and i.msg is not None
            }
        )
        streams = {}
        for src, dst, channel in keys:
            header, payload = dist.new_group([src, dst]), dist.new_group([src, dst])
            if rank in (src, dst):
                streams[(src, dst, channel)] = Stream(header, payload)
        replica_group = None
        role = layout.role(rank)
        for g in range(layout.groups):
            group = dist.new_group(layout.attn_replicas(g))
            if role.comp == "A" and role.group == g:
                replica_group = group
        return cls(layout, rank, role, streams, replica_group)

    def stream(self, src: int, dst: int, channel: str) -> Stream:
        return self.streams[(src, dst, channel)]


def world_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over every worker (in place; returns it)."""
    dist.all_reduce(t)
    return t


def allreduce_grads(params: Sequence[torch.nn.Parameter], group: dist.ProcessGroup) -> int:
    """Sum the gradients of `params` over `group` in one flat all-reduce, in place.

    Every member passes its copies of the same parameters in the same order, each with
    a gradient (`runtime.objective.fill_missing_grads`). Returns the bytes reduced.
    """
    grads: list[torch.Tensor] = []
    for p in params:
        assert p.grad is not None, "allreduce_grads: a parameter has no gradient"
        grads.append(p.grad)
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    pos = 0
    for g in grads:
        g.copy_(flat[pos : pos + g.numel()].view_as(g))
        pos += g.numel()
    return flat.numel() * flat.element_size()
