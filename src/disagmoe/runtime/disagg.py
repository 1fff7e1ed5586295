"""The disaggregated AF-Pipe trainer (one instance per rank, inside a process group).

Per optimizer step:
1. A ranks of group 0 load their micro-batches: slot s of replica r is
   micro-batch `s*m + r` of the global batch (the reference's numbering); when m
   does not divide the M micro-batches, replicas r >= M mod m run one slot fewer;
2. the executor runs the rank's AF-Pipe instruction list, ending with SYNC and
   STEP, which it runs through this trainer's hooks (`sync`, `optimizer_step`);
3. SYNC: gradients of the A components are summed over the group's m
   replicas — with `parallel.overlap_grad_sync` (the default) per layer bucket,
   each issued during the backward once it is final (`runtime.grad_sync`, SYNC waits
   for them), else in one flat all-reduce at SYNC; expert gradients are already
   complete on their shard, which saw the tokens of every replica;
4. STEP: global gradient norm (replicated parameters counted once), clipping,
   AdamW on this rank's own parameters;
5. losses and busy times are reduced to rank 0, which logs them.

Evaluation (`training.evaluate`) runs the forward-only AF-Pipe schedule of the same layout
and slots (`run_schedule(forward_only=True)`, validated like the training one) on a second
executor: eval batch k is loaded like a training batch and its loss comes back like the
step's cross-entropy, with no gradient, SYNC or STEP.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..config import RunConfig
from ..costs.costmodel import group_layers
from ..data import inputs_targets, split_micro_batches
from ..device import payload_backend, resolve_device
from ..distributed.layout import Layout, num_slots, run_layout
from ..distributed.placement import node_mix
from ..distributed.topology import Topology, allreduce_grads, world_sum
from ..schedule.afpipe import build_afpipe, build_afpipe_rank
from ..schedule.ir import Instr, Schedule, lists_text
from ..schedule.orders import Chooser, Resolved, given_schedule
from ..schedule.semantics import RankProgram
from ..schedule.validate import validate
from ..trace import Tracer
from ..training.budget import predict_memory, run_cap, world_memory_budget
from ..training.evaluate import EvalSet
from ..training.memory import ActivationMeter, device_peak_bytes, role_memory, state_bytes
from ..training.objective import (
    LossScale,
    StepResult,
    build_optimizer,
    fill_missing_grads,
    finish_step,
    loss_total,
)
from ..training.setup import apply_variants, build_data, set_threads
from .executor import Executor
from .grad_sync import OverlappedSync
from .stages import AttnWorker, ExpertWorker, build_worker


def resolve_schedule(cfg: RunConfig, layout: Layout, choose: Chooser = given_schedule) -> Resolved:
    """(order, generator costs, exchange chunks, split backward) of a run of `cfg` on
    `layout`: `choose(cfg, layout, slots, cap)`. What is automatic in `cfg` ("auto",
    exchange_chunks 0) is chosen by the caller's `choose` (`simulator.choose.run_order`,
    which `disagmoe train` passes); the default takes `cfg` as given."""
    return choose(cfg, layout, num_slots(cfg, layout), run_cap(cfg, layout))


def run_schedule(
    cfg: RunConfig,
    layout: Layout,
    *,
    forward_only: bool = False,
    resolved: Resolved | None = None,
    choose: Chooser = given_schedule,
) -> Schedule:
    """The AF-Pipe instruction lists a run of `cfg` on `layout` executes (per training step,
    or with `forward_only` per evaluation batch) with the order, generator costs and chunk
    count `resolved` (default: `resolve_schedule` with `choose`; an evaluation batch passes
    the training step's)."""
    slots, cap = num_slots(cfg, layout), run_cap(cfg, layout)
    order, costs, chunks, split = resolved or resolve_schedule(cfg, layout, choose)
    return build_afpipe(
        layout,
        slots,
        cap,
        order,
        num_micro_batches=cfg.train.num_micro_batches,
        forward_only=forward_only,
        costs=costs,
        exchange_chunks=chunks,
        split_backward=split,
    )


# Up to this many ranks every rank also builds and validates the whole world's schedule
# (milliseconds there; run dirs then list every rank's instructions); above, each rank
# builds only its own list and whole-world validation is an offline check
# (`disagmoe schedule --validate`, the tests).
WHOLE_WORLD_RANKS = 64


def run_schedule_of_rank(
    cfg: RunConfig,
    layout: Layout,
    rank: int,
    *,
    forward_only: bool = False,
    resolved: Resolved | None = None,
    choose: Chooser = given_schedule,
) -> tuple[Instr, ...]:
    """`rank`'s list of `run_schedule(cfg, layout)`, built without the other ranks'."""
    slots, cap = num_slots(cfg, layout), run_cap(cfg, layout)
    order, costs, chunks, split = resolved or resolve_schedule(cfg, layout, choose)
    return build_afpipe_rank(
        layout,
        rank,
        slots,
        cap,
        order,
        num_micro_batches=cfg.train.num_micro_batches,
        forward_only=forward_only,
        costs=costs,
        exchange_chunks=chunks,
        split_backward=split,
    )


def rank_lists(
    cfg: RunConfig,
    layout: Layout,
    rank: int,
    *,
    whole_world: bool,
    forward_only: bool = False,
    resolved: Resolved | None = None,
) -> tuple[Schedule | None, tuple[Instr, ...]]:
    """(the whole world's schedule, validated, or None, `rank`'s list): with `whole_world`
    the rank builds every rank's list, else only its own (`WHOLE_WORLD_RANKS`)."""
    if whole_world:
        schedule = run_schedule(cfg, layout, forward_only=forward_only, resolved=resolved)
        validate(schedule)
        return schedule, schedule.ranks[rank]
    lists = run_schedule_of_rank(cfg, layout, rank, forward_only=forward_only, resolved=resolved)
    return None, lists


class DisaggTrainer:
    whole_world_ranks = WHOLE_WORLD_RANKS

    def __init__(self, cfg: RunConfig, choose: Chooser = given_schedule) -> None:
        """`choose` picks what `cfg` leaves automatic in the schedule (`resolve_schedule`)."""
        self.rank = dist.get_rank()
        self.cfg = cfg = world_memory_budget(cfg)  # one budget for all ranks
        self.layout = run_layout(cfg, dist.get_world_size())
        self.cap = run_cap(cfg, self.layout)
        # above `whole_world_ranks` only this rank's list: time and memory follow its own
        self.whole_world = self.layout.world_size <= self.whole_world_ranks
        self.resolved = resolve_schedule(cfg, self.layout, choose)
        self.schedule, self.instrs = rank_lists(
            cfg, self.layout, self.rank, whole_world=self.whole_world, resolved=self.resolved
        )
        program = RankProgram.compile(self.rank, self.instrs, self.cap)
        self.device = resolve_device(cfg.parallel.device)
        self.topo = Topology.build(
            self.layout,
            device=self.device,
            payload_backend=payload_backend(self.device, cfg.parallel.backend),
        )
        self.role = self.layout.role(self.rank)
        self.scale = LossScale.for_run(cfg.model, cfg.train)
        self.worker = build_worker(cfg, self.layout, self.rank, self.scale, self.device)
        held = group_layers(cfg.model, self.layout.groups, self.role.group)
        apply_variants(cfg, [self.worker.modules], held)
        self.named_params = self.worker.named_parameters()
        self.params = [p for _, p in self.named_params]
        # Replicated (A) parameters count toward the global norm on replica 0 only.
        counted = self.role.comp == "F" or self.role.index == 0
        self.counted = [counted] * len(self.params)
        self.optimizer = build_optimizer(self.named_params, cfg.train)
        self.has_data = self.role.comp == "A" and self.role.group == 0
        self.batches = build_data(cfg) if self.has_data else None
        self.tracer = Tracer(self.rank, str(self.role))
        self.meter = ActivationMeter(self.params)
        self.slots = num_slots(cfg, self.layout)
        self.predicted = predict_memory(cfg, min(self.cap, self.slots))
        self._states: tuple[int, int, int] | None = None  # fixed once the optimizer stepped
        self._capture_grads = False
        self._result: StepResult | None = None  # set by STEP
        self.grad_sync: OverlappedSync | None = None
        replicas = self.topo.replica_group
        if (
            cfg.parallel.overlap_grad_sync
            and isinstance(self.worker, AttnWorker)
            and replicas is not None
            and self.layout.attn_workers > 1
        ):
            peers = self.layout.attn_replicas(self.role.group)
            self.grad_sync = OverlappedSync(self.worker, program, replicas, peers, self.tracer)
        self.executor = Executor(
            program,
            str(self.role),
            self.topo,
            self.grad_sync or self.worker,
            self,
            self.tracer,
            timeout_s=cfg.train.comm_timeout_s,
            drop_message=cfg.train.drop_message,
            meter=self.meter,
        )
        self.eval_set = EvalSet.build(cfg, feeds_data=self.has_data)
        self._eval_executor: Executor | None = None  # built at the first evaluation

    def _load_micro_batches(self, batch: torch.Tensor) -> None:
        assert isinstance(self.worker, AttnWorker)
        mbs = split_micro_batches(batch, self.cfg.train.micro_batch_size)
        r = self.role.index
        self.worker.micro_batches = {
            s: inputs_targets(mbs[self.layout.micro_batch(r, s)], self.device)
            for s in range(self.layout.slots_of_replica(r, len(mbs)))
        }

    def sync(self, step: int) -> int:
        """SYNC: sum the A components' gradients over the group's m replicas (wait for the
        buckets issued during the backward, reduce what none of them holds); the bytes
        SYNC all-reduced itself."""
        params = self.params
        if self.grad_sync is not None:
            self.grad_sync.finish(step)
            params = self.grad_sync.uncovered(params)
        fill_missing_grads(params)
        group = self.topo.replica_group
        if group is None or self.layout.attn_workers == 1 or not params:
            return 0
        return allreduce_grads(params, group)

    def optimizer_step(self, step: int) -> int:
        """STEP: global gradient norm, clipping, AdamW, loss reduction; the bytes it
        all-reduced over the world (the squared norm and the two loss sums)."""
        attn = self.worker if isinstance(self.worker, AttnWorker) else None
        reduced = 0

        def reduce_sum(t: torch.Tensor) -> torch.Tensor:
            nonlocal reduced
            reduced += t.numel() * t.element_size()
            return world_sum(t)

        self._result = finish_step(
            step=step,
            train=self.cfg.train,
            named_params=self.named_params,
            counted=self.counted,
            optimizer=self.optimizer,
            ce=attn.ce_sum if attn else 0.0,
            aux=attn.aux_sum if attn else 0.0,
            capture_grads=self._capture_grads,
            reduce_sum=reduce_sum,
        )
        return reduced

    def step(self, step: int, *, capture_grads: bool = False) -> StepResult:
        self.optimizer.zero_grad(set_to_none=True)
        if self.batches is not None:
            self._load_micro_batches(self.batches.global_batch(step))
        if isinstance(self.worker, AttnWorker):
            self.worker.reset_sums()
        self._capture_grads = capture_grads
        self._result = None
        self.meter.start_step()
        self.executor.run_step(step)
        assert self._result is not None, "the schedule has no STEP instruction"
        return self._result

    def eval_ce(self, index: int, step: int) -> float:
        """Forward only: eval batch `index` through the forward-only AF-Pipe schedule, on an
        executor of its own (its trace stays out of the run's); the mean cross-entropy of
        the batch, summed over the workers."""
        assert self.eval_set is not None
        if self._eval_executor is None:
            _, instrs = rank_lists(
                self.cfg,
                self.layout,
                self.rank,
                whole_world=self.whole_world,
                forward_only=True,
                resolved=self.resolved,
            )
            self._eval_executor = Executor(
                RankProgram.compile(self.rank, instrs, self.cap),
                str(self.role),
                self.topo,
                self.worker,
                self,
                Tracer(self.rank, str(self.role), keep_steps=1),
                timeout_s=self.cfg.train.comm_timeout_s,
            )
        attn = self.worker if isinstance(self.worker, AttnWorker) else None
        if attn is not None:
            if self.has_data:
                self._load_micro_batches(self.eval_set.batch(index))
            attn.reset_sums()
        self._eval_executor.run_step(step)
        ce = attn.ce_sum.reshape(1) if attn else loss_total(self.device).reshape(1)
        return float(world_sum(ce)[0])

    def expert_shard(self) -> tuple[int, int] | None:
        """Global expert ids [lo, hi) held by this rank (None on attention ranks)."""
        if not isinstance(self.worker, ExpertWorker):
            return None
        experts = self.layout.expert_range(self.role.index)
        return experts.start, experts.stop

    def local_modules(self) -> list[nn.Module]:
        return [self.worker.modules]

    def memory_bytes(self) -> list[int]:
        """This rank's `training.memory.MEMORY_FIELDS` for the step that just ran."""
        if self._states is None:
            self._states = state_bytes(self.params, self.optimizer)
        return [self.meter.peak, *self._states, device_peak_bytes(self.params)]

    def memory_record(self, rows: list[list[float]]) -> dict[str, dict[str, float]]:
        """Every rank's `memory_bytes` -> per role the largest measured and the predicted, MiB."""
        out: dict[str, dict[str, float]] = {}
        for comp, pred in (("A", self.predicted.attn), ("F", self.predicted.ffn)):
            mine = [row for r, row in enumerate(rows) if self.layout.role(r).comp == comp]
            out[comp] = role_memory(mine, pred, pred.activations + pred.deferred)
        out["cap"] = {
            "in_flight": self.cap,
            "slots": self.slots,
            "budget_gib": self.cfg.train.memory_gib,
        }
        return out

    def process_groups(self) -> int:
        return self.topo.process_groups

    def schedule_facts(self) -> dict[str, Any]:
        order, costs, chunks, split = self.resolved
        return {
            "order": order,
            "costs": "nominal" if costs is None else "run",
            "exchange_chunks": chunks,
            "split_backward": split,
            "compute_costs": self.cfg.schedule.costs_file or self.cfg.train.emulate_compute,
            "max_in_flight": self.cap,
        }

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


def run_disagg(
    cfg: RunConfig, run_dir: Path, choose: Chooser = given_schedule
) -> list[dict[str, Any]]:
    """Train on this rank; rank 0 writes the run outputs. Call inside a process group.
    `choose` picks what `cfg` leaves automatic in the schedule (`resolve_schedule`)."""
    from ..training.loop import run_training

    set_threads(cfg, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    trainer = DisaggTrainer(cfg, choose)

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

    return run_training(trainer, trainer.cfg, run_dir, extra_files=schedule_dump)
