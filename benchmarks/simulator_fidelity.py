"""Simulator fidelity: predict real CPU steps (AF-Pipe and EP 1F1B) from their own traces.

1. Train a small model for a few steps with the real runtime, as a user runs it:
   `disagmoe train --runtime disagg|ep-1f1b ... --threads-per-rank 1 --run-dir DIR`
   (one run at a time; default configs use 2 ranks x 1 thread on this 2-core host).
   Every rank traces one event per executed instruction and message.
2. Fit a cost model to the trace of steps 2.. (step 1 is warm-up):
   * compute: the mean per (op, comp, layer) (AF-Pipe) or per (kind, stage) (1F1B) of
     the CPU time each instruction received — its wall time with every instant weighted
     by `min(1, cores / compute instructions running on the host)`, the inverse of
     the processor sharing the simulator applies (`engine.run_program(cores=...)`);
   * per instruction: the mean lane gap (from a lane being free to its next
     instruction starting, when no message was awaited: Python dispatch, GIL);
   * per message (`MessageOverheads`): posting the sends (AF-Pipe: send post end minus
     the producing compute's end), the receiver's payload time `a + b*bytes` (the
     recv event), the hand-off to the waiting lane (consumer start minus the recv
     end, when the message was what it waited for), and the wire latency (arrival
     minus post, for messages whose receiver was already waiting);
   * SYNC and STEP: each rank's mean durations, after that rank's last instruction.
3. Replay the *same instruction lists* the run executed (`runtime.disagg.run_schedule`,
   `schedule.baselines.build_baseline_schedule`) with that model, the compute of all
   ranks sharing the host's cores, and print predicted vs measured step time.

    .venv/bin/python benchmarks/simulator_fidelity.py [--config NAME ...] [--reuse]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from disagmoe.config import RunConfig
from disagmoe.config_io import load_toml
from disagmoe.distributed.ep_layout import EPLayout
from disagmoe.distributed.layout import Layout
from disagmoe.runtime.disagg import run_schedule
from disagmoe.schedule.baselines import build_baseline_schedule
from disagmoe.schedule.ir import Instr, Msg, Op, compute_event_name
from disagmoe.schedule.semantics import consumer, producer
from disagmoe.simulator import (
    MessageOverheads,
    Network,
    SimResult,
    TableCosts,
    Workload,
    simulate_baseline_schedule,
    simulate_schedule,
)
from disagmoe.simulator.choose import run_order
from disagmoe.simulator.costs import AnalyticCosts
from disagmoe.trace import parse_event_name

Event = dict[str, Any]
COMMON = ["--model", "small", "--set", "model.num_layers=4", "--dtype", "float32"]
# name -> (runtime, layout flags, ranks)
CONFIGS: dict[str, tuple[str, list[str], int]] = {
    "disagg-p1-m1-n1": ("disagg", ["--groups", "1", "--attn-workers", "1", "--expert-workers", "1"], 2),
    "ep-1f1b-pp2-ep1": ("ep-1f1b", ["--pp", "2", "--ep", "1"], 2),
    "disagg-p2-m1-n1": ("disagg", ["--groups", "2", "--attn-workers", "1", "--expert-workers", "1"], 4),
    "ep-1f1b-pp4-ep1": ("ep-1f1b", ["--pp", "4", "--ep", "1"], 4),
}  # fmt: skip
COMPUTE_CATS = ("fwd", "bwd", "compute")


def host_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def train(name: str, run_dir: Path, steps: int, seq_len: int, slots: int) -> None:
    runtime, flags, _ = CONFIGS[name]
    cmd = [
        str(Path(sys.executable).parent / "disagmoe"), "train", "--runtime", runtime, *COMMON,
        *flags, "--seq-len", str(seq_len), "--micro-batch-size", "2",
        "--global-batch-size", str(2 * slots), "--steps", str(steps), "--threads-per-rank", "1",
        "--run-dir", str(run_dir), "--no-progress",
    ]  # fmt: skip
    print("$", " ".join(cmd[1:]), flush=True)
    shutil.rmtree(run_dir, ignore_errors=True)  # metrics.jsonl would be appended to
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def load_run(run_dir: Path) -> tuple[RunConfig, list[Event], list[dict[str, Any]]]:
    cfg = load_toml(run_dir / "config.toml")
    trace = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    events = [e for e in trace if e.get("ph") == "X" and e["args"].get("step", 0) >= 1]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return cfg, events, metrics


def end(e: Event) -> float:
    return float(e["ts"] + e["dur"])


def cpu_time(events: list[Event], cores: int) -> dict[int, float]:
    """Seconds of CPU each compute event received if the host shared `cores` fairly
    (`cores` = 0: its wall time)."""
    comp = [e for e in events if e["cat"] in COMPUTE_CATS]
    points = sorted({t for e in comp for t in (e["ts"], end(e))})
    delta: dict[float, int] = defaultdict(int)
    for e in comp:
        delta[e["ts"]] += 1
        delta[end(e)] -= 1
    prefix, active = [0.0], 0
    for a, b in itertools.pairwise(points):
        active += delta[a]
        rate = min(1.0, cores / active) if active and cores > 0 else 1.0
        prefix.append(prefix[-1] + (b - a) * rate)
    at = {t: prefix[i] for i, t in enumerate(points)}
    return {id(e): (at[end(e)] - at[e["ts"]]) / 1e6 for e in comp}


def mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else 0.0


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope >= 0) of ys over xs; the mean if the sizes do not spread."""
    if len(set(xs)) > 1 and max(xs) > 2 * min(xs):
        slope, icpt = (float(v) for v in np.polyfit(xs, ys, 1))
        if slope > 0 and icpt >= 0:
            return icpt, slope
    return mean(ys), 0.0


def step_stats(events: list[Event], metrics: list[dict[str, Any]]) -> dict[str, float]:
    spans = defaultdict(list)
    for e in events:
        if e["cat"] in (*COMPUTE_CATS, "send", "recv"):
            spans[e["args"]["step"]].append(e)
    pipe = [(max(map(end, ev)) - min(e["ts"] for e in ev)) / 1e6 for ev in spans.values()]
    return {
        "measured_step_s": statistics.median(m["step_time_s"] for m in metrics if m["step"] >= 2),
        "measured_pipeline_s": statistics.median(pipe),
        "sync_s": mean([e["dur"] / 1e6 for e in events if e["name"] == "SYNC grads"]),
        "step_s": mean([e["dur"] / 1e6 for e in events if e["name"] == "STEP"]),
    }


def tail_per_rank(events: list[Event]) -> dict[int, float]:
    """Mean SYNC + STEP seconds of each rank (they follow the rank's last instruction)."""
    per: dict[int, list[float]] = defaultdict(list)
    for e in events:
        if e["name"] in ("SYNC grads", "STEP"):
            per[e["pid"]].append(e["dur"] / 1e6)
    steps = len({e["args"]["step"] for e in events})
    return {r: sum(v) / steps for r, v in per.items()}


def step_end(sim: SimResult, tails: dict[int, float]) -> float:
    """Predicted step: the latest (rank's last simulated op + its own SYNC and STEP)."""
    assert sim.program is not None and sim.timeline is not None
    ends: dict[int, float] = defaultdict(float)
    for op, rank in enumerate(sim.program.rank):
        ends[rank] = max(ends[rank], sim.timeline.end[op])
    return max(t + tails.get(r, 0.0) for r, t in ends.items())


def lane_samples(
    events: list[Event], lane_of: Any, free_after: Any, inputs_ready: Any
) -> tuple[list[float], list[float]]:
    """(lane gaps, hand-offs) of compute events, classified by what they last waited for."""
    gaps, handoffs = [], []
    lanes: dict[Any, list[Event]] = defaultdict(list)
    for e in events:
        if e["cat"] in COMPUTE_CATS:
            lanes[lane_of(e)].append(e)
    for seq in lanes.values():
        seq.sort(key=lambda e: e["ts"])
        for prev, e in itertools.pairwise(seq):
            if prev["args"]["step"] != e["args"]["step"]:
                continue
            free, ready = free_after(prev), inputs_ready(e)
            if ready is not None and ready > free:
                handoffs.append(max(e["ts"] - ready, 0.0) / 1e6)
            else:
                gaps.append(max(e["ts"] - free, 0.0) / 1e6)
    return gaps, handoffs


def disagg_model(cfg: RunConfig, events: list[Event], cores: int) -> dict[str, Any]:
    work = cpu_time(events, cores)
    sends: dict[tuple[Any, ...], Event] = {}
    recvs: dict[tuple[Any, ...], Event] = {}
    produced: dict[tuple[Any, ...], list[Event]] = defaultdict(list)
    consumed: dict[tuple[Any, ...], list[Event]] = defaultdict(list)
    comps: dict[tuple[Any, ...], Event] = {}
    for e in events:
        a = e["args"]
        if e["cat"] in ("fwd", "bwd"):
            comps[(e["pid"], e["name"], a["step"])] = e
        elif e["cat"] in ("send", "recv"):
            kind = parse_event_name(e["name"]).what
            src, dst = (e["pid"], a["dst"]) if e["cat"] == "send" else (a["src"], e["pid"])
            msg = Msg(kind, a["layer"], a["slot"], src, dst)
            if e["cat"] == "send":
                sends[(msg, a["step"])] = e
                produced[(src, compute_event_name(*producer(msg)), a["step"])].append(e)
            else:
                recvs[(msg, a["step"])] = e
                consumed[(dst, compute_event_name(*consumer(msg)), a["step"])].append(e)
    posts = []
    for key, sent in produced.items():
        t = end(comps[key]) if key in comps else None
        for s in sorted(sent, key=lambda e: e["ts"]):
            if t is not None:
                posts.append(max(s["ts"] - t, 0.0) / 1e6)
            t = s["ts"]
    latency = [
        max(r["ts"] - s["ts"], 0.0) / 1e6
        for key, s in sends.items()
        if (r := recvs.get(key)) is not None and r["ts"] - r["args"]["waited_us"] <= s["ts"]
    ]
    recv_a, recv_b = fit_line(
        [float(r["args"]["bytes"]) for r in recvs.values()],
        [r["dur"] / 1e6 for r in recvs.values()],
    )

    def free_after(prev: Event) -> float:
        sent = produced.get((prev["pid"], prev["name"], prev["args"]["step"]), [])
        return max([end(prev), *(s["ts"] for s in sent)])

    def inputs_ready(e: Event) -> float | None:
        got = consumed.get((e["pid"], e["name"], e["args"]["step"]))
        return max(map(end, got)) if got else None

    gaps, handoffs = lane_samples(events, lambda e: (e["pid"], e["tid"]), free_after, inputs_ready)
    lane_gap = mean(gaps)
    per_layer: dict[tuple[str, str, int], list[float]] = defaultdict(list)
    for e in events:
        if e["cat"] in ("fwd", "bwd"):
            name = parse_event_name(e["name"])
            per_layer[(name.op, name.comp, e["args"]["layer"])].append(work[id(e)])
    return {
        "table": {k: mean(v) + lane_gap for k, v in per_layer.items()},
        "overheads": MessageOverheads(
            post_s=mean(posts), recv_s=recv_a, recv_s_per_byte=recv_b, handoff_s=mean(handoffs)
        ),
        "latency_s": mean(latency),
        "lane_gap_s": lane_gap,
        "samples": {
            "posts": len(posts),
            "latency": len(latency),
            "lane_gaps": len(gaps),
            "handoffs": len(handoffs),
        },
    }


def ep_model(cfg: RunConfig, events: list[Event], cores: int) -> dict[str, Any]:
    work = cpu_time(events, cores)
    # PyTorch posts p2p ops and waits later; a traced p2p event spans from its posting to
    # the rank's next computation (baselines/stage.py), so the receive event's end is when
    # the consumer could start. Keys: the consuming (stage, micro-batch).
    sends: dict[tuple[Any, ...], Event] = {}
    recvs: dict[tuple[Any, ...], Event] = {}
    for e in events:
        if e["cat"] in ("send", "recv"):
            a = e["args"]
            kind = parse_event_name(e["name"]).what  # act | grad
            stage = a["stage"] if e["cat"] == "recv" else a["stage"] + (1 if kind == "act" else -1)
            (sends if e["cat"] == "send" else recvs)[(kind, stage, a["micro_batch"], a["step"])] = e
    # post -> consumer start, for messages whose receiver was already waiting (posted first)
    latency = [
        max(end(r) - s["ts"], 0.0) / 1e6
        for key, s in sends.items()
        if (r := recvs.get(key)) is not None and r["ts"] <= s["ts"]
    ]

    def inputs_ready(e: Event) -> float | None:
        a = e["args"]
        kind = "act" if parse_event_name(e["name"]).op == "F" else "grad"
        r = recvs.get((kind, a["stage"], a["micro_batch"], a["step"]))
        return end(r) if r else None

    gaps, handoffs = lane_samples(events, lambda e: e["pid"], end, inputs_ready)
    lane_gap = mean(gaps)
    per_stage: dict[tuple[str, int], list[float]] = defaultdict(list)
    for e in events:
        if e["cat"] in COMPUTE_CATS:
            per_stage[(parse_event_name(e["name"]).what, e["args"]["stage"])].append(work[id(e)])
    return {
        "table": {k: mean(v) + lane_gap for k, v in per_stage.items()},
        "overheads": MessageOverheads(handoff_s=mean(handoffs)),
        "latency_s": mean(latency),
        "lane_gap_s": lane_gap,
        "samples": {"latency": len(latency), "lane_gaps": len(gaps), "handoffs": len(handoffs)},
    }


def predict_disagg(cfg: RunConfig, fit: dict[str, Any], cores: int) -> SimResult:
    layout = Layout.build(cfg.model, cfg.parallel)
    t = cfg.train
    workload = Workload(cfg.model, t.seq_len, t.micro_batch_size, act_bytes=4, index_bytes=8)
    costs = TableCosts(workload, {}, {(o, c, l): v for (o, c, l), v in fit["table"].items()})
    net = Network.single_node(1e15, fit["latency_s"], layout.world_size)  # bytes: in recv time
    sim = simulate_schedule(
        run_schedule(cfg, layout, choose=run_order),
        layout,
        costs,
        workload,
        net,
        sync=False,
        overheads=fit["overheads"],
        cores=cores,
    )
    return sim


def predict_ep(cfg: RunConfig, fit: dict[str, Any], cores: int) -> SimResult:
    world = cfg.parallel.pp * cfg.parallel.ep
    lay = EPLayout.build(cfg.model, cfg.parallel, cfg.train, world)
    schedule = build_baseline_schedule(lay, cfg.model, overlap_chunks=cfg.parallel.overlap_chunks)
    t = cfg.train
    workload = Workload(cfg.model, t.seq_len, t.micro_batch_size, act_bytes=4)
    flops = AnalyticCosts(workload, 1.0)
    last = lay.num_stages - 1
    stage_of = {l: s for s in range(lay.num_stages) for l in lay.layers_of_stage(s)}
    stage_of[cfg.model.num_layers] = last

    def weight(ins: Instr) -> float:
        return flops.compute_s(Op.BWD if ins.op == Op.WGT else ins.op, ins.comp, ins.layer)

    totals: dict[tuple[str, int, int], float] = defaultdict(float)
    for ins in schedule.ranks[0] + tuple(i for r in schedule.ranks[1:] for i in r):
        if ins.is_compute:
            totals[(ins.op.value, stage_of[ins.layer], ins.slot)] += weight(ins)

    def cost(ins: Instr) -> float:
        """The measured stage time split over its layers in proportion to their FLOPs."""
        stage = stage_of[ins.layer]
        share = weight(ins) / totals[(ins.op.value, stage, ins.slot)]
        return fit["table"][(ins.op.value, stage)] * share

    act = float(workload.tokens * cfg.model.dim * 4)
    sim = simulate_baseline_schedule(
        schedule,
        cost,
        message_bytes=lambda m: act,
        tokens_per_step=t.global_batch_size * t.seq_len,
        latency_s=fit["latency_s"],
        overheads=fit["overheads"],
        cores=cores,
    )
    return sim


MODELS = ("shared", "as-measured")  # host cores shared by all ranks | wall times, no sharing


def run_one(name: str, args: argparse.Namespace, cores: int) -> dict[str, Any]:
    run_dir = Path(args.runs) / name
    if not (args.reuse and (run_dir / "trace.json").exists()):
        t0 = time.perf_counter()
        train(name, run_dir, args.steps, args.seq_len, args.slots)
        print(f"  trained in {time.perf_counter() - t0:.0f} s; load {os.getloadavg()[0]:.1f}")
    cfg, events, metrics = load_run(run_dir)
    stats = step_stats(events, metrics)
    tails = tail_per_rank(events)
    runtime = CONFIGS[name][0]
    row: dict[str, Any] = {
        "config": name,
        "runtime": runtime,
        "ranks": CONFIGS[name][2],
        "cores": cores,
        "load_avg": os.getloadavg()[0],
        "measured_steps_s": sorted(m["step_time_s"] for m in metrics if m["step"] >= 2),
        **stats,
        "run": str(run_dir),
    }
    for model, c in zip(MODELS, (cores, 0), strict=True):
        fit = (disagg_model if runtime == "disagg" else ep_model)(cfg, events, c)
        sim = (predict_disagg if runtime == "disagg" else predict_ep)(cfg, fit, c)
        pipe, step = sim.step_time_s, step_end(sim, tails)
        over = fit["overheads"]
        row[model] = {
            "cores": c,
            "predicted_pipeline_s": pipe,
            "pipeline_error": pipe / stats["measured_pipeline_s"] - 1.0,
            "predicted_step_s": step,
            "error": step / stats["measured_step_s"] - 1.0,
            "latency_s": fit["latency_s"],
            "lane_gap_s": fit["lane_gap_s"],
            "overheads": {k: getattr(over, k) for k in over.__slots__},
            "samples": fit["samples"],
            "table": {"/".join(map(str, k)): v for k, v in sorted(fit["table"].items())},
        }
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    two = [n for n, c in CONFIGS.items() if c[2] <= host_cores()]
    parser.add_argument("--config", nargs="*", default=two, choices=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--slots", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--runs", default="runs/fidelity", help="run directories go here")
    parser.add_argument("--reuse", action="store_true", help="reuse existing run directories")
    parser.add_argument("--json", default="docs/figures/simulator_fidelity.json")
    args = parser.parse_args()
    cores = host_cores()
    rows = [run_one(name, args, cores) for name in args.config]
    print(
        f"host: {cores} cores; step = median metrics step_time_s of steps 2..; pipe = first to "
        "last instruction; shared = compute of all ranks shares the cores, as-measured = wall "
        "times, no sharing"
    )
    print(
        f"{'config':17s} {'ranks':>5s} {'model':>11s} {'step meas.':>11s} {'step pred.':>11s} "
        f"{'error':>7s} {'pipe meas.':>11s} {'pipe pred.':>11s} {'error':>7s}  step range"
    )
    for r in rows:
        lo, hi = r["measured_steps_s"][0], r["measured_steps_s"][-1]
        for model in MODELS:
            x = r[model]
            print(
                f"{r['config']:17s} {r['ranks']:5d} {model:>11s} {r['measured_step_s'] * 1e3:9.1f}ms "
                f"{x['predicted_step_s'] * 1e3:9.1f}ms {100 * x['error']:+6.1f}% "
                f"{r['measured_pipeline_s'] * 1e3:9.1f}ms {x['predicted_pipeline_s'] * 1e3:9.1f}ms "
                f"{100 * x['pipeline_error']:+6.1f}%  {lo * 1e3:.0f}-{hi * 1e3:.0f}ms"
            )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
