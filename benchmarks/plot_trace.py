"""Draw one or more trace.json files as Gantt charts on a shared time axis.

python benchmarks/plot_trace.py runs/demo/trace.json docs/figures/trace_disagg.png [--step 5]
python benchmarks/plot_trace.py a/trace.json b/trace.json out.png --titles "AF-Pipe;ep-1f1b"
"""

from __future__ import annotations

import argparse

from disagmoe.plots.trace import plot_traces


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("paths", nargs="+", help="trace.json files, then the output PNG")
    parser.add_argument("--step", type=int, default=None, help="draw only this step (0-based)")
    parser.add_argument("--titles", default="", help="semicolon-separated titles, one per trace")
    args = parser.parse_args()
    *traces, out = args.paths
    titles = args.titles.split(";") if args.titles else traces
    plot_traces(list(zip(titles, traces, strict=True)), out, step=args.step)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
