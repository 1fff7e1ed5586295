"""Run `disagmoe` as a user does, in a subprocess, for end-to-end tests; or in this process,
where a test pins the command's output and exit code rather than the process's."""

from __future__ import annotations

import contextlib
import io
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


def run_cli_in_process(*args: str) -> subprocess.CompletedProcess[str]:
    """`disagmoe ARGS` through `disagmoe.cli.main` in this process, stdout and stderr
    captured: what `run_cli` returns (the exit code `sys.exit(main())` would give), without
    the seconds a Python start-up and the imports cost. For commands that fail on their
    input or run in one process; ranks a command spawns are real processes either way.
    The environment, torch's thread count and default dtype, which a run sets, are restored
    afterwards."""
    import torch

    from ..cli import main

    environ, threads, dtype = dict(os.environ), torch.get_num_threads(), torch.get_default_dtype()
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exit_:  # argument errors (`command.Parser.error`)
            if exit_.code is None or isinstance(exit_.code, int):
                code = exit_.code or 0
            else:  # sys.exit("message"): the message on stderr, code 1
                print(exit_.code, file=sys.stderr)
                code = 1
        finally:
            os.environ.clear()
            os.environ.update(environ)
            torch.set_num_threads(threads)
            torch.set_default_dtype(dtype)
    return subprocess.CompletedProcess(["disagmoe", *args], code, out.getvalue(), err.getvalue())
