"""An attention rank's gradient all-reduce overlapped with its backward (`schedule.sync`).

`OverlappedSync` stands in for the rank's `AttnWorker` before the executor (same
`forward` / `backward` / `weight_grads` / `kept`): after the worker's backward of (layer,
slot) — its W where the list defers weight gradients — it starts, on the lane that ran
it ("bwd", or "wgt" for a W), every bucket whose issue point that compute is: one per
layer, in the fixed order of `schedule.sync_buckets`, so every replica starts the same
buckets in the same order whatever its list and timing. The buckets are
`training.grad_buckets`' (the mechanism the EP baselines share): an asynchronous
`all_reduce` over the group's m replicas of a flat copy of the bucket's gradients. SYNC
(`finish`) waits for them in that order, copies the sums back and traces each bucket on
the "sync" lane as "allreduce l<layer>" with its bytes and peers; the SYNC event itself
keeps the wait and whatever SYNC reduced on its own (`uncovered`).

A forward-only list (evaluation) runs on an executor of its own with the plain worker:
nothing is issued.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from ..schedule.ir import Msg, Op
from ..schedule.semantics import RankProgram, TaskKey
from ..schedule.sync import sync_buckets
from ..trace import BUCKET_EVENT, Tracer
from ..training.grad_buckets import BucketedAllReduce, GradBucket
from .stages import AttnWorker, Payload


class OverlappedSync:
    """The A worker for the executor, issuing its buckets' all-reduces (module doc)."""

    def __init__(
        self,
        worker: AttnWorker,
        program: RankProgram,
        group: dist.ProcessGroup,
        peers: list[int],
        tracer: Tracer,
    ) -> None:
        self.worker = worker
        buckets = sync_buckets(program)
        assert sorted(b.layer for b in buckets) == worker.layers, (
            f"rank {program.rank}: BWD layers {[b.layer for b in buckets]}, "
            f"worker layers {worker.layers}"
        )
        position = {b.layer: k for k, b in enumerate(buckets)}
        home: dict[int, int] = {}  # id(param) -> its bucket: the later issued of its layers'
        for b in buckets:
            for param in worker.layer_parameters(b.layer):
                home[id(param)] = max(home.get(id(param), -1), position[b.layer])
        grad_buckets = [
            GradBucket(f"{BUCKET_EVENT} l{b.layer}", args={"layer": b.layer}) for b in buckets
        ]
        for _, param in worker.named_parameters():  # the model's order, the same on every replica
            if id(param) in home:
                grad_buckets[home[id(param)]].params.append(param)
        self.layers = [b.layer for b in buckets]
        self.all_reduce = BucketedAllReduce(grad_buckets, group, peers, tracer)
        self.issue_at: dict[TaskKey, list[int]] = {}
        for k, b in enumerate(buckets):
            self.issue_at.setdefault(b.after, []).append(k)
        self.issued: list[int] = []  # layers of the buckets issued this step, in order
        self.issued_last: list[int] = []  # ... and of the last step that reached SYNC
        self.covered = {id(p) for b in grad_buckets for p in b.params}

    # -- StageWorker -------------------------------------------------------------------

    def forward(
        self,
        layer: int,
        slot: int,
        received: dict[Msg, Payload],
        outgoing: list[Msg],
        *,
        keep: bool = True,
        chunk: int = -1,
    ) -> dict[Msg, Payload]:
        return self.worker.forward(layer, slot, received, outgoing, keep=keep, chunk=chunk)

    def kept(self, layer: int, slot: int, *, chunk: int = -1) -> Payload:
        return self.worker.kept(layer, slot, chunk=chunk)

    def backward(
        self,
        layer: int,
        slot: int,
        received: dict[Msg, Payload],
        outgoing: list[Msg],
        *,
        chunk: int = -1,
        defer: bool = False,
    ) -> dict[Msg, Payload]:
        out = self.worker.backward(layer, slot, received, outgoing, chunk=chunk, defer=defer)
        for k in self.issue_at.get((Op.BWD.value, "A", layer, slot, chunk), ()):
            self._issue(k)
        return out

    def kept_for_weights(self, layer: int, slot: int, *, chunk: int = -1) -> Payload:
        return self.worker.kept_for_weights(layer, slot, chunk=chunk)

    def weight_grads(self, layer: int, slot: int, *, chunk: int = -1) -> None:
        self.worker.weight_grads(layer, slot, chunk=chunk)
        for k in self.issue_at.get((Op.WGT.value, "A", layer, slot, chunk), ()):
            self._issue(k)

    # -- the all-reduces ---------------------------------------------------------------

    def _issue(self, k: int) -> None:
        self.all_reduce.start_through(k)
        self.issued.append(self.layers[k])

    @property
    def buckets(self) -> list[tuple[int, list[nn.Parameter]]]:
        """(layer, its parameters) of every bucket, in issue order."""
        return [
            (layer, b.params) for layer, b in zip(self.layers, self.all_reduce.buckets, strict=True)
        ]

    def uncovered(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        """The parameters of `params` that no bucket holds (SYNC reduces them itself)."""
        return [p for p in params if id(p) not in self.covered]

    def finish(self, step: int) -> None:
        """SYNC: wait for the buckets issued this step, in issue order; their sums into the
        gradients; one trace event per bucket."""
        assert len(self.issued) == len(self.layers), (
            f"SYNC with {len(self.issued)} of {len(self.layers)} gradient buckets issued"
        )
        self.all_reduce.finish(step)
        self.issued_last = list(self.issued)
        self.issued.clear()
