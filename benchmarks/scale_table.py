"""AF-Pipe against the best EP runtime at cluster scale, each as `disagmoe simulate` runs
it by default: DeepSeek-MoE-16B, Qwen3-30B-A3B and GPT-OSS-20B on 8 and 16 nominal H800
nodes at 4K-32K tokens per sequence.

    python benchmarks/scale_table.py [--models M,M] [--nodes 8,16] [--seq-lens 4096,...]
        [--runtimes ep-1f1b,...] [--groups-sweep] [--jobs J]
        [--ep-from SAVED.json | --from SAVED.json --rerun disagg,ep-combined,...]
        [--json benchmarks/results/scale_table.json]

Every point runs the default command a user would type, whose global batch is the same
for every runtime and plan (8 sequences per GPU, micro-batch 1; `--micro-batches B` below
only spells it out):

* AF-Pipe: `disagmoe simulate --model M --nodes N --seq-len S --micro-batches B`: the
  planner's split, in-flight cap and recompute, held to the runtime's memory model, with
  the exchange chunks and whole or split backwards picked on that plan (in breadth
  order), then its lane order (the six candidates of `schedule.order = auto`);
* each EP runtime: the same with `--runtime R`: the fastest (pp, ep, virtual stages,
  recompute) that fits the GPU (`simulator.ep_search`).

A row: AF-Pipe's and the best EP runtime's tokens/s, step, bound, step/bound, memory per
GPU, exposed communication (s per step, mean over workers) and layout (AF-Pipe's ends
with its lane order), AF-Pipe / best EP, and the verdict against the targets (AF-Pipe within
1.1x of its bound and fitting; at least 1.2x the best EP runtime); where a target is
missed, the two bounds say whether a schedule could meet it (`bound ratio` = best EP's
bound / AF-Pipe's: AF-Pipe can only lead by about that much).

`--groups-sweep` runs instead, per model and node count at 8K, AF-Pipe at every group count p
(virtual stages v = L / p) at one exchange chunk, whole backwards and breadth order
(`SWEEP_SCHEDULE`),
each with the planner's split for that p, in flight and
recompute held to memory (and the cap lowered where that is faster, as `simulate` does):
throughput against virtual stages; `--jobs` runs that many (model, nodes) cases at once.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from results_io import this_command, write_json

from disagmoe.config import EP_RUNTIMES
from disagmoe.schedule.orders import order_label
from disagmoe.simulate_cli import add_simulate_arguments, simulate_from_args
from disagmoe.simulator import SimResult

MODELS = ("deepseek-moe-16b", "qwen3-30b-a3b", "gpt-oss-20b")
NODES = (8, 16)
SEQ_LENS = (4096, 8192, 16384, 32768)
TARGET_BOUND, TARGET_LEAD = 1.1, 1.2
# the groups sweep's schedule: one exchange chunk, whole backwards, breadth order (the
# chunk, split and order search of `simulate`'s defaults takes over 2 h for the sweep on
# 2 cores)
SWEEP_SCHEDULE = ("--exchange-chunks", "1", "--split-backward", "off", "--order", "breadth")


def simulate(argv: list[str]) -> SimResult:
    parser = argparse.ArgumentParser()
    add_simulate_arguments(parser)
    return simulate_from_args(parser.parse_args(argv))


def summary(result: SimResult) -> dict[str, Any]:
    cfg, bound = result.config, result.bound
    recompute = cfg.get("recompute", "none")  # full on each worker's first K layers, where given
    recompute += f" on {cfg['recompute_layers']} layers" if cfg.get("recompute_layers") else ""
    if result.runtime == "disagg":
        layout = (
            f"p {cfg['groups']}, {cfg['attn_workers']}:{cfg['expert_workers']}, cap "
            f"{cfg.get('max_in_flight', 0)}, recompute {recompute}, "
            f"chunks {cfg.get('exchange_chunks', 1)}"
            + (", split backward" if cfg.get("split_backward") else "")
            + f", {order_label(cfg['order'], cfg.get('costed', False))}"
        )
    else:
        v = f" v {cfg['chunks']}" if result.runtime == "ep-interleaved" and "chunks" in cfg else ""
        v += f" chunks {cfg['overlap_chunks']}" if "overlap_chunks" in cfg else ""
        v += f" warm-up +{cfg['pipeline_warmup']}" if cfg.get("pipeline_warmup") else ""
        layout = f"pp {cfg['pp']} ep {cfg['ep']}{v}, recompute {recompute}"
    seconds = bound.seconds if bound else 0.0
    return {
        "runtime": result.runtime,
        "tokens_per_s": result.tokens_per_s,
        "step_s": result.step_time_s,
        "bound_s": seconds,
        "step_over_bound": result.step_time_s / seconds if seconds else None,
        "binding": bound.describe() if bound else "",
        "exposed_comm_s": result.breakdown["comm_exposed"],
        "memory_gib": cfg.get("memory_gib_per_gpu"),
        "gpu_memory_gib": cfg.get("gpu_memory_gib"),
        "layout": layout,
    }


def point(
    model: str,
    nodes: int,
    seq_len: int,
    runtimes: tuple[str, ...],
    saved: list[dict[str, Any]],
    saved_af: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """AF-Pipe and every EP runtime at one point (see the module doc); an EP runtime whose
    row `saved` (the point's EP rows of `--ep-from` / `--from`) holds is taken from there,
    and AF-Pipe's from `saved_af` where given (`--from` without `disagg` rerun)."""
    gpus = nodes * 8
    base = ["--model", model, "--nodes", str(nodes), "--seq-len", str(seq_len),
            "--micro-batches", str(8 * gpus)]  # fmt: skip
    row: dict[str, Any] = {"model": model, "nodes": nodes, "gpus": gpus, "seq_len": seq_len}
    start = time.perf_counter()
    try:
        row["disagg"] = saved_af if saved_af is not None else summary(simulate(base))
    except ValueError as err:  # no plan fits: the row says so
        row["disagg"] = {"runtime": "disagg", "error": str(err)}
    eps = []
    for runtime in runtimes:
        kept = [e for e in saved if e["runtime"] == runtime]
        if kept:
            eps.append(kept[0])
            continue
        try:
            eps.append(summary(simulate([*base, "--runtime", runtime])))
        except ValueError as err:
            eps.append({"runtime": runtime, "error": str(err)})
    row["ep"] = eps
    ok = [e for e in eps if "error" not in e]
    best = max(ok, key=lambda e: e["tokens_per_s"], default=None)
    row["best_ep"] = best
    af = row["disagg"]
    if best is not None and "error" not in af:
        row["vs_best_ep"] = af["tokens_per_s"] / best["tokens_per_s"]
        row["bound_ratio"] = best["bound_s"] / af["bound_s"]
        fits = af["memory_gib"] is None or af["memory_gib"] <= af["gpu_memory_gib"]
        row["af_fits"] = fits
        row["af_at_bound"] = af["step_over_bound"] <= TARGET_BOUND
        row["af_leads"] = row["vs_best_ep"] >= TARGET_LEAD
        row["verdict"] = verdict(row)
    row["wall_s"] = time.perf_counter() - start
    return row


def verdict(row: dict[str, Any]) -> str:
    """Met, or which target is missed and whether the bounds allow meeting it."""
    missed = []
    if not row["af_fits"]:
        missed.append("AF-Pipe over memory")
    if not row["af_at_bound"]:
        missed.append(f"AF-Pipe {row['disagg']['step_over_bound']:.2f}x its bound")
    if not row["af_leads"]:
        can = "bounds allow it" if row["bound_ratio"] >= TARGET_LEAD else "bounds forbid it"
        missed.append(f"{row['vs_best_ep']:.2f}x best EP ({can}: {row['bound_ratio']:.2f})")
    return "met" if not missed else "; ".join(missed)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--nodes", default=",".join(map(str, NODES)))
    parser.add_argument("--seq-lens", default=",".join(map(str, SEQ_LENS)))
    parser.add_argument("--runtimes", default=",".join(EP_RUNTIMES), help="EP runtimes")
    parser.add_argument("--groups-sweep", action="store_true", help="only AF-Pipe against p at 8K")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    parser.add_argument("--jobs", type=int, default=1, help="points simulated at once")
    parser.add_argument(
        "--ep-from", metavar="PATH", help="take the EP runtimes' rows from this saved table "
        "where it has the point (for a change that leaves the EP simulation as it was)",
    )  # fmt: skip
    parser.add_argument(
        "--from", dest="from_", metavar="PATH", help="take every side (AF-Pipe and the EP "
        "runtimes) from this saved table where it has the point, except those of --rerun",
    )  # fmt: skip
    parser.add_argument(
        "--rerun", default="", help="with --from: the sides simulated again (runtime names, "
        "disagg for AF-Pipe), for a change that touches only them",
    )  # fmt: skip
    args = parser.parse_args()
    if args.ep_from and args.from_:
        parser.error("--ep-from and --from: give one")
    rerun = set(filter(None, args.rerun.split(",")))
    if rerun and not args.from_:
        parser.error("--rerun needs --from")
    if args.groups_sweep:
        cases = [(model, nodes, 8192) for model in args.models.split(",")
                 for nodes in map(int, args.nodes.split(","))]  # fmt: skip
        with ProcessPoolExecutor(max(args.jobs, 1)) as pool:
            sweep = [
                row for rows in pool.map(groups_sweep, *zip(*cases, strict=True)) for row in rows
            ]
        if args.json:
            write_json(args.json, {"rows": sweep})
        return 0
    runtimes = tuple(args.runtimes.split(","))
    rows = []
    head = (f"{'model':17s} {'N':>2s} {'seq':>6s} {'AF tok/s':>9s} {'AF s/bd':>7s} "
            f"{'AF GiB':>6s} {'best EP':>14s} {'EP tok/s':>9s} {'EP s/bd':>7s} {'EP GiB':>6s} "
            f"{'AF/EP':>6s} {'bd EP/AF':>8s}  verdict")  # fmt: skip
    print(head)
    points = [
        (model, nodes, seq_len)
        for model in args.models.split(",")
        for nodes in map(int, args.nodes.split(","))
        for seq_len in map(int, args.seq_lens.split(","))
    ]
    saved: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    saved_af: dict[tuple[Any, ...], dict[str, Any]] = {}
    sides = {side: this_command() for side in ("disagg", *runtimes)}
    if args.ep_from or args.from_:
        with open(args.ep_from or args.from_) as f:
            table = json.load(f)
        for row in table["rows"]:
            where = (row["model"], row["nodes"], row["seq_len"])
            saved[where] = [e for e in row["ep"] if e["runtime"] not in rerun]
            if args.from_ and "disagg" not in rerun:
                saved_af[where] = row["disagg"]
        taken = [r for r in runtimes if r not in rerun]
        taken += ["disagg"] if args.from_ and "disagg" not in rerun else []
        for side in taken:
            sides[side] = table.get("sides", {}).get(side, table["meta"]["command"])
    with ProcessPoolExecutor(max(args.jobs, 1)) as pool:
        running = [
            pool.submit(point, *where, runtimes, saved.get(where, []), saved_af.get(where))
            for where in points
        ]
        for done in running:  # in the table's order, each as soon as it and those above are
            row = done.result()
            rows.append(row)
            print(line(row), flush=True)
            print(f"  ({row['wall_s']:.0f} s)", file=sys.stderr, flush=True)
            if args.json:  # after every row: an interrupted run keeps what it measured
                write_json(args.json, {"rows": rows, "targets": {
                    "af_step_over_bound": TARGET_BOUND, "af_vs_best_ep": TARGET_LEAD},
                    "sides": sides}, sides_note(sides))  # fmt: skip
    return 0


def sides_note(sides: dict[str, str]) -> str:
    """Which command simulated each side of the table (`sides`: side -> command), where
    not all of them this one (`--from`, `--ep-from`)."""
    if set(sides.values()) == {this_command()}:
        return ""
    by_command: dict[str, list[str]] = {}
    for side, command in sides.items():
        by_command.setdefault(command, []).append("AF-Pipe" if side == "disagg" else side)
    parts = [
        f"{', '.join(names)} as `{command}` simulated {'it' if len(names) == 1 else 'them'}"
        for command, names in by_command.items()
    ]
    return "; ".join(parts)


def groups_sweep(model: str, nodes: int, seq_len: int) -> list[dict[str, Any]]:
    """AF-Pipe at every group count p that divides the layers and the GPUs (module doc)."""
    from disagmoe.presets import model_preset

    layers, gpus = model_preset(model).num_layers, nodes * 8
    out = []
    for p in [d for d in range(1, layers + 1) if layers % d == 0 and gpus % d == 0]:
        argv = ["--model", model, "--nodes", str(nodes), "--seq-len", str(seq_len),
                "--micro-batches", str(8 * gpus), "--groups", str(p),
                *SWEEP_SCHEDULE]  # fmt: skip
        row: dict[str, Any] = {"model": model, "nodes": nodes, "seq_len": seq_len,
                               "groups": p, "virtual_stages": layers // p}  # fmt: skip
        try:
            row.update(summary(simulate(argv)))
        except ValueError as err:
            row["error"] = str(err)
        print(f"  {model} {nodes} nodes p {p} (v {layers // p}): "
              f"{row.get('tokens_per_s', 0):.0f} tok/s {row.get('error', '')}", flush=True)  # fmt: skip
        out.append(row)
    return out


def line(row: dict[str, Any]) -> str:
    af, best = row["disagg"], row["best_ep"]
    where = f"{row['model']:17s} {row['nodes']:2d} {row['seq_len']:6d}"
    if "error" in af or best is None:
        return f"{where} {af.get('error') or 'no EP runtime fits'}"
    return (
        f"{where} {af['tokens_per_s']:9.0f} {af['step_over_bound']:7.2f} {_gib(af):>6s} "
        f"{best['runtime']:>14s} {best['tokens_per_s']:9.0f} {best['step_over_bound']:7.2f} "
        f"{_gib(best):>6s} {row['vs_best_ep']:6.2f} {row['bound_ratio']:8.2f}  "
        f"{row['verdict']}"
    )


def _gib(side: dict[str, Any]) -> str:
    return "-" if side.get("memory_gib") is None else f"{side['memory_gib']:.1f}"


if __name__ == "__main__":
    raise SystemExit(main())
