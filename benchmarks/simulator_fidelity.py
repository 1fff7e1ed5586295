"""Simulator fidelity: predict a real CPU `disagg` step from its own per-instruction times.

1. Train a small model for a few steps with the real AF-Pipe executor (gloo, one
   process per rank, `DisaggTrainer`); every rank traces one event per executed
   instruction (args: layer, slot, step) and every message (bytes).
2. Build a cost table from the trace: the median duration per (op, comp, layer
   kind) over the steps after the first (warm-up), a latency + bytes/bandwidth
   fit of the messages (send post -> arrival), and the median SYNC and STEP.
3. Replay the same schedule in the simulator with that table (lanes do not share
   compute: measured durations already include the CPU contention of the run)
   and print predicted vs measured step time.

    .venv/bin/python benchmarks/simulator_fidelity.py [--config NAME ...] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from disagmoe.config import RunConfig, from_dict
from disagmoe.distributed.layout import Layout
from disagmoe.simulator import Network, TableCosts, Workload, simulate_schedule

CONFIGS: dict[str, dict[str, Any]] = {
    "p1-m1-n1": {"groups": 1, "attn_workers": 1, "expert_workers": 1},
    "p2-m1-n1": {"groups": 2, "attn_workers": 1, "expert_workers": 1},
    "p1-m2-n2": {"groups": 1, "attn_workers": 2, "expert_workers": 2},
}


def make_config(layout: dict[str, Any], steps: int, seq_len: int, slots: int) -> RunConfig:
    m = layout["attn_workers"]
    return from_dict(
        {
            "model": {"preset": "small", "num_layers": 4},
            "parallel": {"runtime": "disagg", "threads_per_rank": 1, **layout},
            "train": {
                "steps": steps,
                "seq_len": seq_len,
                "micro_batch_size": 2,
                "global_batch_size": 2 * m * slots,
                "progress": False,
                "dtype": "float32",
            },
        }
    )


def train_and_trace(cfg: RunConfig) -> dict[str, Any]:
    """Runs inside each rank: real steps, wall time per step, this rank's trace events."""
    import torch.distributed as dist

    from disagmoe.runtime.disagg import DisaggTrainer

    trainer = DisaggTrainer(cfg)
    times = []
    for step in range(cfg.train.steps):
        dist.barrier()
        t0 = time.perf_counter()
        trainer.step(step)
        times.append(time.perf_counter() - t0)
    return {"times": times, "events": trainer.tracer.events, "rank": dist.get_rank()}


STATS = {"median": statistics.median, "mean": statistics.fmean}


def _stat_by(events: list[dict[str, Any]], key: Any, stat: str) -> dict[Any, float]:
    groups: dict[Any, list[float]] = defaultdict(list)
    for e in events:
        k = key(e)
        if k is not None:
            groups[k].append(e["dur"] / 1e6)
    return {k: STATS[stat](v) for k, v in groups.items()}


def cost_table(
    per_rank: list[dict[str, Any]], workload: Workload, stat: str = "median"
) -> tuple[TableCosts, dict[str, float]]:
    events = [e for r in per_rank for e in r["events"] if e["args"].get("step", 0) >= 1]

    def compute_key(e: dict[str, Any]) -> tuple[str, str, str] | None:
        if e["cat"] not in ("fwd", "bwd"):
            return None
        name = e["name"]  # e.g. "FA l3 s1"
        return (name[0], name[1], workload.layer_kind(name[1], e["args"]["layer"]))

    table = _stat_by(events, compute_key, stat)
    sends = {
        (e["pid"], e["args"]["dst"], e["name"][5:], e["args"]["step"]): e
        for e in events
        if e["cat"] == "send"
    }
    by_size: dict[float, list[float]] = defaultdict(list)  # send post -> arrival, per size
    for e in events:
        if e["cat"] != "recv":
            continue
        s = sends.get((e["args"]["src"], e["pid"], e["name"][5:], e["args"]["step"]))
        if s is not None:
            by_size[float(s["args"]["bytes"])].append(max((e["ts"] + e["dur"] - s["ts"]) / 1e6, 0))
    xs = sorted(by_size)
    ys = [STATS[stat](by_size[x]) for x in xs]
    slope, intercept = 0.0, float(np.median(ys))
    if len(xs) > 1 and xs[-1] > 2 * xs[0]:
        slope, intercept = (float(v) for v in np.polyfit(xs, ys, 1))
    extra = {
        "latency_s": max(float(intercept), 0.0),
        "bytes_per_s": 1.0 / slope if slope > 0 else 1e12,
        "sync_s": statistics.median(
            [e["dur"] / 1e6 for e in events if e["name"] == "SYNC grads"] or [0.0]
        ),
        "step_s": statistics.median([e["dur"] / 1e6 for e in events if e["name"] == "STEP"]),
    }
    return TableCosts(workload, table), extra


def run_one(name: str, steps: int, seq_len: int, slots: int) -> dict[str, Any]:
    from disagmoe.runtime.disagg import DisaggTrainer  # noqa: F401 - fail early if missing
    from disagmoe.schedule.afpipe import build_afpipe
    from disagmoe.testing.spawn import run_ranks

    cfg = make_config(CONFIGS[name], steps, seq_len, slots)
    layout = Layout.build(cfg.model, cfg.parallel)
    per_rank = run_ranks(train_and_trace, layout.world_size, cfg, timeout_s=900)
    measured = statistics.median(max(r["times"][s] for r in per_rank) for s in range(1, steps))
    spans = []  # first instruction start -> last instruction end, all ranks
    for step in range(1, steps):
        ev = [
            e
            for r in per_rank
            for e in r["events"]
            if e["args"].get("step") == step and e["cat"] in ("fwd", "bwd", "send", "recv")
        ]
        spans.append((max(e["ts"] + e["dur"] for e in ev) - min(e["ts"] for e in ev)) / 1e6)
    measured_span = statistics.median(spans)
    workload = Workload(cfg.model, seq_len, cfg.train.micro_batch_size, act_bytes=4, index_bytes=8)
    schedule = build_afpipe(layout, slots, cfg.schedule.max_in_flight)
    row: dict[str, Any] = {
        "config": name,
        "world": layout.world_size,
        "slots": slots,
        "seq_len": seq_len,
        "measured_step_s": measured,
        "measured_pipeline_s": measured_span,
    }
    for stat in STATS:
        costs, extra = cost_table(per_rank, workload, stat)
        net = Network.single_node(extra["bytes_per_s"], extra["latency_s"], layout.world_size)
        sim = simulate_schedule(
            schedule, layout, costs, workload, net, share_compute=False, sync=False
        )
        predicted = sim.step_time_s + extra["sync_s"] + extra["step_s"]
        row[stat] = {
            "predicted_step_s": predicted,
            "error": predicted / measured - 1.0,
            "pipeline_s": sim.step_time_s,
            "pipeline_error": sim.step_time_s / measured_span - 1.0,
            **extra,
            "table": {"/".join(k): v for k, v in sorted(costs.table.items())},
        }
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--json", default="docs/figures/simulator_fidelity.json")
    args = parser.parse_args()
    rows = [run_one(name, args.steps, args.seq_len, args.slots) for name in args.config]
    print("step = whole optimizer step; pipeline = first to last instruction of the lists")
    print(
        f"{'config':10s} {'ranks':>5s} {'table':>6s} {'step meas.':>11s} {'step pred.':>11s} "
        f"{'error':>7s} {'pipe meas.':>11s} {'pipe pred.':>11s} {'error':>7s}"
    )
    for r in rows:
        for stat in STATS:
            x = r[stat]
            print(
                f"{r['config']:10s} {r['world']:5d} {stat:>6s} "
                f"{r['measured_step_s'] * 1e3:9.1f}ms {x['predicted_step_s'] * 1e3:9.1f}ms "
                f"{100 * x['error']:+6.1f}% {r['measured_pipeline_s'] * 1e3:9.1f}ms "
                f"{x['pipeline_s'] * 1e3:9.1f}ms {100 * x['pipeline_error']:+6.1f}%"
            )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
