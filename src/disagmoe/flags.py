"""Field metadata that makes a config field a command-line flag (`flag`), and the error a
renamed flag gives (`add_renamed_flag`).

The config sections (`disagmoe.config`, `disagmoe.train_config`) declare their flags beside
the fields they set; `disagmoe.config_io.config_flags` reads them: `disagmoe train`,
`schedule` and `placement` take them all, and `plan`, `simulate` and `bench` build the
ones they share from the same metadata (`config_io.add_config_flag`), so that one concept
has one flag, unit and meaning in every subcommand.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any


def flag(help: str | None = None, *, name: str = "", **argparse_kwargs: Any) -> dict[str, Any]:
    """Field metadata that makes a config field a `disagmoe train` flag.

    The flag is `name`, by default `--` and the field name with dashes (`seq_len` ->
    `--seq-len`); its value lands in `args.<field name>`; an int or float field parses its
    value as that type. `argparse_kwargs` (`choices`, `nargs`, `action`, ...) go to
    `add_argument` as they are. A flag not given leaves the field as the preset / TOML
    file set it. A help that gives a unit (GiB, seconds, tokens, ...) names it.
    """
    return {"flag": {"name": name, "help": help, **argparse_kwargs}}


class RenamedFlag(argparse.Action):
    """A flag's old name: giving it is a one-line error naming the new flag (exit code 2).

    Hidden from `--help`; it takes an optional value so that `--old VALUE` reaches it.
    """

    def __init__(
        self, option_strings: Sequence[str], dest: str, *, new: str, why: str, **_: Any
    ) -> None:
        super().__init__(
            option_strings,
            dest=argparse.SUPPRESS,
            nargs="?",
            default=argparse.SUPPRESS,
            help=argparse.SUPPRESS,
        )
        self.new, self.why = new, why

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        parser.error(f"{option_string} was renamed {self.new} ({self.why})")


def add_renamed_flag(parser: Any, old: str, new: str, why: str) -> None:
    """Make `old` (a parser or argument group's former flag) an error that names `new`:
    "--nic-gbps was renamed --nic-gbit (Gbit/s per NIC)"."""
    parser.add_argument(old, action=RenamedFlag, new=new, why=why)
