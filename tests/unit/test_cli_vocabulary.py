"""One CLI vocabulary: a concept has one flag, one unit and one default in every subcommand.

The walk reads every subcommand's parser as `disagmoe` builds it (`cli.build_parser`) and
fails when two subcommands disagree:

(a) one dest behind different flags, or one flag with different dests;
(b) two flags for one config field, or a live flag that `CONCEPTS` retired;
(c) one flag whose help names different units;
(d) one flag with different defaults, where a `train`-style default of None is the config
    field's default, except the flags of `OWN_DEFAULTS`.

`test_the_walk_finds_planted_disagreements` shows each check failing on a pair of tiny
parsers. The help test checks that `disagmoe CMD --help` gives the unit of every flag
whose value has one.
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import pytest

from disagmoe.cli import build_parser, main
from disagmoe.config_io import config_flags
from disagmoe.flags import RenamedFlag, add_renamed_flag

CONFIG = {f.option: f for f in config_flags()}  # "--seq-len" -> train.seq_len's flag
FIELD_BY_DEST = {f.dest: f.key for f in config_flags()}

# Concepts whose flag once had another name, or several: the one flag, and the retired
# names, which may only stay as `flags.add_renamed_flag` errors.
CONCEPTS: dict[str, tuple[str, frozenset[str]]] = {
    "virtual pipeline stages per rank": ("--virtual-stages", frozenset({"--chunks"})),
    "measured compute costs file": ("--costs-file", frozenset({"--costs"})),
    "NIC rate, Gbit/s": ("--nic-gbit", frozenset({"--nic-gbps"})),
    "expert compute chunks of ep-overlap": ("--overlap-chunks", frozenset()),
    "in-flight cap (0: memory budget, -1: none)": ("--max-in-flight", frozenset()),
}

# Flags whose default is deliberately each command's own; everything else must agree.
_SIZES = (
    "each command's example workload: train tiny on 4 local workers, plan required, "
    "simulate qwen3-30b-a3b on an H800 node, bench small on 2 emulated nodes"
)
_AUTO = "plan, simulate and bench take 0 as the planner's (or the command's) choice"
OWN_DEFAULTS: dict[str, str] = {
    "--model": _SIZES,
    "--seq-len": _SIZES,
    "--micro-batch-size": _SIZES,
    "--global-batch-size": _SIZES,
    "--steps": _SIZES,
    "--nodes": _SIZES,
    "--groups": _AUTO,
    "--attn-workers": _AUTO,
    "--expert-workers": _AUTO,
    "--pp": _AUTO,
    "--ep": _AUTO,
    "--recompute": "plan, simulate: auto, the planner chooses it along with p, m, n (simulate "
    "ep-*: the layout search tries every mode)",
    "--ranks-per-node": "bench: an emulated node has no torchrun local world size",
    "--nic-gbit": "plan: the cluster preset's NIC; bench: a slow emulated NIC",
    "--format": "what the command writes: schedule text|csv lists, export an hf checkpoint",
    "--overlap-chunks": "simulate: 0, the ep-overlap layout search tries each count (as "
    "--exchange-chunks 0 does for AF-Pipe); a run needs its count",
    "--exchange-chunks": "simulate: 0, the chunk count picked on the planned layout (as the "
    "ep-* search picks --overlap-chunks); a run's default is one chunk",
    "--split-backward": "simulate: auto, whole or split backwards picked on the planned layout",
    "--order": "simulate: auto, the lane order picked on the plan it keeps; a run's default "
    "is breadth",
    "--pipeline-warmup": "simulate: -1, the ep-* layout search tries 0, pp and every forward "
    "first; a run's default is 1F1B's own warm-up",
}

UNIT = re.compile(
    r"(?<![\w/])(Gbit/s|GB/s|TFLOP/s|GiB|MiB|bytes|seconds|ms|tokens|sequences)(?!\w)"
)

# Flags whose value has a unit, and the unit every help of theirs names.
UNIT_FLAGS = {
    "--nic-gbit": "Gbit/s",
    "--seq-len": "tokens",
    "--loss-chunk-tokens": "tokens",
    "--micro-batch-size": "sequences",
    "--global-batch-size": "sequences",
    "--memory-gib": "GiB",
    "--gpu-mem-gib": "GiB",
    "--peak-tflops": "TFLOP/s",
    "--comm-timeout": "seconds",
    "--timeout": "seconds",
    "--mtu": "bytes",
}
# names that carry a unit; every flag with one must be in UNIT_FLAGS
UNIT_NAME = re.compile(r"-(gib|mib|gbit|gbps|tflops|timeout|bytes|ms|s)$|^--timeout$")


@dataclass(frozen=True)
class Flag:
    command: str
    option: str
    dest: str
    help: str
    default: Any  # what not giving the flag means


def subcommands(parser: argparse.ArgumentParser, prefix: str = "") -> dict[str, Any]:
    """Every (nested) subcommand's parser by name: "train", ..., "checkpoint verify"."""
    out: dict[str, Any] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out[f"{prefix}{name}"] = sub
                out.update(subcommands(sub, f"{prefix}{name} "))
    return out


def _option(action: argparse.Action) -> str:
    return max(action.option_strings, key=len)


def flags_of(parsers: dict[str, argparse.ArgumentParser]) -> list[Flag]:
    """The live optional flags of every parser (not -h, not renamed names)."""
    flags = []
    for command, parser in parsers.items():
        for action in parser._actions:
            if not action.option_strings or isinstance(
                action, (argparse._HelpAction, RenamedFlag, argparse._SubParsersAction)
            ):
                continue
            option, default = _option(action), action.default
            if default is None and option in CONFIG:  # train-style: the config's
                default = CONFIG[option].default
            flags.append(Flag(command, option, action.dest, action.help or "", default))
    return flags


def renamed_of(parsers: dict[str, argparse.ArgumentParser]) -> list[tuple[str, str, str]]:
    """(command, old, new) of every renamed flag."""
    return [
        (command, _option(a), a.new)
        for command, parser in parsers.items()
        for a in parser._actions
        if isinstance(a, RenamedFlag)
    ]


def _by(flags: list[Flag], key: str) -> dict[str, list[Flag]]:
    out: dict[str, list[Flag]] = defaultdict(list)
    for f in flags:
        out[getattr(f, key)].append(f)
    return out


def _where(flags: list[Flag], value: Any) -> str:
    return ", ".join(f"{f.command}: {value(f)}" for f in flags)


def disagreements(parsers: dict[str, argparse.ArgumentParser]) -> list[str]:
    """One line per disagreement between subcommands (checks (a)-(d) of the module doc)."""
    flags, problems = flags_of(parsers), []
    for dest, fs in _by(flags, "dest").items():  # (a)
        if len({f.option for f in fs}) > 1:
            problems.append(f"(a) dest {dest} is {_where(fs, lambda f: f.option)}")
    for option, fs in _by(flags, "option").items():
        if len({f.dest for f in fs}) > 1:
            problems.append(f"(a) {option} stores {_where(fs, lambda f: f.dest)}")
    fields: dict[str, set[str]] = defaultdict(set)  # (b)
    for f in flags:
        field = CONFIG[f.option].key if f.option in CONFIG else FIELD_BY_DEST.get(f.dest)
        if field:
            fields[field].add(f.option)
    problems += [
        f"(b) {field} has flags {sorted(opts)}" for field, opts in fields.items() if len(opts) > 1
    ]
    live = {f.option for f in flags}
    for concept, (flag, retired) in CONCEPTS.items():
        for old in sorted(retired & live):
            problems.append(f"(b) {old} is a live flag; {concept} is {flag}")
    for command, old, new in renamed_of(parsers):
        if old in live:
            problems.append(f"(b) {command}: {old} was renamed {new} but is a live flag")
        if new not in {f.option for f in flags if f.command == command}:
            problems.append(f"(b) {command}: {old} was renamed {new}, which it lacks")
    for option, fs in _by(flags, "option").items():  # (c)
        units = {f.command: UNIT.findall(f.help)[:1] for f in fs}
        if len({tuple(u) for u in units.values() if u}) > 1:
            problems.append(f"(c) {option} units differ: {units}")
    for option, fs in _by(flags, "option").items():  # (d)
        if option not in OWN_DEFAULTS and len({repr(f.default) for f in fs}) > 1:
            problems.append(f"(d) {option} defaults differ: {_where(fs, lambda f: f.default)}")
    return problems


def _real() -> dict[str, Any]:
    return subcommands(build_parser())


def test_every_subcommand_speaks_one_vocabulary() -> None:
    assert disagreements(_real()) == []


def test_own_defaults_are_used_and_concepts_are_present() -> None:
    """Every OWN_DEFAULTS entry differs somewhere (else it goes), every concept's flag
    exists."""
    by_option = _by(flags_of(_real()), "option")
    for option in OWN_DEFAULTS:
        assert len({repr(f.default) for f in by_option[option]}) > 1, option
    for flag, _ in CONCEPTS.values():
        assert flag in by_option, flag


def _pair(
    left: list[tuple[str, dict[str, Any]]], right: list[tuple[str, dict[str, Any]]]
) -> dict[str, Any]:
    parsers = {}
    for name, specs in (("one", left), ("two", right)):
        parser = argparse.ArgumentParser(prog=name)
        for option, kwargs in specs:
            parser.add_argument(option, **kwargs)
        parsers[name] = parser
    return parsers


def test_the_walk_finds_planted_disagreements() -> None:
    """Each check fails on a tiny parser pair that plants its disagreement."""
    alias = _pair([("--virtual-stages", {"type": int})], [("--chunks", {"dest": "virtual_stages"})])
    found = disagreements(alias)
    assert any(p.startswith("(a) dest virtual_stages") for p in found), found
    assert any(p.startswith("(b) parallel.virtual_stages") for p in found), found
    assert any(p.startswith("(b) --chunks is a live flag") for p in found), found
    units = _pair([("--nic-gbit", {"help": "GB/s per NIC"})], [("--nic-gbit", {"help": "Gbit/s"})])
    assert [p[:3] for p in disagreements(units)] == ["(c)"]
    # train-style None is the config's 2; a command defaulting to 4 disagrees, to 2 agrees
    differ = _pair([("--virtual-stages", {"type": int})], [("--virtual-stages", {"default": 4})])
    assert [p[:3] for p in disagreements(differ)] == ["(d)"]
    agree = _pair([("--virtual-stages", {"type": int})], [("--virtual-stages", {"default": 2})])
    assert disagreements(agree) == []
    assert disagreements(_pair([("--seq-len", {})], [("--seq-len", {"default": 9})])) == []
    renamed = _pair([("--nic-gbit", {})], [])
    add_renamed_flag(renamed["two"], "--nic-gbps", "--nic-gbit", "Gbit/s per NIC")
    assert disagreements(renamed) == ["(b) two: --nic-gbps was renamed --nic-gbit, which it lacks"]


def _help_entries(text: str) -> dict[str, str]:
    """`--help` output as flag -> its help text, wrapped lines joined."""
    entries: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        if m := re.match(r"^  (-[\w-]+)", line):
            current = m.group(1)
            entries[current] = line
        elif current and line.startswith("   "):
            entries[current] += " " + line.strip()
        else:
            current = None
    return {k: " ".join(v.split()) for k, v in entries.items()}


@pytest.mark.parametrize("command", sorted(_real()))
def test_help_names_the_unit_of_every_flag_that_has_one(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([*command.split(), "--help"])
    assert exit_.value.code == 0
    entries = _help_entries(capsys.readouterr().out)
    for option, text in entries.items():
        assert option in UNIT_FLAGS or not UNIT_NAME.search(option), (
            f"{command} {option}: its name has a unit; add it to UNIT_FLAGS"
        )
        if option in UNIT_FLAGS:
            assert UNIT_FLAGS[option] in text, f"disagmoe {command} --help: {text}"


def test_a_renamed_flag_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, message in (
        (["plan", "--model", "tiny", "--gpus", "8", "--nic-gbps", "25"], "--nic-gbit"),
        (["bench", "--nic-gbps", "0.4"], "--nic-gbit"),
        (["simulate", "--chunks", "3"], "--virtual-stages"),
        (["simulate", "--costs", "c.json"], "--costs-file"),
        (["plan", "--model", "tiny", "--gpus", "8", "--costs", "c.json"], "--costs-file"),
    ):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.count("\n") == 1, err
        assert f"{argv[-2]} was renamed {message} (" in err, err
