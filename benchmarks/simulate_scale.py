"""Wall-clock time of the simulator at cluster scale: 128 H800 GPUs, Qwen3-30B-A3B, S = 8K.

.venv/bin/python benchmarks/simulate_scale.py [--json benchmarks/results/simulate_scale.json]

* disagg: 16 nodes, p=4 m=16 n=16, 64 micro-batches per replica (symmetry reduction on);
* every EP runtime: pp=4 ep=32, 512 micro-batches (the disagg and EP steps differ in
  size: compare wall times, not simulated steps).

Prints a table; exits with 1 if a simulation took longer than `LIMIT_S`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from disagmoe.config import EP_RUNTIMES
from disagmoe.presets import CLUSTER_PRESETS, MODEL_PRESETS
from disagmoe.simulator import SimResult, simulate_disagg, simulate_ep

MODEL = "qwen3-30b-a3b"
GPUS = 128
SEQ_LEN = 8192
LIMIT_S = 5.0
MICRO_BATCHES = {"disagg": 64 * 16, "ep": 32 * 16}  # per step


def simulate(runtime: str) -> SimResult:
    model, cluster = MODEL_PRESETS[MODEL], CLUSTER_PRESETS["h800"]
    if runtime == "disagg":
        return simulate_disagg(model, cluster, groups=4, attn_workers=16, expert_workers=16,
                               seq_len=SEQ_LEN, micro_batch_size=1,
                               num_micro_batches=MICRO_BATCHES["disagg"])  # fmt: skip
    return simulate_ep(runtime, model, cluster, gpus=GPUS, pp=4, ep=32, seq_len=SEQ_LEN,
                       micro_batch_size=1, num_micro_batches=MICRO_BATCHES["ep"])  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args()
    rows: list[dict[str, object]] = []
    print(f"{'runtime':15s} {'GPUs':>5s} {'micro-batches':>13s} {'simulated step ms':>18s} "
          f"{'wall s':>8s}")  # fmt: skip
    for runtime in ("disagg", *EP_RUNTIMES):
        start = time.perf_counter()
        result = simulate(runtime)
        num_micro_batches = MICRO_BATCHES["disagg" if runtime == "disagg" else "ep"]
        seconds = time.perf_counter() - start
        rows.append({"runtime": runtime, "model": MODEL, "gpus": result.num_workers,
                     "seq_len": SEQ_LEN, "micro_batches": num_micro_batches, "step_time_s": result.step_time_s, "wall_s": seconds})  # fmt: skip
        flag = "" if seconds < LIMIT_S else f"  SLOWER THAN {LIMIT_S} s"
        print(f"{runtime:15s} {result.num_workers:5d} {num_micro_batches:13d} "
              f"{result.step_time_s * 1e3:18.1f} "
              f"{seconds:8.2f}{flag}")  # fmt: skip
    worst = max(float(r["wall_s"]) for r in rows)  # type: ignore[arg-type]
    print(f"slowest simulation: {worst:.2f} s (limit {LIMIT_S} s)")
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"limit_s": LIMIT_S, "rows": rows}, indent=1))
        print(f"wrote {out}")
    return 0 if worst < LIMIT_S else 1


if __name__ == "__main__":
    raise SystemExit(main())
