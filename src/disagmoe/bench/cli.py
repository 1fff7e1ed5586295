"""`disagmoe bench`: runtimes side by side on an emulated bandwidth-limited cluster.

    disagmoe bench                                   # 2 nodes x 1 rank, 0.2 Gbit/s NICs
    disagmoe bench --runtimes disagg,ep-1f1b --steps 5 --json
    disagmoe bench --plots docs/figures              # + bar chart and trace pair

Every runtime gets the same model, global batch and number of workers; each worker has
one NIC of `--nic-gbit` Gbit/s (a node's NIC carries `ranks_per_node` of them). `disagg` uses the
planner's split of the workers unless `--attn-workers/--expert-workers` say otherwise, and
runs once per `--splits` entry (planner, the default; even: p = 1, m = n) and per
`--placements` entry (node-aware: A and F of a group on every node, the default; packed:
rank order) and per `--exchange-chunks` entry (`schedule.exchange_chunks`: each exchange
in that many chunks); `--recomputes none,full` runs every runtime once per recompute
mode. Each is a row of the table with its simulator prediction and bound:

    disagmoe bench --compute emulated --nodes 4 --ranks-per-node 2 --runtimes disagg,ep-1f1b \
        --splits planner,even --placements node-aware,packed
    disagmoe bench --runtimes disagg,ep-1f1b --recomputes none,attn,full

Compute is real, one thread per rank, so the number of ranks may not exceed the cores;
`--compute emulated` replaces attention and expert math by waits of their durations
measured on this machine (`models.emulated`), so that 16-32 workers fit on a few cores:

    disagmoe bench --compute emulated --nodes 8 --ranks-per-node 2 --global-batch-size 64
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from ..config import (
    CHUNKED_RUNTIMES,
    MAX_EXCHANGE_CHUNKS,
    MULTI_WORKER_RUNTIMES,
    PLACEMENTS,
    RECOMPUTE,
    ClusterConfig,
)
from ..config_io import add_config_flag, check_overrides
from ..costs.compute import ComputeCosts
from ..extras import require_extra
from ..flags import add_renamed_flag
from ..presets import model_preset
from .meta import results_meta
from .netns import QUEUE_KB, EmulatedCluster, LoopbackCluster, available
from .runner import RuntimeResult, run_all, summarize
from .spec import SPLITS, BenchSpec, even_split

MAX_EMULATED_RANKS = 64
RANK_MEMORY_BYTES = 400 * 2**20  # a rank's Python + torch + gloo, measured ~250-350 MB


def default_time_scale(ranks: int) -> float:
    """Emulated compute's default slow-down: 4 x ranks, at least 10.

    What is not emulated (Python and gloo per message, the network stack) costs CPU that
    all ranks share; slowing the emulated cluster in proportion to the ranks keeps that
    cost small beside it. Measured with 16 ranks on 2 cores: at 20x AF-Pipe ran 1.9x its
    simulated step (0.55x ep-1f1b), at 60x within 8% of it (1.09x).
    """
    return max(10.0, 4.0 * ranks)


def _memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `disagmoe bench`; those of config fields as the fields declare them
    (`config_io.add_config_flag`), with the bench's own workload and layout defaults."""
    p.add_argument("--nodes", type=int, default=2, help="emulated nodes (network namespaces)")
    add_config_flag(
        p, "parallel.ranks_per_node", default=1, note="bench: the ranks of one emulated node (>= 1)"
    )
    p.add_argument("--nic-gbit", type=float, default=0.2,
                   help="Gbit/s per worker (its share of the node's NIC), one direction")  # fmt: skip
    add_renamed_flag(p, "--nic-gbps", "--nic-gbit", "Gbit/s per worker")
    p.add_argument("--model", default="small", help="model preset")
    p.add_argument("--runtimes", default=",".join(MULTI_WORKER_RUNTIMES), help="comma-separated")
    add_config_flag(p, "train.steps", default=6, note="per run, warm-up included")
    p.add_argument("--warmup", type=int, default=2, help="first steps excluded from numbers")
    p.add_argument("--repeats", type=int, default=2, help="interleaved repetitions per runtime")
    add_config_flag(p, "train.seq_len", default=128)
    add_config_flag(p, "train.global_batch_size", default=16)
    add_config_flag(p, "train.micro_batch_size")
    planner = "0: the planner's"
    add_config_flag(p, "parallel.groups", default=0, note=planner)
    add_config_flag(p, "parallel.attn_workers", default=0, note=planner)
    add_config_flag(p, "parallel.expert_workers", default=0, note=planner)
    add_config_flag(p, "parallel.pp", default=0,
                    note="for every EP row (virtual stages, chunks and warm-up still "
                    "searched); 0: each runtime's best layout by the simulator, with this "
                    "machine's measured compute")  # fmt: skip
    add_config_flag(p, "parallel.ep", default=0, note="0: W/pp")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="config override for every runtime (repeatable)")  # fmt: skip
    p.add_argument("--out", help="directory of the runs (default runs/bench-<time>)")
    p.add_argument("--plots", metavar="DIR", help="write bench_tokens.png and bench_trace.png")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    p.add_argument("--loopback", action="store_true", help="no namespaces: plain loopback")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--compute", choices=("real", "emulated"), default="real",
                   help="emulated: attention/expert math replaced by calibrated waits")  # fmt: skip
    p.add_argument("--time-scale", type=float, default=0.0,
                   help="emulated: run waits and transfers K times slower, report /K "
                   "(default 1 for real compute, 4 x ranks (at least 10) for emulated)")  # fmt: skip
    p.add_argument("--mtu", type=int, default=9000, help="emulated NICs' MTU (bytes)")
    p.add_argument("--queue-kb", type=float, default=QUEUE_KB,
                   help="emulated NICs' token-bucket queue, kB beyond the bucket, at every "
                   f"rate (default {QUEUE_KB:g}: 5 ms at 2 x 0.4 Gbit/s)")  # fmt: skip
    p.add_argument("--placements", default="node-aware", metavar="P[,P]",
                   help="disagg: placements to run, one row each (node-aware, packed; "
                   "e.g. node-aware,packed)")  # fmt: skip
    p.add_argument("--splits", default="planner", metavar="S[,S]",
                   help="disagg: splits to run, one row each (planner: the planner's or the "
                   "given m, n; even: p=1, m=n; e.g. planner,even)")  # fmt: skip
    p.add_argument("--recomputes", default="", metavar="R[,R]",
                   help="run every runtime once per train.recompute mode, one row each "
                   "(none, attn, full; default: the config's, one row)")  # fmt: skip
    p.add_argument("--exchange-chunks", default=None, metavar="C[,C]",
                   help="disagg: schedule.exchange_chunks to run, one row each (e.g. 1,4,0; "
                   "0 or auto: the run's schedule choice picks; default: the config's)")  # fmt: skip
    p.add_argument("--nic-split", default="planner", metavar="planner|even|A:F",
                   help="disagg: NIC rate of an attention vs an expert worker, same total as "
                   "the EP runs (planner: the planner's split, else even; even: 1:1)")  # fmt: skip


def emulated_cluster(spec: BenchSpec) -> ClusterConfig:
    """The emulated cluster as the planner sees it: one NIC of `nic_gbps` (Gbit/s) per
    worker."""
    return emulated_cluster_of(spec.ranks_per_node, spec.nic_gbps)


def emulated_cluster_of(ranks_per_node: int, nic_gbps: float) -> ClusterConfig:
    """`emulated_cluster` of a bench with these ranks per node and NIC Gbit/s per worker."""
    return ClusterConfig(
        name="emulated", gpus_per_node=ranks_per_node, nics_per_node=ranks_per_node,
        nic_gbps=nic_gbps / 8, nvlink_gbps=1.5, peak_tflops=0.02, gpu_mem_gib=8.0,
        mfu=0.5, bw_efficiency=0.94, latency_us=100.0,
    )  # fmt: skip


def planner_split(spec: BenchSpec) -> tuple[int, int, int, str, tuple[int, int] | None]:
    """(p, m, n, note, (attention NICs, expert NICs) per group or None): the planner's
    split for this emulated cluster, or an even one (with no NIC split)."""
    from ..planner import plan_for

    model = model_preset(spec.model)
    world = spec.world
    cluster = emulated_cluster(spec)
    num_micro = spec.global_batch_size // spec.micro_batch_size
    try:
        # what `disagmoe plan` prints for this cluster (its CLI default, profile auto: the
        # simulator scores stage 3 at this size), not the analytic stage-2 split alone; the
        # bench's batch is its own, so no stage 4; stage 5 keeps the split (only the split
        # is taken)
        plan = plan_for(model, cluster, gpus=world, seq_len=spec.seq_len,
                        micro_batch_size=spec.micro_batch_size, profile="simulator",
                        batch_stage=False, layers_stage=False)  # fmt: skip
        p, m, n = plan.groups, plan.attn_gpus_per_group, plan.ffn_gpus_per_group
        if p * (m + n) == world and m <= num_micro and model.num_layers % p == 0:
            nics = (plan.attn_nics_per_group, plan.ffn_nics_per_group)
            note = (
                f"planner ({plan.profile} profile): p={p} m={m} n={n}, NICs {nics[0]}:{nics[1]} "
                f"({plan.binding} binds)"
            )
            return p, m, n, note, nics
        reason = f"planner's p={p} m={m} n={n} does not fit this batch/model"
    except ValueError as err:
        reason = f"planner: {str(err).split(';')[0]}"
    if world % 2:
        raise ValueError(f"disagg needs an even worker count here, got {world}; set --groups ...")
    return (*even_split(world), f"{reason}; even split m=n={world // 2}", None)


def nic_split(text: str, m: int, n: int, planned: tuple[int, int] | None) -> tuple[float, float]:
    """Per-worker NIC rate of attention and expert workers (units of --nic-gbit), scaled so
    that m * a + n * f = m + n: disagg gets the same total NIC bandwidth as the EP runs.
    `text`: planner (the planner's split `planned`, else even), even (1:1) or A:F."""
    if text == "auto":
        raise ValueError("--nic-split auto was renamed planner (the planner's NIC split)")
    if text == "even" or (text == "planner" and planned is None):
        return 1.0, 1.0
    if text == "planner":
        assert planned is not None
        ratio = (planned[0] / m, planned[1] / n)
    else:
        try:
            a, f = (float(x) for x in text.split(":"))
        except ValueError:
            a = f = math.nan
        if not all(math.isfinite(x) and x > 0 for x in (a, f)):
            raise ValueError(
                f"--nic-split must be planner, even or A:F with A, F > 0, got {text!r}"
            )
        ratio = (a, f)
    scale = (m + n) / (m * ratio[0] + n * ratio[1])
    return ratio[0] * scale, ratio[1] * scale


def spec_from_args(args: argparse.Namespace) -> BenchSpec:
    runtimes = tuple(r.strip() for r in args.runtimes.split(",") if r.strip())
    unknown = [r for r in runtimes if r not in MULTI_WORKER_RUNTIMES]
    if unknown or not runtimes:
        raise ValueError(f"--runtimes: unknown {unknown}; choose from disagg, ep-1f1b, ...")
    placements = _choices("--placements", args.placements, PLACEMENTS)
    splits = _choices("--splits", args.splits, SPLITS)
    recomputes = _choices("--recomputes", args.recomputes, RECOMPUTE) if args.recomputes else ()
    counts = ("auto", *(str(c) for c in range(MAX_EXCHANGE_CHUNKS + 1)))
    listed = args.exchange_chunks or ""
    chunks = [
        0 if c == "auto" else int(c)
        for c in (_choices("--exchange-chunks", listed, counts) if listed else ())
    ]
    if len(set(chunks)) < len(chunks):  # "auto" and "0" both: auto picks (the config's 0)
        raise ValueError(f"--exchange-chunks lists auto and 0, the same row, got {listed!r}")
    if args.nodes < 1 or args.ranks_per_node < 1 or args.nic_gbit <= 0:
        raise ValueError("--nodes, --ranks-per-node must be >= 1 and --nic-gbit > 0")
    if not 0 <= args.warmup < args.steps:
        raise ValueError(f"--warmup ({args.warmup}) must be < --steps ({args.steps})")
    world = args.nodes * args.ranks_per_node
    cores = os.cpu_count() or 1
    emulated = args.compute == "emulated"
    if not emulated and world > cores:
        raise ValueError(
            f"{world} ranks with real compute on {cores} cores would measure CPU contention, "
            "not scheduling; use fewer --nodes/--ranks-per-node, or --compute emulated"
        )
    if emulated and world > MAX_EMULATED_RANKS:
        raise ValueError(f"--compute emulated runs at most {MAX_EMULATED_RANKS} ranks, got {world}")
    if emulated and world * RANK_MEMORY_BYTES > _memory_bytes():
        raise ValueError(
            f"{world} ranks need about {world * RANK_MEMORY_BYTES / 2**30:.0f} GiB of memory, "
            f"more than this machine has ({_memory_bytes() / 2**30:.0f} GiB)"
        )
    time_scale = args.time_scale or (default_time_scale(world) if emulated else 1.0)
    if not emulated and time_scale != 1.0:
        raise ValueError("--time-scale needs --compute emulated (real compute runs at its speed)")
    if not (math.isfinite(time_scale) and time_scale >= 1.0):
        raise ValueError(f"--time-scale must be >= 1, got {args.time_scale}")
    if not 1280 <= args.mtu <= 65000:
        raise ValueError(f"--mtu must be in [1280, 65000], got {args.mtu}")
    if not (math.isfinite(args.queue_kb) and 1 <= args.queue_kb <= 1e6):
        raise ValueError(f"--queue-kb must be in [1, 1000000], got {args.queue_kb}")
    model_preset(args.model)
    check_overrides(list(args.set))  # a bad --set fails before the calibration
    out = Path(args.out or f"runs/bench-{time.strftime('%Y%m%d-%H%M%S')}")
    _refuse_used(out)
    spec = BenchSpec(
        runtimes=runtimes, nodes=args.nodes, ranks_per_node=args.ranks_per_node,
        nic_gbps=args.nic_gbit, model=args.model, seq_len=args.seq_len,
        global_batch_size=args.global_batch_size, micro_batch_size=args.micro_batch_size,
        steps=args.steps, warmup=args.warmup, repeats=max(args.repeats, 1), groups=args.groups,
        attn_workers=args.attn_workers, expert_workers=args.expert_workers, pp=args.pp,
        ep=args.ep, out_dir=out, overrides=tuple(args.set), timeout_s=args.timeout,
        loopback=args.loopback, mtu=args.mtu, queue_kb=args.queue_kb, compute=args.compute,
        time_scale=time_scale, placements=placements, splits=splits, recomputes=recomputes,
        exchange_chunks=tuple(chunks),
    )  # fmt: skip
    planned = None
    if "disagg" in runtimes and not (args.attn_workers and args.expert_workers):
        p, m, n, note, planned = planner_split(spec)
        spec = dataclasses.replace(spec, groups=p, attn_workers=m, expert_workers=n,
                                   split_note=note)  # fmt: skip
    elif "disagg" in runtimes:
        spec = dataclasses.replace(spec, groups=args.groups or 1, split_note="given")
    if "disagg" in runtimes:
        m, n = spec.attn_workers, spec.expert_workers
        shares = nic_split(args.nic_split, m, n, planned)
        spec = dataclasses.replace(spec, nic_split=shares)
        if "even" in splits:
            even_split(world)  # an odd worker count has none: say so before any run
            if (spec.groups, m, n) == even_split(world) and "planner" in splits:
                spec = dataclasses.replace(
                    spec,
                    splits=tuple(s for s in splits if s != "even"),
                    split_note=f"{spec.split_note}; it is the even split (one row)",
                )
    return spec


def _refuse_used(out: Path) -> None:
    """A one-line error where `out` already holds a bench's runs: every row would fail on
    its run dir (`prepare_run_dir`), after the calibration."""
    used = sorted(path.parent for path in out.glob("*/metrics.jsonl"))
    if used:
        raise ValueError(
            f"--out {str(out)!r} already holds a bench's runs ({used[0]}); choose another "
            "--out or remove them"
        )


def _choices(flag: str, text: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    """A comma-separated list of distinct values of `allowed`, or a one-line error."""
    items = tuple(x.strip() for x in text.split(",") if x.strip())
    if not items or len(set(items)) < len(items) or set(items) - set(allowed):
        raise ValueError(f"{flag} must list distinct values of {', '.join(allowed)}, got {text!r}")
    return items


def format_table(spec: BenchSpec, results: list[RuntimeResult], network: str) -> str:
    w = max([15, *(len(r.runtime) for r in results)])
    lines = [
        f"# {spec.model}, {spec.world} workers ({network}), global batch "
        f"{spec.global_batch_size}x{spec.seq_len}, {spec.steps - spec.warmup} measured steps "
        f"x {spec.repeats} repeats ({compute_label(spec)})",
        f"{'runtime':{w}s} {'tokens/s':>9s} {'vs 1f1b':>8s} {'step s':>7s} {'exposed':>8s} "
        f"{'comm%':>6s} {'bubble':>7s} {'sim s':>7s} {'sim err':>8s} {'bound s':>8s} "
        f"{'step/bd':>7s} {'w/ fill':>8s} {'step/fl':>7s} {'drops':>6s} {'binds':16s} layout",
    ]
    for r in results:
        if not r.ok:
            lines.append(f"{r.runtime:{w}s} FAILED: {r.error}")
            continue
        b = r.breakdown
        assert b is not None
        ratio = f"{r.ratio_vs_ep_1f1b:.2f}x" if r.ratio_vs_ep_1f1b else "-"
        bound_s = r.bound.seconds if r.bound else 0.0
        over = f"{r.step_over_bound:.2f}x" if r.step_over_bound else "-"
        binds = f"{r.bound.binding} {r.bound.worker}" if r.bound else "-"
        fill_s = r.fill_bound.seconds if r.fill_bound else 0.0
        over_fill = f"{r.step_over_fill_bound:.2f}x" if r.step_over_fill_bound else "-"
        drops = r.nic_drops / (spec.steps * spec.repeats)
        lines.append(
            f"{r.runtime:{w}s} {r.tokens_per_s:9.0f} {ratio:>8s} {r.step_time_s:7.3f} "
            f"{b.exposed_comm_s:8.3f} {100 * b.exposed_comm_s / r.step_time_s:5.0f}% "
            f"{b.bubble_s:7.3f} {r.predicted_step_s:7.3f} {100 * r.prediction_error:+7.0f}% "
            f"{bound_s:8.3f} {over:>7s} {fill_s:8.3f} {over_fill:>7s} {drops:6.0f} {binds:16s} "
            f"{r.layout}"
        )
    lines.append("exposed = communication not covered by compute (s/step, mean over ranks); "
                 "comm% = exposed / step; sim = simulator replaying the run with its traced costs")  # fmt: skip
    lines.append("bound = max over ranks of max(compute, its node's busier NIC direction: bytes "
                 "/ rate) + optimizer step, from the trace; binds = what sets it")  # fmt: skip
    lines.append("w/ fill = the bound with a pipeline's fill and drain at this layout and "
                 "micro-batch count (on compute, and on each NIC each kind of traffic inside "
                 "its window) and the all-reduce of the gradient buckets the final "
                 "backward completes (bench.bound); step/fl = step / it")  # fmt: skip
    lines.append("drops = packets the NICs' token buckets dropped per step (every step the "
                 "row ran, warm-up included)")  # fmt: skip
    return "\n".join(lines)


def write_plots(spec: BenchSpec, results: list[RuntimeResult], network: str, out: Path) -> None:
    """bench_tokens.png (tokens/s, step split) and bench_trace.png (a step of the first
    and the last row, bound shaded) into `out`."""
    from .plots import plot_bars, plot_trace_pair

    emulated = spec.compute == "emulated"
    label = f"{network}; {compute_label(spec)}" if emulated else network
    note = f" [emulated compute, wall clock = {spec.time_scale:g}x]" if emulated else ""
    plot_bars(results, out / "bench_tokens.png", label)
    plot_trace_pair(results, out / "bench_trace.png", spec.steps - 1, note, spec.time_scale)


def compute_label(spec: BenchSpec) -> str:
    """How the ranks computed; with emulated compute, the calibration they waited
    (`compute_costs.json`, per micro-batch and layer, before the time scale)."""
    if spec.compute == "real":
        return "real compute"
    label = (
        f"EMULATED compute: calibrated waits, run {spec.time_scale:g}x slower, "
        f"times reported /{spec.time_scale:g}"
    )
    if spec.costs_path and Path(spec.costs_path).is_file():
        from .emulation import calibration_text  # torch: only when it runs

        costs = ComputeCosts.load(spec.costs_path).scaled(1.0 / spec.time_scale)
        label += f"; calibration per micro-batch and layer: {calibration_text(spec, costs)}"
    return label


def choose_ep_layouts(spec: BenchSpec, log: Any, costs: ComputeCosts | None = None) -> BenchSpec:
    """Every EP row's layout: the fastest the simulator finds (`bench.ep_layouts`) with
    `costs` (unscaled), by default the emulated compute's."""
    from ..simulator.ep_search import skipped_for_memory
    from .ep_layouts import search

    if costs is None:
        costs = ComputeCosts.load(spec.costs_path).scaled(1.0 / spec.time_scale)
    chosen, chunks = [], []
    for runtime in spec.runtimes:
        if runtime == "disagg":
            continue
        ranked = search(spec, runtime, costs, emulated_cluster(spec))
        spec_gib = emulated_cluster(spec).gpu_mem_gib
        best = ranked[0]
        if best.refused and spec.pp:  # the given layout runs as given: its row says why not
            if log:
                log(f"bench: {runtime} at the given --pp: {best.refused}")
            continue
        if best.refused:
            raise ValueError(f"{runtime}: no layout fits this bench: {best.refused}")
        chosen.append((runtime, best.pp, best.ep, best.virtual_stages, best.warmup))
        if runtime in CHUNKED_RUNTIMES:
            chunks.append((runtime, best.overlap_chunks))
        if log:
            tried = ", ".join(f"{c.label} {c.step_s:.3f}" for c in ranked if not c.refused)
            over = skipped_for_memory(ranked)
            skipped = f"; {over} over {spec_gib:g} GiB skipped" if over else ""
            log(f"bench: {runtime} layout — simulated s/step: {tried}{skipped}; "
                f"runs {best.label}")  # fmt: skip
    return dataclasses.replace(spec, ep_layouts=tuple(chosen), ep_chunks=tuple(chunks))


def run_bench(args: argparse.Namespace) -> int:
    if args.plots:  # before the runs, not after them
        require_extra("matplotlib", "plots", "--plots")
    spec = spec_from_args(args)
    reason = "" if args.loopback else available()
    log = None if args.json else (lambda s: print(s, file=sys.stderr, flush=True))
    if reason or args.loopback:
        spec = dataclasses.replace(spec, loopback=True)
        print(f"bench: {reason or '--loopback'}: plain loopback, NICs are NOT rate-limited",
              file=sys.stderr)  # fmt: skip
        cluster: EmulatedCluster | LoopbackCluster = LoopbackCluster(spec.nodes, reason)
        network = "loopback, no rate limit"
    else:
        k = spec.time_scale
        cluster = EmulatedCluster(
            [spec.nic_gbps * 1000 * spec.ranks_per_node / k] * spec.nodes,
            mtu=spec.mtu,
            queue_bytes=int(spec.queue_kb * 1000),
        )
        network = (
            f"{spec.nodes} nodes x {spec.ranks_per_node} ranks, "
            f"{spec.nic_gbps:g} Gbit/s NIC per worker (tbf"
            + (f" at 1/{k:g} of it" if k != 1 else "")
            + f", MTU {spec.mtu}, queue {spec.queue_kb:g} kB)"
        )
        a, f = spec.nic_split
        if "disagg" in spec.runtimes and (a, f) != (1.0, 1.0):
            network += f"; disagg NICs {a:.2f}x (attention) / {f:.2f}x (experts) per worker"
            if "packed" in spec.placements or "even" in spec.splits:
                network += " (planner split, node-aware; other rows: even)"
    if log and spec.split_note:
        log(f"bench: disagg split — {spec.split_note}")
    from .emulation import measure_compute, prepare_emulation  # torch: only when it runs

    if spec.compute == "emulated":
        spec = prepare_emulation(spec, log)
        spec = choose_ep_layouts(spec, log)
    elif any(r != "disagg" for r in spec.runtimes):  # the layouts priced with measured costs
        spec = choose_ep_layouts(spec, log, measure_compute(spec, log, "for the EP layouts"))
    with cluster:
        outcomes = run_all(spec, cluster, log)
    results = summarize(spec, outcomes)
    if args.plots:
        write_plots(spec, results, network, Path(args.plots))
    report = json.dumps({
        "network": network, "emulated_compute": spec.compute == "emulated",
        "time_scale": spec.time_scale, "compute": compute_label(spec), "spec": _spec_dict(spec),
        "results": [r.to_dict() for r in results],
        "meta": results_meta(shlex.join(["disagmoe", *sys.argv[1:]])),
    }, indent=2)  # fmt: skip
    table = format_table(spec, results, network)
    spec.out_dir.mkdir(parents=True, exist_ok=True)
    (spec.out_dir / "bench.json").write_text(report + "\n")
    (spec.out_dir / "bench.txt").write_text(table + "\n")
    print(report if args.json else table)
    return 0 if all(r.ok for r in results) else 1


def _spec_dict(spec: BenchSpec) -> dict[str, object]:
    out = dataclasses.asdict(spec)
    out["out_dir"] = str(spec.out_dir)
    out["world"] = spec.world
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="disagmoe bench", description=__doc__)
    add_bench_arguments(parser)
    try:
        return run_bench(parser.parse_args(argv))
    except ValueError as err:
        sys.stderr.write(f"disagmoe: error: {err}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
