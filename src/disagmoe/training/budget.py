"""A rank's memory budget, the memory model's prediction for a run, and the in-flight cap.

The cap is a function of the config alone (`in_flight_cap`), so that every rank of a run
computes the same one: the budget `train.memory_gib` is resolved once, by the process
that launches the ranks (`resolve_memory_budget`), and travels in the config.

* Budget (`default_memory_gib`): `train.memory_gib` when > 0; else on GPU (the run's device
  an accelerator, or backend nccl) the cluster preset's `gpu_mem_gib`; on CPU the host's available memory divided by the
  ranks on this host.
* Prediction (`predict_memory`): per role, states (weight, gradient, AdamW moments in
  the run's dtype) and the activations of K in-flight micro-batches of the worst replica
  (A) and the worst shard (F, ceil(E/n) experts, balanced routing), from
  `costs.runtime_memory` with the run's dtype, seq_len, micro-batch, recompute and split.
* Cap (`in_flight_cap`): `schedule.max_in_flight` when > 0 (refused, a one-line
  ValueError, where that many slots do not fit); -1: no cap (every slot, unchecked);
  0 (default): the largest K <= slots whose prediction fits the budget on both roles.
  If even K = 1 does not fit, a ValueError names the binding term (exit 2 in the CLI).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable

from ..config import RunConfig, TrainConfig
from ..costs import costmodel as cm
from ..costs import runtime_memory as rm
from ..device import is_accelerator, resolve_device
from ..distributed.layout import Layout, num_slots
from .precision import param_dtype_name

NO_CAP = -1  # schedule.max_in_flight: every slot in flight


def host_available_bytes() -> int:
    """MemAvailable of this host (/proc/meminfo), else free physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def default_memory_gib(cfg: RunConfig, local_ranks: int) -> float:
    """The budget per rank (GiB) `train.memory_gib = 0` stands for (module doc)."""
    if cfg.train.memory_gib > 0:
        return cfg.train.memory_gib
    if cfg.parallel.backend == "nccl" or is_accelerator(resolve_device(cfg.parallel.device)):
        return cfg.cluster.gpu_mem_gib
    return host_available_bytes() / max(local_ranks, 1) / cm.GIB


def resolve_memory_budget(cfg: RunConfig, local_ranks: int) -> RunConfig:
    """`cfg` with `train.memory_gib` set (once, in the launching process; see module doc)."""
    gib = default_memory_gib(cfg, local_ranks)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, memory_gib=gib))


def world_memory_budget(cfg: RunConfig) -> RunConfig:
    """`cfg` with the budget every rank of the process group uses: `train.memory_gib` if
    given, else rank 0's `resolve_memory_budget` (its local world's share), broadcast."""
    import torch.distributed as dist

    if cfg.train.memory_gib > 0:
        return cfg
    local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    budget = [resolve_memory_budget(cfg, local).train.memory_gib]
    dist.broadcast_object_list(budget, src=0)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, memory_gib=budget[0]))


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RunMemory:
    """Predicted bytes per rank of each role for `in_flight` micro-batch slots."""

    in_flight: int
    attn: cm.MemoryBreakdown
    ffn: cm.MemoryBreakdown

    def to_dict(self) -> dict[str, dict[str, float]]:
        return {
            role: {
                "states": m.states,
                "activations": m.activations,
                "transient": m.transient,
                "deferred": m.deferred,
                "total": m.total,
            }
            for role, m in (("A", self.attn), ("F", self.ffn))
        }


def run_precision(train: TrainConfig) -> cm.Precision:
    """Bytes per activation (the compute dtype) and per parameter's states (weight, gradient,
    AdamW's two moments in the parameters' dtype) of a run."""
    prec = cm.runtime_precision(train.dtype)
    if param_dtype_name(train) != train.dtype:  # mixed: activations in compute, states in fp32
        states = cm.runtime_precision(param_dtype_name(train)).state
        prec = dataclasses.replace(prec, state=states)
    return prec


# what a GPU run trains in by default (bf16 compute, fp32 weights, gradients and AdamW
# states): `simulate` and the planner price a rank's memory in it
GPU_PRECISION = run_precision(TrainConfig(dtype="bfloat16"))


def predict_memory(cfg: RunConfig, in_flight: int) -> RunMemory:
    """The memory model for this run's model, dtype, seq_len, micro-batch, recompute, split
    and loss head chunks."""
    train, par = cfg.train, cfg.parallel
    prec = run_precision(train)
    # deferred weight gradients: counted wherever the run may split (auto may not)
    split = cfg.schedule.split_backward != "off" and not cfg.split_backward_blocker()
    attn = rm.attn_replica_memory(
        cfg.model, groups=par.groups, shards=par.expert_workers, seq_len=train.seq_len,
        micro_batch_size=train.micro_batch_size, in_flight=in_flight,
        recompute=train.recompute, prec=prec, split_backward=split,
        loss_chunk_tokens=train.loss_chunk_tokens, recompute_layers=train.recompute_layers,
    )  # fmt: skip
    ffn = rm.ffn_shard_memory(
        cfg.model, groups=par.groups, replicas=par.attn_workers, shards=par.expert_workers,
        seq_len=train.seq_len, micro_batch_size=train.micro_batch_size, in_flight=in_flight,
        recompute=train.recompute, prec=prec, split_backward=split,
        recompute_layers=train.recompute_layers,
    )  # fmt: skip
    return RunMemory(in_flight=in_flight, attn=attn, ffn=ffn)


def _gib(nbytes: float) -> str:
    if nbytes < cm.GIB:
        return f"{nbytes / 1024**2:.3g} MiB"
    return f"{nbytes / cm.GIB:.3g} GiB"


def in_flight_cap(cfg: RunConfig, slots: int) -> int:
    """Micro-batch slots a rank may hold (module doc); the same on every rank.

    `train.memory_gib` must be resolved (> 0): see `resolve_memory_budget`.
    """
    assert cfg.train.memory_gib > 0, "resolve train.memory_gib before computing the cap"
    budget = cfg.train.memory_gib * cm.GIB
    one = predict_memory(cfg, 1)
    _check_fits(one, budget, cfg.train.memory_gib, cfg.train.recompute_layers)
    given = cfg.schedule.max_in_flight
    if given == NO_CAP:
        return slots
    fits = max(1, most_in_flight((one.attn, one.ffn), budget, slots))
    if given == 0:
        return fits
    if min(given, slots) > fits:  # a cap given that does not fit
        _refuse_cap(cfg, min(given, slots), fits)
    return min(given, slots)


def most_in_flight(one: Iterable[cm.MemoryBreakdown], budget: float, limit: int) -> int:
    """The largest K <= `limit` with states + transient + deferred + K * activations <=
    `budget` on every role, from each role's memory with one slot in flight; < 1 when not
    even one slot fits."""
    caps = [limit]
    for role in one:
        if role.activations > 0:
            free = budget - role.states - role.transient - role.deferred
            caps.append(int(free // role.activations))
    return min(caps)


def _refuse_cap(cfg: RunConfig, given: int, fits: int) -> None:
    mem = predict_memory(cfg, given)
    role, worst = max(
        (("attention replica", mem.attn), ("expert shard", mem.ffn)), key=lambda r: r[1].total
    )
    train = cfg.train
    recompute = (
        ", --recompute-layers 0 (every layer)" if train.recompute_layers
        else "" if train.recompute == "full" else ", --recompute full"
    )  # fmt: skip
    raise ValueError(
        f"schedule.max_in_flight={cfg.schedule.max_in_flight}: {given} micro-batch(es) in "
        f"flight need {_gib(worst.total)} on an {role} (states {_gib(worst.states)} + "
        f"activations {_gib(worst.activations)}), over train.memory_gib={train.memory_gib:g}; "
        f"use --max-in-flight {fits} (0: the most that fits){recompute}, or a larger "
        f"--memory-gib (-1 runs every slot unchecked)"
    )


def _check_fits(one: RunMemory, budget: float, gib: float, recompute_layers: int = 0) -> None:
    recompute = "--recompute-layers 0 (every layer)" if recompute_layers else "--recompute full"
    fixes = {
        "A": f"more --groups, {recompute}, a smaller --micro-batch-size or a larger budget",
        "F": f"more --expert-workers, {recompute} or a larger budget",
    }
    worst = max((("A", one.attn), ("F", one.ffn)), key=lambda kv: kv[1].total - budget)
    role, mem = worst
    if mem.total <= budget:
        return
    what = "attention replica states" if role == "A" else "expert shard states"
    logits = f" + logits {_gib(mem.transient)}" if mem.transient else ""
    deferred = f" + deferred gradients {_gib(mem.deferred)}" if mem.deferred else ""
    fix = fixes[role] + (", schedule.split_backward = off" if mem.deferred else "")
    raise ValueError(
        f"{what} {_gib(mem.states)} + activations of one micro-batch {_gib(mem.activations)}"
        f"{logits}{deferred} exceed train.memory_gib={gib:g}; use {fix}"
    )


def run_cap(cfg: RunConfig, layout: Layout) -> int:
    """The in-flight cap of a run of `cfg` (`in_flight_cap`). Every entry
    point resolves the budget first (`train.resolve_memory`, `DisaggTrainer`); a config
    whose budget is still 0 (a schedule built by a test or a benchmark) runs uncapped."""
    slots = num_slots(cfg, layout)
    if cfg.train.memory_gib <= 0:
        return cfg.schedule.max_in_flight if cfg.schedule.max_in_flight > 0 else slots
    return in_flight_cap(cfg, slots)
