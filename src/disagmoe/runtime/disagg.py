"""The disaggregated AF-Pipe trainer (one instance per rank, inside a process group).

Per optimizer step:
1. A ranks of group 0 load their micro-batches: slot s of replica r is
   micro-batch `s*m + r` of the global batch (the reference's numbering);
2. the executor runs the rank's AF-Pipe instruction list, ending with SYNC and
   STEP, which it runs through this trainer's hooks (`sync`, `optimizer_step`);
3. SYNC: gradients of the A components are summed over the group's m
   replicas (one flat all-reduce); expert gradients are already complete on
   their shard, which saw the tokens of every replica;
4. STEP: global gradient norm (replicated parameters counted once), clipping,
   AdamW on this rank's own parameters;
5. losses and busy times are reduced to rank 0, which logs them.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..config import RunConfig
from ..data import inputs_targets, split_micro_batches
from ..distributed.layout import Layout
from ..distributed.placement import node_mix, resolve_ranks_per_node
from ..distributed.topology import Topology, allreduce_grads, world_sum
from ..schedule.afpipe import build_afpipe, build_afpipe_rank
from ..schedule.ir import Instr, Schedule, lists_text
from ..schedule.semantics import RankProgram
from ..schedule.validate import validate
from .executor import Executor
from .objective import (
    LossScale,
    StepResult,
    build_optimizer,
    fill_missing_grads,
    finish_step,
)
from .observe import Tracer
from .setup import apply_emulation, build_data, set_threads
from .stages import AttnWorker, ExpertWorker, build_worker


def num_slots(cfg: RunConfig, layout: Layout) -> int:
    num_micro = cfg.train.num_micro_batches
    if num_micro % layout.attn_workers:
        raise ValueError(
            f"global_batch_size/micro_batch_size = {num_micro} micro-batches must be divisible "
            f"by parallel.attn_workers ({layout.attn_workers})"
        )
    return num_micro // layout.attn_workers


def run_layout(cfg: RunConfig, world_size: int | None = None) -> Layout:
    """The layout of a run, with its ranks per node resolved (`parallel.ranks_per_node`,
    else torchrun's LOCAL_WORLD_SIZE of this process, else one node)."""
    layout = Layout.build(cfg.model, cfg.parallel, world_size)
    ranks = resolve_ranks_per_node(
        cfg.parallel.ranks_per_node, layout.world_size, os.environ.get("LOCAL_WORLD_SIZE")
    )
    return dataclasses.replace(layout, ranks_per_node=ranks)


def run_schedule(cfg: RunConfig, layout: Layout) -> Schedule:
    """The AF-Pipe instruction lists a run of `cfg` on `layout` executes."""
    return build_afpipe(
        layout, num_slots(cfg, layout), cfg.schedule.max_in_flight, cfg.schedule.order
    )


# Up to this many ranks every rank also builds and validates the whole world's schedule
# (milliseconds there; run dirs then list every rank's instructions); above, each rank
# builds only its own list and whole-world validation is an offline check
# (`disagmoe schedule --validate`, the tests).
WHOLE_WORLD_RANKS = 64


def run_schedule_of_rank(cfg: RunConfig, layout: Layout, rank: int) -> tuple[Instr, ...]:
    """`rank`'s list of `run_schedule(cfg, layout)`, built without the other ranks'."""
    return build_afpipe_rank(
        layout, rank, num_slots(cfg, layout), cfg.schedule.max_in_flight, cfg.schedule.order
    )


class DisaggTrainer:
    whole_world_ranks = WHOLE_WORLD_RANKS

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.rank = dist.get_rank()
        self.layout = run_layout(cfg, dist.get_world_size())
        if self.layout.world_size <= self.whole_world_ranks:
            self.schedule: Schedule | None = run_schedule(cfg, self.layout)
            validate(self.schedule)
            self.instrs = self.schedule.ranks[self.rank]
        else:  # only this rank's list: time and memory follow its own instructions
            self.schedule = None
            self.instrs = run_schedule_of_rank(cfg, self.layout, self.rank)
        cap = cfg.schedule.max_in_flight or num_slots(cfg, self.layout)
        program = RankProgram.compile(self.rank, self.instrs, cap)
        self.topo = Topology.build(self.layout)
        self.role = self.layout.role(self.rank)
        self.scale = LossScale.for_run(cfg.model, cfg.train)
        self.worker = build_worker(cfg, self.layout, self.rank, self.scale)
        apply_emulation(cfg, [self.worker.modules])
        self.named_params = self.worker.named_parameters()
        self.params = [p for _, p in self.named_params]
        # Replicated (A) parameters count toward the global norm on replica 0 only.
        counted = self.role.comp == "F" or self.role.index == 0
        self.counted = [counted] * len(self.params)
        self.optimizer = build_optimizer(self.named_params, cfg.train)
        self.has_data = self.role.comp == "A" and self.role.group == 0
        self.batches = build_data(cfg) if self.has_data else None
        self.tracer = Tracer(self.rank, str(self.role))
        self._capture_grads = False
        self._result: StepResult | None = None  # set by STEP
        self.executor = Executor(
            program,
            str(self.role),
            self.topo,
            self.worker,
            self,
            self.tracer,
            timeout_s=cfg.train.comm_timeout_s,
            drop_message=cfg.train.drop_message,
        )

    def _load_micro_batches(self, step: int) -> None:
        if self.batches is None:
            return
        assert isinstance(self.worker, AttnWorker)
        m = self.layout.attn_workers
        mbs = split_micro_batches(self.batches.global_batch(step), self.cfg.train.micro_batch_size)
        self.worker.micro_batches = {
            s: inputs_targets(mbs[s * m + self.role.index]) for s in range(len(mbs) // m)
        }

    def sync(self, step: int) -> int:
        """SYNC: sum the A components' gradients over the group's m replicas."""
        fill_missing_grads(self.params)
        group = self.topo.replica_group
        if group is None or self.layout.attn_workers == 1 or not self.params:
            return 0
        return allreduce_grads(self.params, group)

    def optimizer_step(self, step: int) -> None:
        """STEP: global gradient norm, clipping, AdamW, loss reduction."""
        attn = self.worker if isinstance(self.worker, AttnWorker) else None
        self._result = finish_step(
            step=step,
            train=self.cfg.train,
            named_params=self.named_params,
            counted=self.counted,
            optimizer=self.optimizer,
            ce=attn.ce_sum if attn else 0.0,
            aux=attn.aux_sum if attn else 0.0,
            capture_grads=self._capture_grads,
            reduce_sum=world_sum,
        )

    def step(self, step: int, *, capture_grads: bool = False) -> StepResult:
        self.optimizer.zero_grad(set_to_none=True)
        self._load_micro_batches(step)
        if isinstance(self.worker, AttnWorker):
            self.worker.ce_sum = self.worker.aux_sum = 0.0
        self._capture_grads = capture_grads
        self._result = None
        self.executor.run_step(step)
        assert self._result is not None, "the schedule has no STEP instruction"
        return self._result

    def expert_shard(self) -> tuple[int, int] | None:
        """Global expert ids [lo, hi) held by this rank (None on attention ranks)."""
        if not isinstance(self.worker, ExpertWorker):
            return None
        lo = self.worker.expert_offset
        return lo, lo + self.layout.experts_per_worker

    def process_groups(self) -> int:
        return self.topo.process_groups

    def placement(self) -> dict[str, Any]:
        lay = self.layout
        roles = [lay.role(r) for r in range(lay.world_size)]
        return {
            "placement": lay.placement,
            "ranks_per_node": lay.ranks_per_node,
            "roles": [str(r) for r in roles],
            "nodes": [
                {"A": a, "F": f} for a, f in node_mix([r.comp for r in roles], lay.ranks_per_node)
            ],
        }

    def busy_seconds(self, step: int) -> float:
        return self.tracer.busy_us(step=step) / 1e6


def run_disagg(cfg: RunConfig, run_dir: Path) -> list[dict[str, Any]]:
    """Train on this rank; rank 0 writes the run outputs. Call inside a process group."""
    from .loop import run_training

    set_threads(cfg, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    trainer = DisaggTrainer(cfg)

    def schedule_dump(path: Path) -> None:
        if trainer.schedule is not None:
            text = trainer.schedule.to_text()
        else:
            header = (
                f"# schedule afpipe: rank 0 of {trainer.layout.world_size} (each rank built only "
                "its own list; `disagmoe schedule --rank R` prints any rank's)"
            )
            text = lists_text(header, [(0, str(trainer.role), trainer.instrs)])
        (path / "schedule.txt").write_text(text)

    return run_training(trainer, cfg, run_dir, extra_files=schedule_dump)
