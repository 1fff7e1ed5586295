"""Training entry points: local launch (torch elastic), torchrun ranks, and runtime dispatch.

* `disagmoe train` (no torchrun around it) starts `world_size` local ranks with
  torch's elastic launch API, rendezvous bound to 127.0.0.1;
* `torchrun --nnodes N --nproc-per-node K -m disagmoe.train [flags]` runs the
  same training as one rank of a multi-node job (flags as `disagmoe train`).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from .command import CommandFailed, resolve_train_config, run_command, train_parser
from .config import RunConfig, replace_section
from .config_io import from_dict, to_dict
from .device import bind_device, check_device, default_backend, init_kwargs, resolve_device
from .training.observe import prepare_run_dir


def world_size_for(cfg: RunConfig) -> int:
    """Ranks a runtime needs; validates the layout and the device so errors surface before
    any spawn."""
    check_device(cfg.parallel.device)
    world = _world_size(cfg)
    train = cfg.train
    if (train.fail_at_step >= 0 or train.fail_in_save) and train.fail_rank >= world:
        raise ValueError(f"train.fail_rank ({train.fail_rank}) must be < the world size ({world})")
    point = train.fail_in_save.partition(":")[0]
    if point not in ("", "shards") and train.fail_rank != 0:
        raise ValueError(
            f"train.fail_in_save: only rank 0 reaches the point {point!r} of a save; "
            "give --fail-rank 0 (or the point 'shards', which every rank reaches)"
        )
    return world


def _world_size(cfg: RunConfig) -> int:
    par = cfg.parallel
    if par.runtime == "reference":
        return 1
    if par.runtime == "disagg":
        from .distributed.layout import num_slots, run_layout

        layout = run_layout(cfg, par.world_size or None)
        num_slots(cfg, layout)
        return layout.world_size
    from .baselines.layout import EPLayout

    world = par.world_size or par.pp * par.ep
    EPLayout.build(cfg.model, par, cfg.train, world)
    return world


def resolve_memory(cfg: RunConfig, local_ranks: int) -> RunConfig:
    """disagg and ep-*: `cfg` with its memory budget resolved once for all ranks, checked to
    fit (a ValueError, exit 2: disagg when even one micro-batch in flight, or the
    `--max-in-flight` given, does not fit, ep-*
    when a pipeline rank's states and the micro-batches its order holds do not,
    `training.ep_budget.check_ep_run`)."""
    if cfg.parallel.runtime == "reference":
        return cfg
    from .training.budget import in_flight_cap, resolve_memory_budget

    cfg = resolve_memory_budget(cfg, local_ranks)
    if cfg.parallel.runtime != "disagg":
        from .baselines.layout import EPLayout
        from .training.ep_budget import check_ep_run

        check_ep_run(cfg, EPLayout.build(cfg.model, cfg.parallel, cfg.train, _world_size(cfg)))
        return cfg
    from .distributed.layout import num_slots, run_layout

    layout = run_layout(cfg, cfg.parallel.world_size or None)
    in_flight_cap(cfg, num_slots(cfg, layout))
    return cfg


def run_rank(cfg: RunConfig, run_dir: Path) -> list[dict[str, Any]]:
    """Run the configured runtime on this rank (process group already initialised)."""
    runtime = cfg.parallel.runtime
    if runtime == "disagg":
        from .runtime.disagg import run_disagg
        from .simulator.choose import run_order

        return run_disagg(cfg, run_dir, choose=run_order)
    from .baselines import RUNNERS

    return list(RUNNERS[runtime](cfg, run_dir))


def _init_process_group(cfg: RunConfig) -> None:
    """Join the job's process group through a store that holds no keys of a failed attempt.

    Under torch elastic the store is either the agents' (`TORCHELASTIC_USE_AGENT_STORE=True`,
    torch's default: one server for the whole job, so the keys of each attempt get the
    attempt's prefix) or, with `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` in the agents'
    environment, one that rank 0 hosts for this attempt alone at the port its agent chose
    in this rendezvous round (`env://`). Only the second is safe across several agents: an
    agent whose workers were still running when another node rejoined the rendezvous
    restarts them without counting a restart, so the two nodes' workers can carry different
    `TORCHELASTIC_RESTART_COUNT`s and the prefix of one of them names a dead attempt's
    peers (`training.loop.restart_count`; docs/operations.md, "Network faults"). The rank's
    device (`disagmoe.device`) is bound first, and the group to it.
    """
    device = resolve_device(cfg.parallel.device)
    bind_device(device)
    backend = default_backend(device, cfg.parallel.backend)
    extra = init_kwargs(device)
    timeout = timedelta(seconds=max(cfg.train.comm_timeout_s, 60))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, timeout=timeout, **extra)
        return
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    if rank == 0 and nodes > 1 and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
        print(
            f"disagmoe: warning: torchrun --max-restarts on {nodes} nodes with the agents' "
            "shared store: a restart can meet the failed attempt's store keys (gloo "
            "connectFullMesh: Connection refused); start torchrun with "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment",
            file=sys.stderr,
            flush=True,
        )
    base = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=False,
        timeout=timeout,
    )
    store = dist.PrefixStore(f"disagmoe/attempt{attempt}", base)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world, timeout=timeout, **extra
    )


def _worker(cfg_dict: dict[str, Any], run_dir: str) -> list[dict[str, Any]]:
    """Elastic-launch entry point of one local rank.

    On failure the exception is recorded for the launcher (error file) and the process
    exits at once: communication threads blocked in a dead exchange must not turn a clean
    error into an abort at interpreter shutdown.
    """
    cfg = from_dict(cfg_dict)
    try:
        _init_process_group(cfg)
        records = run_rank(cfg, Path(run_dir))
    except BaseException as err:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(err)
        sys.stderr.flush()
        os._exit(1)
    dist.destroy_process_group()
    return records


def launch_local(cfg: RunConfig, run_dir: Path, nprocs: int) -> list[dict[str, Any]]:
    """Start `nprocs` ranks on this machine and return rank 0's step records."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from .device import free_port

    # A failed rank is reported once, in one line, by the CLI (full report in the run dir),
    # not by the elastic agent's log of every rank's traceback.
    for name in ("torch.distributed.elastic", "torch.multiprocessing"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nprocs,
        run_id=f"disagmoe-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=cfg.train.max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
    )
    results = elastic_launch(config, _worker)(to_dict(cfg), str(run_dir))
    return list(results[0])


def check_inputs(cfg: RunConfig) -> None:
    """Load data and initial weights once in the launching process, so that bad input is
    reported as one clear error before any rank starts."""
    from .training.evaluate import check_eval_data
    from .training.setup import build_data, load_emulation

    build_data(cfg)
    check_eval_data(cfg)
    load_emulation(cfg)
    if cfg.train.tensorboard:
        from .training.tensorboard import require_tensorboard

        require_tensorboard()
    if cfg.train.init_from_hf:  # the whole checkpoint, from its headers: no tensor is read
        from .models.hf_import import check_hf_weights

        check_hf_weights(cfg.train.init_from_hf, cfg.model)
    if cfg.train.resume and cfg.train.resume not in ("latest", "auto"):
        from .training.checkpoint import check_compatible, read_meta

        check_compatible(read_meta(cfg.train.resume), cfg.model, cfg.train.resume)


def resolve_resume(cfg: RunConfig) -> RunConfig:
    """`cfg` with `train.resume` naming the verified step dir to continue
    (`training.checkpoint.choose_checkpoint`: every file checked against its manifest, in
    this process, before any rank starts); a warning line when newer ones were skipped.
    A checkpoint that does not verify, or none that does, is a `CheckpointError` (exit 2).
    `latest`/`auto` without a checkpoint in the run dir are left to `prepare_run_dir`."""
    resume = cfg.train.resume
    if resume in ("latest", "auto"):
        root = Path(cfg.train.run_dir) / "checkpoints"
        if not cfg.train.run_dir or not (root / "latest").is_file():
            return cfg
        resume = str(root)
    if not resume:
        return cfg
    from .training.checkpoint import choose_checkpoint

    choice = choose_checkpoint(resume)
    if note := choice.note():
        print(f"disagmoe: warning: {note}", file=sys.stderr, flush=True)
    return replace_section(cfg, "train", resume=str(choice.step_dir))


def train(cfg: RunConfig) -> tuple[Path, list[dict[str, Any]]]:
    """Train as configured from a plain process (the CLI); returns the run dir and rank-0 records."""
    nprocs = world_size_for(cfg)
    check_device(cfg.parallel.device, nprocs)
    cfg = resolve_resume(resolve_memory(cfg, nprocs))
    check_inputs(cfg)
    run_dir = prepare_run_dir(cfg)
    if cfg.parallel.runtime == "reference":
        from .training.reference import run_reference

        return run_dir, run_reference(cfg, run_dir)
    try:
        return run_dir, launch_local(cfg, run_dir, nprocs)
    except ChildFailedError as err:
        raise TrainingFailed(err, run_dir) from None


def train_command(args: argparse.Namespace) -> int:
    """`disagmoe train`: train as the flags say, then one line of results."""
    cfg = resolve_train_config(args)
    run_dir, records = train(cfg)
    if records:
        first, last = records[0], records[-1]
        evals = [r for r in records if "eval_loss" in r]
        eval_part = (
            f", eval_loss {evals[-1]['eval_loss']:.4f} (ppl {evals[-1]['eval_ppl']:.2f}) "
            f"at step {evals[-1]['step']}"
            if evals
            else ""
        )
        print(
            f"{cfg.parallel.runtime}: {len(records)} steps, loss {first['loss']:.4f} -> "
            f"{last['loss']:.4f}{eval_part}, {mean_tokens_per_s(records):.0f} tokens/s; "
            f"run dir {run_dir}"
        )
        if "memory_mib" in last:
            print(memory_summary(last["memory_mib"]))
    else:
        print(f"{cfg.parallel.runtime}: 0 steps; run dir {run_dir}")
    return 0


def mean_tokens_per_s(records: list[dict[str, Any]]) -> float:
    """Tokens/s over the measured steps: all steps of this invocation but its first (thread
    start-up, first allocations), or that one step alone; total tokens / total step time."""
    measured = records[1:] or records
    tokens = sum(r["tokens_per_s"] * r["step_time_s"] for r in measured)
    return tokens / sum(r["step_time_s"] for r in measured)


def memory_summary(mem: dict[str, dict[str, float]]) -> str:
    """One line: per role (disagg: A, F; ep-*: pipeline ranks pp<r>) measured vs predicted
    MiB (last step), and the in-flight cap (disagg) or the most forwards a rank holds (ep-*)."""
    cap = mem["cap"]
    parts = [
        f"{role} act {m['act_peak']:.2f} (pred {m['act_pred']:.2f}), states {m['states']:.2f} "
        f"(pred {m['states_pred']:.2f})"
        for role, m in mem.items()
        if role != "cap"
    ]
    if "slots" in cap:
        held = f"in flight {cap['in_flight']:g} of {cap['slots']:g} slots"
    else:
        held = f"up to {cap['held']:g} forwards held of {cap['micro_batches']:g} micro-batches"
    return (
        f"memory MiB per rank, max per role: {'; '.join(parts)}; {held}, "
        f"budget {cap['budget_gib']:.3g} GiB"
    )


class TrainingFailed(CommandFailed):
    """A rank failed; the one-line reason, with every rank's report written to the run dir."""

    def __init__(self, err: ChildFailedError, run_dir: Path) -> None:
        rank, failure = err.get_first_failure()
        reports = []
        for r, f in sorted(err.failures.items()):
            reports.append(f"=== rank {r} (exit code {f.exitcode})\n{_failure_text(f)}")
        path = run_dir / "failure.txt"
        path.write_text("\n".join(reports) + "\n")
        lines = _failure_text(failure).strip().splitlines()
        reason = lines[-1] if lines else f"exit code {failure.exitcode}"
        reason = re.sub(r"^(?:\w+\.)+(\w+: )", r"\1", reason)  # drop the module path
        super().__init__(f"rank {rank} failed: {reason} (all reports: {path})")


def _failure_text(failure: Any) -> str:
    message = failure.message
    if isinstance(message, dict):
        extra = message.get("extraInfo", {}).get("py_callstack", "")
        message = extra or message.get("message", "")
    return str(message or f"exit code {failure.exitcode}, signal {failure.signal_name()}")


def torchrun_main(argv: list[str] | None = None) -> int:
    """`python -m disagmoe.train` under torchrun: one rank of the job.

    Without torchrun around it, this is `disagmoe train`. Rank 0 checks the inputs and
    creates the run dir, then tells every rank its path (or the error, so that all
    ranks exit with the same one-line message). A failure is recorded for torchrun
    and the process exits at once (see `_worker`).
    """
    args_list = argv if argv is not None else sys.argv[1:]
    if "RANK" not in os.environ:
        return run_command(train_command, train_parser().parse_args(args_list))
    try:
        cfg = resolve_train_config(train_parser().parse_args(args_list))
        from .training.loop import restart_count

        _init_process_group(cfg)
        restart = restart_count()  # the same on every rank, unlike the agents' counts
        decision: list[Any] = [None]
        if dist.get_rank() == 0:
            try:
                world_size_for(cfg)
                # rank 0 resolves the memory budget once; config.toml and every rank get it
                resolved = resolve_memory(cfg, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
                if restart > 0:
                    # an elastic restart continues this run dir; rank 0 of the ranks
                    # chooses and verifies its latest checkpoint (training.loop.resume_path)
                    resolved = replace_section(resolved, "train", resume="auto")
                else:
                    resolved = resolve_resume(resolved)  # verified once, here
                check_inputs(resolved)
                run_dir = str(prepare_run_dir(resolved))
                decision = [(run_dir, resolved.train.memory_gib, resolved.train.resume)]
            except ValueError as err:
                decision = [ValueError(str(err))]
        dist.broadcast_object_list(decision, src=0)
        if isinstance(decision[0], ValueError):
            if dist.get_rank() == 0:
                sys.stderr.write(f"disagmoe: error: {decision[0]}\n")
            dist.destroy_process_group()
            return 2
        run_dir, memory_gib, resume = decision[0]
        cfg = replace_section(cfg, "train", memory_gib=memory_gib, resume=resume)
        run_rank(cfg, Path(run_dir))
    except ValueError as err:  # configuration errors: the same line on every rank
        sys.stderr.write(f"disagmoe: error: {err}\n")
        return 2
    except BaseException as err:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(err)
        reason = f"{type(err).__name__}: {err}"  # as the local launcher's line says it
        sys.stderr.write(f"disagmoe: error: rank {os.environ['RANK']} failed: {reason}\n")
        sys.stderr.flush()
        os._exit(1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(torchrun_main())
