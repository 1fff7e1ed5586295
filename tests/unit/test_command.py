"""`disagmoe train` flags: generated from the config fields, resolved to a RunConfig; and
how `command.run_command` ends a command whose output is cut short."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from disagmoe.command import config_flags, resolve_train_config, train_parser
from disagmoe.config import RunConfig

# The public flag names; a rename breaks users' scripts.
CONFIG_FLAGS = {
    "--runtime": "parallel.runtime",
    "--groups": "parallel.groups",
    "--attn-workers": "parallel.attn_workers",
    "--expert-workers": "parallel.expert_workers",
    "--pp": "parallel.pp",
    "--ep": "parallel.ep",
    "--virtual-stages": "parallel.virtual_stages",
    "--overlap-chunks": "parallel.overlap_chunks",
    "--pipeline-warmup": "parallel.pipeline_warmup",
    "--world-size": "parallel.world_size",
    "--device": "parallel.device",
    "--param-dtype": "train.param_dtype",
    "--placement": "parallel.placement",
    "--ranks-per-node": "parallel.ranks_per_node",
    "--threads-per-rank": "parallel.threads_per_rank",
    "--no-overlap-grad-sync": "parallel.overlap_grad_sync",
    "--max-in-flight": "schedule.max_in_flight",
    "--order": "schedule.order",
    "--costed": "schedule.costs",
    "--exchange-chunks": "schedule.exchange_chunks",
    "--split-backward": "schedule.split_backward",
    "--costs-file": "schedule.costs_file",
    "--steps": "train.steps",
    "--seed": "train.seed",
    "--dtype": "train.dtype",
    "--seq-len": "train.seq_len",
    "--global-batch-size": "train.global_batch_size",
    "--micro-batch-size": "train.micro_batch_size",
    "--lr": "train.lr",
    "--lr-schedule": "train.lr_schedule",
    "--warmup-steps": "train.warmup_steps",
    "--min-lr": "train.min_lr",
    "--decay-fraction": "train.decay_fraction",
    "--weight-decay": "train.weight_decay",
    "--grad-clip": "train.grad_clip",
    "--recompute": "train.recompute",
    "--recompute-layers": "train.recompute_layers",
    "--memory-gib": "train.memory_gib",
    "--data": "train.data",
    "--eval-data": "train.eval_data",
    "--eval-every": "train.eval_every",
    "--eval-batches": "train.eval_batches",
    "--allow-byte-data": "train.allow_byte_data",
    "--run-dir": "train.run_dir",
    "--comm-timeout": "train.comm_timeout_s",
    "--no-progress": "train.progress",
    "--log-expert-tokens": "train.log_expert_tokens",
    "--tensorboard": "train.tensorboard",
    "--checkpoint-every": "train.checkpoint_every",
    "--gc-every": "train.gc_every",
    "--resume": "train.resume",
    "--max-restarts": "train.max_restarts",
    "--fail-at-step": "train.fail_at_step",
    "--fail-rank": "train.fail_rank",
    "--loss-chunk-tokens": "train.loss_chunk_tokens",
}


def resolve(*argv: str) -> RunConfig:
    return resolve_train_config(train_parser().parse_args(list(argv)))


def test_flags_come_from_the_config_fields() -> None:
    assert {f.option: f"{f.section}.{f.field}" for f in config_flags()} == CONFIG_FLAGS


def test_each_flag_sets_its_field() -> None:
    cfg = resolve(
        *("--runtime", "ep-1f1b", "--groups", "2", "--attn-workers", "1", "--expert-workers", "1"),
        *("--pp", "2", "--ep", "1", "--virtual-stages", "3", "--overlap-chunks", "4"),
        *("--world-size", "4", "--threads-per-rank", "1", "--max-in-flight", "3"),
        *("--steps", "7", "--seed", "5", "--dtype", "float64", "--seq-len", "32"),
        *("--global-batch-size", "4", "--micro-batch-size", "1", "--lr", "0.5", "--data", "d"),
        *("--run-dir", "r", "--comm-timeout", "9.5", "--no-progress", "--checkpoint-every", "2"),
        *("--resume", "--max-restarts", "1", "--fail-at-step", "3", "--fail-rank", "2"),
        *("--log-expert-tokens", "--tensorboard", "--no-overlap-grad-sync", "--gc-every", "0"),
        *("--order", "depth", "--costed"),
    )
    par, train = cfg.parallel, cfg.train
    assert (par.runtime, par.groups, par.attn_workers, par.expert_workers) == ("ep-1f1b", 2, 1, 1)
    assert (par.pp, par.ep, par.virtual_stages, par.overlap_chunks) == (2, 1, 3, 4)
    assert (par.world_size, par.threads_per_rank, cfg.schedule.max_in_flight) == (4, 1, 3)
    assert (train.steps, train.seed, train.dtype, train.seq_len) == (7, 5, "float64", 32)
    assert (train.global_batch_size, train.micro_batch_size, train.lr) == (4, 1, 0.5)
    assert (train.data, train.run_dir, train.comm_timeout_s, train.progress) == (
        "d",
        "r",
        9.5,
        False,
    )
    assert (train.checkpoint_every, train.resume, train.max_restarts) == (2, "latest", 1)
    assert (train.fail_at_step, train.fail_rank, train.gc_every) == (3, 2, 0)
    assert train.log_expert_tokens and train.tensorboard and not par.overlap_grad_sync
    assert (cfg.schedule.order, cfg.schedule.costs) == ("depth", "run")
    assert resolve().parallel.overlap_grad_sync  # on unless the flag says otherwise
    assert resolve("--resume", "runs/x").train.resume == "runs/x"


def test_flags_not_given_keep_the_config_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[train]\nsteps = 3\nprogress = false\n[parallel]\nruntime = 'reference'\n")
    cfg = resolve("--config", str(path), "--seed", "1")
    assert (cfg.train.steps, cfg.train.progress, cfg.parallel.runtime) == (3, False, "reference")
    assert resolve("--config", str(path), "--steps", "4").train.steps == 4
    assert resolve("--steps", "4", "--set", "train.steps=5").train.steps == 5


def test_flags_of_one_section_are_checked_together() -> None:
    # 9 is not a multiple of the default micro-batch size 2, but is one of 3
    cfg = resolve("--global-batch-size", "9", "--micro-batch-size", "3")
    assert (cfg.train.global_batch_size, cfg.train.micro_batch_size) == (9, 3)
    with pytest.raises(ValueError, match="multiple of train.micro_batch_size"):
        resolve("--global-batch-size", "9", "--micro-batch-size", "2")


PRINTS_MUCH = """
import argparse, sys
from disagmoe.command import run_command

def body(args):
    for _ in range(200000):
        print("x" * 80)
    return 0

sys.exit(run_command(body, argparse.Namespace()))
"""


def test_a_reader_that_closes_the_pipe_ends_the_command_quietly() -> None:
    """`disagmoe simulate ... | head -3`: the body's next write fails; the command exits
    141 (as a shell reports SIGPIPE) with nothing on stderr, not a traceback."""
    proc = subprocess.Popen(
        [sys.executable, "-c", PRINTS_MUCH], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.read(81) == b"x" * 80 + b"\n"
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141
    assert err == ""
