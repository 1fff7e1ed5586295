"""A saved bench report re-analysed (`benchmarks/bench_repredict.py`) and shown
(`benchmarks/bench_table.py`) keeps what only the run measured: its tbf drops."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _module(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module(name)


def test_re_analysis_keeps_a_rows_drops(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    repredict = _module("bench_repredict", monkeypatch)
    dirs = []
    for k in range(2):
        d = tmp_path / f"disagg-r{k}"
        d.mkdir()
        (d / "trace.json").write_text("{}")
        dirs.append(str(d))
    monkeypatch.setattr(repredict, "read_steps", lambda path, warmup: {3: 1.0})
    spec = SimpleNamespace(warmup=1)  # all `outcomes` reads of the bench's spec
    rows = [
        {"runtime": "disagg", "ok": True, "nic_drops": 146, "run_dirs": dirs},
        {"runtime": "ep-1f1b", "ok": True, "run_dirs": dirs[:1]},
    ]
    runs = repredict.outcomes(spec, rows)
    assert [(o.runtime, o.drops) for o in runs] == [("disagg", 146), ("disagg", 0), ("ep-1f1b", 0)]


def test_the_bench_table_shows_drops_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    bench_table = _module("bench_table", monkeypatch)
    report = json.loads((BENCHMARKS / "results" / "bench8_searched.json").read_text())
    row = dict(report["results"][0], nic_drops=600)
    report["results"] = [row]
    report["spec"] = dict(report["spec"], steps=5, repeats=2)
    assert bench_table.drops_per_step(report, row) == 60.0
    lines = bench_table.table(report).splitlines()
    head, line = lines[2], lines[4]
    cells = [c.strip() for c in line.split("|")]
    assert cells[[c.strip() for c in head.split("|")].index("drops/step")] == "60"


def test_a_replay_runs_the_schedule_its_run_executed(tmp_path: Path) -> None:
    """`ran_schedule` pins what `auto` picked at the run's start (run.json), so the replay
    does not choose again; without a run.json the config stays as it was."""
    from disagmoe.bench.runner import ran_schedule
    from disagmoe.config import RunConfig, ScheduleConfig

    cfg = RunConfig(schedule=ScheduleConfig(order="auto", exchange_chunks=0))
    assert ran_schedule(cfg, tmp_path) == cfg
    facts = {"order": "steady", "exchange_chunks": 4, "split_backward": True, "max_in_flight": 3}
    (tmp_path / "run.json").write_text(json.dumps({"runtime": "disagg", "schedule": facts}))
    ran = ran_schedule(cfg, tmp_path).schedule
    assert (ran.order, ran.exchange_chunks, ran.split_backward, ran.max_in_flight) == (
        "steady", 4, "on", 3)  # fmt: skip
