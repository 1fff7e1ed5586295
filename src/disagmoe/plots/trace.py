"""Draw Chrome traces written by `disagmoe train` (or the simulator) as Gantt charts.

One row per (worker, lane); forward computes in blue, backward in orange,
sends and receives in grey, gradient sync / optimizer in green. Several traces
can be stacked on one shared time axis to compare runtimes side by side.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

COLORS = {
    "fwd": "#4C72B0",
    "bwd": "#DD8452",
    "send": "#8C8C8C",
    "recv": "#B0B0B0",
    "sync": "#55A868",
    "compute": "#4C72B0",
}
LANE_ORDER = ("fwd", "bwd", "send", "recv", "sync", "compute")


def load_events(
    path: str | Path, step: int | None = None
) -> tuple[list[dict[str, Any]], dict[int, str]]:
    """Complete events ("X") of a trace, optionally one step only, time zero at its start."""
    data = json.loads(Path(path).read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    spans = [e for e in events if e.get("ph") == "X"]
    if step is not None:
        spans = [e for e in spans if e.get("args", {}).get("step") == step]
    t0 = min((e["ts"] for e in spans), default=0.0)
    return [{**e, "ts": e["ts"] - t0} for e in spans], names


def plot_traces(
    traces: list[tuple[str, str | Path]],
    out: str | Path,
    *,
    step: int | None = None,
    lanes: tuple[str, ...] = ("fwd", "bwd", "send", "recv"),
) -> None:
    """Stack the given (title, trace.json) pairs on one shared time axis (ms)."""
    loaded = [(title, *load_events(path, step)) for title, path in traces]
    horizon = max((e["ts"] + e["dur"] for _, evs, _ in loaded for e in evs), default=1.0) / 1e3
    heights = [
        len({(e["pid"], e["cat"]) for e in evs if e["cat"] in lanes}) or 1 for _, evs, _ in loaded
    ]
    fig, axes = plt.subplots(
        len(loaded),
        1,
        figsize=(12, 0.9 + 0.28 * sum(heights) + 0.5 * len(loaded)),
        sharex=True,
        gridspec_kw={"height_ratios": heights},
        squeeze=False,
    )
    for ax, (title, events, names) in zip(axes[:, 0], loaded, strict=True):
        rows = sorted(
            {(e["pid"], e["cat"]) for e in events if e["cat"] in lanes},
            key=lambda r: (r[0], LANE_ORDER.index(r[1]) if r[1] in LANE_ORDER else 99),
        )
        index = {row: k for k, row in enumerate(rows)}
        for e in events:
            row = (e["pid"], e["cat"])
            if row not in index:
                continue
            ax.barh(
                index[row],
                e["dur"] / 1e3,
                left=e["ts"] / 1e3,
                height=0.8,
                color=COLORS.get(e["cat"], "#999999"),
                edgecolor="white",
                linewidth=0.3,
            )
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([f"{names.get(pid, pid)} {lane}" for pid, lane in rows], fontsize=7)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=9, loc="left")
        ax.set_xlim(0, horizon)
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("time (ms)" + (f", step {step}" if step is not None else ""))
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)
    plt.close(fig)
