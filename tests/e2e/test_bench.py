"""`disagmoe bench` on the emulated cluster: it runs, reports, and leaves nothing behind —
no namespace, no veth, no qdisc — after success, after a failure inside a run, and after
Ctrl-C. Needs root (network namespaces); skipped otherwise."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from disagmoe.bench.netns import available, list_namespaces

pytestmark = pytest.mark.skipif(bool(available()), reason=available() or "")

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
SMALL = ["--model", "tiny", "--seq-len", "64", "--global-batch-size", "8",
         "--micro-batch-size", "2", "--repeats", "1"]  # fmt: skip


def bench(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "disagmoe.cli", "bench", *SMALL, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )


def ours(pid: int) -> list[str]:
    return list_namespaces(f"dmoe-{pid}-")


def test_bench_reports_every_runtime_and_cleans_up(tmp_path: Path) -> None:
    proc = bench("--runtimes", "disagg,ep-1f1b", "--steps", "3", "--warmup", "1", "--json",
                 "--out", str(tmp_path))  # fmt: skip
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    report = json.loads(out)
    rows = {r["runtime"]: r for r in report["results"]}
    assert set(rows) == {"disagg", "ep-1f1b"}
    for r in rows.values():
        assert r["ok"] and r["tokens_per_s"] > 0 and r["step_time_s"] > 0
        assert 0 <= r["exposed_comm_s"] <= r["step_time_s"] * 1.05
        assert r["predicted_step_s"] > 0
    assert rows["ep-1f1b"]["ratio_vs_ep_1f1b"] == pytest.approx(1.0)
    assert "Gbit/s NIC per worker (tbf)" in report["network"]
    assert ours(proc.pid) == []
    assert (tmp_path / "disagg-r0" / "trace.json").exists()


def test_a_failing_run_is_reported_and_cleaned_up(tmp_path: Path) -> None:
    # rank 0 is SIGKILLed before step 2 (fault injection): node 0's torchrun fails
    proc = bench("--runtimes", "ep-1f1b", "--steps", "3", "--warmup", "1", "--out",
                 str(tmp_path), "--set", "train.fail_at_step=1")  # fmt: skip
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err
    assert "ep-1f1b" in out and "FAILED" in out
    assert ours(proc.pid) == []


def test_ctrl_c_cleans_up(tmp_path: Path) -> None:
    proc = bench("--runtimes", "disagg", "--steps", "50", "--out", str(tmp_path))
    deadline = time.monotonic() + 60
    while not (tmp_path / "disagg-r0" / "node0.log").exists():
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    assert ours(proc.pid), "the cluster should exist while a run is going"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert ours(proc.pid) == []
    assert "interrupted" in err
