"""Figures of a bench: tokens/s bars with exposed communication, and an AF-Pipe / ep-1f1b
trace pair on one time axis (`plots.trace.plot_traces`)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from ..plots.trace import TraceBound, plot_traces
from .runner import RuntimeResult


def plot_bars(results: list[RuntimeResult], out: Path, network: str) -> None:
    """Tokens/s per runtime (left) and step time split into compute-side / exposed comm."""
    ok = [r for r in results if r.ok and r.breakdown is not None]
    names = [r.runtime for r in ok]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.6))
    colors = ["#C44E52" if n.startswith("disagg") else "#4C72B0" for n in names]
    ax1.bar(names, [r.tokens_per_s for r in ok], color=colors)
    for k, r in enumerate(ok):
        label = f"{r.ratio_vs_ep_1f1b:.2f}x" if r.ratio_vs_ep_1f1b else ""
        ax1.text(k, r.tokens_per_s, label, ha="center", va="bottom", fontsize=8)
    ax1.set_ylabel(
        "tokens/s (emulated compute)" if "EMULATED" in network else "tokens/s (measured)"
    )
    ax1.set_title("throughput (ratio to ep-1f1b)", fontsize=9)
    exposed = [r.breakdown.exposed_comm_s for r in ok if r.breakdown]
    rest = [r.step_time_s - e for r, e in zip(ok, exposed, strict=True)]
    ax2.bar(names, rest, color="#8C8C8C", label="compute, bubble, overlapped comm")
    ax2.bar(names, exposed, bottom=rest, color="#DD8452", label="exposed communication")
    ax2.scatter(names, [r.predicted_step_s for r in ok], color="black", marker="_", s=300,
                label="simulator prediction", zorder=3)  # fmt: skip
    ax2.set_ylabel("seconds per step")
    ax2.set_title("step time", fontsize=9)
    ax2.legend(fontsize=7)
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", labelsize=8, rotation=15)
    fig.suptitle(network, fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)
    plt.close(fig)


def plot_trace_pair(
    results: list[RuntimeResult], out: Path, step: int, note: str = "", time_scale: float = 1.0
) -> None:
    """One measured step of AF-Pipe above one of ep-1f1b (first repetition), same axis: the
    first row of each runtime (`disagg`, or its first variant), each with its bound's
    binding resource shaded (`time_scale`: how much slower the traces' wall clock runs
    than the reported times, so the bound is drawn in trace time)."""
    pair = [("AF-Pipe", "disagg"), ("ep-1f1b (EP all-to-all + 1F1B)", "ep-1f1b")]
    traces: list[tuple[str, str | Path]] = []
    bounds: list[TraceBound | None] = []
    for title, name in pair:
        row = next((r for r in results if r.ok and r.runtime.split(" (")[0] == name), None)
        if row is not None:
            dirs = [Path(d) for d in row.run_dirs if (Path(d) / "trace.json").exists()]
            traces.append((f"{title} ({row.runtime}){note}", dirs[0] / "trace.json"))
            bounds.append(TraceBound.of(row.bound, time_scale) if row.bound else None)
    if traces:
        plot_traces(traces, out, step=step, bounds=bounds)
