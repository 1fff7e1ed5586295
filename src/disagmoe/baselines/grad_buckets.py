"""Gradients of an `ep-*` rank all-reduced in buckets during its last backward.

DDP-style overlap for the expert-parallel baselines (`parallel.overlap_grad_sync`, as
AF-Pipe's attention replicas do it in `runtime.grad_sync`): the dense parameters
(attention, router, shared / dense MLPs, embedding, final norm, LM head) of each stage
are cut into buckets in the order the backward finishes them — the final norm and LM head,
then layer by layer from the last, then the embedding — and each bucket's all-reduce over
the data-parallel group starts, asynchronously, as soon as the stage's last backward of
the step (its `n`-th, for `n` local micro-batches) has left the bucket's layer:

* a `_Mark` (identity forward) on the input of each layer and of the final norm; its
  backward runs once the gradient of that input is complete, that is once every operation
  of the layer behind it has run backward (the layer's weight-gradient accumulations
  included: autograd runs a leaf's accumulation as soon as its gradient is ready);
* a stage whose last backward is split (I then W: DualPipeV's zero-bubble tail) gets its
  weight gradients in its W, so its buckets start when that W ends; so do any buckets a
  mark did not start (the stage end starts every bucket of the stage still waiting).

A parameter shared by two buckets (tied embedding and LM head) belongs to the later one.
Every replica starts the same buckets in the same order (a strict order: a bucket starts
only after every one before it), since all replicas run the same action list; starting,
waiting and tracing are `training.grad_buckets`', the mechanism AF-Pipe's attention
replicas use too (`runtime.grad_sync`). `finish`
(before the optimizer step) waits for them in that order, copies the sums back and traces
each bucket on the "sync" lane ("allreduce s<stage> l<layer>"): its bytes and peers count
in the bench's bound. A MoE layer's expert shard has its own bucket of the same position
("allreduce s<stage> l<layer> experts"), all-reduced over the expert-data-parallel group
(the ranks holding the same shard in other EP groups) where there is one: the layer's
mark is reached once every operation of the layer has run backward, its experts' weight
gradients included, so the shard's gradients are final too, whichever micro-batches routed
to it. The two groups' buckets run side by side, each group's in its own order.

A forward-only pass (evaluation) and every backward but a stage's last start nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..trace import BUCKET_EVENT, Tracer
from ..training.grad_buckets import BucketedAllReduce, GradBucket

HEAD = -1  # bucket key of the final norm and LM head; the embedding's is EMBED
EMBED = -2


class _Mark(torch.autograd.Function):
    """Identity; its backward tells `buckets` that `key`'s gradients are complete."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, buckets: StageBuckets, key: int) -> torch.Tensor:  # type: ignore[override]
        ctx.buckets, ctx.key = buckets, key
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        ctx.buckets.reached(ctx.key)
        return grad, None, None


class StageBuckets:
    """The buckets of one stage, in the order its backward finishes them; marks within."""

    def __init__(self, owner: EPGradBuckets, stage: int, num_mb: int) -> None:
        self.owner, self.stage, self.num_mb = owner, stage, num_mb
        self.backwards = 0  # B / I actions of this stage this step
        self.live = False  # inside the stage's last full backward: marks start buckets

    def mark(self, x: torch.Tensor, key: int) -> torch.Tensor:
        """`x`, marked: when the backward reaches it, bucket `key` of this stage may start."""
        if not torch.is_grad_enabled() or not x.requires_grad:
            return x
        return _Mark.apply(x, self, key)  # type: ignore[no-any-return]

    def reached(self, key: int) -> None:
        if self.live:
            self.owner.start_through(self.stage, key)

    @contextmanager
    def backward(self, kind: str) -> Iterator[None]:
        """Around a backward action of this stage (B, I or W): marks are live in its last
        full backward; when its last backward's weights are done, every bucket may start."""
        last = False
        if kind in ("B", "I"):
            self.backwards += 1
            last = self.backwards == self.num_mb
            self.live = last and kind == "B"
        try:
            yield
        finally:
            self.live = False
        if (last and kind == "B") or (kind == "W" and self.backwards == self.num_mb):
            self.owner.start_through(self.stage, EMBED)


class EPGradBuckets:
    """Every stage's buckets of one rank, started in one order (module doc): the dense ones
    over `group` (`peers`), the expert shards' over `experts` (the EDP group and its ranks;
    None: the experts are reduced by the caller)."""

    def __init__(
        self,
        modules: list[Any],  # StageModule: its `stage`, `layer_ids`, named parts
        group: dist.ProcessGroup,
        peers: list[int],
        tracer: Tracer,
        num_mb: int,
        experts: tuple[dist.ProcessGroup, list[int]] | None = None,
    ) -> None:
        buckets: list[GradBucket] = []
        shards: list[GradBucket] = []  # the expert bucket at each dense bucket's position
        self.position: dict[tuple[int, int], int] = {}  # (stage, key) -> its bucket
        self.stage_end: dict[int, int] = {}  # stage -> its last bucket
        home: dict[int, int] = {}  # id(param) -> its bucket (the later one when shared)
        params: dict[int, nn.Parameter] = {}
        for module in sorted(modules, key=lambda m: -m.stage):  # later stages finish first
            keys = [HEAD] if module.is_last else []
            keys += sorted(module.layer_ids, reverse=True)
            keys += [EMBED] if module.is_first else []
            for key in keys:
                name = {HEAD: "head", EMBED: "embed"}.get(key, f"l{key}")
                buckets.append(GradBucket(f"{BUCKET_EVENT} s{module.stage} {name}"))
                shards.append(GradBucket(f"{BUCKET_EVENT} s{module.stage} {name} experts"))
                if key >= 0 and f"layers.{key}.experts" in module:
                    shards[-1].params.extend(module[f"layers.{key}.experts"].parameters())
                self.position[(module.stage, key)] = self.stage_end[module.stage] = len(buckets) - 1
                for p in self._params_of(module, key):
                    home[id(p)] = len(buckets) - 1
                    params[id(p)] = p
        for pid, k in home.items():
            buckets[k].params.append(params[pid])
        self.stages = {m.stage: StageBuckets(self, m.stage, num_mb) for m in modules}
        self.all_reduce = BucketedAllReduce(buckets, group, peers, tracer)
        self.expert_reduce = (
            BucketedAllReduce(shards, experts[0], experts[1], tracer) if experts else None
        )

    @staticmethod
    def _params_of(module: Any, key: int) -> list[nn.Parameter]:
        if key == HEAD:
            parts = ["norm", "lm_head"]
        elif key == EMBED:
            parts = ["embed"]
        else:
            parts = [f"layers.{key}.attn_block"]
        return [p for part in parts for p in module[part].parameters()]

    def start_through(self, stage: int, key: int) -> None:
        """Start, in order, every bucket up to and including (stage, key); with key EMBED,
        through the stage's last bucket (the stage's backward is done)."""
        position = self.position[(stage, key)] if key != EMBED else self.stage_end[stage]
        self.all_reduce.start_through(position)
        if self.expert_reduce is not None:
            self.expert_reduce.start_through(position)

    def reset(self) -> None:
        """At the start of a step."""
        for st in self.stages.values():
            st.backwards, st.live = 0, False

    def finish(self, step: int) -> None:
        """Before the optimizer step: start what has not started, wait for every bucket in
        order, the sums into the gradients, one trace event per bucket."""
        self.all_reduce.finish(step)
        if self.expert_reduce is not None:
            self.expert_reduce.finish(step)
