"""`--loss-chunk-tokens` (`train.loss_chunk_tokens`) means one thing in every command that
prices a training run: `plan`, `simulate` and `schedule` take train's flag, default and
check, price the loss head with it and (`plan`, `simulate`) record it in `--json`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from disagmoe.config import LOSS_CHUNK_TOKENS
from disagmoe.testing.cli import run_cli_in_process

# gpt-oss-20b (a 201088-token vocabulary) at 8192 tokens on one attention replica: the
# unchunked head's fp32 log-probabilities make the attention replica the fullest GPU
SIMULATE = ("--model", "gpt-oss-20b", "--groups", "1", "--attn-workers", "1",
            "--expert-workers", "7", "--micro-batches", "4", "--max-in-flight", "1",
            "--recompute", "none", "--exchange-chunks", "1", "--split-backward", "off")  # fmt: skip
PLAN = ("--model", "gpt-oss-20b", "--gpus", "16", "--seq-len", "8192", "--recompute",
        "none", "--profile", "analytic", "--search-moves", "8")  # fmt: skip
SCHEDULE = ("--model", "deepseek-moe-16b", "--seq-len", "8192", "--global-batch-size", "4",
            "--memory-gib", "2000")  # fmt: skip


def _json(*args: str) -> dict[str, Any]:
    result = run_cli_in_process(*args, "--json")
    assert result.returncode == 0, result.stderr
    out: dict[str, Any] = json.loads(result.stdout)
    return out


def _order_line(*args: str) -> str:
    result = run_cli_in_process("schedule", *args)
    assert result.returncode == 0, result.stderr
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("# order")]
    return line


def test_simulate_prices_and_records_the_loss_head() -> None:
    """Unchunked, the attention replica keeps the logits' log-probabilities (more memory)
    and its head's backward makes them once (a shorter step than the chunked rerun). The
    exchange chunks and whole backwards are fixed, so only the head differs."""
    default = _json("simulate", *SIMULATE)
    chunked = _json("simulate", *SIMULATE, "--loss-chunk-tokens", str(LOSS_CHUNK_TOKENS))
    plain = _json("simulate", *SIMULATE, "--loss-chunk-tokens", "0")
    assert default == chunked
    assert default["config"]["loss_chunk_tokens"] == LOSS_CHUNK_TOKENS
    assert plain["config"]["loss_chunk_tokens"] == 0
    assert plain["memory_gib_per_gpu"] > default["memory_gib_per_gpu"] + 1
    assert plain["step_time_s"] < default["step_time_s"]


def test_simulate_ep_prices_the_loss_head_memory() -> None:
    """The EP runtimes' last stage keeps the unchunked head's log-probabilities too."""
    ep = ("--model", "deepseek-moe-16b", "--runtime", "ep-1f1b", "--pp", "2", "--ep", "4",
          "--micro-batches", "8", "--recompute", "full")  # fmt: skip
    default = _json("simulate", *ep)
    plain = _json("simulate", *ep, "--loss-chunk-tokens", "0")
    assert (default["config"]["loss_chunk_tokens"], plain["config"]["loss_chunk_tokens"]) == (
        LOSS_CHUNK_TOKENS,
        0,
    )
    assert plain["memory_gib_per_gpu"] > default["memory_gib_per_gpu"] + 1


def test_plan_prices_and_records_the_loss_head() -> None:
    default = _json("plan", *PLAN)
    plain = _json("plan", *PLAN, "--loss-chunk-tokens", "0")
    assert default["loss_chunk_tokens"] == LOSS_CHUNK_TOKENS and plain["loss_chunk_tokens"] == 0
    assert plain["mem_attn_gib"] > default["mem_attn_gib"] + 1


def test_schedule_prices_the_flag_and_the_config_file(tmp_path: Path) -> None:
    """`schedule` reads `train.loss_chunk_tokens` as train does: flag, `--config` file,
    and the flag over the file; its predicted step is the one of the head it names."""
    toml = tmp_path / "run.toml"
    toml.write_text("[train]\nloss_chunk_tokens = 0\n")
    default = _order_line(*SCHEDULE)
    plain = _order_line(*SCHEDULE, "--loss-chunk-tokens", "0")
    assert plain != default
    assert _order_line(*SCHEDULE, "--config", str(toml)) == plain
    assert _order_line(*SCHEDULE, "--config", str(toml), "--loss-chunk-tokens", "4096") == default


@pytest.mark.parametrize("value", ["-1", "x", "1.5"])
@pytest.mark.parametrize(
    "command",
    [("train",), ("plan", "--model", "tiny", "--gpus", "4"), ("simulate",), ("schedule",)],
    ids=lambda c: c[0],
)
def test_bad_values_are_one_line_and_exit_2(command: tuple[str, ...], value: str) -> None:
    result = run_cli_in_process(*command, "--loss-chunk-tokens", value)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--loss-chunk-tokens" in lines[0], result.stderr
    if value == "-1":
        assert lines[0] == (
            "disagmoe: error: train.loss_chunk_tokens (--loss-chunk-tokens) must be >= 0 "
            "(0: the unchunked loss head), got -1"
        )
