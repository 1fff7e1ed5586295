"""Training throughput with activation recompute none, attn and full, side by side.

    PYTHONPATH=src .venv/bin/python benchmarks/recompute.py [--steps 20] [--rounds 3]
        [--json PATH] [-- more `disagmoe train` arguments]

Runs `disagmoe train` (by default the default run: `disagg`, the tiny model, p = 1, m = n = 2,
float32) once per mode and round, `--recompute` none / attn / full, the modes interleaved
within each round so that a change of load on a shared machine falls on every mode alike.
A run's step time is the median of its `metrics.jsonl` step times after the first
`--warmup` steps; a mode's is the median over its rounds. Prints mode, s/step, tokens/s and
the ratio of tokens/s to none; writes JSON with a `rows` list and every run's step times.

First, in this process (alone with `--rounds 0`), the bytes one micro-batch's A component (layer 1) and expert shard
(layer 0) save for backward in each mode (`testing.memory.stage_saved_bytes`, the default
run's model and micro-batch at each `--memory-seq-len`); `memory` in the JSON.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

from results_io import train_records, write_json

from disagmoe.config import RECOMPUTE, RunConfig, replace_section
from disagmoe.testing.memory import stage_saved_bytes

KIB = 1024


def memory_rows(seq_lens: list[int]) -> list[dict[str, Any]]:
    """Saved bytes per mode of an A component and an expert shard (one micro-batch)."""
    rows = []
    for seq_len in seq_lens:
        for mode in RECOMPUTE:
            cfg = replace_section(RunConfig(), "train", seq_len=seq_len, recompute=mode)
            saved = stage_saved_bytes(cfg)
            rows.append(
                {
                    "seq_len": seq_len,
                    "mode": mode,
                    **{f"{w}_{k}": getattr(saved[w], k) for w in "AF" for k in saved[w].__slots__},
                }
            )
    print("saved for backward per (layer, micro-batch), KiB (floats + integer indices)")
    print(f"{'seq':>5} {'mode':<6}{'A':>10}{'A inputs':>10}{'F':>10}{'F inputs':>10}")
    for r in rows:
        a, f = (r["A_floats"] + r["A_ints"]) / KIB, (r["F_floats"] + r["F_ints"]) / KIB
        print(
            f"{r['seq_len']:>5} {r['mode']:<6}{a:>10.1f}{r['A_inputs'] / KIB:>10.1f}"
            f"{f:>10.1f}{r['F_inputs'] / KIB:>10.1f}"
        )
    return rows


def run_once(mode: str, steps: int, extra: list[str], run_dir: Path) -> list[dict[str, Any]]:
    """One `disagmoe train` with `--recompute mode`; its metrics records."""
    return train_records(["--steps", str(steps), "--recompute", mode, *extra], run_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of each run")
    parser.add_argument(
        "--rounds", type=int, default=3, help="0: print the saved bytes only, write nothing"
    )
    parser.add_argument("--memory-seq-len", type=int, nargs="+", default=[64, 1024])
    parser.add_argument("--json", default="benchmarks/results/recompute.json")
    parser.add_argument("extra", nargs="*", help="more `disagmoe train` arguments (after --)")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        raise SystemExit("--steps must exceed --warmup")
    memory = memory_rows(args.memory_seq_len)
    if args.rounds == 0:  # the saved bytes only (deterministic): no runs, no JSON
        return
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
        print(
            f"{row['mode']:<6}{row['step_s']:>9.4f}{row['tokens_per_s']:>10.0f}{row['ratio']:>8.3f}"
        )
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
            "memory": memory,
        },
    )


if __name__ == "__main__":
    main()
