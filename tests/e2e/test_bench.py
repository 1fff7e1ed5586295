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

from disagmoe.bench.netns import EmulatedCluster, available, list_namespaces

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
        # the bound (trace: compute, NIC bytes / tbf rate) is below the measured step
        assert 0 < r["bound_s"] <= r["step_time_s"] * 1.05
        assert r["step_over_bound"] == pytest.approx(r["step_time_s"] / r["bound_s"])
    assert rows["ep-1f1b"]["ratio_vs_ep_1f1b"] == pytest.approx(1.0)
    assert "Gbit/s NIC per worker (tbf, MTU 9000, queue 500 kB)" in report["network"]
    assert report["emulated_compute"] is False
    # no --pp with real compute either: the EP row ran the layout the search found best
    assert [layout[0] for layout in report["spec"]["ep_layouts"]] == ["ep-1f1b"]
    assert ours(proc.pid) == []
    assert (tmp_path / "disagg-r0" / "trace.json").exists()
    # torchrun-launched ranks save the config they ran: the memory budget rank 0 resolved
    # (the in-flight cap follows from it; the simulator's replay needs the same cap)
    from disagmoe.config_io import load_toml

    assert load_toml(tmp_path / "disagg-r0" / "config.toml").train.memory_gib > 0
    # the run dir keeps the report and the table, whatever was printed
    assert json.loads((tmp_path / "bench.json").read_text())["results"] == report["results"]
    assert (tmp_path / "bench.txt").read_text().splitlines()[1].startswith("runtime")


def test_emulated_compute_runs_more_ranks_than_cores_and_says_so(tmp_path: Path) -> None:
    """4 ranks on a 2-core machine: each attention/expert call waits its calibrated
    duration x the time scale, so the traces' compute spans are at least that long."""
    proc = bench("--compute", "emulated", "--time-scale", "2", "--nodes", "2",
                 "--ranks-per-node", "2", "--runtimes", "disagg,ep-1f1b", "--steps", "3",
                 "--warmup", "1", "--json", "--out", str(tmp_path),
                 "--placements", "node-aware,packed", "--attn-workers", "2",
                 "--expert-workers", "2")  # fmt: skip
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err
    report = json.loads(out)
    assert report["emulated_compute"] is True and report["time_scale"] == 2.0
    assert "EMULATED compute" in report["compute"] and "at 1/2" in report["network"]
    assert all(r["ok"] and r["tokens_per_s"] > 0 for r in report["results"])
    rows = {r["runtime"]: r for r in report["results"]}
    assert set(rows) == {"disagg", "disagg (packed)", "ep-1f1b"}
    assert all(rows[k]["predicted_step_s"] > 0 for k in ("disagg", "disagg (packed)"))
    # no --pp: the EP row ran the layout the simulator found best among those it accepts
    ((runtime, pp, ep, *_),) = report["spec"]["ep_layouts"]
    assert runtime == "ep-1f1b" and f"pp {pp} ep {ep} " in rows["ep-1f1b"]["layout"]
    for name, placement in (("disagg", "node-aware"), ("disagg-packed", "packed")):
        info = json.loads((tmp_path / f"{name}-r0" / "run.json").read_text())
        assert info["placement"] == placement and info["ranks_per_node"] == 2
        mixed = info["nodes"] == [{"A": 1, "F": 1}] * 2  # m = n = 2 on 2 nodes of 2
        assert mixed == (placement == "node-aware"), info
    costs = json.loads((tmp_path / "compute_costs.json").read_text())
    assert "x2" in costs["note"]
    attn_fwd = costs["attn_fwd"]["fixed"] + costs["attn_fwd"]["per_row"] * 2 * 64
    trace = json.loads((tmp_path / "disagg-r0" / "trace.json").read_text())
    fa = [e["dur"] / 1e6 for e in trace["traceEvents"]
          if e.get("ph") == "X" and e["name"].startswith("FA l0 ")]  # fmt: skip
    assert fa and min(fa) >= attn_fwd
    config = (tmp_path / "disagg-r0" / "config.toml").read_text()
    assert "compute_costs.json" in config
    assert ours(proc.pid) == []


def test_nic_rates_change_in_place_between_runs() -> None:
    with EmulatedCluster([100.0, 100.0], mtu=9000) as cluster:
        assert all("rate 100Mbit" in q for q in cluster.qdiscs()), cluster.qdiscs()
        cluster.set_rates([50.0, 150.0])
        lines = cluster.qdiscs()
        node0 = [q for q in lines if q.startswith(cluster.node(0)) or " dev v0 " in q]
        node1 = [q for q in lines if q.startswith(cluster.node(1)) or " dev v1 " in q]
        assert len(node0) == len(node1) == 2  # the node's egress and the hub port towards it
        assert all("rate 50Mbit" in q for q in node0) and all("rate 150Mbit" in q for q in node1)
        name = cluster.name
    assert list_namespaces(f"{name}-") == []


UDP_BURST = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for _ in range(400):
    s.sendto(bytes(8000), (sys.argv[1], 9))
"""


def test_drops_counts_what_the_token_buckets_drop() -> None:
    # 3.2 MB of datagrams at once into a 1 Mbit/s bucket with a 5 ms queue: most are dropped
    with EmulatedCluster([1.0, 1.0], mtu=9000, queue_ms=5.0) as cluster:
        assert cluster.drops() == 0
        argv = cluster.wrap(0, [sys.executable, "-c", UDP_BURST, cluster.addr(1)])
        subprocess.run(argv, check=True, timeout=60)
        assert cluster.drops() > 300


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
