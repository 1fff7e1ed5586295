"""Measured vs predicted memory per rank of the disaggregated runtime.

Trains a few steps of each configuration (tiny model, `disagmoe train` flags) and prints,
per role, the peak activation bytes kept for backward and the parameter + gradient +
optimizer-state bytes that metrics.jsonl reports (largest rank of the role, last step)
beside the runtime memory model's prediction (costs.runtime_memory), with the in-flight
cap the budget allowed.

    PYTHONPATH=src python benchmarks/memory_model.py --json benchmarks/results/memory_model.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from results_io import write_json

from disagmoe.command import resolve_train_config, train_parser
from disagmoe.train import train

CASES: dict[str, list[str]] = {
    "default (p=1 m=2 n=2)": [],
    "n=1": ["--expert-workers", "1"],
    "n=1, cap 1": ["--expert-workers", "1", "--max-in-flight", "1"],
    "n=1, cap 1, recompute attn": [
        "--expert-workers",
        "1",
        "--max-in-flight",
        "1",
        "--recompute",
        "attn",
    ],
    "n=1, cap 1, recompute full": [
        "--expert-workers",
        "1",
        "--max-in-flight",
        "1",
        "--recompute",
        "full",
    ],
    "n=1, recompute full": ["--expert-workers", "1", "--recompute", "full"],
    "p=2 m=1 n=1": ["--groups", "2", "--attn-workers", "1", "--expert-workers", "1"],
    "float64, n=1": ["--dtype", "float64", "--expert-workers", "1"],
    "batch 32, 9.5 MiB budget": ["--global-batch-size", "32", "--memory-gib", "0.0095"],
}


def measure(flags: list[str], steps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        args = ["--steps", str(steps), "--no-progress", "--run-dir", str(Path(tmp) / "run")]
        cfg = resolve_train_config(train_parser().parse_args([*args, *flags]))
        _, records = train(cfg)
    return dict(records[-1]["memory_mib"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    rows = {name: measure(flags, args.steps) for name, flags in CASES.items()}
    print("MiB per rank (largest of the role), measured / predicted; act: activations at peak")
    head = f"{'config':30} {'cap':>6} {'A act':>13} {'A states':>13} {'F act':>13} {'F states':>13}"
    print(head)
    for name, mem in rows.items():
        cap = f"{mem['cap']['in_flight']}/{mem['cap']['slots']}"
        cells = [
            f"{mem[r][k]:.2f}/{mem[r][k + '_pred' if k == 'states' else 'act_pred']:.2f}"
            for r in ("A", "F")
            for k in ("act_peak", "states")
        ]
        print(f"{name:30} {cap:>6} " + " ".join(f"{c:>13}" for c in cells))
    if args.json:
        write_json(args.json, {"steps": args.steps, "cases": CASES, "memory_mib": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
