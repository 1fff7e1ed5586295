"""Reliability: exact and re-layout resume, restart after a killed worker, hang reports, NaN guard."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from disagmoe.config import ParallelConfig, RunConfig, TrainConfig
from disagmoe.testing.cli import run_cli, run_cli_in_process
from disagmoe.testing.spawn import run_ranks


def _cfg(run_dir: Path, **train: Any) -> RunConfig:
    base = TrainConfig(dtype="float64", progress=False, steps=4, run_dir=str(run_dir), seq_len=32)
    return RunConfig(
        parallel=ParallelConfig(groups=1, attn_workers=2, expert_workers=2),
        train=dataclasses.replace(base, **train),
    )


def _train_disagg(cfgs: list[RunConfig]) -> list[list[float]]:
    import torch.distributed as dist

    from disagmoe.baselines import EPTrainer
    from disagmoe.runtime.disagg import DisaggTrainer
    from disagmoe.simulator.choose import run_order
    from disagmoe.training.loop import run_training

    out = []
    for cfg in cfgs:
        Path(cfg.train.run_dir).mkdir(parents=True, exist_ok=True)
        trainer = (
            DisaggTrainer(cfg, run_order) if cfg.parallel.runtime == "disagg" else EPTrainer(cfg)
        )
        records = run_training(trainer, cfg, Path(cfg.train.run_dir))
        out.append([r["loss"] for r in records])
        dist.barrier()
    return out


def _reference(cfg: RunConfig) -> list[float]:
    from disagmoe.training.loop import run_training
    from disagmoe.training.reference import ReferenceTrainer

    Path(cfg.train.run_dir).mkdir(parents=True, exist_ok=True)
    return [r["loss"] for r in run_training(ReferenceTrainer(cfg), cfg, Path(cfg.train.run_dir))]


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= 1e-10 * abs(x) for x, y in zip(a, b, strict=True))


def _step2(run_dir: Path) -> str:
    return str(run_dir / "checkpoints" / "step-00000002")


@pytest.fixture(scope="module")
def resumes(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[float]]]:
    """The resume tests' training, their run dirs under one root: the reference trainer's
    4 steps (`ref`, checkpoints every 2), then one spawn of 4 ranks that trains, in order,
    every disagg and ep-1f1b run (each after the run whose checkpoint it continues).
    Returns the root and each run's losses."""
    tmp = tmp_path_factory.mktemp("resumes")
    ref = dataclasses.replace(
        _cfg(tmp / "ref", checkpoint_every=2), parallel=ParallelConfig(runtime="reference")
    )
    losses = {"ref": _reference(ref)}
    # Uneven expert shards (8 experts on 3 shards: 3, 3, 2): the even checkpoint continued
    # for one step, saved, and that uneven checkpoint resumed on the same layout.
    uneven = ParallelConfig(groups=1, attn_workers=1, expert_workers=3)
    ep = ParallelConfig(runtime="ep-1f1b", pp=2, ep=2)
    cfgs = {
        "full": _cfg(tmp / "full", checkpoint_every=2),
        "first": _cfg(tmp / "part", steps=2, checkpoint_every=2),
        "second": _cfg(tmp / "part", checkpoint_every=2, resume="latest"),
        # re-layout: the 4-rank disagg checkpoint continued by p=2 ...
        "ring": dataclasses.replace(
            _cfg(tmp / "ring", resume=_step2(tmp / "full")),
            parallel=ParallelConfig(groups=2, attn_workers=1, expert_workers=1),
        ),
        # ... and a reference checkpoint continued by the disaggregated runtime
        "from_ref": _cfg(tmp / "fr", resume=_step2(tmp / "ref")),
        "uneven_a": dataclasses.replace(
            _cfg(tmp / "un", resume=_step2(tmp / "full"), steps=3, checkpoint_every=1),
            parallel=uneven,
        ),
        "uneven_b": dataclasses.replace(
            _cfg(tmp / "un2", resume=str(tmp / "un" / "checkpoints" / "step-00000003")),
            parallel=uneven,
        ),
        # ep-1f1b (pp=2, ep=2): a full run, its exact resume, the reference's continued
        "ep": dataclasses.replace(_cfg(tmp / "ep", checkpoint_every=2), parallel=ep),
        "ep_resumed": dataclasses.replace(
            _cfg(tmp / "ep2", resume=_step2(tmp / "ep")), parallel=ep
        ),
        "ep_from_ref": dataclasses.replace(
            _cfg(tmp / "ep3", resume=_step2(tmp / "ref")), parallel=ep
        ),
    }
    losses.update(zip(cfgs, run_ranks(_train_disagg, 4, list(cfgs.values()))[0], strict=True))
    return tmp, losses


def test_exact_and_relayout_resume(
    resumes: tuple[Path, dict[str, list[float]]], tmp_path: Path
) -> None:
    root, losses = resumes
    full_losses = losses["full"]
    assert _close(losses["second"], full_losses[2:]), (losses["second"], full_losses)
    metrics = (root / "part" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(m)["step"] for m in metrics] == [1, 2, 3, 4]
    # Re-layout: the 4-rank disagg checkpoint continued by the reference trainer and by p=2.
    by_reference = dataclasses.replace(
        _cfg(tmp_path / "ref", resume=_step2(root / "full")),
        parallel=ParallelConfig(runtime="reference"),
    )
    assert _close(_reference(by_reference), full_losses[2:])
    assert _close(losses["ring"], full_losses[2:])
    # ... and a reference checkpoint continued by the disaggregated runtime.
    ref_losses = losses["ref"]
    assert _close(ref_losses, full_losses)
    assert _close(losses["from_ref"], ref_losses[2:])
    # Uneven expert shards: one step from the even checkpoint, then resumed from its own.
    assert _close(losses["uneven_a"], full_losses[2:3])
    assert _close(losses["uneven_b"], full_losses[3:])


def test_baseline_resume_and_relayout(resumes: tuple[Path, dict[str, list[float]]]) -> None:
    """ep-1f1b (pp=2, ep=2): exact resume, and continuing the reference trainer's checkpoint."""
    _, losses = resumes
    ref_losses = losses["ref"]
    assert _close(losses["ep"], ref_losses)
    assert _close(losses["ep_resumed"], ref_losses[2:])
    assert _close(losses["ep_from_ref"], ref_losses[2:])


def test_incompatible_checkpoint_is_refused(tmp_path: Path) -> None:
    cfg = dataclasses.replace(
        _cfg(tmp_path / "a", steps=1, checkpoint_every=1),
        parallel=ParallelConfig(runtime="reference"),
    )
    _reference(cfg)
    result = run_cli(
        "train",
        "--runtime",
        "reference",
        "--set",
        "model.dim=32",
        "--resume",
        str(tmp_path / "a"),
        "--run-dir",
        str(tmp_path / "b"),
        timeout=120,
    )
    assert result.returncode == 2
    assert "model.dim is 64 there, 32 here" in result.stderr and "Traceback" not in result.stderr


def test_killed_worker_restarts_from_checkpoint(tmp_path: Path) -> None:
    """The restarted disagg run's losses are those of an uninterrupted run of the same flags:
    the reference trainer's (the ground truth, in this process: no ranks to kill)."""
    common = ["--dtype", "float64", "--no-progress", "--steps", "5", "--checkpoint-every", "2"]

    def run(name: str, *extra: str) -> subprocess.CompletedProcess[str]:
        return run_cli("train", *common, "--run-dir", str(tmp_path / name), *extra, timeout=300)

    clean = run_cli_in_process(
        "train", *common, "--runtime", "reference", "--run-dir", str(tmp_path / "clean")
    )
    assert clean.returncode == 0, clean.stderr[-2000:]
    failed = run("failed", "--max-restarts", "1", "--fail-at-step", "3", "--fail-rank", "2")
    assert failed.returncode == 0, failed.stderr[-2000:]
    assert "restart 1: a worker failed" in failed.stderr and "resumed from" in failed.stdout
    clean_m = [
        json.loads(x) for x in (tmp_path / "clean" / "metrics.jsonl").read_text().splitlines()
    ]
    fail_m = [
        json.loads(x) for x in (tmp_path / "failed" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [m["step"] for m in fail_m] == [1, 2, 3, 4, 5]
    assert _close([m["loss"] for m in fail_m], [m["loss"] for m in clean_m])


def _restart_count_of_ranks(counts: list[str]) -> int:
    import torch.distributed as dist

    from disagmoe.training.loop import restart_count

    os.environ["TORCHELASTIC_RESTART_COUNT"] = counts[dist.get_rank()]
    return restart_count()


def test_ranks_agree_on_the_restart_count() -> None:
    """An agent that restarts healthy workers because another node rejoined the rendezvous
    counts no restart: its ranks say 0 where the failed node's say 1. Every rank takes the
    largest, so that all of them know the attempt is a restart (resume, fault injection)."""
    assert run_ranks(_restart_count_of_ranks, 3, ["1", "0", "0"]) == [1, 1, 1]
    assert run_ranks(_restart_count_of_ranks, 2, ["0", "0"]) == [0, 0]


def test_lost_message_is_diagnosed(tmp_path: Path) -> None:
    """combine of the last layer, last slot, last step never sent: the receiver times out."""
    start = time.monotonic()
    result = run_cli(
        "train",
        "--no-progress",
        "--steps",
        "2",
        "--comm-timeout",
        "4",
        "--set",
        "train.drop_message=combine:3:1:1",
        "--run-dir",
        str(tmp_path / "r"),
        timeout=120,
    )
    assert result.returncode == 1
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("disagmoe: error: rank ") and "failed" in line, line
    # Every rank's report is in failure.txt; the waiting workers name their role, the
    # message and the peer. Which wait times out first is a race: rank 0 waiting for the
    # lost combine, or rank 2 for the gradient that rank 0 therefore never sends.
    reports = (tmp_path / "r" / "failure.txt").read_text()
    waits = re.findall(
        r"rank (\d) ([AF])\(g0,[rj]\d\): receiving (grad_combine|combine)\[l3,s1\] \d->\d from rank (\d)",
        reports,
    )
    assert waits, reports[-3000:]
    for _rank, comp, kind, _peer in waits:
        assert (comp, kind) in (("A", "combine"), ("F", "grad_combine"))
    assert "nothing arrived within 4 s" in line and "failure.txt" in line
    assert time.monotonic() - start < 60


def _dead_peer(timeout_s: float) -> str:
    import torch.distributed as dist

    from disagmoe.runtime.disagg import DisaggTrainer
    from disagmoe.simulator.choose import run_order

    cfg = dataclasses.replace(_cfg(Path("unused"), comm_timeout_s=timeout_s))
    trainer = DisaggTrainer(cfg, run_order)
    trainer.step(0)
    if dist.get_rank() == 3:
        os._exit(0)  # an expert worker dies between steps
    try:
        trainer.step(1)
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def test_dead_peer_is_diagnosed() -> None:
    """Expert worker rank 3 (F(g0,j1)) exits; its attention peers name themselves, the message and
    the dead peer (whether a receive from it or a send to it fails first is a race)."""
    start = time.monotonic()
    reports = run_ranks(_dead_peer, 4, 4.0, timeout_s=90, may_vanish={3})
    assert reports[3] is None
    for rank, replica in ((0, 0), (2, 1)):  # node-aware: ranks A(r0), F(j0), A(r1), F(j1)
        report = reports[rank]
        assert f"rank {rank} A(g0,r{replica})" in report, reports
        assert re.search(
            r"(receiving \S+ 3->\d from rank 3|sending \S+ \d->3 to rank 3)", report
        ), reports
    assert time.monotonic() - start < 60


def test_non_finite_loss_stops_and_keeps_checkpoint(tmp_path: Path) -> None:
    result = run_cli(
        "train",
        "--no-progress",
        "--steps",
        "4",
        "--lr",
        "1e36",
        "--set",
        "train.warmup_steps=1000",
        "--checkpoint-every",
        "1",
        "--run-dir",
        str(tmp_path / "r"),
        timeout=120,
    )
    assert result.returncode == 1
    line = result.stderr.strip().splitlines()[-1]
    assert "non-finite" in line and "at step 2" in line and "rank(s) [" in line, line
    assert (tmp_path / "r" / "checkpoints" / "latest").read_text().strip() == "step-00000001"
