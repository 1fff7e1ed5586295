"""A saved `disagmoe bench` report (its bench.json, kept in benchmarks/results/) as the
Markdown table docs/bench.md shows: every runtime beside its own bound, and each one
against the fastest baseline.

    python benchmarks/bench_table.py benchmarks/results/bench8_searched.json [...]

Columns: tokens/s; step s (median over measured steps; with more than one repetition,
the fastest and slowest repetition's median in brackets); bound s (max over ranks of compute
and its node's busier NIC direction, from the trace: `bench.bound.trace_bound`) and
step/bound; the bound with the pipeline's fill and drain at the row's layout and
micro-batch count (on compute and on each NIC) and the all-reduce of the gradient buckets the final backward completes
(`bench.bound.trace_bound(fill=True)`) and step over it; what binds; exposed communication (s/step, mean over ranks); the simulator's
error on the step; the packets the NICs' token buckets dropped per step (over every step
the row ran, warm-up and repeats included: docs/bench.md, "The emulated cluster"); the
layout the row ran; tokens/s against the fastest EP runtime.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def drops_per_step(report: dict[str, Any], row: dict[str, Any]) -> float:
    """A row's tbf drops over the steps its runs ran (`nic_drops` sums its repeats)."""
    spec = report["spec"]
    return float(row.get("nic_drops") or 0) / (spec["steps"] * spec["repeats"])


def table(report: dict[str, Any]) -> str:
    rows = [r for r in report["results"] if r["ok"]]
    best_ep = max((r["tokens_per_s"] for r in rows if r["runtime"].startswith("ep-")), default=0.0)
    spec = report["spec"]
    head = (
        f"{spec['model']}, {spec['world']} workers ({report['network']}), global batch "
        f"{spec['global_batch_size']}x{spec['seq_len']}, micro-batch {spec['micro_batch_size']}; "
        f"{report['compute']}"
    )
    lines = [
        head,
        "",
        "| runtime | tokens/s | step s | bound s | step/bound | with fill s | step/fill "
        "| binds | exposed s | sim err | drops/step | vs best EP | layout |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        vs = f"{r['tokens_per_s'] / best_ep:.2f}x" if best_ep else "-"  # no EP row ran
        lo, hi = r.get("step_time_spread_s") or (0.0, 0.0)
        step = f"{r['step_time_s']:.3f}" + (f" ({lo:.3f}-{hi:.3f})" if lo < hi else "")
        lines.append(
            f"| {r['runtime']} | {r['tokens_per_s']:.0f} | {step} "
            f"| {r['bound_s']:.3f} | {r['step_over_bound']:.2f} | {r['fill_bound_s']:.3f} "
            f"| {r['step_over_fill_bound']:.2f} | {r['binding']} "
            f"| {r['exposed_comm_s']:.3f} | {100 * r['prediction_error']:+.0f}% "
            f"| {drops_per_step(report, r):.0f} | {vs} "
            f"| {r['layout']} |"
        )
    for r in report["results"]:
        if not r["ok"]:
            lines.append(f"| {r['runtime']} | FAILED: {r['error']} ||||||||||||")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="+", type=Path, help="bench.json files")
    args = parser.parse_args(argv)
    for k, path in enumerate(args.reports):
        try:
            report = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            print(f"bench_table: cannot read {path}: {err}", file=sys.stderr)
            return 2
        print(("\n" if k else "") + table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
