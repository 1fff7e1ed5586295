"""Draw Chrome traces written by `disagmoe train` (or the simulator) as Gantt charts.

One row per (worker, lane); forward computes in blue, backward in orange,
sends and receives in grey, gradient sync / optimizer in green. Several traces
can be stacked on one shared time axis to compare runtimes side by side.

With a step's bound (`simulator.bound.Bound`: given by the caller, or the `bound` a
simulated trace carries in its `otherData`), the binding resource is shaded — the
binding worker's compute lanes, its send/receive lanes for a network bound, its sync
lane for a serial one — and a dashed line marks where a step at its bound would end
(docs/design.md §4: every speed claim states its bound).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

COLORS = {
    "fwd": "#4C72B0",
    "bwd": "#DD8452",
    "wgt": "#937860",
    "send": "#8C8C8C",
    "recv": "#B0B0B0",
    "sync": "#55A868",
    "compute": "#4C72B0",
}
LANE_ORDER = ("fwd", "bwd", "wgt", "send", "recv", "sync", "compute")
# The lanes that carry each kind of binding resource (`Bound.binding`).
BINDING_LANES = {
    "compute": ("fwd", "bwd", "wgt", "compute"),
    "network": ("send", "recv"),
    "serial": ("sync",),
}
BOUND_COLOR = "#C44E52"


@dataclass(frozen=True, slots=True)
class TraceBound:
    """A step's bound as a plot draws it: seconds in the trace's own time, the binding
    resource ("compute", "network" or "serial") and the binding worker ("rank N", a role
    such as "F(g0,j0)", or a port)."""

    seconds: float
    binding: str
    worker: str

    @classmethod
    def of(cls, bound: Any, time_scale: float = 1.0) -> TraceBound:
        """From a `simulator.bound.Bound` (or its `to_dict()`), `time_scale` x its seconds
        (an emulated run's trace is that many times slower than the bound it reports)."""
        if isinstance(bound, dict):
            return cls(bound["bound_s"] * time_scale, bound["binding"], bound["binding_worker"])
        return cls(bound.seconds * time_scale, bound.binding, bound.worker)

    def describe(self) -> str:
        return f"bound {self.seconds:.4g} s: {self.binding} ({self.worker})"


def binding_rows(
    rows: Sequence[tuple[int, str]], names: dict[int, str], bound: TraceBound
) -> list[int]:
    """Indices of the `rows` ((pid, lane) pairs) to shade for `bound`: the binding worker's
    lanes of the binding resource, or all its rows if none of those is drawn; none if the
    worker is not a drawn rank (a port)."""
    match = re.fullmatch(r"rank (\d+)", bound.worker)
    if match:
        pids = {int(match.group(1))}
    else:
        pids = {pid for pid, name in names.items() if bound.worker in name.split()}
    mine = [k for k, (pid, _) in enumerate(rows) if pid in pids]
    lanes = BINDING_LANES.get(bound.binding, ())
    return [k for k in mine if rows[k][1] in lanes] or mine


def trace_bound_of(path: str | Path) -> TraceBound | None:
    """The bound a trace file carries (`otherData.bound`, written by the simulator)."""
    data = json.loads(Path(path).read_text())
    bound = data.get("otherData", {}).get("bound") if isinstance(data, dict) else None
    return TraceBound.of(bound) if bound else None


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
    lanes: tuple[str, ...] = ("fwd", "bwd", "wgt", "send", "recv"),
    bounds: Sequence[TraceBound | None] = (),
) -> None:
    """Stack the given (title, trace.json) pairs on one shared time axis (ms); `bounds[i]`
    (or the bound trace i carries) shades trace i's binding resource (module doc)."""
    loaded = [(title, *load_events(path, step)) for title, path in traces]
    marks = [
        bounds[i] if i < len(bounds) and bounds[i] is not None else trace_bound_of(path)
        for i, (_, path) in enumerate(traces)
    ]
    horizon = max((e["ts"] + e["dur"] for _, evs, _ in loaded for e in evs), default=1.0) / 1e3
    horizon = max([horizon] + [b.seconds * 1e3 for b in marks if b is not None])
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
    for ax, (title, events, names), bound in zip(axes[:, 0], loaded, marks, strict=True):
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
        if bound is not None:
            for k in binding_rows(rows, names, bound):
                ax.axhspan(k - 0.5, k + 0.5, color=BOUND_COLOR, alpha=0.15, lw=0, zorder=0)
            ax.axvline(bound.seconds * 1e3, color=BOUND_COLOR, ls="--", lw=1)
            title = f"{title} | {bound.describe()} (shaded; dashed: step at its bound)"
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
