"""An attention rank's gradient all-reduce overlapped with its backward (`schedule.sync`).

`OverlappedSync` stands in for the rank's `AttnWorker` before the executor (same
`forward` / `backward` / `weight_grads` / `kept`): after the worker's backward of (layer,
slot) — its W where the list defers weight gradients — it issues, on the lane that ran
it ("bwd", or "wgt" for a W), every bucket whose issue point that compute is — an asynchronous
`all_reduce` over the group's m replicas of a flat copy of the bucket's gradients (a
parameter without a gradient is final with none: it joins as zeros, as
`objective.fill_missing_grads` would make it at SYNC). Every replica issues the same
buckets in the same order (the fixed order of `schedule.sync_buckets`), whatever its
list and timing. SYNC (`finish`) waits for them in that order, copies the sums back into
the gradients and traces each bucket on the "sync" lane as "allreduce l<layer>", from its
issue to its completion, with its bytes and its peers (what `bench.analysis.trace_bound`
counts as the rank's all-reduce traffic); the SYNC event itself keeps the wait and
whatever SYNC reduced on its own.

Sums are elementwise over the same m replicas as the one flat all-reduce, so a float64
run still equals the single-process reference. A forward-only list (evaluation) runs on an
executor of its own with the plain worker: nothing is issued.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..schedule.ir import Msg, Op
from ..schedule.semantics import RankProgram, TaskKey
from ..schedule.sync import sync_buckets
from ..trace import BUCKET_EVENT, Tracer
from .stages import AttnWorker, Payload


@dataclass
class _InFlight:
    layer: int
    grads: list[torch.Tensor]
    flat: torch.Tensor
    work: dist.Work
    start_us: float
    end_us: list[float]  # set by the work's completion callback


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
        self.group, self.peers, self.tracer = group, peers, tracer
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
        self.buckets: list[tuple[int, list[nn.Parameter]]] = [(b.layer, []) for b in buckets]
        for _, param in worker.named_parameters():  # the model's order, the same on every replica
            if id(param) in home:
                self.buckets[home[id(param)]][1].append(param)
        self.issue_at: dict[TaskKey, list[int]] = {}
        for k, b in enumerate(buckets):
            self.issue_at.setdefault(b.after, []).append(k)
        self.in_flight: list[_InFlight] = []
        self.issued: list[int] = []  # layers of the buckets issued this step, in order
        self.issued_last: list[int] = []  # ... and of the last step that reached SYNC
        self.covered = {id(p) for _, ps in self.buckets for p in ps}

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
        layer, params = self.buckets[k]
        if not params:
            self.issued.append(layer)
            return
        grads = []
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grads.append(param.grad)
        flat = torch.cat([g.reshape(-1) for g in grads])
        start = Tracer.now_us()
        work = dist.all_reduce(flat, group=self.group, async_op=True)
        assert work is not None
        done: list[float] = []
        work.get_future().then(lambda _: done.append(Tracer.now_us()))
        self.in_flight.append(_InFlight(layer, grads, flat, work, start, done))
        self.issued.append(layer)

    def uncovered(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        """The parameters of `params` that no bucket holds (SYNC reduces them itself)."""
        return [p for p in params if id(p) not in self.covered]

    def finish(self, step: int) -> None:
        """SYNC: wait for the buckets issued this step, in issue order; their sums into the
        gradients; one trace event per bucket."""
        assert len(self.issued) == len(self.buckets), (
            f"SYNC with {len(self.issued)} of {len(self.buckets)} gradient buckets issued"
        )
        for item in self.in_flight:
            item.work.wait()
            pos = 0
            for g in item.grads:
                g.copy_(item.flat[pos : pos + g.numel()].view_as(g))
                pos += g.numel()
            end = item.end_us[0] if item.end_us else Tracer.now_us()
            self.tracer.add(
                f"{BUCKET_EVENT} l{item.layer}",
                "sync",
                item.start_us,
                end,
                step=step,
                layer=item.layer,
                bytes=item.flat.numel() * item.flat.element_size(),
                peers=self.peers,
            )
        self.in_flight.clear()
        self.issued_last = list(self.issued)
        self.issued.clear()
