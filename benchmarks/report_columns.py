"""The pieces of `benchmarks/report.py`'s tables: a column (a header, how to get the value
from a row, its format), a results file's table (a title, a line on what it measures, its
columns), and a table of rows in Markdown. The tables themselves are in `report_tables.py`
(measured) and `tables_simulated.py` (simulated and planned).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Getter = Callable[[dict[str, Any]], Any]
S3, S4 = "{:.3f}", "{:.4f}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Col:
    """One column: its header, how to get the value from a row, and its format."""

    head: str
    get: str | Getter
    fmt: str = "{}"

    def cell(self, row: dict[str, Any]) -> str:
        try:
            value = self.get(row) if callable(self.get) else path(row, self.get)
        except KeyError:  # a row without the field (an infeasible plan)
            value = None
        if value is None:
            return "-"
        if isinstance(value, bool):
            return "yes" if value else "no"
        if isinstance(value, list | tuple):
            return " ".join(self.fmt.format(v) for v in value)
        return self.fmt.format(value)


@dataclass(frozen=True, kw_only=True, slots=True)
class Table:
    """What one results file shows: a title, a line on what it measures, its columns."""

    title: str
    about: str
    cols: tuple[Col, ...] = ()
    rows: Callable[[Any], list[dict[str, Any]]] = field(default=lambda p: payload_rows(p))


def path(row: dict[str, Any], key: str) -> Any:
    value: Any = row
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def payload_rows(payload: Any) -> list[dict[str, Any]]:
    return list(payload if isinstance(payload, list) else payload.get("rows", []))


def ratio(num: str, den: str) -> Getter:
    return lambda r: r[num] / r[den]


def markdown_table(rows: list[dict[str, Any]], cols: tuple[Col, ...]) -> str:
    """`rows` as a Markdown table; without `cols`, every scalar field of the first row."""
    if not cols:
        keys = [k for k, v in (rows[0] if rows else {}).items() if not isinstance(v, dict | list)]
        cols = tuple(Col(head=k, get=k, fmt="{:.4g}" if isinstance(rows[0][k], float) else "{}")
                     for k in keys)  # fmt: skip
    lines = ["| " + " | ".join(c.head for c in cols) + " |", "|" + "---|" * len(cols)]
    # a "|" inside a cell (e.g. "n | E") would end it: escaped, Markdown shows it as is
    lines += ["| " + " | ".join(c.cell(r).replace("|", "\\|") for c in cols) + " |" for r in rows]
    return "\n".join(lines)
