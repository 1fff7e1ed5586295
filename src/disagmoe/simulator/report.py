"""Turn a simulated timeline into the numbers and the trace a user reads.

Breakdown (seconds, averaged over real workers, so that
`attn + ffn + other + comm_exposed + bubble == step_time_s` on every worker):

* `attn`, `ffn`, `other` — the worker's GPU busy time (union of its compute
  ops) split by the work of each category (`other`: optimizer step);
* `comm_overlapped` — time the worker has a message or collective in flight
  while its GPU computes;
* `comm_exposed` — time a message or collective is in flight and the GPU idles;
* `bubble` — the rest: the worker waits with nothing in flight.

`trace.json` uses the real runs' format (trace.py): one process per
worker, one thread per lane, one complete event per operation; a message
appears as "send ..." on the sender's send lane and "recv ..." on the
receiver's recv lane, from when its bytes start moving to its arrival.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..schedule.orders import order_label
from ..trace import (
    Interval,
    Tracer,
    message_event_name,
    overlap_length,
    total_length,
    union_intervals,
    write_trace,
)
from .bound import Bound, program_bound
from .engine import A2A, COMPUTE, DELAY, XFER, Program, Timeline

BREAKDOWN_KEYS = ("attn", "ffn", "other", "comm_overlapped", "comm_exposed", "bubble")
# config entries `to_dict` also puts at the top: the fullest worker's peak, the GPU's memory
MEMORY_KEYS = ("memory_gib_per_gpu", "gpu_memory_gib")


@dataclass
class SimResult:
    runtime: str
    step_time_s: float
    tokens_per_step: int
    num_workers: int
    breakdown: dict[str, float]
    workers: list[dict[str, Any]]  # one entry per simulated rank (it may stand for several)
    config: dict[str, Any] = field(default_factory=dict)
    program: Program | None = None
    timeline: Timeline | None = None
    bound: Bound | None = None  # the step-time lower bound (simulator.bound)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_time_s if self.step_time_s > 0 else 0.0

    def share(self, key: str) -> float:
        return self.breakdown[key] / self.step_time_s if self.step_time_s > 0 else 0.0

    @property
    def comm_share(self) -> float:
        """Communication in flight (hidden or not) as a share of step time."""
        return self.share("comm_overlapped") + self.share("comm_exposed")

    def to_dict(self) -> dict[str, Any]:
        return {
            "runtime": self.runtime,
            "step_time_s": self.step_time_s,
            "tokens_per_step": self.tokens_per_step,
            "tokens_per_s": self.tokens_per_s,
            "num_workers": self.num_workers,
            "breakdown": self.breakdown,
            "shares": {k: self.share(k) for k in BREAKDOWN_KEYS},
            "workers": self.workers,
            "config": self.config,
            **{k: self.config[k] for k in MEMORY_KEYS if k in self.config},
            **(self.bound.to_dict() if self.bound else {}),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def write_trace(self, path: str | Path) -> None:
        assert self.program is not None and self.timeline is not None
        other = {"bound": self.bound.to_dict()} if self.bound is not None else None
        write_trace(Path(path), trace_events(self.program, self.timeline, self.workers), other)


def summarize(
    runtime: str,
    program: Program,
    timeline: Timeline,
    *,
    tokens_per_step: int,
    roles: list[str],
    real_ranks: list[int],
    config: dict[str, Any],
    cores: int = 0,
) -> SimResult:
    """Per-worker busy time, breakdown and bound of a finished simulation."""
    n = program.num_ranks
    compute: list[list[Interval]] = [[] for _ in range(n)]
    comm: list[list[Interval]] = [[] for _ in range(n)]
    work: list[dict[str, float]] = [{"attn": 0.0, "ffn": 0.0, "other": 0.0} for _ in range(n)]
    for op, kind in enumerate(program.kind):
        s, e = timeline.start[op], timeline.end[op]
        cat = program.category[op]
        if kind == XFER:
            span = (timeline.xfer_begin.get(op, s), e)
            for r in program.xfer_ranks[op]:
                comm[r].append(span)
        elif kind == A2A or (kind == DELAY and cat == "comm"):
            comm[program.rank[op]].append((s, e))
        elif kind in (COMPUTE, DELAY):
            compute[program.rank[op]].append((s, e))
            work[program.rank[op]][cat] += program.work[op]
    step = timeline.makespan
    mult = program.multiplicity or [1] * n
    total = float(sum(mult))
    breakdown = dict.fromkeys(BREAKDOWN_KEYS, 0.0)
    workers = []
    for r in range(n):
        busy_spans, comm_spans = union_intervals(compute[r]), union_intervals(comm[r])
        busy = total_length(busy_spans)
        overlapped = overlap_length(busy_spans, comm_spans)
        exposed = total_length(comm_spans) - overlapped
        done = sum(work[r].values())
        scale = busy / done if done > 0 else 0.0
        row = {k: v * scale for k, v in work[r].items()}
        row.update(
            comm_overlapped=overlapped, comm_exposed=exposed, bubble=max(step - busy - exposed, 0.0)
        )
        for key in BREAKDOWN_KEYS:
            breakdown[key] += row[key] * mult[r] / total
        workers.append(
            {
                "rank": real_ranks[r],
                "role": roles[r],
                "count": mult[r],
                "busy_s": busy,
                **{k: row[k] for k in BREAKDOWN_KEYS},
            }
        )
    bound = program_bound(program, cores=cores, names=roles)
    return SimResult(
        runtime,
        step,
        tokens_per_step,
        int(total),
        breakdown,
        workers,
        config,
        program,
        timeline,
        bound,
    )


def trace_events(
    program: Program, timeline: Timeline, workers: list[dict[str, Any]]
) -> list[tuple[list[dict[str, Any]], list[dict[str, Any]]]]:
    tracers = []
    for w in workers:
        role = w["role"] + (f" x{w['count']}" if w["count"] > 1 else "")
        tracers.append(Tracer(w["rank"], role))
    for op, kind in enumerate(program.kind):
        s, e = timeline.start[op] * 1e6, timeline.end[op] * 1e6
        args = program.args[op]
        if kind == XFER:
            s = timeline.xfer_begin.get(op, timeline.start[op]) * 1e6
            ranks = program.xfer_ranks[op]
            tracers[ranks[0]].add(
                message_event_name("send", program.label[op]), "send", s, e, **args
            )
            if len(ranks) > 1:
                tracers[ranks[1]].add(
                    message_event_name("recv", program.label[op]), "recv", s, e, **args
                )
        else:
            tracers[program.rank[op]].add(program.label[op], program.lane[op], s, e, **args)
    return [(t.metadata(), t.events) for t in tracers]


def _searched(what: str, search: dict[Any, Any] | None) -> list[str]:
    """The line naming every simulated choice of `what` and its step (none if no search)."""
    if not search:
        return []
    steps = (f"{k} {v if isinstance(v, str) else f'{v * 1e3:.2f} ms'}" for k, v in search.items())
    return [f"{what:11s} the fastest simulated of: " + "; ".join(steps)]


def format_result(result: SimResult) -> str:
    """What `disagmoe simulate` prints for a result (without `--json`)."""
    cfg = result.config
    lines = [
        f"runtime {result.runtime}  model {cfg.get('model')}  cluster {cfg.get('cluster')}  "
        f"workers {result.num_workers}",
        *(
            [
                f"schedule    {order_label(cfg['order'], cfg.get('costed', False))}, "
                f"{cfg.get('exchange_chunks', 1)} exchange chunk(s)"
                + (", weight gradients deferred" if cfg.get("split_backward") else "")
            ]
            if result.runtime == "disagg" and "order" in cfg
            else []
        ),
        f"step time   {result.step_time_s * 1e3:10.2f} ms",
        f"throughput  {result.tokens_per_s:10.0f} tokens/s ({result.tokens_per_step} tokens/step)",
        *(
            [
                f"bound       {result.bound.seconds * 1e3:10.2f} ms  (step/bound "
                f"{result.step_time_s / result.bound.seconds:.2f}; binding: "
                f"{result.bound.describe()})"
            ]
            if result.bound and result.bound.seconds > 0
            else []
        ),
        *(
            [
                f"memory      {cfg['memory_gib_per_gpu']:10.1f} GiB per GPU (of "
                f"{cfg['gpu_memory_gib']:g}; recompute {cfg.get('recompute', 'none')}"
                + (
                    f" on each worker's first {cfg['recompute_layers']} layers"
                    if cfg.get("recompute_layers")
                    else ""
                )
                + (f", {cfg['max_in_flight']} in flight" if cfg.get("max_in_flight") else "")
                + ")"
            ]
            if "memory_gib_per_gpu" in cfg
            else []
        ),
        *([f"layout      {cfg['layout_note']}"] if cfg.get("layout_note") else []),
        *_searched("recompute", cfg.get("recompute_search")),
        *_searched("order", cfg.get("order_search")),
        *_searched("in flight", cfg.get("in_flight_search")),
        "breakdown (per worker, s; attn+ffn+other+comm_exposed+bubble = step):",
    ]
    for key in BREAKDOWN_KEYS:
        lines.append(f"  {key:16s} {result.breakdown[key]:10.4f}  {100 * result.share(key):5.1f}%")
    return "\n".join(lines)
