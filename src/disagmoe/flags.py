"""Field metadata that makes a config field a `disagmoe train` flag (`flag`).

The config sections (`disagmoe.config`, `disagmoe.train_config`) declare their flags beside
the fields they set; `disagmoe.command` builds the parser from this metadata.
"""

from __future__ import annotations

from typing import Any


def flag(help: str | None = None, *, name: str = "", **argparse_kwargs: Any) -> dict[str, Any]:
    """Field metadata that makes a config field a `disagmoe train` flag.

    The flag is `name`, by default `--` and the field name with dashes (`seq_len` ->
    `--seq-len`); an int or float field parses its value as that type. `argparse_kwargs`
    (`choices`, `nargs`, `action`, ...) go to `add_argument` as they are. A flag not
    given leaves the field as the preset / TOML file set it.
    """
    return {"flag": {"name": name, "help": help, **argparse_kwargs}}
