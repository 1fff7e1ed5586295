"""What `disagmoe` (cli.py) and `python -m disagmoe.train` share: the parser whose errors
are one line, the exit codes, and the `train` flags with the RunConfig they resolve to.

The `train` flags are not listed here: a config field declares its own flag in its
metadata (`flags.flag`), and `config_io.config_flags` reads them. The flags below choose where
the config starts instead, in this order of precedence: built-in defaults < `--model`
preset / `--init-from-hf` < `--config FILE.toml` < explicit flags < `--set a.b=v`.

User mistakes (`ValueError`) print one line `disagmoe: error: ...` and exit with code 2;
output cut short by its reader (a closed pipe) ends the command quietly with code 141.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from torch.distributed.elastic.multiprocessing.api import SignalException

from .config import RunConfig, replace_section
from .config_io import apply_overrides, config_flags, load_toml
from .presets import model_preset


class Parser(argparse.ArgumentParser):
    """An argument error is one line `disagmoe CMD: error: ...` and exit code 2."""

    def error(self, message: str) -> NoReturn:
        words = self.prog.split()  # "disagmoe" or "disagmoe CMD" (unknown flags: the former)
        name = "disagmoe" if words[-1] == "disagmoe" else f"disagmoe {words[-1]}"
        sys.stderr.write(f"{name}: error: {message}\n")
        sys.exit(2)


class CommandFailed(RuntimeError):
    """A command failed for a reason other than its input: one line, exit code 1."""


def run_command(func: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run a command's body; returns the process exit code (errors as one line on stderr)."""
    try:
        return int(func(args))
    except ValueError as err:
        sys.stderr.write(f"disagmoe: error: {err}\n")
        return 2
    except CommandFailed as err:  # e.g. a failed rank: which one and why
        sys.stderr.write(f"disagmoe: error: {err}\n")
        return 1
    except KeyboardInterrupt:
        sys.stderr.write("disagmoe: interrupted\n")
        return 130
    except BrokenPipeError:  # stdout closed early (`disagmoe simulate ... | head`)
        # nothing more can be written; point stdout at /dev/null so that the interpreter's
        # final flush does not fail again, and exit as a shell reports SIGPIPE
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except SignalException as err:  # Ctrl-C / SIGTERM while the elastic agent runs
        sys.stderr.write(f"disagmoe: interrupted ({err.sigval.name})\n")
        return 130


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
    p.add_argument(
        "--plan",
        choices=("auto",),
        help="disagg: let the planner choose p, m, n, the in-flight cap and recompute "
        "for --world-size workers (default 4) on the [cluster] config",
    )
    groups: dict[str, Any] = {}
    for flag in config_flags():
        if flag.section not in groups:
            groups[flag.section] = p.add_argument_group(f"[{flag.section}]")
        groups[flag.section].add_argument(flag.option, dest=flag.dest, **flag.kwargs)


def train_parser() -> argparse.ArgumentParser:
    p = Parser(prog="disagmoe train")
    add_train_arguments(p)
    return p


def resolve_train_config(args: argparse.Namespace) -> RunConfig:
    """The RunConfig that `add_train_arguments`' flags describe (precedence: module doc)."""
    cfg = RunConfig()
    if args.model:
        cfg = dataclasses.replace(cfg, model=model_preset(args.model))
    if args.init_from_hf:  # the checkpoint's shape; a --config file may still adjust it
        from .models.hf_config import read_hf_config

        cfg = dataclasses.replace(cfg, model=read_hf_config(args.init_from_hf))
        cfg = replace_section(cfg, "train", init_from_hf=str(args.init_from_hf))
    if args.config:
        cfg = load_toml(args.config, cfg)
        if cfg.train.init_from_hf and not args.init_from_hf:
            from .models.hf_config import read_hf_config

            hf_model = read_hf_config(cfg.train.init_from_hf)
            cfg = load_toml(args.config, dataclasses.replace(cfg, model=hf_model))
    changes: dict[str, dict[str, Any]] = {}
    for flag in config_flags():
        value = getattr(args, flag.dest)
        if value is not None:
            changes.setdefault(flag.section, {})[flag.field] = value
    for section, values in changes.items():  # validated together, like a TOML section
        cfg = replace_section(cfg, section, **values)
    cfg = apply_overrides(cfg, args.set)
    if args.plan == "auto":
        from .planner.layout_plan import auto_layout

        cfg, plan = auto_layout(cfg, cfg.parallel.world_size or 4)
        print(
            f"plan: p={plan.groups} m={plan.attn_gpus_per_group} n={plan.ffn_gpus_per_group} "
            f"in flight {plan.in_flight}, recompute {plan.recompute_label} (predicted stage "
            f"{plan.t_stage_s * 1e3:.3g} ms, binding: {plan.binding})",
            file=sys.stderr,
        )
    return cfg
