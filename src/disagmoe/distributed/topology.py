"""Process groups of a disaggregated run, built once and passed explicitly.

A fixed set, whatever m and n are (docs/design.md §2.3, §4):

* per channel ("fwd": activations, "bwd": gradients) and direction of travel (to a
  higher or to a lower rank), one group for message headers and one for payloads, each
  holding every rank. Point-to-point messages between two ranks on one group are FIFO
  (per sender, receiver and tag), and two groups never queue behind each other (with
  gloo each group has its own connection per pair of ranks; with NCCL each its own
  communicator). So every (sender, receiver, channel) stream is FIFO on its own; forward
  and backward traffic between the same two workers never wait for each other; a small
  header never waits behind a large payload; and a gloo send's "ready to receive" notice,
  which travels against its data, never queues behind the other direction's payloads;
* per attention group, the group of its m data-parallel replicas (gradient
  all-reduce);
* the world group (loss/metrics reduction, global gradient norm).

Headers are host tensors: their groups are always gloo (`device.HOST_BACKEND`).
Payload and replica groups use `payload_backend` (`device.payload_backend`: gloo on
the CPU, NCCL on CUDA), since what they carry lives on the run's device.

So `8 + p` groups in all (the world excluded), and a rank belongs to at most 9 of them.
Every rank must call `Topology.build` in the same order: group creation is collective.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..device import HOST, HOST_BACKEND
from .layout import Layout, Role

CHANNELS = ("fwd", "bwd")
DIRECTIONS = ("up", "down")  # to a higher rank, to a lower rank
# `dist.new_group(ranks, backend=...)`, or a fake in tests
GroupFactory = Callable[..., Any]


@dataclass(frozen=True)
class Channel:
    """The two process groups every stream of one channel shares."""

    header: dist.ProcessGroup
    payload: dist.ProcessGroup


@dataclass
class Topology:
    layout: Layout
    rank: int
    role: Role
    channels: dict[tuple[str, str], Channel]  # (channel, direction) -> its groups
    replica_group: dist.ProcessGroup | None  # this A rank's replicas (None for F ranks)
    process_groups: int  # groups this run created (the world group excluded)
    device: torch.device = HOST  # where this rank's tensors, and its payloads, live

    @classmethod
    def build(
        cls,
        layout: Layout,
        rank: int | None = None,
        new_group: GroupFactory | None = None,
        *,
        device: torch.device = HOST,
        payload_backend: str = HOST_BACKEND,
    ) -> Topology:
        """Create the run's groups (collective: every rank calls it, in the same order):
        header groups on gloo, payload and replica groups on `payload_backend`."""
        rank = dist.get_rank() if rank is None else rank
        make = dist.new_group if new_group is None else new_group
        everyone = list(range(layout.world_size))
        created = 0
        channels = {}
        for channel in CHANNELS:
            for direction in DIRECTIONS:
                channels[(channel, direction)] = Channel(
                    make(everyone, backend=HOST_BACKEND), make(everyone, backend=payload_backend)
                )
                created += 2
        replica_group = None
        role = layout.role(rank)
        for g in range(layout.groups):
            group = make(layout.attn_replicas(g), backend=payload_backend)
            created += 1
            if role.comp == "A" and role.group == g:
                replica_group = group
        return cls(layout, rank, role, channels, replica_group, created, device)

    def stream(self, src: int, dst: int, channel: str) -> Channel:
        """The groups carrying the (src, dst, channel) stream (shared with the channel's
        other streams in the same direction; FIFO per pair of ranks)."""
        return self.channels[(channel, "up" if src < dst else "down")]


def world_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over every worker (in place; returns it)."""
    dist.all_reduce(t)
    return t


def allreduce_grads(params: Sequence[torch.nn.Parameter], group: dist.ProcessGroup) -> int:
    """Sum the gradients of `params` over `group` in one flat all-reduce, in place.

    Every member passes its copies of the same parameters in the same order, each with
    a gradient (`training.objective.fill_missing_grads`). Returns the bytes reduced.
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
