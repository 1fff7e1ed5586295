"""Shared machinery: run a distributed trainer on spawned gloo ranks and compare it
with the single-process reference trainer, step by step (losses and every gradient)."""

from __future__ import annotations

from typing import Any

import torch

from disagmoe.config import RunConfig
from disagmoe.runtime.reference import ReferenceTrainer
from disagmoe.testing.spawn import run_ranks


def trainer_steps(cfg: RunConfig, steps: int, trainer_path: str) -> dict[str, Any]:
    """Runs inside each rank: `steps` steps of the trainer class at `module:Class`."""
    import importlib

    module, name = trainer_path.split(":")
    trainer = getattr(importlib.import_module(module), name)(cfg)
    out = []
    for step in range(steps):
        result = trainer.step(step, capture_grads=True)
        out.append({"loss": result.loss, "grads": result.grads})
    shard = getattr(trainer, "expert_shard", None)
    return {"steps": out, "shard": shard() if callable(shard) else None}


def reference_steps(cfg: RunConfig, steps: int) -> list[dict[str, Any]]:
    ref = ReferenceTrainer(cfg)
    out = []
    for step in range(steps):
        result = ref.step(step, capture_grads=True)
        out.append({"loss": result.loss, "grads": result.grads})
    return out


def max_rel_errors(
    cfgs: list[RunConfig], world: int, steps: int, trainer_path: str
) -> list[tuple[float, float, int]]:
    """For each config: (max loss rel err, max grad rel err, #params compared)."""
    results = run_ranks(_run_many, world, cfgs, steps, trainer_path)
    report = []
    for k, cfg in enumerate(cfgs):
        ref = reference_steps(cfg, steps)
        loss_err = grad_err = 0.0
        names: set[str] = set()
        for step in range(steps):
            ref_loss = ref[step]["loss"]
            for rank_out in results:
                got = rank_out[k]["steps"][step]
                loss_err = max(loss_err, abs(got["loss"] - ref_loss) / abs(ref_loss))
                shard = rank_out[k]["shard"]
                for name, grad in got["grads"].items():
                    expected = ref[step]["grads"][name]
                    if shard is not None and name.endswith(("experts.gate_up", "experts.down")):
                        lo, hi = shard
                        expected = expected[lo:hi]
                    assert grad.shape == expected.shape, name
                    scale = expected.abs().max().item() or 1.0
                    grad_err = max(grad_err, (grad - expected).abs().max().item() / scale)
                    names.add(name)
        missing = set(ref[0]["grads"]) - names
        assert not missing, f"parameters without a distributed gradient: {sorted(missing)[:5]}"
        report.append((loss_err, grad_err, len(names)))
    return report


def _run_many(cfgs: list[RunConfig], steps: int, trainer_path: str) -> list[dict[str, Any]]:
    import torch.distributed as dist

    out = []
    for cfg in cfgs:
        out.append(trainer_steps(cfg, steps, trainer_path))
        dist.barrier()
    return out


def float64(cfg: RunConfig) -> RunConfig:
    import dataclasses

    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, dtype="float64"))


torch.set_default_dtype(torch.float32)
