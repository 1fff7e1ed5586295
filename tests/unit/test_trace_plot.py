"""Trace plots shade the binding resource of a step's bound (`plots.trace`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from disagmoe.plots.trace import TraceBound, binding_rows, load_events, plot_traces, trace_bound_of
from disagmoe.presets import CLUSTER_PRESETS, model_preset
from disagmoe.simulator import simulate_disagg
from disagmoe.simulator.bound import Bound

ROWS = [(0, "fwd"), (0, "bwd"), (0, "send"), (0, "recv"), (1, "fwd"), (1, "bwd"), (1, "sync")]
NAMES = {0: "rank 0 A(g0,r0) x4", 1: "rank 1 F(g0,j0) x4"}


@pytest.mark.parametrize(
    ("bound", "shaded"),
    [
        (TraceBound(1.0, "compute", "F(g0,j0)"), [4, 5]),
        (TraceBound(1.0, "network", "A(g0,r0)"), [2, 3]),
        (TraceBound(1.0, "compute", "rank 0"), [0, 1]),
        (TraceBound(1.0, "serial", "rank 1"), [6]),
        (TraceBound(1.0, "network", "rank 1"), [4, 5, 6]),  # no send/recv row drawn: all its rows
        (TraceBound(1.0, "network", "nic-out node 3"), []),  # a port: no worker row
        (TraceBound(1.0, "compute", "rank 7"), []),
    ],
)
def test_binding_rows_are_the_binding_workers_lanes_of_its_resource(
    bound: TraceBound, shaded: list[int]
) -> None:
    assert binding_rows(ROWS, NAMES, bound) == shaded


def test_trace_bound_of_a_bound_and_of_its_dict() -> None:
    b = Bound(0.25, "network", "rank 3", 0.1, 0.25, 0.0)
    assert TraceBound.of(b, time_scale=4.0) == TraceBound(1.0, "network", "rank 3")
    assert TraceBound.of(b.to_dict()) == TraceBound(0.25, "network", "rank 3")


def test_a_simulated_trace_carries_its_bound_and_plots_it(tmp_path: Path) -> None:
    r = simulate_disagg(model_preset("tiny"), CLUSTER_PRESETS["h800"], groups=1, attn_workers=2, expert_workers=2,
                        seq_len=64, micro_batch_size=1, num_micro_batches=4)  # fmt: skip
    assert r.bound is not None
    path = tmp_path / "trace.json"
    r.write_trace(path)
    carried = trace_bound_of(path)
    assert carried == TraceBound(r.bound.seconds, r.bound.binding, r.bound.worker)
    events, names = load_events(path)
    rows = sorted({(e["pid"], e["cat"]) for e in events})
    assert binding_rows(rows, names, carried), "the simulator's binding worker is a drawn rank"
    assert "traceEvents" in json.loads(path.read_text())
    out = tmp_path / "trace.png"
    plot_traces([("sim", path)], out)
    assert out.stat().st_size > 0


def test_the_bench_trace_pair_draws_each_runs_bound_in_trace_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`bench.plots.plot_trace_pair` hands each row's bound to the plot, scaled to the
    trace's wall clock (an emulated run's trace is `time_scale` x slower)."""
    from disagmoe.bench import plots
    from disagmoe.bench.runner import RuntimeResult

    r = simulate_disagg(model_preset("tiny"), CLUSTER_PRESETS["h800"], groups=1, attn_workers=1,
                        expert_workers=1, seq_len=64, micro_batch_size=1, num_micro_batches=2)  # fmt: skip
    (tmp_path / "run").mkdir()
    r.write_trace(tmp_path / "run" / "trace.json")
    bound = Bound(0.5, "network", "rank 0", 0.1, 0.5, 0.0)
    rows = [RuntimeResult("disagg", True, "", "", bound=bound, run_dirs=[str(tmp_path / "run")])]
    seen: list[object] = []
    monkeypatch.setattr(plots, "plot_traces", lambda traces, out, **kw: seen.append(kw["bounds"]))
    plots.plot_trace_pair(rows, tmp_path / "pair.png", step=0, time_scale=20.0)
    assert seen == [[TraceBound(10.0, "network", "rank 0")]]
