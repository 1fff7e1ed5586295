"""What a results file says about where it came from: the command, the machine, the date
(`meta`, which `benchmarks/report.py` prints above each table)."""

from __future__ import annotations

import datetime
import os
import platform


def machine() -> str:
    """This machine, as a results file's `meta.machine` says it."""
    return f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs"


def results_meta(command: str) -> dict[str, str]:
    """`meta` of a results file written now by `command`."""
    return {"command": command, "machine": machine(), "date": datetime.date.today().isoformat()}
