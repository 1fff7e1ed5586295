"""Every script in benchmarks/ still imports and builds its command line.

The benchmarks measure (minutes each; docs/ quote their output) and CI does not run them,
so an API they call can drift unseen. This imports each one as a module, as its own
directory would on `python benchmarks/NAME.py`, and runs `main` with `--help`: the imports
resolve and the argument parser builds. What each script measures is checked where a
cheap run is possible (`tests/e2e/test_gpu_check.py`, `tests/e2e/test_bench.py`); that the
docs show what `benchmarks/results/` holds, in `tests/unit/test_report.py`.
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys
import threading
import time
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted(p.stem for p in BENCHMARKS.glob("*.py"))
# imported by the scripts, no command line
LIBRARIES = {"results_io", "ablation_plots", "report_tables", "report_columns", "tables_simulated"}


def test_the_benchmark_folder_is_found() -> None:
    assert {"exchange_overhead", "schedule_orders", "gpu_check"} <= set(SCRIPTS)


@pytest.mark.parametrize("name", SCRIPTS)
def test_benchmark_script_imports_and_parses_help(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    module = importlib.import_module(name)
    if name in LIBRARIES:
        assert not hasattr(module, "main")
        return
    assert (module.__doc__ or "").strip(), f"benchmarks/{name}.py has no docstring"
    monkeypatch.setattr(sys, "argv", [f"{name}.py", "--help"])
    takes_argv = bool(inspect.signature(module.main).parameters)  # else it reads sys.argv
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"]) if takes_argv else module.main()
    assert exit_info.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_exchange_overhead_counts_each_threads_cpu_under_its_lane(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`benchmarks/exchange_overhead.py --threads`: a thread's CPU time is counted under
    its lane's name, and nowhere else."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench = importlib.import_module("exchange_overhead")
    assert bench._thread_group(None) == "native"  # gloo's loop threads have no Python name
    assert bench._thread_group("MainThread") == "main"
    assert bench._thread_group("recv3bwd") == "recv*"
    assert bench._thread_group("fwd") == "fwd"
    assert bench._thread_group("Thread-7") == "other"
    before = bench._thread_cpu_ns()
    if not before:
        pytest.skip("no /proc/self/task/TID/schedstat on this system")
    spun, release = threading.Event(), threading.Event()

    def spin() -> None:
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.05:
            pass
        spun.set()
        release.wait()

    lane = threading.Thread(target=spin, name="send")
    lane.start()
    try:
        assert spun.wait(30)
        spent = bench._by_group(before, bench._thread_cpu_ns())
    finally:
        release.set()
        lane.join()
    assert spent["send"] >= 0.045
    assert "fwd" not in spent
    assert spent.get("main", 0.0) < 0.02  # it only waited while the lane spun


def test_the_paper_figures_follow_from_the_scale_results(monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/results/paper_figures.json is what paper_figures.py derives from the
    scale table and the groups sweep as they are stored: re-running either means re-running
    it, or this fails."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    figures = importlib.import_module("paper_figures")
    results = BENCHMARKS / "results"
    table = json.loads((results / "scale_table.json").read_text())["rows"]
    groups = json.loads((results / "scale_groups.json").read_text())["rows"]
    stored = json.loads((results / "paper_figures.json").read_text())["rows"]
    derived = [figures.figure10(table), figures.figure11(table), figures.figure14(groups)]
    assert stored == derived


def test_the_scale_table_says_which_command_simulated_each_side(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A table assembled from a saved one (`--from ... --rerun R`) names, per side, the
    command that simulated it; the stored table's note is what its sides say."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    scale = importlib.import_module("scale_table")
    monkeypatch.setattr(sys, "argv", ["scale_table.py", "--rerun", "ep-overlap"])
    here = "python benchmarks/scale_table.py --rerun ep-overlap"
    assert scale.sides_note({"disagg": here, "ep-overlap": here}) == ""
    note = scale.sides_note({"disagg": "A", "ep-1f1b": "A", "ep-overlap": here})
    assert note == f"AF-Pipe, ep-1f1b as `A` simulated them; ep-overlap as `{here}` simulated it"
    stored = json.loads((BENCHMARKS / "results" / "scale_table.json").read_text())
    assert set(stored["sides"]) == {"disagg", *scale.EP_RUNTIMES}
    monkeypatch.setattr(sys, "argv", stored["meta"]["command"].split()[1:])
    assert stored["meta"].get("note", "") == scale.sides_note(stored["sides"])
