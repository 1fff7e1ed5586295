"""Run `disagmoe` as a user does, in a subprocess, for end-to-end tests."""

from __future__ import annotations

import os
import subprocess
import sys


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`python -m disagmoe.cli ARGS` with captured text output and unbuffered Python."""
    return subprocess.run(
        [sys.executable, "-m", "disagmoe.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
