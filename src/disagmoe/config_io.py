"""A `RunConfig` to and from nested dicts, TOML files, `--set section.key=value` strings and
the flags its fields declare (`config_flags`, `add_config_flag`).

Values are checked against each field's declared type (`"3"` becomes 3 for an int
field; `"x"` is a `ValueError` naming the key). A `preset = "name"` key in `[model]`
or `[cluster]` starts that section from a preset of `disagmoe.presets`.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import tomllib
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w

from .config import SECTIONS, RunConfig
from .presets import cluster_preset, model_preset


def to_dict(cfg: RunConfig) -> dict[str, dict[str, Any]]:
    return {name: dataclasses.asdict(getattr(cfg, name)) for name in SECTIONS}


def dump_toml(cfg: RunConfig) -> str:
    return tomli_w.dumps(to_dict(cfg))


def save_toml(cfg: RunConfig, path: str | Path) -> None:
    Path(path).write_text(dump_toml(cfg))


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(value: Any, typ: Any, where: str) -> Any:
    """Check/convert a TOML or command-line value to a field's declared type."""
    if isinstance(typ, types.UnionType):
        typ = next(t for t in typing.get_args(typ) if t is not type(None))
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ValueError(f"{where} must be true or false, got {value!r}")
    if typ is int:
        if isinstance(value, bool):
            raise ValueError(f"{where} must be an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ValueError(f"{where} must be an integer, got {value!r}")
    if typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ValueError(f"{where} must be a number, got {value!r}")
    if typ is str:
        if isinstance(value, str):
            return value
        raise ValueError(f"{where} must be a string, got {value!r}")
    raise AssertionError(f"unsupported field type {typ} at {where}")


def _build_section(cls: type, base: Any, values: dict[str, Any], section: str) -> Any:
    if not isinstance(values, dict):
        raise ValueError(f"[{section}] must be a table")
    types_ = _field_types(cls)
    changes = {}
    for key, value in values.items():
        if key not in types_:
            raise ValueError(
                f"unknown key {section}.{key}; valid keys: {', '.join(sorted(types_))}"
            )
        changes[key] = _coerce(value, types_[key], f"{section}.{key}")
    return dataclasses.replace(base, **changes)


def _migrate_train(values: dict[str, Any], base_lr: float) -> dict[str, Any]:
    """Old `[train]` keys in their current form: `min_lr_ratio = r` is `min_lr = r * lr`.

    `lr` is the same table's (or, without one, the config's so far); a later `--lr`
    flag does not rescale it.
    """
    if "min_lr_ratio" not in values:
        return values
    if "min_lr" in values:
        raise ValueError("set train.min_lr or the older train.min_lr_ratio, not both")
    values = dict(values)
    ratio = _coerce(values.pop("min_lr_ratio"), float, "train.min_lr_ratio")
    lr = _coerce(values["lr"], float, "train.lr") if "lr" in values else base_lr
    values["min_lr"] = ratio * lr
    return values


def from_dict(data: dict[str, Any], base: RunConfig | None = None) -> RunConfig:
    """Build a RunConfig from nested dicts; `model.preset = "name"` starts from a preset."""
    base = base or RunConfig()
    for section in data:
        if section not in SECTIONS:
            shown = section.encode("unicode_escape").decode()  # one line, whatever TOML held
            raise ValueError(
                f"unknown config section [{shown}]; valid sections: {', '.join(SECTIONS)}"
            )
    sections: dict[str, Any] = {}
    for name, cls in SECTIONS.items():
        values = dict(data.get(name, {}))
        start = getattr(base, name)
        if name == "model" and "preset" in values:
            start = model_preset(str(values.pop("preset")))
        if name == "cluster" and "preset" in values:
            start = cluster_preset(str(values.pop("preset")))
        if name == "train":
            values = _migrate_train(values, start.lr)
        sections[name] = _build_section(cls, start, values, name)
    return RunConfig(**sections)


def load_toml(path: str | Path, base: RunConfig | None = None) -> RunConfig:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file {str(path)!r} does not exist")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"config file {str(path)!r} is not valid TOML: {err}") from None
    return from_dict(data, base)


def parse_override(text: str) -> tuple[str, str, str]:
    """Split `section.key=value`."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ValueError(f"--set expects section.key=value, got {text!r}")
    lhs, value = text.split("=", 1)
    section, key = lhs.strip().split(".", 1)
    if not re.fullmatch(r"\w+", section) or not re.fullmatch(r"\w+", key):
        raise ValueError(f"--set expects section.key=value, got {text!r}")
    return section, key, value.strip()


def check_overrides(overrides: list[str]) -> None:
    """A one-line ValueError for a `--set` whose section, key or value (by the field's
    type) is wrong; how the values combine with the rest of a config is not checked
    (for a command that builds its configs later, e.g. a bench's rows)."""
    for text in overrides:
        section, key, value = parse_override(text)
        if section not in SECTIONS:
            raise ValueError(
                f"unknown config section [{section}]; valid sections: {', '.join(SECTIONS)}"
            )
        if key == "preset" and section in ("model", "cluster"):
            (model_preset if section == "model" else cluster_preset)(value)
            continue
        types_ = _field_types(SECTIONS[section])
        if section == "train":
            types_["min_lr_ratio"] = float  # an older key (`_migrate_train`)
        if key not in types_:
            raise ValueError(
                f"unknown key {section}.{key}; valid keys: {', '.join(sorted(types_))}"
            )
        _coerce(value, types_[key], f"{section}.{key}")


def apply_overrides(cfg: RunConfig, overrides: list[str]) -> RunConfig:
    """Apply `--set section.key=value` strings (values are parsed by the field's type)."""
    nested: dict[str, dict[str, Any]] = {}
    for text in overrides:
        section, key, value = parse_override(text)
        nested.setdefault(section, {})[key] = value
    return from_dict(nested, cfg)


@dataclass(frozen=True)
class ConfigFlag:
    """A flag that sets `section.field` (declared by `flags.flag`)."""

    section: str
    field: str
    option: str  # e.g. "--seq-len"
    kwargs: dict[str, Any]  # for `add_argument`
    default: Any  # the field's default: what the flag means when not given

    @property
    def key(self) -> str:
        return f"{self.section}.{self.field}"

    @property
    def dest(self) -> str:
        return self.field


def config_flags() -> list[ConfigFlag]:
    """The flags declared on the config fields, section by section in field order."""
    flags = []
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if "flag" not in f.metadata:
                continue
            kwargs = dict(f.metadata["flag"])
            option = kwargs.pop("name") or "--" + f.name.replace("_", "-")
            if "action" not in kwargs and hints[f.name] in (int, float):
                kwargs["type"] = hints[f.name]
            assert f.default is not dataclasses.MISSING, (
                f"{section}.{f.name}: a flag needs a default"
            )
            flags.append(ConfigFlag(section, f.name, option, kwargs, f.default))
    return flags


_FIELD_DEFAULT: Any = object()


def add_config_flag(
    parser: Any, key: str, *, default: Any = _FIELD_DEFAULT, note: str = "", **kwargs: Any
) -> argparse.Action:
    """Add the flag of config field `key` (`"schedule.costs_file"`) to a command that reads
    the value itself (`plan`, `simulate`, `bench`): the name, help, type and choices the
    field declares, and the field's default.

    Where the command's meaning differs (`simulate --groups 0`: the planner chooses), pass
    its `default` and say what it means in `note`, which follows the declared help; other
    `kwargs` (a subset of `choices`, a `metavar`) replace the declared ones.
    """
    (flag,) = [f for f in config_flags() if f.key == key]
    args = {**flag.kwargs, **kwargs}
    args["default"] = flag.default if default is _FIELD_DEFAULT else default
    args["help"] = "; ".join(h for h in (args.get("help"), note) if h)
    action: argparse.Action = parser.add_argument(flag.option, dest=flag.dest, **args)
    return action
