"""Recompute a finished `disagmoe bench`'s simulator predictions under each replay model.

.venv/bin/python benchmarks/bench_repredict.py runs/bench-fair8 [--json PATH]

Reads `<out>/bench.json` (the spec and each row's run dirs) and every run dir's
`metrics.jsonl`, `config.toml` and `trace.json` — what the bench itself reads — and runs
the bench's own summary (`bench.runner.summarize`: measured step, breakdown, bound,
prediction) once per model. Nothing is re-measured. The models (`MODELS`):

* `fifo`: the link model before max-min sharing (`simulator.links`), pooled costs;
* `pooled`: fair links, one compute median per (op, component, layer kind) and the
  workload's average message bytes (the bench's prediction before "own");
* `own`: fair links, each rank's instructions and each message's bytes as measured
  (the bench's prediction: `bench.analysis.predict_disagg`);
* `own+msg`: `own` with the run's per-message host costs (`bench.overheads`).

The EP rows are one model for all but `fifo` (the replay options are AF-Pipe's).
Prints one row per bench row: measured step, the predicted step and its error per
model, then the bound; `--json PATH` writes the same rows. `--table` prints the bench's
own table instead, summarized again with the current analysis (breakdown, bound and the
bench's prediction), as `disagmoe bench` would print it now; with `--plots DIR` also its
figures (`disagmoe bench --plots`). `--rewrite REPORT` replaces the rows of a saved
report (a copy of the bench's bench.json in benchmarks/results/) with that summary and
keeps the rest (spec, network, meta) but the compute label (with emulated compute, the
calibration the ranks waited, from the run dir's `compute_costs.json`): the measured
steps are the run's, the analysis today's, and `meta.reanalysed` says when.
"""

from __future__ import annotations

import argparse
import json
from datetime import date
from pathlib import Path
from typing import Any

from disagmoe.bench.analysis import Replay
from disagmoe.bench.cli import compute_label, format_table, write_plots
from disagmoe.bench.runner import RunOutcome, RuntimeResult, read_steps, summarize
from disagmoe.bench.spec import BenchSpec
from disagmoe.simulator.links import LinkModel

# name -> (link model, replay, per-message overheads)
MODELS: dict[str, tuple[LinkModel, Replay, bool]] = {
    "fifo": ("fifo", "pooled", False),
    "pooled": ("fair", "pooled", False),
    "own": ("fair", "own", False),
    "own+msg": ("fair", "own", True),
}


def load_spec(out_dir: Path) -> tuple[BenchSpec, list[dict[str, Any]]]:
    """The bench's spec and its JSON rows, as `disagmoe bench` wrote them."""
    report = json.loads((out_dir / "bench.json").read_text())
    raw = dict(report["spec"])
    raw.pop("world", None)
    fields = BenchSpec.__dataclass_fields__
    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items() if k in fields}
    kw["out_dir"] = out_dir
    return BenchSpec(**kw), report["results"]


def outcomes(spec: BenchSpec, rows: list[dict[str, Any]]) -> list[RunOutcome]:
    """One outcome per run dir of a row that measured steps (the bench's `RunOutcome`).
    The report keeps a row's tbf drops summed over its runs: they go to its first run, so
    the summary's sum is the measured one."""
    out = []
    for row in rows:
        drops = int(row.get("nic_drops") or 0)
        for k, run_dir in enumerate(row.get("run_dirs") or []):
            path = Path(run_dir)
            if row.get("ok") and (path / "trace.json").exists():
                steps = read_steps(path, spec.warmup)
                run = RunOutcome(row["runtime"], k, path, True, step_times=steps, drops=drops)
                out.append(run)
                drops = 0
    return out


def rewrite(path: Path, results: list[RuntimeResult], spec: BenchSpec) -> None:
    """`path`'s rows replaced by `results` (the same runtimes, in order) and its compute
    label by today's (`compute_label`: with the calibration where the run dir has it), the
    rest kept."""
    report = json.loads(path.read_text())
    old = [r["runtime"] for r in report["results"]]
    new = [r.runtime for r in results]
    if old != new:
        raise SystemExit(f"bench_repredict: {path} has rows {old}, the run dir {new}")
    report["results"] = [r.to_dict() for r in results]
    report["compute"] = compute_label(spec)
    report.setdefault("meta", {})["reanalysed"] = date.today().isoformat()
    path.write_text(json.dumps(report, indent=2) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out_dir", type=Path, help="a `disagmoe bench --out` directory")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    parser.add_argument("--table", action="store_true", help="print the bench's own table")
    parser.add_argument("--plots", metavar="DIR", type=Path, help="with --table: its figures")
    parser.add_argument(
        "--rewrite", metavar="REPORT", type=Path, help="with --table: its rows, re-analysed"
    )
    args = parser.parse_args()
    spec, rows = load_spec(args.out_dir)
    runs = outcomes(spec, rows)
    if args.rewrite and not args.table:
        parser.error("--rewrite needs --table")
    if args.table:
        network = json.loads((args.out_dir / "bench.json").read_text())["network"]
        results = summarize(spec, runs)
        print(format_table(spec, results, network))
        if args.plots:
            write_plots(spec, results, network, args.plots)
        if args.rewrite:
            rewrite(args.rewrite, results, spec)
        return 0
    models = tuple(MODELS)
    results: dict[str, list[RuntimeResult]] = {m: summarize(spec, runs, *MODELS[m]) for m in models}
    head = f"{'runtime':22s} {'step s':>7s}"
    for m in models:
        head += f" {m + ' sim s':>11s} {'err':>6s}"
    print(head + f" {'bound s':>8s}")
    table = []
    for k, res in enumerate(results[models[0]]):
        if not res.ok:
            continue
        line = f"{res.runtime:22s} {res.step_time_s:7.3f}"
        entry: dict[str, Any] = {"runtime": res.runtime, "step_time_s": res.step_time_s}
        for m in models:
            r = results[m][k]
            line += f" {r.predicted_step_s:11.3f} {100 * r.prediction_error:+5.0f}%"
            entry[f"predicted_step_s_{m}"] = r.predicted_step_s
            entry[f"prediction_error_{m}"] = r.prediction_error
        bound = res.bound.seconds if res.bound else 0.0
        entry["bound_s"] = bound
        print(line + f" {bound:8.3f}")
        table.append(entry)
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
