"""`disagmoe train | plan | simulate | schedule` — the command-line interface.

Configuration precedence for `train`: built-in defaults < `--model` preset /
`--init-from-hf` < `--config FILE.toml` < explicit flags < `--set a.b=v`.
User mistakes print one line `disagmoe: error: ...` and exit with code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.multiprocessing.api import SignalException

from .config import RUNTIMES, RunConfig, replace_section
from .config_io import apply_overrides, load_toml
from .presets import model_preset

# flag name -> (section, field)
_TRAIN_FLAGS: dict[str, tuple[str, str]] = {
    "run_dir": ("train", "run_dir"),
    "steps": ("train", "steps"),
    "seed": ("train", "seed"),
    "lr": ("train", "lr"),
    "dtype": ("train", "dtype"),
    "data": ("train", "data"),
    "seq_len": ("train", "seq_len"),
    "global_batch_size": ("train", "global_batch_size"),
    "micro_batch_size": ("train", "micro_batch_size"),
    "comm_timeout": ("train", "comm_timeout_s"),
    "checkpoint_every": ("train", "checkpoint_every"),
    "resume": ("train", "resume"),
    "max_restarts": ("train", "max_restarts"),
    "fail_at_step": ("train", "fail_at_step"),
    "fail_rank": ("train", "fail_rank"),
    "runtime": ("parallel", "runtime"),
    "groups": ("parallel", "groups"),
    "attn_workers": ("parallel", "attn_workers"),
    "expert_workers": ("parallel", "expert_workers"),
    "pp": ("parallel", "pp"),
    "ep": ("parallel", "ep"),
    "virtual_stages": ("parallel", "virtual_stages"),
    "threads_per_rank": ("parallel", "threads_per_rank"),
    "world_size": ("parallel", "world_size"),
    "overlap_chunks": ("parallel", "overlap_chunks"),
    "max_in_flight": ("schedule", "max_in_flight"),
}


class CliError(ValueError):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, exit 2
        sys.stderr.write(f"disagmoe {self.prog.split()[-1]}: error: {message}\n")
        sys.exit(2)


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config", help="TOML file with [model] [parallel] [schedule] [train] [cluster]"
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override any config field (repeatable)",
    )
    p.add_argument("--model", help="model preset (tiny, tiny-shared, small, qwen3-30b-a3b, ...)")
    p.add_argument(
        "--init-from-hf", metavar="DIR", help="Hugging Face checkpoint dir (Qwen3-MoE, Mixtral)"
    )
    p.add_argument("--runtime", choices=RUNTIMES)
    p.add_argument("--run-dir")
    p.add_argument("--steps", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--dtype", choices=("float32", "float64", "bfloat16"))
    p.add_argument("--data", help=".txt (bytes), .npy or .bin token file; default: built-in corpus")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--global-batch-size", type=int, help="sequences per optimizer step")
    p.add_argument("--micro-batch-size", type=int, help="sequences per micro-batch")
    p.add_argument("--groups", type=int, help="disagg: interleaved A/F groups p")
    p.add_argument("--attn-workers", type=int, help="disagg: attention replicas m per group")
    p.add_argument("--expert-workers", type=int, help="disagg: expert shards n per group")
    p.add_argument("--pp", type=int, help="baselines: pipeline stages")
    p.add_argument("--ep", type=int, help="baselines: expert-parallel ranks")
    p.add_argument("--virtual-stages", type=int, help="ep-interleaved: stages per rank")
    p.add_argument("--overlap-chunks", type=int, help="ep-overlap: expert compute chunks")
    p.add_argument("--world-size", type=int, help="workers (default: p*(m+n), or pp*ep for ep-*)")
    p.add_argument("--max-in-flight", type=int, help="micro-batch slots a worker may hold")
    p.add_argument("--threads-per-rank", type=int)
    p.add_argument("--comm-timeout", type=float, help="seconds before a communication wait fails")
    p.add_argument(
        "--checkpoint-every", type=int, help="save a checkpoint every N steps and at the end"
    )
    p.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        metavar="DIR",
        help="resume from DIR (a run dir, its checkpoints/ or a step dir); "
        "without DIR: the run dir's latest checkpoint",
    )
    p.add_argument(
        "--max-restarts", type=int, help="restart all workers this often after a failure"
    )
    p.add_argument(
        "--fail-at-step", type=int, help="fault injection: kill --fail-rank before this step"
    )
    p.add_argument("--fail-rank", type=int, help="fault injection: the rank to kill (default 0)")
    p.add_argument(
        "--plan",
        choices=("auto",),
        help="disagg: let the planner choose p, m, n "
        "for --world-size workers (default 4) on the [cluster] config",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def train_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="disagmoe train")
    add_train_arguments(p)
    return p


def resolve_train_config(args: argparse.Namespace) -> RunConfig:
    cfg = RunConfig()
    if args.model:
        cfg = dataclasses.replace(cfg, model=model_preset(args.model))
    if args.init_from_hf:  # the checkpoint's shape; a --config file may still adjust it
        from .models.hf_import import read_hf_config

        cfg = dataclasses.replace(cfg, model=read_hf_config(args.init_from_hf))
        cfg = replace_section(cfg, "train", init_from_hf=str(args.init_from_hf))
    if args.config:
        cfg = load_toml(args.config, cfg)
        if cfg.train.init_from_hf and not args.init_from_hf:
            from .models.hf_import import read_hf_config

            hf_model = read_hf_config(cfg.train.init_from_hf)
            cfg = load_toml(args.config, dataclasses.replace(cfg, model=hf_model))
    for flag, (section, name) in _TRAIN_FLAGS.items():
        value = getattr(args, flag, None)
        if value is not None:
            cfg = replace_section(cfg, section, **{name: value})
    if args.no_progress:
        cfg = replace_section(cfg, "train", progress=False)
    cfg = apply_overrides(cfg, args.set)
    if getattr(args, "plan", None) == "auto":
        from .planner.layout_plan import auto_layout

        cfg, plan = auto_layout(cfg, cfg.parallel.world_size or 4)
        print(
            f"plan: p={plan.groups} m={plan.attn_gpus_per_group} n={plan.ffn_gpus_per_group} "
            f"(predicted stage {plan.t_stage_s * 1e3:.3g} ms, binding: {plan.binding})",
            file=sys.stderr,
        )
    return cfg


def _cmd_train(args: argparse.Namespace) -> int:
    from .train import train

    cfg = resolve_train_config(args)
    run_dir, records = train(cfg)
    if records:
        first, last = records[0], records[-1]
        print(
            f"{cfg.parallel.runtime}: {len(records)} steps, loss {first['loss']:.4f} -> "
            f"{last['loss']:.4f}, {last['tokens_per_s']:.0f} tokens/s; run dir {run_dir}"
        )
    else:
        print(f"{cfg.parallel.runtime}: 0 steps; run dir {run_dir}")
    return 0


def _cmd_schedule(args: argparse.Namespace) -> int:
    from .distributed.layout import Layout
    from .runtime.disagg import run_schedule
    from .schedule.validate import validate

    cfg = resolve_train_config(args)
    layout = Layout.build(cfg.model, cfg.parallel)
    schedule = run_schedule(cfg, layout)
    peak = validate(schedule)
    if args.format == "csv":
        sys.stdout.write(schedule.to_csv())
    else:
        sys.stdout.write(schedule.to_text())
        print(
            f"# valid: matching sends/receives, FIFO channels, no deadlock; peak in-flight {peak}"
        )
    return 0


def _optional(
    module: str, add: str, run: str
) -> tuple[Callable[..., None], Callable[..., int]] | None:
    import importlib

    try:
        mod = importlib.import_module(module, __package__)
    except ImportError:
        return None
    return getattr(mod, add), getattr(mod, run)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="disagmoe", description="Disaggregated MoE training (AF-Pipe).")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p_train = sub.add_parser("train", help="train a model (default: tiny, disagg, 4 local workers)")
    add_train_arguments(p_train)
    p_train.set_defaults(func=_cmd_train)
    p_sched = sub.add_parser("schedule", help="print the AF-Pipe instruction lists of a layout")
    add_train_arguments(p_sched)
    p_sched.add_argument("--format", choices=("text", "csv"), default="text")
    p_sched.set_defaults(func=_cmd_schedule)
    for name, module, add, run, help_ in (
        ("plan", ".planner.cli", "add_plan_arguments", "run_plan", "choose the A/F split"),
        (
            "simulate",
            ".simulator.cli",
            "add_simulate_arguments",
            "run_simulate",
            "simulate a step at cluster scale",
        ),
        (
            "bench",
            ".bench.cli",
            "add_bench_arguments",
            "run_bench",
            "benchmark runtimes side by side",
        ),
    ):
        fns = _optional(module, add, run)
        if fns is None:
            continue
        p_cmd = sub.add_parser(name, help=help_)
        fns[0](p_cmd)
        p_cmd.set_defaults(func=fns[1])
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ValueError as err:
        sys.stderr.write(f"disagmoe: error: {err}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("disagmoe: interrupted\n")
        return 130
    except SignalException as err:  # Ctrl-C / SIGTERM while the elastic agent runs
        sys.stderr.write(f"disagmoe: interrupted ({err.sigval.name})\n")
        return 130
    except Exception as err:  # a failed rank: say which and why, in one line
        from .train import TrainingFailed

        if isinstance(err, TrainingFailed):
            sys.stderr.write(f"disagmoe: error: {err}\n")
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
