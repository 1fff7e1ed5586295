"""The planner's choice under the simulator profile against an exhaustive simulator sweep.

    .venv/bin/python benchmarks/planner_vs_sweep.py [--json benchmarks/results/planner_vs_sweep.json]

Per case (model preset, sequence length; 8 nodes of the h800 preset = 64 GPUs, one
sequence per micro-batch): `plan_for(..., profile="simulator")` (stages 1-3, Stage 3
scored by `planner.sim_profile.SimulatorProfile`), timed; then every plan of the same
Stage-3 space at the planner's p (`sim_profile.sweep_plans`: m, the NIC split M_a : M_f,
the in-flight cap, recompute none/full; the planner's memory model rules out what does
not fit) is simulated with the same profile and the best tokens/s is reported, timed.
By default the sweep takes every m and every M_a and the in-flight cap at powers of two
and its largest value (`--caps pow2`; `--caps all` for every cap); `--m-points` /
`--nic-points` > 0 put m and M_a on grids of that many evenly spaced values instead.
`gap %` = best swept tokens/s / planner's - 1 (negative: the planner found a point the
sweep's grid misses).

Then the planning time with the simulator profile at 64 and 1024 GPUs (`--timing-gpus`,
`--timing-models`; `--models` with no name skips the sweep), wall-clock and the process's
CPU seconds (what it costs on an idle core when the machine is shared).
Cluster presets are nominal (analytic per-op costs, no GPU measurement).
"""

from __future__ import annotations

import argparse
import time

from results_io import write_json

from disagmoe.planner import Plan, Planner, PlanOptions, plan_for
from disagmoe.planner.sim_profile import SimulatorProfile, sweep_plans
from disagmoe.presets import CLUSTER_PRESETS, model_preset

H800 = CLUSTER_PRESETS["h800"]
MODELS = ("qwen3-30b-a3b", "deepseek-moe-16b", "gpt-oss-20b")
SEQS = (8192, 32768)


def describe(plan: Plan) -> str:
    return (
        f"p{plan.groups} {plan.attn_gpus_per_group}:{plan.ffn_gpus_per_group} "
        f"M{plan.attn_nics_per_group}:{plan.ffn_nics_per_group} K{plan.in_flight} "
        f"{plan.recompute}"
    )


def tokens_per_s(plan: Plan) -> float:
    return plan.seq_len * plan.sequences_per_step / plan.step_time_s


def compare(model_name: str, seq: int, gpus: int, args: argparse.Namespace) -> dict[str, object]:
    model = model_preset(model_name)
    t0 = time.perf_counter()
    # stages 1-3 (no stage 4): the sweep is of the same space, at the same micro-batches
    chosen = plan_for(model, H800, gpus=gpus, seq_len=seq, micro_batch_size=1,
                      profile="simulator", batch_stage=False,
                      layers_stage=False)  # the sweep's space: whole recompute modes  # fmt: skip
    plan_s = time.perf_counter() - t0
    planner = Planner(model=model, cluster=H800, gpus=gpus, seq_len=seq, micro_batch_size=1,
                      options=PlanOptions(profile="simulator"))  # fmt: skip
    t0 = time.perf_counter()
    swept = sweep_plans(
        planner, chosen.groups, SimulatorProfile(planner), m_points=args.m_points,
        nic_points=args.nic_points, caps=args.caps,
    )  # fmt: skip
    sweep_s = time.perf_counter() - t0
    best = max(swept, key=tokens_per_s)
    mine, top = tokens_per_s(chosen), tokens_per_s(best)
    return {
        "model": model_name,
        "seq_len": seq,
        "gpus": gpus,
        "planner_plan": describe(chosen),
        "planner_tokens_s": mine,
        "planner_simulated_step_s": chosen.simulated_step_s,
        "best_plan": describe(best),
        "best_tokens_s": top,
        "gap_pct": 100.0 * (top / mine - 1.0),
        "plan_s": plan_s,
        "sweep_s": sweep_s,
        "swept_points": len(swept),
        "planner": chosen.to_dict(),
        "best": best.to_dict(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", default="", help="write the rows and timings here")
    parser.add_argument("--models", nargs="*", default=list(MODELS), help="swept presets")
    parser.add_argument("--seqs", nargs="+", type=int, default=list(SEQS))
    parser.add_argument("--nodes", type=int, default=8, help="h800 nodes of 8 GPUs")
    parser.add_argument("--m-points", type=int, default=0, help="sweep: m values (0: all)")
    parser.add_argument("--nic-points", type=int, default=0, help="sweep: M_a values (0: all)")
    parser.add_argument("--caps", choices=("all", "pow2"), default="pow2")
    parser.add_argument("--timing-gpus", nargs="*", type=int, default=[64, 1024])
    parser.add_argument("--timing-models", nargs="*", default=list(MODELS))
    args = parser.parse_args()
    gpus = args.nodes * H800.gpus_per_node
    rows = []
    print(f"{'preset':17s} {'seq':>6s} {'planner plan':28s} {'tok/s':>9s} {'best swept plan':28s} "
          f"{'tok/s':>9s} {'gap %':>6s} {'plan s':>7s} {'sweep s':>8s} {'points':>6s}")  # fmt: skip
    for name in args.models:
        for seq in args.seqs:
            try:
                row = compare(name, seq, gpus, args)
            except ValueError as err:  # no plan fits the GPU's memory: the row says so
                rows.append({"model": name, "seq_len": seq, "gpus": gpus, "error": str(err)})
                print(f"{name:17s} {seq:6d} no feasible plan", flush=True)
                continue
            rows.append(row)
            print(f"{name:17s} {seq:6d} {row['planner_plan']:28s} {row['planner_tokens_s']:9,.0f} "
                  f"{row['best_plan']:28s} {row['best_tokens_s']:9,.0f} {row['gap_pct']:6.1f} "
                  f"{row['plan_s']:7.1f} {row['sweep_s']:8.1f} {row['swept_points']:6d}",
                  flush=True)  # fmt: skip
    timings = []
    for n in args.timing_gpus:
        for name in args.timing_models:
            for seq in args.seqs:
                t0, c0 = time.perf_counter(), time.process_time()
                try:
                    plan = plan_for(model_preset(name), H800, gpus=n, seq_len=seq,
                                    micro_batch_size=1, profile="simulator")  # fmt: skip
                    what = describe(plan)
                except ValueError:  # infeasible: how long it took to say so
                    what = "no feasible plan"
                seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
                timings.append({"gpus": n, "model": name, "seq_len": seq, "plan_s": seconds,
                                "plan_cpu_s": cpu, "plan": what})  # fmt: skip
                print(f"planning {name} seq {seq} on {n} GPUs: {seconds:.1f} s wall, {cpu:.1f} s "
                      f"CPU ({what})", flush=True)  # fmt: skip
    if args.json:
        write_json(args.json, {"cluster": "h800", "gpus": gpus, "rows": rows, "timings": timings,
                               "grid": {"m_points": args.m_points,
                                        "nic_points": args.nic_points, "caps": args.caps}})  # fmt: skip


if __name__ == "__main__":
    main()
