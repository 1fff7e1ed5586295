"""What the benchmark scripts share: writing their JSON results, running `disagmoe train`."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from disagmoe.bench.meta import results_meta


def this_command() -> str:
    """The command that runs this script with its arguments, as `meta.command` records it."""
    return shlex.join(["python", f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]])


def write_json(path: str, payload: dict[str, Any], note: str = "") -> None:
    """Write `payload` to `path` (parent folders created) and say so. The file also gets
    `meta`: the command that ran (this script and its arguments), the machine and the date,
    and `note` where given, which `benchmarks/report.py` prints above its table."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {**results_meta(this_command()), **({"note": note} if note else {})}
    out.write_text(json.dumps({**payload, "meta": meta}, indent=1))
    print(f"wrote {out}")


def train_records(args: list[str], run_dir: Path) -> list[dict[str, Any]]:
    """Run `disagmoe train ARGS --no-progress --run-dir RUN_DIR` with this checkout's
    sources; its metrics.jsonl records. A failed run stops the script with its stderr's end."""
    cmd = [sys.executable, "-m", "disagmoe.cli", "train", *args, "--no-progress"]
    cmd += ["--run-dir", str(run_dir)]
    src = str(Path(__file__).resolve().parent.parent / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]
