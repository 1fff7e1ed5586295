"""Draw one or more trace.json files as Gantt charts on a shared time axis.

python benchmarks/plot_trace.py runs/demo/trace.json docs/figures/trace_disagg.png [--step 5]
python benchmarks/plot_trace.py a/trace.json b/trace.json out.png --titles "AF-Pipe;ep-1f1b"

A trace written by `disagmoe simulate --trace` carries its step's bound: the binding
resource is shaded and the step at its bound marked (`disagmoe.plots.trace`); the bench's
`--plots` does the same for measured runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from disagmoe.plots.trace import plot_traces


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("paths", nargs="+", help="trace.json files, then the output PNG")
    parser.add_argument("--step", type=int, default=None, help="draw only this step (0-based)")
    parser.add_argument("--titles", default="", help="semicolon-separated titles, one per trace")
    args = parser.parse_args()
    if len(args.paths) < 2:
        parser.error("give at least one trace.json and then the output PNG")
    *traces, out = args.paths
    missing = [t for t in traces if not Path(t).is_file()]
    if missing:
        parser.error(f"no such trace file: {', '.join(missing)}")
    titles = args.titles.split(";") if args.titles else traces
    if len(titles) != len(traces):
        parser.error(f"--titles has {len(titles)} titles for {len(traces)} traces")
    plot_traces(list(zip(titles, traces, strict=True)), out, step=args.step)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
