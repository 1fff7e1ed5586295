"""Measured memory of one rank: activation bytes kept for backward, and state bytes.

`ActivationMeter` counts the bytes a rank keeps between a stage's forward and its
backward, as *unique storages* (a view and its base, or a tensor saved by three ops,
count once), refcounted so that a storage is released when its last holder goes:

* tensors autograd saves for backward while a forward compute runs — a
  `torch.autograd.graph.saved_tensors_hooks` pair whose pack returns a small holder;
  when autograd frees the saved variable (after its backward node ran) the holder
  goes and its bytes with it. Saved-tensor hooks are thread-local state, and the
  executor runs forward computes on a lane thread: the executor enters `saving()`
  around each FWD on the thread that runs it;
* what a stage's stash keeps besides (`StageWorker.kept`), until its BWD: `hold` at the
  FWD, `release` after the matching BWD. The disaggregated runtime's stages keep none of
  their messages (`runtime.stages`): a received payload that an op saves is counted by the
  hooks above, a sent one lives until its send completes (a transient, not counted).
  Tensors that travelled inline in a header are copied out of it (`distributed.exchange`),
  so each holds only its own bytes.

Parameters are not activations: saved tensors whose storage is a parameter's (a
weight saved by a linear, a view of an expert's weight) are skipped.

An activation checkpoint (`models.recompute`) saves its inputs as saved tensors, which
these hooks count; what its region saves goes to the checkpoint's own (inner) hooks and
is not kept, only recomputed. Not counted: transients of a compute (freed before it
returns) and gradients in flight. On CUDA, `torch.cuda.max_memory_allocated` reports
everything the caching allocator handed out.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..costs import costmodel as cm
from ..device import peak_memory_bytes

MEMORY_FIELDS = ("act_peak", "params", "grads", "optim", "device_peak")


class _Saved:
    """What autograd stores in place of a saved tensor while the meter counts it."""

    __slots__ = ("key", "meter", "tensor")

    def __init__(self, meter: ActivationMeter, tensor: torch.Tensor, key: int) -> None:
        self.meter = meter
        self.tensor = tensor
        self.key = key

    def __del__(self) -> None:
        self.meter._drop(self.key)


class ActivationMeter:
    """Unique storages kept for backward on this rank; current and per-step peak bytes."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self._params = {_storage_key(p) for p in params}
        self._lock = threading.Lock()
        self._refs: dict[int, list[int]] = {}  # storage key -> [holders, nbytes]
        self._held: dict[tuple[int, ...], list[tuple[torch.Tensor, int]]] = {}
        self.current = 0
        self.peak = 0

    def _add(self, t: torch.Tensor) -> int:
        """Count one holder of `t`'s storage; its key (0: not counted). Called for every
        tensor a metered forward saves: one storage lookup, no device query."""
        if t.is_meta:
            return 0
        storage = t.untyped_storage()
        key = int(storage.data_ptr())
        if key == 0 or key in self._params:
            return 0
        with self._lock:
            ref = self._refs.get(key)
            if ref is None:
                nbytes = storage.nbytes()
                self._refs[key] = [1, nbytes]
                self.current += nbytes
                self.peak = max(self.peak, self.current)
            else:
                ref[0] += 1
        return key

    def _drop(self, key: int) -> None:
        if key == 0:
            return
        with self._lock:
            ref = self._refs[key]
            ref[0] -= 1
            if ref[0] == 0:
                del self._refs[key]
                self.current -= ref[1]

    def _pack(self, t: torch.Tensor) -> Any:
        return _Saved(self, t.detach(), self._add(t))

    @staticmethod
    def _unpack(saved: Any) -> torch.Tensor:
        return saved.tensor

    @contextmanager
    def saving(self) -> Iterator[None]:
        """Count what autograd saves on *this thread* inside the block."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def hold(self, task: tuple[int, ...], payloads: Iterable[list[torch.Tensor]]) -> None:
        """A FWD of `task` (layer, slot, exchange chunk) keeps these payloads until its BWD
        (`release`)."""
        held = self._held.setdefault(task, [])
        for payload in payloads:
            held += [(t, self._add(t)) for t in payload]

    def release(self, task: tuple[int, ...]) -> None:
        for _, key in self._held.pop(task, []):
            self._drop(key)

    def start_step(self) -> None:
        """The next step's peak starts from what is held now."""
        with self._lock:
            self.peak = self.current


def _storage_key(t: torch.Tensor) -> int:
    if t.is_meta:
        return 0
    return int(t.untyped_storage().data_ptr())


def state_bytes(
    params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer
) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer-state) bytes of this rank's own parameters."""
    nbytes = sum(p.numel() * p.element_size() for p in params)
    grads = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    optim = sum(
        t.numel() * t.element_size()
        for state in optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    )
    return nbytes, grads, optim


def device_peak_bytes(params: list[torch.nn.Parameter]) -> int:
    """The accelerator allocator's peak since the last reset (0 on the CPU); resets it."""
    return peak_memory_bytes(params[0].device) if params else 0


def role_memory(
    rows: list[list[float]], pred: cm.MemoryBreakdown, act_pred: float
) -> dict[str, float]:
    """One role's entry of a step's `memory_mib`: the largest of `rows` (the
    `MEMORY_FIELDS` of the role's ranks, bytes) beside the memory model's `pred` for the
    role (`act_pred`: the activation bytes the meter's peak is compared with), MiB."""
    mib = 1024**2
    fields = {f: max(row[i] for row in rows) for i, f in enumerate(MEMORY_FIELDS)}
    rec = {
        "act_peak": fields["act_peak"] / mib,
        "act_pred": act_pred / mib,
        "states": (fields["params"] + fields["grads"] + fields["optim"]) / mib,
        "states_pred": pred.states / mib,
    }
    if fields["device_peak"]:
        rec["device_peak"] = fields["device_peak"] / mib
        rec["total_pred"] = pred.total / mib
    return {k: round(v, 4) for k, v in rec.items()}
