"""Single-process reference trainer: the ground truth every distributed runtime must match."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import RunConfig
from ..data import inputs_targets, split_micro_batches
from ..device import bind_device, resolve_device
from ..trace import Tracer
from .evaluate import EvalSet
from .objective import (
    LossScale,
    StepResult,
    build_optimizer,
    fill_missing_grads,
    finish_step,
    loss_total,
)
from .precision import Precision
from .setup import apply_variants, build_data, build_initial_model, set_threads


class ReferenceTrainer:
    """Runs each micro-batch forward/backward on one process, accumulates, steps AdamW."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.device = resolve_device(cfg.parallel.device)
        bind_device(self.device)
        self.model = build_initial_model(cfg, self.device)
        self.precision = Precision.for_run(cfg.train, self.device)
        apply_variants(cfg, [self.model])
        self.batches = build_data(cfg)
        self.scale = LossScale.for_run(cfg.model, cfg.train)
        self.named_params = list(self.model.named_parameters())
        self.optimizer = build_optimizer(self.named_params, cfg.train)
        self.tracer = Tracer(0, "reference")
        self.eval_set = EvalSet.build(cfg, feeds_data=True)

    def expert_shard(self) -> tuple[int, int] | None:
        return None  # every expert, whole

    def local_modules(self) -> list[nn.Module]:
        return [self.model]

    def process_groups(self) -> int:
        return 0

    def placement(self) -> dict[str, Any]:
        return {"roles": ["reference"]}

    def schedule_facts(self) -> dict[str, Any]:
        return {}

    def busy_seconds(self, step: int) -> float:
        return self.tracer.busy_us(step=step) / 1e6

    def step(self, step: int, *, capture_grads: bool = False) -> StepResult:
        train = self.cfg.train
        self.optimizer.zero_grad(set_to_none=True)
        ce_total, aux_total = loss_total(self.device), loss_total(self.device)
        batch = self.batches.global_batch(step)
        for mb, samples in enumerate(split_micro_batches(batch, train.micro_batch_size)):
            t0 = Tracer.now_us()
            inputs, targets = inputs_targets(samples, self.device)
            with self.precision.autocast():
                logits, aux = self.model(inputs)
            ce = self.scale.ce(logits, targets)
            aux_term = self.scale.aux(aux)
            total = ce if aux_term is None else ce + aux_term
            t1 = Tracer.now_us()
            total.backward()
            t2 = Tracer.now_us()
            self.tracer.add(f"F mb{mb}", "fwd", t0, t1, micro_batch=mb, step=step)
            self.tracer.add(f"B mb{mb}", "bwd", t1, t2, micro_batch=mb, step=step)
            ce_total += ce.detach().double()
            if aux_term is not None:
                aux_total += aux_term.detach().double()
        fill_missing_grads(p for _, p in self.named_params)
        return finish_step(
            step=step,
            train=train,
            named_params=self.named_params,
            counted=[True] * len(self.named_params),
            optimizer=self.optimizer,
            ce=ce_total,
            aux=aux_total,
            capture_grads=capture_grads,
        )

    def eval_ce(self, index: int, step: int) -> float:
        """Forward only, under `torch.no_grad()`: eval batch `index`'s mean cross-entropy."""
        assert self.eval_set is not None
        ce = loss_total(self.device)
        with torch.no_grad():
            for samples in split_micro_batches(
                self.eval_set.batch(index), self.cfg.train.micro_batch_size
            ):
                inputs, targets = inputs_targets(samples, self.device)
                with self.precision.autocast():
                    logits, _ = self.model(inputs)
                ce += self.scale.ce(logits, targets).double()
        return float(ce)


def run_reference(cfg: RunConfig, run_dir: Path) -> list[dict[str, Any]]:
    """Train `cfg.train.steps` steps on this process, writing the run outputs into `run_dir`."""
    from .loop import run_training

    set_threads(cfg, 1)
    return run_training(ReferenceTrainer(cfg), cfg, run_dir)
