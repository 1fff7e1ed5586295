"""Garbage-collection pauses in training: Python's automatic collector against collections
every N steps on every rank at once (`train.gc_every`, `training.collector`), side by side.

    PYTHONPATH=src .venv/bin/python benchmarks/gc_pauses.py [--steps 200] [--rounds 3]
        [--every 50] [--json PATH] [-- more `disagmoe train` arguments]

Runs `disagmoe train` (by default the default run: `disagg`, the tiny model, 4 local
workers) with `--gc-every 0` (automatic) and `--gc-every N`, alternating within each round
so that a change of load on a shared machine falls on both alike. Each step's record says
how long the slowest rank spent collecting since the step before (`gc_s`: in automatic mode
every collection Python made, timed through `gc.callbacks`). Per run, after the first
`--warmup` steps: the median and the largest step time, the wall time per step (from
`elapsed_s`: steps, collections, logging, all of it), the seconds spent collecting and the
largest single step's share; per mode the median over its rounds. Prints a table and the
ratio of each mode's wall time per step to the automatic one's; writes JSON with `rows` and
every run's figures.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

from results_io import train_records, write_json


def run_once(every: int, steps: int, extra: list[str], run_dir: Path) -> list[dict[str, Any]]:
    """One `disagmoe train --gc-every EVERY`; its metrics records."""
    return train_records(["--steps", str(steps), "--gc-every", str(every), *extra], run_dir)


def summarize(records: list[dict[str, Any]], warmup: int) -> dict[str, float]:
    """One run's figures, its first `warmup` steps left out."""
    kept = records[warmup:]
    times = [r["step_time_s"] for r in kept]
    gcs = [r["gc_s"] for r in kept]
    wall = kept[-1]["elapsed_s"] - (records[warmup - 1]["elapsed_s"] if warmup else 0.0)
    return {
        "step_median_s": statistics.median(times),
        "step_max_s": max(times),
        "wall_per_step_s": wall / len(kept),
        "gc_total_s": sum(gcs),
        "gc_max_s": max(gcs),
    }


FIGURES = ("step_median_s", "step_max_s", "wall_per_step_s", "gc_total_s", "gc_max_s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=1, help="steps left out of each run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--every", type=int, default=50, help="the scheduled mode's interval")
    parser.add_argument("--json", default="benchmarks/results/gc_pauses.json")
    parser.add_argument("extra", nargs="*", help="more `disagmoe train` arguments (after --)")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        raise SystemExit("--steps must exceed --warmup")
    if args.every < 1:
        raise SystemExit("--every must be >= 1 (the automatic mode runs anyway)")
    modes = (0, args.every)
    runs: dict[int, list[dict[str, float]]] = {every: [] for every in modes}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for every in modes:
                records = run_once(every, args.steps, args.extra, Path(tmp) / f"{every}-{r}")
                runs[every].append(summarize(records, args.warmup))
                print(f"round {r + 1}, gc_every {every}: "
                      + ", ".join(f"{k} {v:.4f}" for k, v in runs[every][-1].items()),
                      flush=True)  # fmt: skip
    rows = []
    for every in modes:
        row: dict[str, Any] = {"gc_every": every}
        row.update({k: statistics.median(run[k] for run in runs[every]) for k in FIGURES})
        rows.append(row)
    base = rows[0]["wall_per_step_s"]
    print(f"disagmoe train {' '.join(args.extra) or '(default run)'}: {args.rounds} rounds x "
          f"{args.steps} steps per mode, medians over rounds, first {args.warmup} step(s) "
          "left out")  # fmt: skip
    print(f"{'gc_every':>8} {'step median':>11} {'step max':>9} {'wall/step':>9} "
          f"{'GC total':>9} {'GC max':>7} {'wall ratio':>10}")  # fmt: skip
    for row in rows:
        row["wall_ratio"] = row["wall_per_step_s"] / base
        print(f"{row['gc_every']:>8} {row['step_median_s']:>11.4f} {row['step_max_s']:>9.4f} "
              f"{row['wall_per_step_s']:>9.4f} {row['gc_total_s']:>9.3f} {row['gc_max_s']:>7.3f} "
              f"{row['wall_ratio']:>10.3f}")  # fmt: skip
    write_json(
        args.json,
        {
            "command": ["disagmoe", "train", *args.extra],
            "steps": args.steps,
            "warmup": args.warmup,
            "rounds": args.rounds,
            "rows": rows,
            "runs": {str(every): figures for every, figures in runs.items()},
        },
    )


if __name__ == "__main__":
    main()
