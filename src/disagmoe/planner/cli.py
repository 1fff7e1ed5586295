"""`disagmoe plan`: argument definitions and the command body (wired up in disagmoe/cli.py).

A cluster preset (`--cluster`) gives the hardware defaults; explicit flags override them
(`add_cluster_arguments`, shared with `disagmoe simulate`). Flags that set a config field
(`--seq-len`, `--loss-chunk-tokens`, `--order`, `--costs-file`, ...) are built from the field's declaration
(`config_io.add_config_flag`), with the planner's own default where it chooses.
Infeasible requests raise ValueError naming the binding constraint (the caller prints it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from disagmoe.config import RECOMPUTE, ClusterConfig
from disagmoe.config_io import add_config_flag
from disagmoe.extras import require_extra
from disagmoe.flags import add_renamed_flag
from disagmoe.planner import Plan, plan_for
from disagmoe.planner.options import PROFILES, PlanOptions
from disagmoe.planner.sim_profile import AUTO_SIMULATOR_MAX_GPUS
from disagmoe.presets import CLUSTER_PRESETS, MODEL_PRESETS, cluster_preset, model_preset
from disagmoe.simulator.measured import MeasuredCosts

# `--cluster`'s overrides of the preset: field of `ClusterConfig` -> (type, help). The NIC
# rate is Gbit/s on the command line (as `disagmoe bench` takes it) and GB/s in the config.
CLUSTER_FLAGS: dict[str, tuple[type, str]] = {
    "gpus_per_node": (int, "GPUs per node"),
    "nics_per_node": (int, "NICs per node"),
    "nic_gbit": (float, "Gbit/s per NIC, one direction (sets cluster.nic_gbps, which is in "
                 "GB/s: this / 8)"),
    "peak_tflops": (float, "dense bf16 peak per GPU, TFLOP/s"),
    "gpu_mem_gib": (float, "memory per GPU, GiB"),
    "mfu": (float, "achievable fraction of peak FLOP/s"),
    "bw_efficiency": (float, "achievable fraction of NIC bandwidth"),
}  # fmt: skip


def add_cluster_arguments(
    parser: argparse.ArgumentParser, overrides: tuple[str, ...] = tuple(CLUSTER_FLAGS)
) -> None:
    """`--cluster PRESET` and the `overrides` (of `CLUSTER_FLAGS`) of its fields; read them
    back with `cluster_from_args`. Shared by `disagmoe plan` and `disagmoe simulate`."""
    parser.add_argument("--cluster", default="h800", choices=sorted(CLUSTER_PRESETS),
                        help="hardware preset; the overrides below replace its fields")  # fmt: skip
    hw = parser.add_argument_group("hardware overrides (default: the preset's)")
    for name in overrides:
        typ, help = CLUSTER_FLAGS[name]
        hw.add_argument("--" + name.replace("_", "-"), type=typ, help=help)
    if "nic_gbit" in overrides:
        add_renamed_flag(hw, "--nic-gbps", "--nic-gbit", "Gbit/s per NIC")


def cluster_from_args(args: argparse.Namespace) -> ClusterConfig:
    """The `--cluster` preset with the overrides given (`add_cluster_arguments`)."""
    values = {name: getattr(args, name, None) for name in CLUSTER_FLAGS}
    overrides = {name: v for name, v in values.items() if v is not None}
    if "nic_gbit" in overrides:
        overrides["nic_gbps"] = overrides.pop("nic_gbit") / 8
    return dataclasses.replace(cluster_preset(args.cluster), **overrides)


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `disagmoe plan`; those of config fields as the fields declare them."""
    parser.add_argument("--model", required=True, choices=sorted(MODEL_PRESETS))
    parser.add_argument("--gpus", type=int, required=True, help="total GPUs W")
    add_cluster_arguments(parser)
    add_config_flag(parser, "train.seq_len", default=4096)
    add_config_flag(parser, "train.micro_batch_size", default=1, note="per attention replica")
    add_config_flag(parser, "train.loss_chunk_tokens")
    parser.add_argument("--top-k", type=int, help="override the model's top-k")
    parser.add_argument("--roofline-only", action="store_true",
                        help="the paper's two-stage problem only (p=1, nominal peaks, no memory)")  # fmt: skip
    add_config_flag(parser, "parallel.groups", default=0, note="0: the planner chooses")
    parser.add_argument("--micro-batches", type=int, default=0,
                        help="per attention replica (default: auto)")  # fmt: skip
    add_config_flag(parser, "train.global_batch_size", default=0,
                    note="plan for this batch, as train --plan auto does (0: the planner's "
                    "own micro-batch count)")  # fmt: skip
    add_config_flag(parser, "train.recompute", default="auto", choices=("auto", *RECOMPUTE),
                    note="auto: the planner chooses")  # fmt: skip
    parser.add_argument("--solver", choices=("milp", "enumerate"), default="milp")
    parser.add_argument("--epsilon", type=float, default=0.02, help="stage-2 tie band")
    parser.add_argument("--search-moves", type=int, default=64, help="stage-3 moves K")
    parser.add_argument("--search-radius", type=int, default=2, help="stage-3 radius r")
    replays = "plan: what the simulator profile replays (auto: {}x the replays)"
    add_config_flag(parser, "schedule.order", note=replays.format(6))
    # one chunk by default: a run left at auto picks its chunks on the plan it runs, and the
    # planner ranks plans unchunked for it (options.run_replays)
    add_config_flag(parser, "schedule.exchange_chunks", default=1,
                    note="plan: default 1, what the simulator profile replays (0: auto, 4x the replays)")  # fmt: skip
    add_config_flag(parser, "schedule.split_backward", note=replays.format(2))
    parser.add_argument("--profile", choices=PROFILES, default="auto",
                        help="what scores stage 3: the simulator's replay of the plan's step or "
                        f"the analytic formula (auto: simulator up to {AUTO_SIMULATOR_MAX_GPUS} "
                        "GPUs, analytic above and for --roofline-only)")  # fmt: skip
    add_config_flag(parser, "schedule.costs_file", note="plan: the simulator profile's")
    add_renamed_flag(parser, "--costs", "--costs-file", "a compute_costs.json")
    parser.add_argument("--seed", type=int, default=0, help="seed of the stage-3 search")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", metavar="FILE.png", help="write the roofline figure")


def run_plan(args: argparse.Namespace) -> int:
    """Plan, print a table (or JSON), optionally plot. ValueError propagates to the caller."""
    if args.plot:
        require_extra("matplotlib", "plots", "--plot")
    model = model_preset(args.model)
    if args.top_k is not None:
        model = dataclasses.replace(model, top_k=args.top_k)
    cluster = cluster_from_args(args)
    costs = MeasuredCosts.load(args.costs_file) if args.costs_file else None
    if costs is not None and (args.profile == "analytic" or args.roofline_only):
        raise ValueError(
            "--costs-file prices the simulator profile: use --profile simulator or auto"
        )
    plan = plan_for(
        model,
        cluster,
        gpus=args.gpus,
        seq_len=args.seq_len,
        micro_batch_size=args.micro_batch_size,
        loss_chunk_tokens=args.loss_chunk_tokens,
        roofline_only=args.roofline_only,
        groups=args.groups,
        micro_batches=args.micro_batches,
        global_batch=args.global_batch_size,
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
            f"--costs-file prices the simulator profile, which auto uses up to "
            f"{AUTO_SIMULATOR_MAX_GPUS} GPUs; give --profile simulator for {args.gpus}"
        )
    if args.plot:
        from disagmoe.planner.plot import plot_roofline  # matplotlib only when asked

        plot_roofline(plan, cluster, args.plot)
    if args.json:
        costs_file = args.costs_file or "analytic"
        print(json.dumps({**plan.to_dict(), "costs": costs_file}, sort_keys=True))
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
        ("recompute", plan.recompute_label),
        ("T_attn compute / comm", f"{plan.t_attn_compute_s * ms:.3f} / {plan.t_attn_comm_s * ms:.3f} ms"),
        ("T_ffn compute / comm", f"{plan.t_ffn_compute_s * ms:.3f} / {plan.t_ffn_comm_s * ms:.3f} ms"),
        ("T_stage (binding)", f"{plan.t_stage_s * ms:.3f} ms  ({plan.binding})"),
        ("vs Stage 1 optimum", f"+{100 * plan.stage1_gap:.2f}% per sequence (stage 2 band "
         f"{100 * epsilon:g}%)" if plan.stage == "milp" else
         "- (moved by stage 3)" if plan.stage == "search" else
         "- (recomputed layers from stage 5)" if plan.stage == "layers" else
         "- (micro-batches from stage 4)"),
        ("I_attn / I_ffn / ridge", f"{plan.i_attn:,.0f} / {plan.i_ffn:,.0f} / {plan.ridge:,.0f} FLOP/B"),
        ("memory A / F / GPU", f"{plan.mem_attn_gib:.1f} / {plan.mem_ffn_gib:.1f} / "
         f"{plan.mem_cap_gib:.1f} GiB per GPU"),
        ("step time (profile)", f"{plan.step_time_s:.3f} s for {plan.sequences_per_step} sequences"
         f"  ({plan.profile})"),
        ("simulated step", "-" if plan.simulated_step_s is None else
         f"{plan.simulated_step_s:.3f} s  ({plan.seq_len * plan.sequences_per_step / plan.simulated_step_s:,.0f} tokens/s)"),
        ("schedule replayed", plan.schedule or "-"),
    ]  # fmt: skip
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
