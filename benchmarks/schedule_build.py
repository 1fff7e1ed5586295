"""Time to build one rank's AF-Pipe list vs the whole world's schedule, and to validate it.

    .venv/bin/python benchmarks/schedule_build.py [--json benchmarks/results/schedule_build.json]

Rows: (model, p, m, n, slots). `rank_s` is `build_afpipe_rank` for an attention rank
and an expert rank (the slower is reported); `global_s` is `build_afpipe` (every rank)
and `validate_s` the whole-world validation, both skipped above `--global-limit` ranks
(they grow with m·n). Prints a table; writes JSON with a `rows` list.
"""

from __future__ import annotations

import argparse
import gc
import time

from results_io import write_json

from disagmoe.config import ParallelConfig
from disagmoe.distributed.layout import Layout
from disagmoe.presets import model_preset
from disagmoe.schedule.afpipe import build_afpipe, build_afpipe_rank
from disagmoe.schedule.validate import validate

CASES = [  # (model, p, m, n, slots per replica)
    ("tiny", 1, 2, 2, 4),
    ("tiny", 2, 2, 2, 8),
    ("small", 2, 4, 4, 8),
    ("qwen3-30b-a3b", 1, 4, 4, 16),
    ("qwen3-30b-a3b", 1, 8, 8, 16),
    ("qwen3-30b-a3b", 1, 32, 32, 16),
    ("qwen3-30b-a3b", 2, 32, 32, 16),
]


def _timed(fn, *args):  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", default="", help="write the rows to this JSON file")
    parser.add_argument("--global-limit", type=int, default=16, help="ranks above which "
                        "the whole-world build and validation are skipped")  # fmt: skip
    args = parser.parse_args()
    rows = []
    print(f"{'model':15s} {'p':>2s} {'m':>3s} {'n':>3s} {'slots':>5s} {'instrs/rank':>11s} "
          f"{'rank s':>7s} {'global s':>8s} {'validate s':>10s}")  # fmt: skip
    for name, p, m, n, slots in CASES:
        lay = Layout.build(model_preset(name), ParallelConfig(groups=p, attn_workers=m,
                                                              expert_workers=n))  # fmt: skip
        times, sizes = [], []
        for rank in (lay.attn_rank(0, 0), lay.expert_rank(0, 0)):
            instrs, seconds = _timed(build_afpipe_rank, lay, rank, slots)
            times.append(seconds)
            sizes.append(len(instrs))
        row: dict[str, object] = {
            "model": name, "p": p, "m": m, "n": n, "slots": slots,
            "instrs_per_rank": max(sizes), "rank_s": max(times),
            "global_s": None, "validate_s": None,
        }  # fmt: skip
        if lay.world_size <= args.global_limit:
            sched, row["global_s"] = _timed(build_afpipe, lay, slots)
            _, row["validate_s"] = _timed(validate, sched)
            del sched
        gc.collect()  # the next case's timings do not pay for this one's garbage
        rows.append(row)

        def cell(key: str, width: int, row: dict[str, object] = row) -> str:
            v = row[key]
            return f"{v:{width}.3f}" if isinstance(v, float) else f"{'-':>{width}s}"

        print(f"{name:15s} {p:2d} {m:3d} {n:3d} {slots:5d} {max(sizes):11d} "
              f"{cell('rank_s', 7)} {cell('global_s', 8)} {cell('validate_s', 10)}")  # fmt: skip
    if args.json:
        write_json(args.json, {"rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
