"""`disagmoe train | schedule | placement | prepare-data | export | checkpoint | plan | simulate |
bench` — the command-line interface.

`train`, `schedule` and `placement` take the same flags (`disagmoe.command`: generated from
the config dataclasses); `plan`, `simulate` and `bench` build the flags they share with them
from the same declarations (`config_io.add_config_flag`), so a concept has one flag, unit
and meaning everywhere (tests/unit/test_cli_vocabulary.py). User mistakes print one line
`disagmoe: error: ...` and exit with code 2.
"""

from __future__ import annotations

import argparse
import sys

from .bench.cli import add_bench_arguments, run_bench
from .checkpoint_cli import add_checkpoint_arguments, run_checkpoint
from .command import Parser, add_train_arguments, resolve_train_config, run_command
from .config import RunConfig
from .data_prep import add_prepare_arguments, run_prepare
from .distributed.ep_layout import EPLayout
from .distributed.layout import Layout, num_slots, run_layout
from .export import add_export_arguments, run_export
from .planner.cli import add_plan_arguments, run_plan
from .runtime.disagg import run_schedule, run_schedule_of_rank
from .schedule.baselines import build_baseline_schedule
from .schedule.ir import lists_csv, lists_text
from .schedule.validate import validate
from .simulate_cli import add_simulate_arguments, run_simulate
from .simulator.choose import run_choice, run_order
from .train import resolve_memory, train_command
from .training.budget import run_cap


def _cmd_schedule_ep(args: argparse.Namespace, cfg: RunConfig) -> int:
    """An `ep-*` runtime's per-rank lists (`schedule.baselines`: PyTorch's pipeline order
    with its all-to-alls); or with `--rank R` that rank's. They run in order on one lane
    per rank, so the lane validator does not apply (`--validate` is refused)."""
    par = cfg.parallel
    if par.runtime == "reference":
        raise ValueError("--runtime reference runs one process: it has no per-rank schedule")
    if args.forward_only or args.validate:
        raise ValueError(
            f"--forward-only and --validate are AF-Pipe's; drop them for --runtime {par.runtime}"
        )
    layout = EPLayout.build(cfg.model, par, cfg.train, par.world_size or par.pp * par.ep)
    schedule = build_baseline_schedule(layout, cfg.model, overlap_chunks=par.overlap_chunks)
    if args.rank is not None and not 0 <= args.rank < layout.world:
        raise ValueError(f"--rank must be in 0..{layout.world - 1}, got {args.rank}")
    if args.rank is None:
        sys.stdout.write(schedule.to_csv() if args.format == "csv" else schedule.to_text())
        return 0
    entries = [(args.rank, schedule.roles[args.rank], schedule.ranks[args.rank])]
    if args.format == "csv":
        sys.stdout.write(lists_csv(entries))
    else:
        header = f"# schedule {par.runtime}: rank {args.rank} of {layout.world}"
        sys.stdout.write(lists_text(header, entries))
    return 0


def _cmd_schedule(args: argparse.Namespace) -> int:
    """All ranks' lists, validated; or with `--rank R` that rank's list alone (built without
    the others'), checked against the whole world's only with `--validate`. An `ep-*`
    runtime prints the lists it records in its run's schedule.txt (`_cmd_schedule_ep`)."""
    cfg = resolve_train_config(args)
    if cfg.parallel.runtime != "disagg":
        return _cmd_schedule_ep(args, cfg)
    layout = run_layout(cfg)
    cfg = resolve_memory(cfg, layout.world_size)  # the cap `disagmoe train` would run here
    fwd = args.forward_only
    if args.rank is None:
        schedule = run_schedule(cfg, layout, forward_only=fwd, choose=run_order)
        peak = validate(schedule)
        if args.format == "csv":
            sys.stdout.write(schedule.to_csv())
        else:
            sys.stdout.write(schedule.to_text())
            print(
                "# valid: matching sends/receives, FIFO channels, no deadlock; "
                f"peak in-flight {peak}"
            )
            print(_order_line(cfg, layout))
        return 0
    if not 0 <= args.rank < layout.world_size:
        raise ValueError(f"--rank must be in 0..{layout.world_size - 1}, got {args.rank}")
    instrs = run_schedule_of_rank(cfg, layout, args.rank, forward_only=fwd, choose=run_order)
    entries = [(args.rank, str(layout.role(args.rank)), instrs)]
    if args.format == "csv":
        sys.stdout.write(lists_csv(entries))
    else:
        name = "afpipe-forward" if fwd else "afpipe"
        header = f"# schedule {name}: rank {args.rank} of {layout.world_size}, built alone"
        sys.stdout.write(lists_text(header, entries))
    if args.validate:
        schedule = run_schedule(cfg, layout, forward_only=fwd, choose=run_order)
        peak = validate(schedule)
        if schedule.ranks[args.rank] != instrs:
            raise AssertionError(f"rank {args.rank}'s list differs from the global schedule's")
        if args.format != "csv":
            print(
                "# valid: the whole world's lists check out and this rank's list equals its "
                f"slice; peak in-flight {peak}"
            )
    if args.format != "csv":
        print(_order_line(cfg, layout))
    return 0


def _order_line(cfg: RunConfig, layout: Layout) -> str:
    """The order and exchange chunks the lists follow and the simulated optimizer step of
    the training lists on `cfg.cluster` (compute: `choose.run_compute_costs`), with its
    bound."""
    slots, cap = num_slots(cfg, layout), run_cap(cfg, layout)
    choice, _ = run_choice(cfg, layout, slots, cap)
    ratio = f" (step/bound {choice.step_s / choice.bound_s:.2f})" if choice.bound_s else ""
    measured = cfg.schedule.costs_file or cfg.train.emulate_compute
    costs = f"measured costs {measured}" if measured else "analytic costs"
    line = (
        f"# order {choice.label}: predicted optimizer step {choice.step_s * 1e3:.4g} ms, bound "
        f"{choice.bound_s * 1e3:.4g} ms{ratio} on cluster {cfg.cluster.name} "
        f"(simulator, {costs}, fair links)"
    )
    given = cfg.schedule
    if given.order == "auto" or given.exchange_chunks == 0 or given.split_backward == "auto":
        steps = ", ".join(
            f"{o}{'+costs' if c else ''}{f' c{k}' if k > 1 else ''}{' +W' if w else ''} "
            f"{t * 1e3:.4g}"
            for o, c, k, t, w in choice.steps
        )
        line += f"\n# auto candidates (ms): {steps}"
    return line


def _cmd_placement(args: argparse.Namespace) -> int:
    """Which rank is which worker, node by node (`parallel.placement`, `--ranks-per-node`)."""
    cfg = resolve_train_config(args)
    layout = run_layout(cfg)
    R = layout.ranks_per_node
    print(
        f"# placement {layout.placement}: p={layout.groups} m={layout.attn_workers} "
        f"n={layout.expert_workers}, {layout.world_size} ranks, {R} per node"
    )
    roles = [layout.role(r) for r in range(layout.world_size)]
    width = max(len(str(r)) for r in roles)
    print(f"{'node':>4s} {'ranks':>9s}  {'A:F':>5s}  roles")
    for node, start in enumerate(range(0, layout.world_size, R)):
        mine = roles[start : start + R]
        a = sum(1 for r in mine if r.comp == "A")
        mix = f"{a}:{len(mine) - a}"
        names = " ".join(f"{r!s:{width}s}" for r in mine)
        print(f"{node:4d} {f'{start}-{start + len(mine) - 1}':>9s}  {mix:>5s}  {names}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="disagmoe", description="Disaggregated MoE training (AF-Pipe).")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    p_train = sub.add_parser("train", help="train a model (default: tiny, disagg, 4 local workers)")
    add_train_arguments(p_train)
    p_train.set_defaults(func=train_command)
    p_sched = sub.add_parser("schedule", help="print the AF-Pipe instruction lists of a layout")
    add_train_arguments(p_sched)
    p_sched.add_argument("--format", choices=("text", "csv"), default="text")
    p_sched.add_argument("--rank", type=int, default=None,
                         help="print only this rank's list, built without the others'")  # fmt: skip
    p_sched.add_argument("--validate", action="store_true",
                         help="with --rank: also build and validate the whole world's "
                         "schedule and check this rank's list against it")  # fmt: skip
    p_sched.add_argument("--forward-only", action="store_true",
                         help="the forward-only schedule of an evaluation batch")  # fmt: skip
    p_sched.set_defaults(func=_cmd_schedule)
    p_place = sub.add_parser("placement", help="print which rank is which worker, per node")
    add_train_arguments(p_place)
    p_place.set_defaults(func=_cmd_placement)
    p_prep = sub.add_parser("prepare-data", help="tokenize text / jsonl into a token file")
    add_prepare_arguments(p_prep)
    p_prep.set_defaults(func=run_prepare)
    p_export = sub.add_parser("export", help="write a run's checkpoint as a HF checkpoint")
    add_export_arguments(p_export)
    p_export.set_defaults(func=run_export)
    p_ckpt = sub.add_parser("checkpoint", help="verify a run's checkpoints against their manifests")
    add_checkpoint_arguments(p_ckpt)
    p_ckpt.set_defaults(func=run_checkpoint)
    p_plan = sub.add_parser("plan", help="choose the A/F split")
    add_plan_arguments(p_plan)
    p_plan.set_defaults(func=run_plan)
    p_sim = sub.add_parser("simulate", help="simulate a step at cluster scale")
    add_simulate_arguments(p_sim)
    p_sim.set_defaults(func=run_simulate)
    p_bench = sub.add_parser("bench", help="benchmark runtimes side by side")
    add_bench_arguments(p_bench)
    p_bench.set_defaults(func=run_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(args.func, args)


if __name__ == "__main__":
    sys.exit(main())
