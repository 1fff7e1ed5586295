"""What a run leaves behind: run directory, resolved config, metrics, progress.

* `config.toml`   — the fully resolved RunConfig,
* `metrics.jsonl` — one JSON object per optimizer step (`eval_loss`, `eval_ppl` on the
                    steps that evaluate: training/evaluate.py),
* `tensorboard/`  — with `train.tensorboard`, the same scalars as TensorBoard events,
* `trace.json`    — Chrome / Perfetto trace events: one process per worker,
                    one thread per lane, one event per executed instruction
                    (`disagmoe.trace`: event names, `Tracer`, `write_trace`).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ..config import RunConfig
from ..config_io import save_toml
from .tensorboard import TensorBoardLog


def new_run_dir(base: str = "runs") -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    root = Path(base)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(1000):
        path = root / (stamp if i == 0 else f"{stamp}-{i}")
        try:
            path.mkdir()  # atomic: two runs started in the same second get two dirs
        except FileExistsError:
            continue
        return path
    raise RuntimeError("could not find a free run directory name")


def prepare_run_dir(cfg: RunConfig) -> Path:
    """Create the run directory and write the resolved config (rank 0 only).

    A run dir that already holds a run (metrics or checkpoints) is only reused to
    resume it: a fresh run there would mix two runs' metrics and checkpoints.
    """
    path = Path(cfg.train.run_dir) if cfg.train.run_dir else new_run_dir()
    used = (path / "metrics.jsonl").exists() or (path / "checkpoints" / "latest").exists()
    if used and not cfg.train.resume:
        raise ValueError(
            f"run dir {str(path)!r} already holds a run; continue it with --resume or choose "
            "another --run-dir"
        )
    if cfg.train.resume == "latest" and not (path / "checkpoints" / "latest").exists():
        raise ValueError(
            f"--resume: run dir {str(path)!r} has no checkpoint; name one with --resume DIR "
            "(or --set train.resume=auto to start fresh when there is none)"
        )
    path.mkdir(parents=True, exist_ok=True)
    save_toml(cfg, path / "config.toml")
    return path


class MetricsLog:
    """Appends one JSON object per step to `metrics.jsonl` and drives the progress bar;
    with `tensorboard` also the records' scalars as TensorBoard events."""

    def __init__(
        self,
        run_dir: Path,
        total_steps: int,
        *,
        progress: bool,
        start_step: int = 0,
        tensorboard: TensorBoardLog | None = None,
    ) -> None:
        self.path = run_dir / "metrics.jsonl"
        self._file = self.path.open("a")
        self._tensorboard = tensorboard
        self._eval = ""  # the last evaluation's loss, kept in the progress bar
        self._bar = (
            tqdm(
                total=total_steps,
                initial=start_step,
                desc="train",
                unit="step",
                file=sys.stderr,
                dynamic_ncols=True,
            )
            if progress
            else None
        )

    def log(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tensorboard is not None:
            self._tensorboard.log(record)
        if "eval_loss" in record:
            self._eval = f"{record['eval_loss']:.4f}"
        if self._bar is not None:
            postfix = {"loss": f"{record['loss']:.4f}", "tok_s": f"{record['tokens_per_s']:.0f}"}
            if self._eval:
                postfix["eval_loss"] = self._eval
            self._bar.set_postfix(postfix)
            self._bar.update(1)

    def close(self) -> None:
        self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._bar is not None:
            self._bar.close()
