"""Solve time of `disagmoe plan` (stages 1-3) from 8 to 4096 GPUs; prints a table, writes JSON.

.venv/bin/python benchmarks/plan_solve_times.py [--out benchmarks/results/plan_solve_times.json]
"""

from __future__ import annotations

import argparse
import time

from results_io import write_json

from disagmoe.planner import plan_for
from disagmoe.presets import CLUSTER_PRESETS, MODEL_PRESETS

GPUS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
MODELS = ("deepseek-moe-16b", "qwen3-30b-a3b", "gpt-oss-20b")
LIMIT_S = 2.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results/plan_solve_times.json")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--solver", choices=("milp", "enumerate"), default="milp")
    args = parser.parse_args()
    cluster = CLUSTER_PRESETS["h800"]
    rows: list[dict[str, object]] = []
    print(f"{'model':18s} {'GPUs':>5s} {'solve s':>8s} {'p':>3s} {'A:F GPUs':>11s} "
          f"{'A:F NICs':>10s} {'T_stage ms':>10s}  status")  # fmt: skip
    for name in MODELS:
        for gpus in GPUS:
            start = time.perf_counter()
            try:
                plan = plan_for(MODEL_PRESETS[name], cluster, gpus=gpus, seq_len=args.seq_len,
                                micro_batch_size=1, solver=args.solver)  # fmt: skip
                row: dict[str, object] = {"attn_gpus": plan.attn_gpus, "ffn_gpus": plan.ffn_gpus,
                                          "attn_nics": plan.attn_nics, "ffn_nics": plan.ffn_nics,
                                          "groups": plan.groups, "t_stage_s": plan.t_stage_s,
                                          "status": "ok"}  # fmt: skip
            except ValueError as err:
                row = {"status": f"infeasible: {str(err)[:60]}"}
            seconds = time.perf_counter() - start
            row.update(model=name, gpus=gpus, seq_len=args.seq_len, solve_s=seconds)
            rows.append(row)
            ok = row["status"] == "ok"
            split = f"{row['attn_gpus']}:{row['ffn_gpus']}" if ok else "-"
            nics = f"{row['attn_nics']}:{row['ffn_nics']}" if ok else "-"
            stage = f"{float(row['t_stage_s']) * 1e3:10.2f}" if ok else f"{'-':>10s}"  # type: ignore[arg-type]
            flag = "" if seconds < LIMIT_S else f"  SLOWER THAN {LIMIT_S} s"
            print(f"{name:18s} {gpus:5d} {seconds:8.3f} {row.get('groups', '-')!s:>3s} "
                  f"{split:>11s} {nics:>10s} {stage}  {row['status']}{flag}")  # fmt: skip
    write_json(args.out, {"limit_s": LIMIT_S, "rows": rows})
    worst = max(float(r["solve_s"]) for r in rows)  # type: ignore[arg-type]
    print(f"slowest solve: {worst:.3f} s (limit {LIMIT_S} s)")
    return 0 if worst < LIMIT_S else 1


if __name__ == "__main__":
    raise SystemExit(main())
