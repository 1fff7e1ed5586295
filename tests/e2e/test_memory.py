"""Memory as a user meets it: the memory-safe default cap, the one-line error of a run that
cannot fit, and measured activation / state bytes against the runtime's memory model.

Prediction vs measurement (training.memory counts saved tensors and held stage inputs and
outputs as unique storages; costs.runtime_memory predicts them): with one micro-batch in
flight the two agree within 2%; with K > 1 the prediction is an upper bound at most 15%
high (the first slot's loss head is released before the last slot's forward ends). One
expert shard (n = 1) keeps routing balanced by construction; an untrained router on a tiny
model routes unevenly over n > 1 shards, which the balanced-routing model does not cover.

EP runtimes (`--runtime ep-*`, `training.ep_budget`): the same meter on every rank, one
role per pipeline rank. With ep = 1 (every expert local: the rank computes all T*k pairs,
whatever the router does) the prediction is an upper bound at most 10% high: the peak of
the order's in-flight walk, per-token terms that the run partly shares between tensors
(1F1B 0.97-0.99, interleaved 0.97-0.98 of the prediction on the tiny model). Where a
forward runs beside a backward (DualPipeV, `ep-combined`) the measured peak depends on how
the two threads interleave, and `--recompute full` measures 0.7-0.8 of it. With ep > 1 the
untrained router's uneven routing puts a rank above the balanced-routing model, as n > 1
does for AF-Pipe.

The runs that train call `disagmoe.cli.main` in this process (`run_cli_in_process`: their
ranks are real processes, launched as from a shell, without the launcher's 3 s start-up);
the run that cannot fit is refused by a real process.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from disagmoe.testing.cli import run_cli, run_cli_in_process

# Recompute modes checked: every mode on the first layout; `full` also with p = 2, on every
# layer and on each group's first layer only.
RECOMPUTE = ["none", "attn", "full"]


def train(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run_cli_in_process("train", "--no-progress", "--run-dir", str(tmp_path / "run"), *args)


def last_record(tmp_path: Path) -> dict[str, Any]:
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    return dict(json.loads(lines[-1]))


@pytest.mark.parametrize(
    ("recompute", "dtype", "layout", "cap"),
    [
        *[(r, "float32", ["--groups", "1", "--attn-workers", "2"], "1") for r in RECOMPUTE],
        ("none", "float64", ["--groups", "1", "--attn-workers", "2"], "0"),
        *[(r, "float32", ["--groups", "2", "--attn-workers", "1"], "1") for r in ("none", "full")],
        # Qwen3's per-head q/k norms
        (
            "none",
            "float32",
            ["--groups", "1", "--attn-workers", "2", "--set", "model.qk_norm=true"],
            "1",
        ),
        # full recompute of each group's first layer only (train.recompute_layers)
        (
            "full",
            "float32",
            ["--groups", "2", "--attn-workers", "1", "--recompute-layers", "1"],
            "1",
        ),
    ],
)
def test_measured_memory_matches_the_model(
    tmp_path: Path, recompute: str, dtype: str, layout: list[str], cap: str
) -> None:
    result = train(
        tmp_path, "--steps", "2", "--dtype", dtype, "--recompute", recompute,
        "--expert-workers", "1", "--max-in-flight", cap, *layout,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    memory = last_record(tmp_path)["memory_mib"]
    low = 0.98 if memory["cap"]["in_flight"] == 1 else 0.85
    for role in ("A", "F"):
        m = memory[role]
        assert low * m["act_pred"] <= m["act_peak"] <= 1.02 * m["act_pred"], (role, memory)
        assert m["states"] == pytest.approx(m["states_pred"], rel=0.01), (role, memory)
    assert "memory MiB per rank" in result.stdout


def test_the_loss_head_chunks_are_measured_and_predicted(tmp_path: Path) -> None:
    """The A rank holding the loss head, unchunked and in chunks of 16 tokens (8 per
    micro-batch of 128): the two agree as above, and the chunked head keeps less."""
    act = {}
    for chunk in ("0", "16"):
        run = tmp_path / chunk
        result = train(
            run, "--steps", "2", "--dtype", "float32", "--expert-workers", "1",
            "--max-in-flight", "1", "--groups", "1", "--attn-workers", "2",
            "--loss-chunk-tokens", chunk,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        m = last_record(run)["memory_mib"]["A"]
        assert 0.98 * m["act_pred"] <= m["act_peak"] <= 1.02 * m["act_pred"], (chunk, m)
        act[chunk] = m
    assert act["16"]["act_peak"] < act["0"]["act_peak"], act
    assert act["16"]["act_pred"] < act["0"]["act_pred"], act


@pytest.mark.parametrize(
    ("runtime", "low"), [("ep-1f1b", 0.9), ("ep-interleaved", 0.9), ("ep-dualpipev", 0.5)]
)
def test_ep_measured_memory_matches_the_model(tmp_path: Path, runtime: str, low: float) -> None:
    """`low`: one order per rank, one thread (1F1B, interleaved): the meter meets the walk's
    peak, 0.9; DualPipeV runs a forward beside a backward on two threads, which frees while
    the forward keeps, so the measured peak depends on their timing (0.81-0.99 of the
    prediction seen): an upper bound only."""
    result = train(
        tmp_path, "--steps", "2", "--dtype", "float32", "--runtime", runtime, "--pp", "2",
        "--ep", "1",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    memory = last_record(tmp_path)["memory_mib"]
    assert set(memory) == {"pp0", "pp1", "cap"}, memory
    assert memory["cap"]["budget_gib"] > 0 and memory["cap"]["micro_batches"] == 4, memory
    for role in ("pp0", "pp1"):
        m = memory[role]
        assert low * m["act_pred"] <= m["act_peak"] <= 1.02 * m["act_pred"], (role, memory)
        assert m["states"] == pytest.approx(m["states_pred"], rel=0.01), (role, memory)
    line = result.stdout.strip().splitlines()[-1]
    assert line.startswith("memory MiB per rank, max per role: pp0 act "), line
    assert "forwards held of 4 micro-batches, budget" in line, line


def test_deferred_weight_gradients_are_counted_and_predicted_from_above(tmp_path: Path) -> None:
    """With `schedule.split_backward` on the meter also counts the gradients a deferred BWD
    keeps for its W, and the model adds one slot's of them (`runtime_memory`): an upper
    bound, since the Ws run as soon as the rank has nothing else to do."""
    args = ["--steps", "2", "--dtype", "float32", "--expert-workers", "1", "--max-in-flight", "1"]
    result = train(tmp_path, *args, "--split-backward", "on")
    assert result.returncode == 0, result.stderr
    split = last_record(tmp_path)["memory_mib"]
    whole_run = tmp_path / "whole"
    result = run_cli_in_process(
        "train", "--no-progress", "--run-dir", str(whole_run / "run"), *args
    )
    assert result.returncode == 0, result.stderr
    whole = last_record(whole_run)["memory_mib"]
    for role in ("A", "F"):
        assert split[role]["act_peak"] > whole[role]["act_peak"], (role, split, whole)
        assert split[role]["act_pred"] > whole[role]["act_pred"], (role, split, whole)
        assert split[role]["act_peak"] <= split[role]["act_pred"], (role, split)


def test_small_budget_caps_in_flight_and_trains(tmp_path: Path) -> None:
    # 16 micro-batches over 2 replicas: 8 slots, which do not fit in 9.5 MiB per rank.
    result = train(tmp_path, "--steps", "3", "--global-batch-size", "32", "--memory-gib", "0.0095")
    assert result.returncode == 0, result.stderr
    record = last_record(tmp_path)
    cap = record["memory_mib"]["cap"]
    assert cap["slots"] == 8 and 1 <= cap["in_flight"] < 8, cap
    assert record["step"] == 3 and record["loss"] == record["loss"]  # trained, finite
    header = (tmp_path / "run" / "schedule.txt").read_text().splitlines()[0]
    assert f"max_in_flight={cap['in_flight']}" in header.replace(" ", ""), header


def test_a_run_that_cannot_fit_fails_with_one_line(tmp_path: Path) -> None:
    result = run_cli(
        "train", "--no-progress", "--run-dir", str(tmp_path / "run"), "--steps", "1",
        "--memory-gib", "0.003",
    )  # fmt: skip
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("disagmoe: error: expert shard states 3 MiB + activations")
    assert "exceed train.memory_gib=0.003; use more --expert-workers" in lines[0]
    assert not (tmp_path / "run").exists()
    # one slot fits 4.2 MiB (the shard's states 3 MiB + 1 MiB per slot), the two given do not
    given = run_cli(
        "train", "--no-progress", "--run-dir", str(tmp_path / "run"), "--steps", "1",
        "--memory-gib", "0.0042", "--max-in-flight", "2",
    )  # fmt: skip
    assert given.returncode == 2
    lines = given.stderr.strip().splitlines()
    assert len(lines) == 1, given.stderr
    assert lines[0].startswith("disagmoe: error: schedule.max_in_flight=2: 2 micro-batch(es)")
    assert "on an expert shard" in lines[0] and "use --max-in-flight 1 (0: the most" in lines[0]
    assert not (tmp_path / "run").exists()


def test_an_ep_run_that_cannot_fit_fails_with_one_line(tmp_path: Path) -> None:
    result = run_cli(
        "train", "--no-progress", "--run-dir", str(tmp_path / "run"), "--steps", "1",
        "--runtime", "ep-1f1b", "--pp", "2", "--ep", "1", "--memory-gib", "0.003",
    )  # fmt: skip
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("disagmoe: error: ep-1f1b pp 2 ep 1: pipeline rank 0 needs ")
    assert "2 micro-batch(es) in flight" in lines[0]
    assert "over train.memory_gib=0.003; use more --pp or --ep" in lines[0]
    assert lines[0].endswith("a larger --memory-gib")
    assert not (tmp_path / "run").exists()
