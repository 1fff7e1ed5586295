"""Per-message cost of the runtime's exchange path against raw gloo isend/irecv, side by side.

    .venv/bin/python benchmarks/exchange_overhead.py [--json PATH] [--repeats 7] [--runs 6]
        [--hand-over] [--threads]

Two local gloo ranks (one thread each), in one run:

* runtime: `runtime.executor.Executor` runs a two-rank schedule in which rank 0 computes
  nothing and sends `count` messages (`dispatch` of `count` layers) to rank 1, whose computes
  consume them: header, payload, receive lanes, hand-over to the consuming lane, tracing —
  everything a message costs in a training step;
* gloo: the same number of payloads of the same byte size, every `isend` / `irecv` posted
  at once on a dedicated 2-rank group, then waited for; receive buffers allocated once;
* gloo+alloc: the same, each receive into a freshly allocated buffer, as a receiver of
  variable-size messages must;
* protocol: the gloo operations of the runtime's message protocol alone, without the
  executor: per message its header (`encode_header` of the same tensors: inline up to 64
  KiB) on one 2-rank group and, above that, its payload on another; the receiver posts
  every header receive at once and a payload's receive when its header arrived, into
  buffers allocated once. Its ratio to gloo is the floor of a two-operation protocol on
  this host; runtime / protocol is what the executor adds on top.

Per message = the receiver's wall time for the whole batch / count (median of repeats;
messages stream back to back, so this is the cost per message, not one message's latency).
Prints a table; `--json PATH` writes `{"rows": [{bytes, count, runtime_us, gloo_us,
gloo_alloc_us, protocol_us, ratio, protocol_ratio, ratio_min, ratio_median, ratio_max,
cpu_us, cpu_ratio}]}` (ratio = runtime / gloo of the medians, protocol_ratio = protocol /
gloo; the next three of the per-repeat runtime / gloo ratios, each repeat running both back
to back; `cpu_us` per variant {send, recv}: the CPU time per message of each rank's process,
all its threads, and `cpu_ratio` runtime / gloo of their sums — a second table: see
`_with_cpu`; `threads_us` per variant {send, recv}: that CPU time split by thread, the
executor's lanes by name, the rank's own thread and the threads without a Python name
(gloo's loop threads), which `--threads` prints: see `_thread_group`; and, read from the
receiver's trace of its last runtime step, `header_gap_us`, `compute_gap_us` and
`consumer_lag_us`, which `--hand-over` prints: see `_hand_over`).
With `--runs R` > 1 it measures R times, each in a fresh pair of processes, and also prints
per size the median, min and max of the runs' ratios, CPU ratio included (JSON: `runs`,
`over_runs`; `rows` is the first run's).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import statistics
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from results_io import write_json

from disagmoe.config import ModelConfig, ParallelConfig
from disagmoe.distributed.exchange import HEADER_BYTES, encode_header
from disagmoe.distributed.layout import Layout
from disagmoe.distributed.topology import Topology
from disagmoe.runtime.executor import Executor, Payload
from disagmoe.schedule.ir import Msg
from disagmoe.schedule.semantics import RankProgram
from disagmoe.testing.spawn import run_ranks
from disagmoe.testing.streams import one_stream_schedule
from disagmoe.trace import Tracer

# (bytes, count): a step of the large sizes lasts 50-100 ms, long enough that the VM's
# scheduling noise (a few ms per step) does not set the ratio
SIZES = ((256, 400), (4096, 400), (65536, 200), (1 << 20, 160), (8 << 20, 16))


class _Worker:
    """Rank 0 sends a prebuilt payload per message; rank 1 consumes without computing."""

    def __init__(self, nbytes: int) -> None:
        ints = 8  # an int part, as real messages carry (token ids, expert ids)
        floats = max((nbytes - 8 * ints) // 8, 0)
        self.payload = [torch.ones(floats, dtype=torch.float64), torch.arange(ints)]

    def forward(
        self,
        layer: int,
        slot: int,
        received: dict[Msg, Payload],
        outgoing: list[Msg],
        *,
        keep: bool = True,
        chunk: int = -1,
    ) -> dict[Msg, Payload]:
        return {m: self.payload for m in outgoing}

    def backward(
        self,
        layer: int,
        slot: int,
        received: dict[Msg, Payload],
        outgoing: list[Msg],
        *,
        chunk: int = -1,
        defer: bool = False,
    ) -> dict[Msg, Payload]:
        return self.forward(layer, slot, received, outgoing)

    def sync(self, step: int) -> int:
        return 0

    def optimizer_step(self, step: int) -> int:
        return 0


def _thread_cpu_ns() -> dict[int, int]:
    """CPU time so far of each thread of this process, ns, by thread id: the first field of
    Linux's `/proc/self/task/TID/schedstat` (empty where there is none). Python threads
    and native ones alike: gloo's loop threads, which copy the data, have no Python name."""
    out = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
    return out


def _thread_group(name: str | None) -> str:
    """Which column of the per-thread table a thread counts in: the executor's lanes by
    their thread names ("recv*": every receive lane), "main" the rank's own thread (it
    posts and waits in the gloo and protocol variants), "native" every thread without a
    Python name (gloo's loop threads and torch's)."""
    if name is None:
        return "native"
    if name == "MainThread":
        return "main"
    if name.startswith("recv"):
        return "recv*"
    return name if name in THREAD_GROUPS else "other"


# the columns of `--threads`, in order
THREAD_GROUPS = ("main", "fwd", "bwd", "wgt", "send", "recv*", "native", "other")


def _by_group(before: dict[int, int], after: dict[int, int]) -> dict[str, float]:
    """CPU seconds each thread group spent between two `_thread_cpu_ns` snapshots."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    spent: dict[str, float] = {}
    for tid, ns in after.items():
        group = _thread_group(names.get(tid))
        spent[group] = spent.get(group, 0.0) + (ns - before.get(tid, 0)) / 1e9
    return spent


def _timed(fn: Any) -> tuple[float, float, dict[str, float]]:
    """Wall-clock and CPU seconds of `fn` on this rank (CPU: every thread of the process,
    gloo's loop threads that copy the data included), and the CPU seconds per thread group
    (`_thread_group`)."""
    dist.barrier()
    threads = _thread_cpu_ns()
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    wall, used = time.perf_counter() - t0, time.process_time() - c0
    return wall, used, _by_group(threads, _thread_cpu_ns())


def _protocol(
    header: torch.Tensor,
    payloads: list[torch.Tensor],
    landing: list[torch.Tensor],
    bodies_in: list[list[torch.Tensor]],
    groups: tuple[dist.ProcessGroup, dist.ProcessGroup],
) -> None:
    """The runtime's protocol alone: rank 0 sends `len(landing)` messages (`header` on the
    first group, `payloads` on the second); rank 1 posts every header receive at once and a
    message's payload receives (into `bodies_in`) once its header is in."""
    heads, bodies = groups
    if dist.get_rank() == 0:
        works = []
        for _ in landing:
            works.append(dist.isend(header, 1, group=heads))
            works += [dist.isend(t, 1, group=bodies) for t in payloads]
    else:
        posted = [dist.irecv(b, 0, group=heads) for b in landing]
        works = []
        for head, body in zip(posted, bodies_in, strict=True):
            assert head is not None
            head.wait()
            works += [dist.irecv(t, 0, group=bodies) for t in body]
    for w in works:
        assert w is not None
        w.wait()


def _measure(sizes: tuple[tuple[int, int], ...], repeats: int) -> list[dict[str, float]]:
    rank = dist.get_rank()
    layout = Layout.build(
        ModelConfig(num_layers=1, num_experts=2), ParallelConfig(attn_workers=1, expert_workers=1)
    )
    raw = dist.new_group([0, 1])
    heads, bodies = dist.new_group([0, 1]), dist.new_group([0, 1])  # the protocol's groups
    rows = []
    for nbytes, count in sizes:
        schedule = one_stream_schedule(count)
        topo = Topology.build(layout)
        worker = _Worker(nbytes)
        tracer = Tracer(rank, schedule.roles[rank])
        executor = Executor(
            RankProgram.build(schedule, rank), schedule.roles[rank], topo, worker, worker,
            tracer, timeout_s=120,
        )  # fmt: skip
        buffers = [torch.ones(nbytes // 8, dtype=torch.float64) for _ in range(count)]

        def gloo(fresh: bool, buffers: list[torch.Tensor] = buffers) -> None:
            op = dist.isend if rank == 0 else dist.irecv
            if fresh and rank == 1:
                works = [op(torch.empty_like(b), 0, group=raw) for b in buffers]
            else:
                works = [op(b, 1 - rank, group=raw) for b in buffers]
            for w in works:
                assert w is not None
                w.wait()

        header, payloads = encode_header(worker.payload)
        header = header.clone()
        landing = [torch.empty(HEADER_BYTES, dtype=torch.uint8) for _ in range(count)]
        bodies_in = [[torch.empty_like(t) for t in payloads] for _ in range(count)]

        times: dict[str, list[float]] = {"runtime": [], "gloo": [], "gloo_alloc": [],
                                         "protocol": []}  # fmt: skip
        cpu: dict[str, list[float]] = {key: [] for key in times}
        per_thread: dict[str, dict[str, list[float]]] = {key: {} for key in times}
        for step in range(repeats + 1):  # the first of each is a warm-up
            r = _timed(functools.partial(executor.run_step, step))
            g = _timed(functools.partial(gloo, False))
            a = _timed(functools.partial(gloo, True))
            p = _timed(functools.partial(_protocol, header, payloads, landing, bodies_in,
                                         (heads, bodies)))  # fmt: skip
            if step:
                for key, (wall, used, groups) in zip(times, (r, g, a, p), strict=True):
                    times[key].append(wall)
                    cpu[key].append(used)
                    for group, seconds in groups.items():
                        per_thread[key].setdefault(group, []).append(seconds)
        us = {key: statistics.median(t) / count * 1e6 for key, t in times.items()}
        cpu_us = {key: round(statistics.median(c) / count * 1e6, 1) for key, c in cpu.items()}
        threads_us = {key: {group: round(statistics.median(c) / count * 1e6, 1)
                            for group, c in groups.items()}
                      for key, groups in per_thread.items()}  # fmt: skip
        # runtime / gloo of each repeat (they run back to back, so a slow phase of the
        # machine hits both): the spread says how far to trust the median's ratio
        paired = sorted(r / g for r, g in zip(times["runtime"], times["gloo"], strict=True))
        rows.append(
            {
                "bytes": nbytes,
                "count": count,
                "runtime_us": round(us["runtime"], 1),
                "gloo_us": round(us["gloo"], 1),
                "gloo_alloc_us": round(us["gloo_alloc"], 1),
                "protocol_us": round(us["protocol"], 1),
                "ratio": round(us["runtime"] / us["gloo"], 2),
                "protocol_ratio": round(us["protocol"] / us["gloo"], 2),
                "ratio_min": round(paired[0], 2),
                "ratio_median": round(statistics.median(paired), 2),
                "ratio_max": round(paired[-1], 2),
                "cpu_us": cpu_us,  # this rank's; `_with_cpu` adds the sender's
                "threads_us": threads_us,  # likewise
                **_hand_over(tracer.step_events(repeats)),
            }
        )
    return rows


def _hand_over(events: list[dict[str, Any]]) -> dict[str, float]:
    """The receiver's last runtime step, read from its trace (medians, us): how far apart
    its receive lane took the headers (`header_gap_us`), how far apart the consuming lane
    started its computes (`compute_gap_us`), and how long after its header a message's
    compute started (`consumer_lag_us`). Empty on the sender."""
    heads = sorted(e["ts"] for e in events if e["cat"] == "recv")
    starts = sorted(e["ts"] for e in events if e["cat"] == "fwd")
    if len(heads) < 2 or len(heads) != len(starts):
        return {}
    return {
        "header_gap_us": round(statistics.median(b - a for a, b in itertools.pairwise(heads)), 1),
        "compute_gap_us": round(statistics.median(b - a for a, b in itertools.pairwise(starts)), 1),
        "consumer_lag_us": round(
            statistics.median(c - h for h, c in zip(heads, starts, strict=True)), 1
        ),
    }


def _print_hand_over(rows: list[dict[str, float]]) -> None:
    print("receiver's last step: median us between headers taken, between the consumer's "
          "computes, and from a header to its compute")  # fmt: skip
    for r in rows:
        if "header_gap_us" in r:
            print(f"{r['bytes']:9d}  header gap {r['header_gap_us']:8.1f}  compute gap "
                  f"{r['compute_gap_us']:8.1f}  lag {r['consumer_lag_us']:9.1f}")  # fmt: skip


def _with_cpu(sender: list[dict[str, Any]], receiver: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The receiver's rows, each with `cpu_us` = per variant {"send", "recv"}: the CPU time
    per message of the sender's and the receiver's process (median of the repeats), and
    `cpu_ratio` = runtime / gloo of their sums. On a host whose cores the two ranks keep
    busy (2 cores here: each rank's gloo thread copies the data while its lanes run), a
    message's wall time follows the CPU both sides spend on it; the CPU columns say which
    side spends it."""
    rows = []
    for send, recv in zip(sender, receiver, strict=True):
        both = {key: {"send": send["cpu_us"][key], "recv": recv["cpu_us"][key]}
                for key in recv["cpu_us"]}  # fmt: skip
        total = {key: sides["send"] + sides["recv"] for key, sides in both.items()}
        threads = {key: {"send": send["threads_us"][key], "recv": recv["threads_us"][key]}
                   for key in recv["threads_us"]}  # fmt: skip
        rows.append({**recv, "cpu_us": both, "threads_us": threads,
                     "cpu_ratio": round(total["runtime"] / total["gloo"], 2)})  # fmt: skip
    return rows


def _print_threads(rows: list[dict[str, Any]]) -> None:
    """`threads_us` of the runtime and raw gloo, per side: where each message's CPU goes."""
    print("CPU us per message by thread (lanes by name; main: the rank's own thread; native: "
          "threads without a Python name, gloo's loop threads among them)")  # fmt: skip
    print(f"{'bytes':>9s} {'variant':>8s} {'side':>4s} "
          + " ".join(f"{g:>7s}" for g in THREAD_GROUPS))  # fmt: skip
    for r in rows:
        for key in ("runtime", "gloo"):
            for side in ("send", "recv"):
                spent = r["threads_us"][key][side]
                cells = " ".join(f"{spent[g]:7.1f}" if g in spent else f"{'-':>7s}"
                                 for g in THREAD_GROUPS)  # fmt: skip
                print(f"{r['bytes']:9d} {key:>8s} {side:>4s} {cells}")


def _print_cpu(rows: list[dict[str, Any]]) -> None:
    print("CPU us per message, sender + receiver (every thread of each process):")
    print(f"{'bytes':>9s} {'runtime':>17s} {'gloo':>17s} {'protocol':>17s} {'ratio':>6s}")
    for r in rows:
        cells = [f"{c['send']:7.1f} +{c['recv']:8.1f}"
                 for c in (r["cpu_us"][k] for k in ("runtime", "gloo", "protocol"))]  # fmt: skip
        print(f"{r['bytes']:9d} {cells[0]:>17s} {cells[1]:>17s} {cells[2]:>17s} "
              f"{r['cpu_ratio']:6.2f}")  # fmt: skip


def _print_rows(rows: list[dict[str, float]]) -> None:
    print(f"{'bytes':>9s} {'count':>5s} {'runtime us/msg':>14s} {'gloo us/msg':>11s} "
          f"{'gloo+alloc':>10s} {'protocol':>8s} {'ratio':>6s} {'floor':>5s}  "
          "per-repeat ratio min/median/max")  # fmt: skip
    for r in rows:
        print(f"{r['bytes']:9d} {r['count']:5d} {r['runtime_us']:14.1f} {r['gloo_us']:11.1f} "
              f"{r['gloo_alloc_us']:10.1f} {r['protocol_us']:8.1f} {r['ratio']:6.2f} "
              f"{r['protocol_ratio']:5.2f}  {r['ratio_min']:.2f} / "
              f"{r['ratio_median']:.2f} / {r['ratio_max']:.2f}")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", default="", help="write the rows to this JSON file")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--runs", type=int, default=1,
                        help="measure this many times, each in a fresh pair of processes, and "
                        "print the median ratio over the runs")  # fmt: skip
    parser.add_argument("--hand-over", action="store_true",
                        help="also print how the receiver's lanes handed messages over in its "
                        "last step (from its trace)")  # fmt: skip
    parser.add_argument("--threads", action="store_true",
                        help="also print the CPU time per message of each side's threads, "
                        "runtime and raw gloo (Linux: /proc/self/task)")  # fmt: skip
    parser.add_argument(
        "--sizes",
        default="",
        help="comma-separated message sizes in bytes (default: "
        + ",".join(str(b) for b, _ in SIZES)
        + "); each streams as many messages as its default, or 400 at most",
    )
    args = parser.parse_args()
    sizes = SIZES
    if args.sizes:
        counts = dict(SIZES)
        try:
            picked = [int(b) for b in args.sizes.split(",")]
        except ValueError:
            parser.error(f"--sizes: not a comma-separated list of byte counts: {args.sizes!r}")
        if any(b < 64 for b in picked):
            parser.error("--sizes: every message needs at least 64 bytes (its int part)")
        sizes = tuple((b, counts.get(b, max(10, min(400, (16 << 20) // b)))) for b in picked)
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    runs = []
    for run in range(args.runs):
        sender, receiver = run_ranks(_measure, 2, sizes, args.repeats)
        rows = _with_cpu(sender, receiver)  # the receiver's timings, both sides' CPU
        runs.append(rows)
        if args.runs > 1:
            print(f"run {run + 1} of {args.runs}:")
        _print_rows(rows)
        _print_cpu(rows)
        if args.hand_over:
            _print_hand_over(rows)
        if args.threads:
            _print_threads(rows)
    out: dict[str, Any] = {"rows": runs[0]}
    if args.runs > 1:
        # each run starts its own pair of processes: the machine's phase differs between
        # runs more than between the repeats of one, so the median over runs is the figure
        print(f"over {args.runs} runs: median (min - max) of the runtime / gloo ratio, of the "
              "protocol / gloo floor, of runtime / protocol and of the CPU ratio")  # fmt: skip
        summary = []
        for i, (nbytes, _count) in enumerate(sizes):
            ratios = sorted(rows[i]["ratio"] for rows in runs)
            floors = sorted(rows[i]["protocol_ratio"] for rows in runs)
            over = sorted(rows[i]["runtime_us"] / rows[i]["protocol_us"] for rows in runs)
            cpus = sorted(rows[i]["cpu_ratio"] for rows in runs)
            summary.append({"bytes": nbytes,
                            "ratio_median": round(statistics.median(ratios), 2),
                            "ratio_min": ratios[0], "ratio_max": ratios[-1], "ratios": ratios,
                            "protocol_ratio_median": round(statistics.median(floors), 2),
                            "protocol_ratios": floors,
                            "runtime_over_protocol_median": round(statistics.median(over), 2),
                            "cpu_ratio_median": round(statistics.median(cpus), 2),
                            "cpu_ratios": cpus})  # fmt: skip
            print(f"{nbytes:9d}  {statistics.median(ratios):.2f} ({ratios[0]:.2f} - "
                  f"{ratios[-1]:.2f})   floor {statistics.median(floors):.2f} ({floors[0]:.2f} - "
                  f"{floors[-1]:.2f})   over the floor {statistics.median(over):.2f} "
                  f"({over[0]:.2f} - {over[-1]:.2f})   CPU {statistics.median(cpus):.2f} "
                  f"({cpus[0]:.2f} - {cpus[-1]:.2f})")  # fmt: skip
        out = {"rows": runs[0], "runs": runs, "over_runs": summary}
    if args.json:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
