"""`benchmarks/gpu_lanes.py` end to end on the CPU (tiny shapes, no streams): the three ways
run, each pair's input gradient equals the serial one, and `--device cuda` without CUDA
is one line and exit code 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_lanes.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def test_runs_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "lanes.json"
    tiny = ("--model", "tiny", "--seq-len", "32", "--repeats", "2")
    result = _run("--device", "cpu", *tiny, "--out", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert set(report["ways"]) == {"serial", "lane_streams", "micro_batch_streams"}
    assert report["fwd_ms"] > 0 and report["bwd_ms"] > 0
    for row in report["ways"].values():
        assert row["grad_equal_to_serial"] is True
        assert row["pair_ms"] > 0 and row["backward_streams"] is None  # no streams on CPU
    assert "micro_batch_streams" in result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_one_line_exit_2(tmp_path: Path) -> None:
    result = _run("--device", "cuda", "--out", str(tmp_path / "g.json"))
    assert result.returncode == 2
    assert result.stderr.strip().startswith("gpu_lanes: error: --device cuda: CUDA is not")
    assert not (tmp_path / "g.json").exists()
