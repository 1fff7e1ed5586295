"""`benchmarks/gpu_check.py` end to end: on the CPU with tiny shapes (what CI can run), and
on CUDA where there is one (marked gpu)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from disagmoe.costs.compute import ComputeCosts

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
TINY = ("--seq-len", "16", "--micro-batch-size", "2", "--steps", "3", "--repeats", "2")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def _check(out: Path, result: subprocess.CompletedProcess[str]) -> dict[str, object]:
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all checks" in result.stdout and "ok;" in result.stdout
    report = json.loads((out / "gpu_check.json").read_text())
    assert set(report) == {"device", "args", "training", "expert_kernel", "timings"}
    losses = report["training"]["losses"]
    assert len(losses) == 3 and losses[-1] < losses[0]
    costs = ComputeCosts.load(str(out / "compute_costs.json"))  # the bench's format
    assert costs.attn_fwd(32) > 0 and costs.expert_fwd(64) > 0
    return report


def test_runs_end_to_end_on_cpu(tmp_path: Path) -> None:
    report = _check(tmp_path, _run("--device", "cpu", *TINY, "--out", str(tmp_path)))
    kernel = report["expert_kernel"]
    assert isinstance(kernel, dict)
    assert kernel["float32"]["y_rel_err"] == 0.0  # the CPU against itself
    assert 0 < kernel["bf16_autocast"]["y_rel_err"] < 5e-2  # bf16 rounding, and only that


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_one_line_exit_2(tmp_path: Path) -> None:
    result = _run("--device", "cuda", "--out", str(tmp_path / "g"))
    assert result.returncode == 2
    assert result.stderr.strip().startswith("gpu_check: error: --device cuda: CUDA is not")
    assert not (tmp_path / "g").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_runs_end_to_end_on_cuda(tmp_path: Path) -> None:
    report = _check(tmp_path, _run("--device", "cuda", *TINY, "--out", str(tmp_path)))
    assert "cpu" not in str(report["device"])
