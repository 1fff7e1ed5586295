"""The training loop every runtime shares: resume, steps, guards, metrics, checkpoints, trace.

A runtime provides a `Trainer` (one per rank); this loop drives it:

* resume from `train.resume` (layout-independent checkpoint, see checkpoint.py),
* fault injection for tests and demos (`train.fail_at_step` / `fail_rank`,
  first attempt only: the restarted worker must get past it),
* numerical guard: a non-finite loss or gradient stops the run naming the step
  and the workers, before any checkpoint could store it,
* evaluation (`eval_loss`, `eval_ppl`) on the steps `training.evaluate` says, forward only,
* metrics.jsonl + progress on rank 0 (routing and FLOP/s from `model_stats`, reduced in
  the step's one all-reduce), checkpoints every `checkpoint_every` steps and at the end,
  trace.json gathered to rank 0.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ..config import RunConfig, TrainConfig
from ..trace import Tracer, write_trace
from .checkpoint import checkpoint_root, choose_checkpoint, load_checkpoint, save_checkpoint
from .collector import StepCollector
from .evaluate import Evaluates, evaluate, should_evaluate
from .manifest import CheckpointError
from .memory import MEMORY_FIELDS
from .model_stats import StepStats
from .objective import StepResult, lr_at
from .observe import MetricsLog
from .tensorboard import open_tensorboard


class Trainer(Evaluates, Protocol):
    @property
    def tracer(self) -> Tracer: ...
    @property
    def named_params(self) -> list[tuple[str, torch.nn.Parameter]]: ...
    @property
    def optimizer(self) -> torch.optim.Optimizer: ...

    def step(self, step: int, *, capture_grads: bool = False) -> StepResult: ...
    def busy_seconds(self, step: int) -> float: ...
    def expert_shard(self) -> tuple[int, int] | None: ...
    def local_modules(self) -> list[torch.nn.Module]:
        """The modules this rank runs (their routers' statistics go to metrics.jsonl)."""
        ...

    def process_groups(self) -> int:
        """Process groups this run created (the world group excluded; the same on every rank)."""
        ...

    def placement(self) -> dict[str, Any]:
        """Where the ranks sit, for run.json: `roles` (rank -> role), the placement rule."""
        ...

    def schedule_facts(self) -> dict[str, Any]:
        """What the run's schedule resolved to, for run.json's `schedule` (AF-Pipe: order,
        generator costs, exchange chunks, compute costs file, in-flight cap; else empty)."""
        ...


class NonFiniteError(RuntimeError):
    pass


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _non_finite_ranks(trainer: Trainer, *, params: bool = False) -> list[int]:
    """Ranks holding a non-finite gradient (or parameter, with `params=True`); collective."""
    tensors = [p.data if params else p.grad for _, p in trainer.named_params]
    bad = any(t is not None and not bool(torch.isfinite(t).all()) for t in tensors)
    if not _dist():
        return [0] if bad else []
    flags = torch.zeros(dist.get_world_size(), dtype=torch.int64)
    flags[dist.get_rank()] = int(bad)
    dist.all_reduce(flags)
    return [r for r, f in enumerate(flags.tolist()) if f]


def _truncate_metrics(path: Path, last_step: int) -> None:
    """On resume, keep the records of steps up to the checkpoint (no duplicates, nothing lost)."""
    if not path.exists():
        return
    kept = [
        line
        for line in path.read_text().splitlines()
        if line and json.loads(line)["step"] <= last_step
    ]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


def restart_count() -> int:
    """How often torch elastic restarted this job's workers, the same on every rank: the
    largest `TORCHELASTIC_RESTART_COUNT` of the ranks (a collective when distributed).

    Each agent counts only the restarts it made because its own workers failed. An agent
    whose workers were still running when another node rejoined the rendezvous restarts them
    without counting ("membership changes do not count as retries": a node cut off by a dead
    link learns that the other node rejoined only once the link is back), so its ranks can
    say 0 in a restarted attempt while the others say 1.
    """
    local = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if not _dist():
        return local
    counts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(counts, local)
    return max(counts)


def resume_path(cfg: RunConfig, run_dir: Path, restart: int) -> str:
    """Where to resume from: after an elastic restart (`restart_count() > 0`) always this
    run's latest checkpoint."""
    root = run_dir / "checkpoints"
    if restart > 0 and (root / "latest").is_file():
        return str(root)
    if cfg.train.resume in ("latest", "auto"):
        return str(root) if (root / "latest").is_file() else ""
    return cfg.train.resume


def _chosen_checkpoint(resume: str, rank: int) -> Path:
    """The step dir to load. A checkpoint root (`latest`, an elastic restart's run dir) is
    verified here, by rank 0 before any rank loads (`checkpoint.choose_checkpoint`: the
    newest checkpoint that verifies); a step dir was chosen and verified by the launching
    process (`disagmoe.train.resolve_resume`) and is loaded as given."""
    if checkpoint_root(Path(resume)) is None:
        return Path(resume)
    decision: list[Any] = [None]
    if rank == 0:
        try:
            choice = choose_checkpoint(resume)
            decision = [(str(choice.step_dir), "")]
            if note := choice.note():
                print(f"disagmoe: warning: {note}", file=sys.stderr, flush=True)
        except ValueError as err:
            decision = [("", str(err))]
    if _dist():
        dist.broadcast_object_list(decision, src=0)
    step_dir, error = decision[0]
    if error:
        raise CheckpointError(error)
    return Path(step_dir)


def run_training(
    trainer: Trainer,
    cfg: RunConfig,
    run_dir: Path,
    *,
    extra_files: Callable[[Path], None] | None = None,
) -> list[dict[str, Any]]:
    """Train on this rank until `cfg.train.steps`; rank 0 logs. Returns rank 0's records."""
    rank = dist.get_rank() if _dist() else 0
    world = dist.get_world_size() if _dist() else 1
    train = cfg.train
    restart = restart_count()
    if restart and rank == 0:
        print(
            f"restart {restart}: a worker failed; all workers restarted",
            file=sys.stderr,
            flush=True,
        )
    start_step = _resume(trainer, cfg, run_dir, rank, restart)
    if rank == 0:
        _truncate_metrics(run_dir / "metrics.jsonl", start_step)
        _write_run_info(trainer, cfg, run_dir, world)
    log = (
        MetricsLog(
            run_dir,
            train.steps,
            progress=train.progress,
            start_step=start_step,
            tensorboard=open_tensorboard(cfg, run_dir, start_step),
        )
        if rank == 0
        else None
    )
    model_stats = StepStats(cfg, trainer.local_modules())
    records: list[dict[str, Any]] = []
    start = time.perf_counter()
    collector = StepCollector(train.gc_every, trainer.tracer)  # garbage collection
    try:
        collector.start()
        for step in range(start_step, train.steps):
            if step == train.fail_at_step and rank == train.fail_rank and restart == 0:
                os.kill(os.getpid(), signal.SIGKILL)  # fault injection: a worker dies
            collector.step = step
            t0 = time.perf_counter()
            with model_stats.recording():
                result = trainer.step(step)
            dt = time.perf_counter() - t0
            _check_finite(trainer, result, step)
            collector.after(step)  # on every rank at once, or on none
            # the step's one all-reduce: busy, garbage-collection and memory per rank, routing
            record = _step_record(
                trainer, train, result, step, dt, start, collector, model_stats, rank, world
            )
            if should_evaluate(train, step + 1):  # forward only (training/evaluate.py)
                record.update(evaluate(trainer, step))
            records.append(record)
            if log is not None:
                log.log(record)
            _checkpoint_if_due(trainer, cfg, run_dir, step + 1, rank, world, restart)
    finally:
        collector.stop()
        if log is not None:
            log.close()
    _write_trace(trainer, run_dir, rank, world)
    if rank == 0 and extra_files is not None:
        extra_files(run_dir)
    return records


def _resume(trainer: Trainer, cfg: RunConfig, run_dir: Path, rank: int, restart: int) -> int:
    """Load the checkpoint `resume_path` names (`restart`: the job's restart count, the same
    on every rank), if any; returns the step to start from."""
    resume = resume_path(cfg, run_dir, restart)
    if not resume:
        return 0
    step_dir = _chosen_checkpoint(resume, rank)
    start_step = load_checkpoint(
        step_dir, trainer.named_params, trainer.optimizer, trainer.expert_shard(), cfg.model
    )
    if rank == 0:
        print(f"resumed from {step_dir} at step {start_step}", flush=True)
    return start_step


def _write_run_info(trainer: Trainer, cfg: RunConfig, run_dir: Path, world: int) -> None:
    """run.json (rank 0): runtime, world size, process groups, placement, schedule facts."""
    run_info = {
        "runtime": cfg.parallel.runtime,
        "world_size": world,
        "process_groups": trainer.process_groups(),
        **trainer.placement(),
    }
    if facts := trainer.schedule_facts():
        run_info["schedule"] = facts
    (run_dir / "run.json").write_text(json.dumps(run_info, indent=1) + "\n")


def _check_finite(trainer: Trainer, result: StepResult, step: int) -> None:
    """`NonFiniteError` for a non-finite loss or gradient norm, naming the step and the
    ranks with non-finite gradients (a collective then)."""
    if not (math.isfinite(result.loss) and math.isfinite(result.grad_norm)):
        bad = _non_finite_ranks(trainer)
        raise NonFiniteError(
            f"non-finite {'loss' if not math.isfinite(result.loss) else 'gradient'} at step "
            f"{step + 1} (loss={result.loss}, grad_norm={result.grad_norm}); non-finite "
            f"gradients on rank(s) {bad or 'none'}; last checkpoint left untouched"
        )


def _step_record(
    trainer: Trainer,
    train: TrainConfig,
    result: StepResult,
    step: int,
    dt: float,
    start: float,
    collector: StepCollector,
    model_stats: StepStats,
    rank: int,
    world: int,
) -> dict[str, Any]:
    """The step's metrics record, after its one all-reduce (a collective): busy seconds,
    garbage-collection seconds and, where the runtime measures it, each rank's memory
    (training.memory.MEMORY_FIELDS, exact in float64), one row per rank; then the routing
    sums of all ranks (training.model_stats)."""
    memory = getattr(trainer, "memory_bytes", None)  # DisaggTrainer, EPTrainer
    memory_record = getattr(trainer, "memory_record", None)
    cols = 2 + (len(MEMORY_FIELDS) if memory else 0)
    flat = torch.zeros(world * cols + model_stats.size, dtype=torch.float64)
    stats, routing = flat[: world * cols].view(world, cols), flat[world * cols :]
    stats[rank, 0] = trainer.busy_seconds(step)
    stats[rank, 1] = collector.take()
    if memory is not None:
        stats[rank, 2:] = torch.tensor(memory(), dtype=torch.float64)
    model_stats.fill(routing)
    if _dist():
        dist.all_reduce(flat)
    busy = stats[:, 0]
    record = {
        "step": step + 1,
        "loss": result.loss,
        "ce_loss": result.ce_loss,
        "aux_loss": result.aux_loss,
        "grad_norm": result.grad_norm,
        "lr": lr_at(train, step),
        "step_time_s": dt,
        "tokens_per_s": train.global_batch_size * train.seq_len / dt,
        "elapsed_s": time.perf_counter() - start,
        "busy_s": [round(b, 6) for b in busy.tolist()],
        "idle_s": [round(max(dt - b, 0.0), 6) for b in busy.tolist()],
        "gc_s": round(float(stats[:, 1].max()), 6),  # the slowest rank's
        **model_stats.record(routing, dt, world),
    }
    if memory_record is not None:
        record["memory_mib"] = memory_record(stats[:, 2:].tolist())
    return record


def _checkpoint_if_due(
    trainer: Trainer,
    cfg: RunConfig,
    run_dir: Path,
    done: int,
    rank: int,
    world: int,
    restart: int,
) -> None:
    """After step `done`: a checkpoint every `checkpoint_every` steps and at the end, unless
    a parameter is non-finite (`NonFiniteError`; a collective when due)."""
    train = cfg.train
    if train.checkpoint_every and (done % train.checkpoint_every == 0 or done == train.steps):
        bad = _non_finite_ranks(trainer, params=True)
        if bad:
            raise NonFiniteError(
                f"non-finite parameters after step {done} on rank(s) {bad}; checkpoint "
                "not written, last checkpoint left untouched"
            )
        save_checkpoint(
            run_dir / "checkpoints",
            done,
            trainer.named_params,
            trainer.optimizer,
            trainer.expert_shard(),
            cfg.model,
            extra={"runtime": cfg.parallel.runtime, "world_size": world},
            keep=train.keep_checkpoints,
            kill_at=_save_kill_point(train, done, rank, restart),
        )


def _save_kill_point(train: TrainConfig, done: int, rank: int, restart: int) -> str:
    """Fault injection: where this rank dies in the save after step `done` (first attempt
    only, `train.fail_in_save`), or ""."""
    point, _, at = train.fail_in_save.partition(":")
    if point and int(at) == done and rank == train.fail_rank and restart == 0:
        return point
    return ""


def _write_trace(trainer: Trainer, run_dir: Path, rank: int, world: int) -> None:
    mine = (trainer.tracer.metadata(), trainer.tracer.events)
    if not _dist():
        write_trace(run_dir / "trace.json", [mine])
        return
    gathered: list[Any] = [None] * world if rank == 0 else []
    dist.gather_object(mine, gathered if rank == 0 else None, dst=0)
    if rank == 0:
        write_trace(run_dir / "trace.json", gathered)
