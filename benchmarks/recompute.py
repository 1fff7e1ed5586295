"""Training throughput with activation recompute none, attn and full, side by side.

    PYTHONPATH=src .venv/bin/python benchmarks/recompute.py [--steps 20] [--rounds 3]
        [--json PATH] [-- more `disagmoe train` arguments]

Runs `disagmoe train` (by default the default run: `disagg`, the tiny model, p = 1, m = n = 2,
float32) once per mode and round, `--recompute` none / attn / full, the modes interleaved
within each round so that a change of load on a shared machine falls on every mode alike.
A run's step time is the median of its `metrics.jsonl` step times after the first
`--warmup` steps; a mode's is the median over its rounds. Prints mode, s/step, tokens/s and
the ratio of tokens/s to none; writes JSON with a `rows` list and every run's step times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from results_io import write_json

from disagmoe.config import RECOMPUTE


def run_once(mode: str, steps: int, extra: list[str], run_dir: Path) -> list[dict[str, Any]]:
    """One `disagmoe train` with `--recompute mode`; its metrics records."""
    cmd = [sys.executable, "-m", "disagmoe.cli", "train", "--steps", str(steps), "--no-progress"]
    cmd += ["--recompute", mode, "--run-dir", str(run_dir), *extra]
    src = str(Path(__file__).resolve().parent.parent / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of each run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default="benchmarks/results/recompute.json")
    parser.add_argument("extra", nargs="*", help="more `disagmoe train` arguments (after --)")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        raise SystemExit("--steps must exceed --warmup")
    runs: dict[str, list[list[float]]] = {mode: [] for mode in RECOMPUTE}
    tokens_per_step = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for mode in RECOMPUTE:
                records = run_once(mode, args.steps, args.extra, Path(tmp) / f"{mode}-{r}")
                times = [rec["step_time_s"] for rec in records[args.warmup :]]
                runs[mode].append(times)
                tokens_per_step = records[-1]["tokens_per_s"] * records[-1]["step_time_s"]
    rows = []
    for mode in RECOMPUTE:
        step_s = statistics.median(statistics.median(times) for times in runs[mode])
        rows.append({"mode": mode, "step_s": step_s, "tokens_per_s": tokens_per_step / step_s})
    base = rows[0]["tokens_per_s"]
    print(f"disagmoe train {' '.join(args.extra) or '(default run)'}: {args.rounds} rounds x")
    print(f"{args.steps} steps per mode, median after {args.warmup} warm-up steps")
    print(f"{'mode':<6}{'s/step':>9}{'tokens/s':>10}{'ratio':>8}")
    for row in rows:
        row["ratio"] = row["tokens_per_s"] / base
        print(f"{row['mode']:<6}{row['step_s']:>9.4f}{row['tokens_per_s']:>10.0f}{row['ratio']:>8.3f}")
    write_json(
        args.json,
        {
            "command": ["disagmoe", "train", *args.extra],
            "steps": args.steps,
            "warmup": args.warmup,
            "rounds": args.rounds,
            "tokens_per_step": tokens_per_step,
            "rows": rows,
            "step_times": runs,
        },
    )


if __name__ == "__main__":
    main()
