"""What a run leaves behind: run directory, resolved config, metrics, progress, trace.

* `config.toml`   — the fully resolved RunConfig,
* `metrics.jsonl` — one JSON object per optimizer step,
* `trace.json`    — Chrome / Perfetto trace events: one process per worker,
                    one thread per lane, one event per executed instruction.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ..config import RunConfig
from ..config_io import save_toml

LANES = ("compute", "fwd", "bwd", "send", "recv", "sync")


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
    """Appends one JSON object per step to `metrics.jsonl` and drives the progress bar."""

    def __init__(
        self, run_dir: Path, total_steps: int, *, progress: bool, start_step: int = 0
    ) -> None:
        self.path = run_dir / "metrics.jsonl"
        self._file = self.path.open("a")
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
        if self._bar is not None:
            self._bar.set_postfix(
                loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}"
            )
            self._bar.update(1)

    def close(self) -> None:
        self._file.close()
        if self._bar is not None:
            self._bar.close()


class Tracer:
    """Collects complete ("X") trace events for one worker; thread-safe.

    Events are indexed by their `step` argument; only the last `keep_steps` steps are
    kept (and written to trace.json), so long runs use bounded memory and per-step
    busy time costs the same at step 10 and at step 100,000.
    """

    def __init__(self, rank: int, role: str, keep_steps: int = 50) -> None:
        self.rank = rank
        self.role = role
        self.keep_steps = keep_steps
        self._by_step: dict[int | None, list[dict[str, Any]]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def now_us() -> float:
        return time.time_ns() / 1000.0

    def add(self, name: str, lane: str, start_us: float, end_us: float, **args: Any) -> None:
        event = {
            "name": name,
            "cat": lane,
            "ph": "X",
            "ts": start_us,
            "dur": max(end_us - start_us, 0.0),
            "pid": self.rank,
            "tid": LANES.index(lane),
            "args": args,
        }
        step = args.get("step")
        with self._lock:
            if step not in self._by_step:
                self._by_step[step] = []
                if step is not None:
                    for old in [
                        s for s in self._by_step if s is not None and s <= step - self.keep_steps
                    ]:
                        del self._by_step[old]
            self._by_step[step].append(event)

    @property
    def events(self) -> list[dict[str, Any]]:
        with self._lock:
            return [e for evs in self._by_step.values() for e in evs]

    def step_events(self, step: int) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._by_step.get(step, []))

    def metadata(self) -> list[dict[str, Any]]:
        meta: list[dict[str, Any]] = [
            {
                "name": "process_name",
                "ph": "M",
                "pid": self.rank,
                "args": {"name": f"rank {self.rank} {self.role}"},
            },
            {
                "name": "process_sort_index",
                "ph": "M",
                "pid": self.rank,
                "args": {"sort_index": self.rank},
            },
        ]
        for tid, lane in enumerate(LANES):
            meta.append(
                {
                    "name": "thread_name",
                    "ph": "M",
                    "pid": self.rank,
                    "tid": tid,
                    "args": {"name": lane},
                }
            )
        return meta

    def busy_us(
        self, lanes: Iterable[str] = ("compute", "fwd", "bwd"), step: int | None = None
    ) -> float:
        """Union length of this worker's compute events (overlapping lanes counted once)."""
        events = self.events if step is None else self.step_events(step)
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["cat"] in set(lanes))
        total, cur_s, cur_e = 0.0, None, None
        for s, e in spans:
            if cur_e is None or s > cur_e:
                if cur_e is not None and cur_s is not None:
                    total += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        if cur_e is not None and cur_s is not None:
            total += cur_e - cur_s
        return total


def write_trace(
    path: Path, per_rank: list[tuple[list[dict[str, Any]], list[dict[str, Any]]]]
) -> None:
    """Merge (metadata, events) of every rank into one Chrome trace, time zero at the first event."""
    events = [e for _, evs in per_rank for e in evs]
    t0 = min((e["ts"] for e in events), default=0.0)
    out = [m for meta, _ in per_rank for m in meta]
    for e in events:
        out.append({**e, "ts": round(e["ts"] - t0, 3), "dur": round(e["dur"], 3)})
    path.write_text(json.dumps({"traceEvents": out, "displayTimeUnit": "ms"}))
