"""Gradient buckets all-reduced while the backward runs: the one mechanism every runtime's
overlapped gradient sync uses (`parallel.overlap_grad_sync`).

A runtime decides what a bucket holds and when it is final: AF-Pipe's attention replicas
at the issue points of `schedule.sync_buckets` (`runtime.grad_sync`), the EP baselines
when autograd's backward leaves a layer (`baselines.grad_buckets`). What they share is
here (`BucketedAllReduce`):

* **Start** (`start_through`): buckets start strictly in their list order, each an
  asynchronous `all_reduce` of a flat copy of its parameters' gradients (a parameter
  without one joins as zeros, as `training.objective.fill_missing_grads` would make it).
  Collectives on one process group must be issued in the same order by every member: the
  list is the same on every member, so the order is.
* **Finish** (`finish`, before the optimizer step): what has not started starts, each
  bucket is waited for in order, its sums are copied back into the gradients, and it is
  traced on the "sync" lane from its start to its completion with its bytes and peers
  (what `bench.bound.trace_bound` counts as the rank's all-reduce traffic).

Sums are elementwise over the same members as one flat all-reduce, so a float64 run
still equals the single-process reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..trace import Tracer


@dataclass
class GradBucket:
    """Parameters all-reduced together; `name` and `args` go into its trace event."""

    name: str
    params: list[nn.Parameter] = field(default_factory=list)
    args: dict[str, Any] = field(default_factory=dict)
    work: Any = None  # the all-reduce in flight
    flat: torch.Tensor | None = None
    grads: list[torch.Tensor] = field(default_factory=list)
    start_us: float = 0.0
    end_us: list[float] = field(default_factory=list)  # set by the completion callback


class BucketedAllReduce:
    """`buckets` all-reduced over `group` (whose ranks are `peers`) in list order."""

    def __init__(
        self, buckets: list[GradBucket], group: dist.ProcessGroup, peers: list[int], tracer: Tracer
    ) -> None:
        self.buckets, self.group, self.peers, self.tracer = buckets, group, peers, tracer
        self.started = 0  # buckets started this step: a prefix of `buckets`

    def start_through(self, k: int) -> None:
        """Start, in order, every bucket up to and including bucket `k`."""
        while self.started <= k:
            self._start(self.buckets[self.started])
            self.started += 1

    def _start(self, bucket: GradBucket) -> None:
        if not bucket.params:
            return
        grads = []
        for p in bucket.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        bucket.grads, bucket.flat = grads, torch.cat([g.reshape(-1) for g in grads])
        bucket.start_us, bucket.end_us = Tracer.now_us(), []
        bucket.work = dist.all_reduce(bucket.flat, group=self.group, async_op=True)
        done = bucket.end_us
        bucket.work.get_future().then(lambda _: done.append(Tracer.now_us()))

    def finish(self, step: int) -> None:
        """Start what has not started, then wait for every bucket in order: its sums into
        the gradients, one trace event per bucket."""
        self.start_through(len(self.buckets) - 1)
        for b in self.buckets:
            if b.work is None:
                continue
            b.work.wait()
            assert b.flat is not None
            pos = 0
            for g in b.grads:
                g.copy_(b.flat[pos : pos + g.numel()].view_as(g))
                pos += g.numel()
            self.tracer.add(
                b.name,
                "sync",
                b.start_us,
                b.end_us[0] if b.end_us else Tracer.now_us(),
                step=step,
                **b.args,
                bytes=b.flat.numel() * b.flat.element_size(),
                peers=self.peers,
            )
            b.work, b.flat, b.grads = None, None, []
        self.started = 0
