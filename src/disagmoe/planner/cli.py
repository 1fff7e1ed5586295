"""`disagmoe plan`: argument definitions and the command body (wired up in disagmoe/cli.py).

A cluster preset (`--cluster`) gives the hardware defaults; explicit flags override them.
Infeasible requests raise ValueError naming the binding constraint (the caller prints it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from disagmoe.config import RECOMPUTE, SCHEDULE_ORDERS
from disagmoe.extras import require_extra
from disagmoe.planner import Plan, plan_for
from disagmoe.planner.plan import PROFILES, PlanOptions
from disagmoe.planner.sim_profile import AUTO_SIMULATOR_MAX_GPUS
from disagmoe.presets import CLUSTER_PRESETS, MODEL_PRESETS, cluster_preset, model_preset
from disagmoe.simulator.measured import MeasuredCosts


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `disagmoe plan`."""
    parser.add_argument("--model", required=True, choices=sorted(MODEL_PRESETS))
    parser.add_argument("--gpus", type=int, required=True, help="total GPUs W")
    parser.add_argument("--cluster", default="h800", choices=sorted(CLUSTER_PRESETS),
                        help="hardware preset; the flags below override it")  # fmt: skip
    hw = parser.add_argument_group("hardware overrides")
    hw.add_argument("--gpus-per-node", type=int)
    hw.add_argument("--nics-per-node", type=int)
    hw.add_argument("--nic-gbps", type=float, help="GB/s per NIC, one direction")
    hw.add_argument("--peak-tflops", type=float, help="dense bf16 peak per GPU")
    hw.add_argument("--gpu-mem-gib", type=float)
    hw.add_argument("--mfu", type=float, help="achievable fraction of peak FLOP/s")
    hw.add_argument("--bw-efficiency", type=float, help="achievable fraction of NIC bandwidth")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--micro-batch-size", type=int, default=1,
                        help="sequences per micro-batch per attention replica")  # fmt: skip
    parser.add_argument("--top-k", type=int, help="override the model's top-k")
    parser.add_argument("--roofline-only", action="store_true",
                        help="the paper's two-stage problem only (p=1, nominal peaks, no memory)")  # fmt: skip
    parser.add_argument("--groups", type=int, default=0, help="fix p (default: chosen)")
    parser.add_argument("--micro-batches", type=int, default=0, help="per step (default: auto)")
    parser.add_argument("--recompute", choices=("auto", *RECOMPUTE), default="auto")
    parser.add_argument("--solver", choices=("milp", "enumerate"), default="milp")
    parser.add_argument("--epsilon", type=float, default=0.02, help="stage-2 tie band")
    parser.add_argument("--search-moves", type=int, default=64, help="stage-3 moves K")
    parser.add_argument("--search-radius", type=int, default=2, help="stage-3 radius r")
    parser.add_argument("--order", choices=SCHEDULE_ORDERS, default="breadth",
                        help="schedule.order the simulator profile replays (auto: each plan "
                        "scored by its best order, simulator.choose; 6x the replays)")  # fmt: skip
    parser.add_argument("--exchange-chunks", type=int, default=1, metavar="C",
                        help="schedule.exchange_chunks the simulator profile replays "
                        "(0: auto's pick of 1, 2, 4 or 8 per plan; 4x the replays)")  # fmt: skip
    parser.add_argument("--split-backward", choices=("off", "on", "auto"), default="off",
                        help="schedule.split_backward the simulator profile replays (weight "
                        "gradients deferred; auto: the better per plan, 2x the replays)")  # fmt: skip
    parser.add_argument("--profile", choices=PROFILES, default="auto",
                        help="what scores stage 3: the simulator's replay of the plan's step or "
                        f"the analytic formula (auto: simulator up to {AUTO_SIMULATOR_MAX_GPUS} "
                        "GPUs, analytic above and for --roofline-only)")  # fmt: skip
    parser.add_argument("--costs", default="", metavar="FILE",
                        help="the simulator profile prices compute with these measured per-op "
                        "costs (compute_costs.json of the bench or benchmarks/gpu_check.py)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", metavar="FILE.png", help="write the roofline figure")


def run_plan(args: argparse.Namespace) -> int:
    """Plan, print a table (or JSON), optionally plot. ValueError propagates to the caller."""
    if args.plot:
        require_extra("matplotlib", "plots", "--plot")
    model = model_preset(args.model)
    if args.top_k is not None:
        model = dataclasses.replace(model, top_k=args.top_k)
    hw_flags = "gpus_per_node nics_per_node nic_gbps peak_tflops gpu_mem_gib mfu bw_efficiency"
    overrides = {
        name: getattr(args, name) for name in hw_flags.split() if getattr(args, name) is not None
    }
    cluster = dataclasses.replace(cluster_preset(args.cluster), **overrides)
    costs = MeasuredCosts.load(args.costs) if args.costs else None
    if costs is not None and (args.profile == "analytic" or args.roofline_only):
        raise ValueError("--costs prices the simulator profile: use --profile simulator or auto")
    plan = plan_for(
        model,
        cluster,
        gpus=args.gpus,
        seq_len=args.seq_len,
        micro_batch_size=args.micro_batch_size,
        roofline_only=args.roofline_only,
        groups=args.groups,
        micro_batches=args.micro_batches,
        recompute=args.recompute,
        solver=args.solver,
        epsilon=args.epsilon,
        search_moves=args.search_moves,
        search_radius=args.search_radius,
        seed=args.seed,
        profile=args.profile,
        order=args.order,
        exchange_chunks=args.exchange_chunks,
        split_backward=args.split_backward,
        costs=costs,
    )
    if costs is not None and plan.profile != "simulator":
        raise ValueError(
            f"--costs prices the simulator profile, which auto uses up to "
            f"{AUTO_SIMULATOR_MAX_GPUS} GPUs; give --profile simulator for {args.gpus}"
        )
    if args.plot:
        from disagmoe.planner.plot import plot_roofline  # matplotlib only when asked

        plot_roofline(plan, cluster, args.plot)
    if args.json:
        print(json.dumps({**plan.to_dict(), "costs": args.costs or "analytic"}, sort_keys=True))
    else:
        print(format_plan(plan, args.epsilon))
    return 0


def format_plan(plan: Plan, epsilon: float = PlanOptions().epsilon) -> str:
    ms = 1e3
    rows = [
        ("model / cluster", f"{plan.model} on {plan.gpus} x {plan.cluster} GPUs, {plan.nics} NICs"),
        ("problem", "roofline only (paper)" if plan.roofline_only else f"full ({plan.stage})"),
        ("seq len / micro-batch", f"{plan.seq_len} / {plan.micro_batch_size} per replica"),
        ("groups p / virtual stages v", f"{plan.groups} / {plan.virtual_stages}"),
        ("A:F GPUs (total)", f"{plan.attn_gpus} : {plan.ffn_gpus}"
         f"  ({plan.attn_gpus_per_group} : {plan.ffn_gpus_per_group} per group)"),
        ("A:F NICs (total)", f"{plan.attn_nics} : {plan.ffn_nics}"
         f"  (of {plan.nics}; half carry each direction)"),
        ("micro-batches / in flight", f"{plan.micro_batches} / {plan.in_flight}"
         + (f"  [{plan.memory_binding}]" if plan.memory_binding else "")),
        ("recompute", plan.recompute),
        ("T_attn compute / comm", f"{plan.t_attn_compute_s * ms:.3f} / {plan.t_attn_comm_s * ms:.3f} ms"),
        ("T_ffn compute / comm", f"{plan.t_ffn_compute_s * ms:.3f} / {plan.t_ffn_comm_s * ms:.3f} ms"),
        ("T_stage (binding)", f"{plan.t_stage_s * ms:.3f} ms  ({plan.binding})"),
        ("vs Stage 1 optimum", f"+{100 * plan.stage1_gap:.2f}% per sequence (stage 2 band "
         f"{100 * epsilon:g}%)" if plan.stage == "milp" else
         "- (moved by stage 3)" if plan.stage == "search" else "- (micro-batches from stage 4)"),
        ("I_attn / I_ffn / ridge", f"{plan.i_attn:,.0f} / {plan.i_ffn:,.0f} / {plan.ridge:,.0f} FLOP/B"),
        ("memory A / F / usable", f"{plan.mem_attn_gib:.1f} / {plan.mem_ffn_gib:.1f} / "
         f"{plan.mem_cap_gib:.1f} GiB per GPU"),
        ("step time (profile)", f"{plan.step_time_s:.3f} s for {plan.sequences_per_step} sequences"
         f"  ({plan.profile})"),
        ("simulated step", "-" if plan.simulated_step_s is None else
         f"{plan.simulated_step_s:.3f} s  ({plan.seq_len * plan.sequences_per_step / plan.simulated_step_s:,.0f} tokens/s)"),
        ("schedule replayed", plan.schedule or "-"),
    ]  # fmt: skip
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
