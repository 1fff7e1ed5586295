"""Expert-parallel pipeline baselines as trainers and runner: `ep-1f1b`, `ep-combined`,
`ep-interleaved`, `ep-dualpipev`, `ep-overlap` (one `EPTrainer` per rank, inside an
initialised process group).

Per optimizer step, on every rank:
1. replica `dp_rank` takes global micro-batches `s*dp + dp_rank` (the
   reference's numbering); the rank holding stage 0 feeds their tokens, the
   rank holding the last stage their targets;
2. PyTorch's pipeline runtime (`baselines.fb_overlap.ScheduleOrdered` for the 1F1B
   orders, interleaved 1F1B's among them, `ScheduleDualPipeV`;
   `scale_grads=False` because `LossScale` already weights every micro-batch) runs
   forward/backward of this rank's stages,
   with the EP all-to-alls inside each MoE layer;
3. gradients: dense parameters all-reduced over the DP group and expert shards over the
   expert-data-parallel group — per layer bucket during the stage's last backward
   (`baselines.grad_buckets`, `parallel.overlap_grad_sync`), else one flat all-reduce
   each after the pipeline;
4. global gradient norm (each parameter counted on one rank), clipping,
   AdamW on this rank's parameters; losses reduced over the world.

Evaluation (`training.evaluate`) runs the same stage modules forward only, stage by stage
(`EPTrainer.eval_ce`), not through PyTorch's schedules: torch 2.13's
`ScheduleDualPipeV.eval()` fails on the V's local hand-over between the two stages of the
last rank, and its schedule validator refuses a forward-only action list (docs/baselines.md,
"Evaluation").
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import ScheduleDualPipeV

from ..config import WARMUP_RUNTIMES, RunConfig
from ..data import inputs_targets, split_micro_batches
from ..device import resolve_device
from ..distributed.topology import allreduce_grads, world_sum
from ..models.parts import unique_named_parameters
from ..schedule.baselines import build_baseline_schedule
from ..schedule.ir import Schedule
from ..torch_private import (
    PipelineSchedule,
    PipelineScheduleRuntime,
    PipelineStageBase,
    receives_at_start,
)
from ..trace import Tracer
from ..training.budget import world_memory_budget
from ..training.ep_budget import check_ep_run, peak_in_flight, predict_ep_run
from ..training.evaluate import EvalSet
from ..training.memory import ActivationMeter, device_peak_bytes, role_memory, state_bytes
from ..training.objective import (
    LossScale,
    StepResult,
    build_optimizer,
    fill_missing_grads,
    finish_step,
    loss_total,
    torch_dtype,
)
from ..training.precision import param_dtype_name
from ..training.setup import apply_variants, build_data, set_threads
from .fb_overlap import ScheduleOrdered, enable_fb_overlap
from .grad_buckets import EPGradBuckets
from .layout import EPGroups, EPLayout
from .moe import EPComm
from .stage import StageModule, TracedStage, build_stage_modules


class EPTrainer:
    """One rank of an expert-parallel pipeline run; same interface as `DisaggTrainer`."""

    def __init__(self, cfg: RunConfig, *, overlap_chunks: int | None = None) -> None:
        self.rank = dist.get_rank()
        self.cfg = cfg = world_memory_budget(cfg)  # one budget for all ranks
        self.device = resolve_device(cfg.parallel.device)
        self.layout = EPLayout.build(cfg.model, cfg.parallel, cfg.train, dist.get_world_size())
        # the memory model, per pipeline rank; a layout over the budget stops every rank here
        self.predicted = predict_ep_run(cfg, self.layout)
        check_ep_run(cfg, self.layout)
        chunks = overlap_chunks if overlap_chunks is not None else cfg.parallel.overlap_chunks
        self.groups = EPGroups.build(self.layout, self.rank, chunks)
        self.pp_rank, self.dp_rank, self.ep_rank, self.edp_rank = self.layout.coords(self.rank)
        self.role = self.layout.role(self.rank)
        self.tracer = Tracer(self.rank, self.role)
        self.scale = LossScale.for_run(cfg.model, cfg.train)
        self.comm = EPComm(
            self.groups.ep,
            self.layout.ep,
            self.tracer,
            overlap_group=self.groups.a2a,
            chunks=chunks,
            bwd_group=self.groups.bwd,
            overlap_bwd_group=self.groups.a2a_bwd,
        )
        self.stage_ids = self.layout.stages_of(self.pp_rank)
        self.modules = build_stage_modules(
            cfg, self.layout, self.pp_rank, self.ep_rank, self.scale, self.comm, self.device
        )
        held = self.layout.layers_of_rank(self.pp_rank)
        apply_variants(cfg, self.modules, held)
        self.named_params = unique_named_parameters(*self.modules)
        self.params = [p for _, p in self.named_params]
        self.meter = ActivationMeter(self.params)  # what a forward keeps for its backward
        self._states: tuple[int, int, int] | None = None  # fixed once the optimizer stepped
        self.order: list[tuple[int, str, int]] = []  # executed (stage, F/B/I/W, micro-batch)
        self.stages = [self._stage(m) for m in self.modules]
        self.pipeline = self._build_pipeline()
        self.schedule: Schedule = build_baseline_schedule(
            self.layout, cfg.model, overlap_chunks=cfg.parallel.overlap_chunks
        )
        self.is_expert = [".experts." in n for n, _ in self.named_params]
        # Replicated copies count toward the norm once: dense on replica 0, experts on EDP rank 0.
        self.counted = [(self.edp_rank == 0) if e else (self.dp_rank == 0) for e in self.is_expert]
        self.optimizer = build_optimizer(self.named_params, cfg.train)
        self.grad_sync: EPGradBuckets | None = None  # grads reduced in the backward
        if cfg.parallel.overlap_grad_sync and self.groups.dp is not None:
            edp = self.groups.edp
            self.grad_sync = EPGradBuckets(
                self.modules,
                self.groups.dp,
                self.layout.dp_group_ranks(self.pp_rank),
                self.tracer,
                self.layout.num_local_micro_batches,
                None if edp is None else (edp, dist.get_process_group_ranks(edp)),
            )
            for m in self.modules:
                m.grad_buckets = self.grad_sync.stages[m.stage]
        self.has_first = 0 in self.stage_ids
        self.has_last = self.layout.num_stages - 1 in self.stage_ids
        self.batches = build_data(cfg) if self.has_first or self.has_last else None
        self.eval_set = EvalSet.build(cfg, feeds_data=self.batches is not None)
        self.eval_tracer = Tracer(self.rank, self.role, keep_steps=1)  # eval's all-to-alls

    def _stage(self, module: StageModule) -> TracedStage:
        c, t = self.cfg.model, self.cfg.train
        # the residual stream in the parameters' dtype, logits in the compute dtype; with a
        # chunked loss head the last stage returns the normed residual stream
        dtype, logits_dtype = torch_dtype(param_dtype_name(t)), torch_dtype(t.dtype)
        B, S = t.micro_batch_size, t.seq_len
        # Static shapes (no metadata inference pass); requires_grad marks what carries gradients.
        dev = self.device
        hidden = torch.zeros(B, S, c.dim, dtype=dtype, device=dev, requires_grad=True)
        example_in = torch.zeros(B, S, dtype=torch.long, device=dev) if module.is_first else hidden
        example_out = (
            torch.zeros(B, S, c.vocab_size, dtype=logits_dtype, device=dev, requires_grad=True)
            if module.is_last and not self.scale.chunk_tokens
            else hidden
        )
        return TracedStage(
            module,
            module.stage,
            self.layout.num_stages,
            dev,
            input_args=example_in,
            output_args=example_out,
            group=self.groups.pp,
            tracer=self.tracer,
            order=self.order,
            meter=self.meter,
        )

    def _loss(self, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The schedule's loss: the last stage's `StageModule.head_loss`, what it saves counted
        by the meter (PyTorch's schedule computes it after the last stage's forward, on the
        same thread)."""
        last = next(m for m in self.modules if m.is_last)
        with self.meter.saving():
            return last.head_loss(out, targets)

    def _build_pipeline(self) -> PipelineSchedule:
        n = self.layout.num_local_micro_batches
        runtime = self.layout.runtime
        loss_fn = self._loss
        stages: list[PipelineStageBase] = list(self.stages)
        schedule: PipelineScheduleRuntime
        if runtime in WARMUP_RUNTIMES:
            schedule = ScheduleOrdered(
                list(self.stages), n, loss_fn, runtime, scale_grads=False,
                warmup=self.layout.warmup,
            )  # fmt: skip
        else:
            schedule = ScheduleDualPipeV(stages, n, loss_fn=loss_fn, scale_grads=False)
            # its F&B pairs run at once (baselines.fb_overlap)
            enable_fb_overlap(schedule, self.layout.stage_to_pp_rank())
        receives_at_start(schedule)
        return schedule

    def _local_batch(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of this replica's micro-batches of a global batch, in order."""
        mbs = split_micro_batches(batch, self.cfg.train.micro_batch_size)
        mine = [
            mbs[self.layout.global_micro_batch(self.dp_rank, s)]
            for s in range(self.layout.num_local_micro_batches)
        ]
        inputs, targets = zip(*(inputs_targets(m, self.device) for m in mine), strict=True)
        return torch.cat(inputs), torch.cat(targets)

    def _all_reduce(
        self, params: list[torch.nn.Parameter], group: dist.ProcessGroup | None, name: str
    ) -> None:
        if group is None or not params:
            return
        t0 = Tracer.now_us()
        nbytes = allreduce_grads(params, group)
        self.tracer.add(
            f"SYNC {name}",
            "sync",
            t0,
            Tracer.now_us(),
            bytes=nbytes,
            step=self.comm.step,
            peers=dist.get_process_group_ranks(group),
        )

    def step(self, step: int, *, capture_grads: bool = False) -> StepResult:
        self.optimizer.zero_grad(set_to_none=True)
        self.comm.step = step
        for st in self.stages:
            st.step_index = step
        for m in self.modules:
            m.aux_sum = 0.0
        if self.grad_sync is not None:
            self.grad_sync.reset()
        args: tuple[torch.Tensor, ...] = ()
        target = None
        if self.batches is not None:
            inputs, targets = self._local_batch(self.batches.global_batch(step))
            args = (inputs,) if self.has_first else ()
            target = targets if self.has_last else None
        losses: list[torch.Tensor] = []
        self.meter.start_step()
        self.pipeline.step(*args, target=target, losses=losses, return_outputs=False)
        for st in self.stages:
            st.finish_early_sends()
            st._close_p2p()
        if self.grad_sync is not None:  # started during the backward: wait for them
            self.grad_sync.finish(step)
        fill_missing_grads(self.params)
        if self.grad_sync is None:
            self._all_reduce(
                [p for p, e in zip(self.params, self.is_expert, strict=True) if not e],
                self.groups.dp,
                "dense",
            )
        if self.grad_sync is None:  # else in its buckets, with the dense ones
            self._all_reduce(
                [p for p, e in zip(self.params, self.is_expert, strict=True) if e],
                self.groups.edp,
                "experts",
            )
        t0 = Tracer.now_us()
        reduced = 0  # bytes of STEP's all-reduces over the world: the norm and the losses

        def reduce_sum(t: torch.Tensor) -> torch.Tensor:
            nonlocal reduced
            reduced += t.numel() * t.element_size()
            return world_sum(t)

        result = finish_step(
            step=step,
            train=self.cfg.train,
            named_params=self.named_params,
            counted=self.counted,
            optimizer=self.optimizer,
            ce=sum((x.detach().double() for x in losses), loss_total(self.device)),
            aux=sum(m.aux_sum for m in self.modules),
            capture_grads=capture_grads,
            reduce_sum=reduce_sum,
        )
        world = list(range(dist.get_world_size()))
        self.tracer.add("STEP", "sync", t0, Tracer.now_us(), step=step, bytes=reduced, peers=world)
        return result

    def eval_ce(self, index: int, step: int) -> float:
        """Forward only, under `torch.no_grad()`: eval batch `index` through this rank's
        stages, GPipe-style (each stage runs every local micro-batch, then the next stage
        does; activations go to the rank of the next stage, or stay when it is this rank's,
        as on DualPipeV's last rank), with the EP all-to-alls inside the MoE layers (EP peers
        run the same order) and the loss on the last stage; the batch's mean cross-entropy,
        summed over the workers. Its all-to-alls are traced apart (`eval_tracer`)."""
        assert self.eval_set is not None
        t = self.cfg.train
        B, n = t.micro_batch_size, self.layout.num_local_micro_batches
        inputs = targets = torch.zeros(0, device=self.device)
        if self.batches is not None:
            inputs, targets = self._local_batch(self.eval_set.batch(index))
        owner = self.layout.stage_to_pp_rank()
        held: dict[int, list[torch.Tensor]] = {}  # stage -> outputs for this rank's next stage
        sends: list[Any] = []
        ce = loss_total(self.device)
        train_tracer, self.comm.tracer, self.comm.step = self.comm.tracer, self.eval_tracer, step
        try:
            with torch.no_grad():
                for module in sorted(self.modules, key=lambda m: m.stage):
                    s = module.stage
                    held[s] = []
                    for mb in range(n):
                        self.comm.micro_batch = mb
                        if module.is_first:
                            x = inputs[mb * B : (mb + 1) * B]
                        elif owner[s - 1] == self.pp_rank:
                            x = held[s - 1][mb]
                        else:
                            like = next(module.parameters())
                            x = like.new_empty(B, t.seq_len, self.cfg.model.dim)
                            dist.recv(x, self.layout.rank_of(owner[s - 1], self.dp_rank))
                        y = module(x)
                        if module.is_last:
                            ce += module.head_loss(y, targets[mb * B : (mb + 1) * B]).double()
                        elif owner[s + 1] == self.pp_rank:
                            held[s].append(y)
                        else:
                            dst = self.layout.rank_of(owner[s + 1], self.dp_rank)
                            sends.append(dist.isend(y.contiguous(), dst))
                for work in sends:
                    work.wait()
        finally:
            self.comm.tracer = train_tracer
        return float(world_sum(ce.reshape(1))[0])

    def expert_shard(self) -> tuple[int, int] | None:
        """Global expert ids [lo, hi) of this rank's shard (every rank holds one)."""
        per = self.layout.experts_per_rank
        return self.ep_rank * per, (self.ep_rank + 1) * per

    def local_modules(self) -> list[torch.nn.Module]:
        return list(self.modules)

    def memory_bytes(self) -> list[int]:
        """This rank's `training.memory.MEMORY_FIELDS` for the step that just ran."""
        if self._states is None:
            self._states = state_bytes(self.params, self.optimizer)
        return [self.meter.peak, *self._states, device_peak_bytes(self.params)]

    def memory_record(self, rows: list[list[float]]) -> dict[str, dict[str, float]]:
        """Every rank's `memory_bytes` -> per pipeline rank (role `pp<r>`: its dp replicas)
        the largest measured beside the predicted (`training.ep_budget`), MiB; "cap": the
        most forwards a rank holds for backward at once (a micro-batch counts once per stage
        of the rank that holds it, `ep_budget.peak_in_flight`), the micro-batches per
        replica and the budget."""
        lay = self.layout
        out: dict[str, dict[str, float]] = {}
        for p, pred in enumerate(self.predicted):
            mine = [row for r, row in enumerate(rows) if lay.coords(r)[0] == p]
            out[f"pp{p}"] = role_memory(mine, pred, pred.activations)
        out["cap"] = {
            "held": max(peak_in_flight(lay)),
            "micro_batches": lay.num_local_micro_batches,
            "budget_gib": self.cfg.train.memory_gib,
        }
        return out

    def process_groups(self) -> int:
        return self.groups.created

    def placement(self) -> dict[str, Any]:
        lay = self.layout
        roles = [lay.role(r) for r in range(lay.pp * lay.dp)]
        return {"placement": "rank order", "roles": roles}

    def schedule_facts(self) -> dict[str, Any]:
        return {}

    def busy_seconds(self, step: int) -> float:
        return self.tracer.busy_us(step=step) / 1e6


# ------------------------------------------------------------------------------------ runner


def run_ep(cfg: RunConfig, run_dir: Path) -> list[dict[str, Any]]:
    """Train with runtime `cfg.parallel.runtime` (any `ep-*`) through the shared training loop.

    Call on every rank inside an initialised process group. Rank 0 writes what
    `run_disagg` writes: `metrics.jsonl` (same fields, incl. per-rank
    `busy_s`/`idle_s`), checkpoints, `trace.json` (lanes of `trace.LANES`:
    stage computations on fwd/bwd, chunked expert GEMMs on compute,
    all-to-alls and pipeline sends on send, pipeline receives and blocking waits
    on recv, gradient sync and optimizer step on sync) and `schedule.txt` (the IR).
    """
    from ..training.loop import run_training

    set_threads(cfg, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    trainer = EPTrainer(cfg)

    def schedule_dump(path: Path) -> None:
        (path / "schedule.txt").write_text(trainer.schedule.to_text())

    return run_training(trainer, cfg, run_dir, extra_files=schedule_dump)
