"""What every writer and reader of traces shares: lanes, the event names (formatters and
their parser), a worker's `Tracer`, writing one Chrome trace for all workers, and the time
events cover (interval union, overlap, busy time).

The runtimes write events, the simulator lowers and reports with the same names, the
bench reads them back (`bench.analysis`).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LANES = ("compute", "fwd", "bwd", "send", "recv", "sync", "wgt")
COMPUTE_LANES = ("compute", "fwd", "bwd", "wgt")
COMM_LANES = ("send", "recv")
HOST_WORK = ("STEP", "GC")  # "sync"-lane events that are the rank's own work, not communication
BUCKET_EVENT = (
    "allreduce"  # trace name prefix of a gradient bucket's all-reduce: "allreduce l<layer>"
)
_LANE_IDS = {lane: tid for tid, lane in enumerate(LANES)}
Interval = tuple[float, float]
_Raw = tuple[str, str, float, float, dict[str, Any]]  # name, lane, start, end, args


# ------------------------------------------------------------------ trace event names
# One format for the runtimes, the simulator and the trace readers:
#   a computation        "FA l3 s1"        op (F / B / W) + component (A / F), layer, slot:
#                                          the instruction's own text (schedule.ir.compute_event_name)
#                        "FF l3 s1 c0"     ... and exchange chunk, when chunked
#   a message's events   "send act l3 s1"  "send" / "recv" + the message: kind, layer, slot
#                                          (+ " c0": its exchange chunk, when chunked)
#   a pipeline stage's   "F s0 mb1"        ep-* runtimes: stage action (F / B / I / W) or
#   work / messages      "recv act s0 mb1" message kind (act / grad), stage, micro-batch
_EVENT_NAME = re.compile(r"(?:(send|recv) )?(\S+) (?:l(\d+) s(\d+)(?: c(\d+))?|s(\d+) mb(\d+))")


def message_label(kind: str, layer: int, slot: int, chunk: int = -1) -> str:
    """A message of the AF-Pipe IR, "act l3 s1" ("dispatch l3 s1 c0": exchange chunk 0);
    its trace events: `message_event_name`."""
    return f"{kind} l{layer} s{slot}" + (f" c{chunk}" if chunk >= 0 else "")


def stage_event_name(what: str, stage: int, micro_batch: int) -> str:
    """Work of a pipeline stage on a micro-batch (ep-* runtimes), "F s0 mb1", or the label of
    a message between stages, "act s0 mb1"."""
    return f"{what} s{stage} mb{micro_batch}"


def message_event_name(side: str, label: str) -> str:
    """The sender's ("send") or the receiver's ("recv") event of the message `label`; the
    side is also the event's lane."""
    assert side in COMM_LANES, side
    return f"{side} {label}"


@dataclass(frozen=True, slots=True)
class EventName:
    """A trace event name taken apart (`parse_event_name`)."""

    what: str  # "FA" (op + component), a message kind ("act"), a stage action ("F")
    side: str | None = None  # "send" / "recv" for a message's events
    layer: int | None = None
    slot: int | None = None
    stage: int | None = None
    micro_batch: int | None = None
    chunk: int | None = None  # exchange chunk (AF-Pipe, chunked exchange)

    @property
    def op(self) -> str:
        """F / B / W of a computation ("FA l3 s1") or the action of a stage ("F s0 mb1")."""
        return self.what[0]

    @property
    def comp(self) -> str:
        """A / F: the component of an AF-Pipe computation."""
        return self.what[1:]


def parse_event_name(name: str) -> EventName:
    """Inverse of the formatters above; ValueError for any other name (SYNC, STEP, a2a ...)."""
    match = _EVENT_NAME.fullmatch(name)
    if match is None:
        raise ValueError(f"not a computation or message event name: {name!r}")
    side, what, layer, slot, chunk, stage, micro_batch = match.groups()

    def number(text: str | None) -> int | None:
        return None if text is None else int(text)

    return EventName(
        what,
        side,
        number(layer),
        number(slot),
        number(stage),
        number(micro_batch),
        number(chunk),
    )


# ------------------------------------------------------------------ device waits
# A computation's span on its lane includes any time it waited for its worker's one device
# while another lane held it (emulated compute, `models.emulated.Device`). The waiting
# thread adds that time here; the executor takes it when it traces the computation
# (`device_wait_us` in the event's args), so a computation's own seconds are its span less
# that wait (`own_seconds`).
_waits = threading.local()


def add_device_wait(us: float) -> None:
    """This thread waited `us` microseconds for its worker's device."""
    _waits.us = getattr(_waits, "us", 0.0) + us


def take_device_wait_us() -> float:
    """This thread's device waits since the last call (and reset)."""
    us = getattr(_waits, "us", 0.0)
    _waits.us = 0.0
    return float(us)


def own_seconds(e: dict[str, Any]) -> float:
    """A computation event's seconds less its waits for the device."""
    return (float(e.get("dur", 0.0)) - float(e["args"].get("device_wait_us", 0.0))) / 1e6


class Tracer:
    """Collects complete ("X") trace events for one worker; thread-safe.

    Events are indexed by their `step` argument; only the last `keep_steps` steps are
    kept (and written to trace.json), so long runs use bounded memory and per-step
    busy time costs the same at step 10 and at step 100,000.

    `add` is on every message's path: it appends a tuple to the step's list (atomic under
    the GIL) and takes the lock only for a step's first event; the event dicts are built
    when read.
    """

    def __init__(self, rank: int, role: str, keep_steps: int = 50) -> None:
        self.rank = rank
        self.role = role
        self.keep_steps = keep_steps
        self._by_step: dict[int | None, list[_Raw]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def now_us() -> float:
        return time.time_ns() / 1000.0

    def add(self, name: str, lane: str, start_us: float, end_us: float, **args: Any) -> None:
        step = args.get("step")
        events = self._by_step.get(step)
        if events is None:
            events = self._new_step(step)
        assert lane in _LANE_IDS, lane
        events.append((name, lane, start_us, end_us, args))

    def _new_step(self, step: int | None) -> list[_Raw]:
        with self._lock:
            if step not in self._by_step:
                if step is not None:
                    old = [
                        s for s in self._by_step if s is not None and s <= step - self.keep_steps
                    ]
                    for s in old:
                        del self._by_step[s]
                self._by_step[step] = []
            return self._by_step[step]

    def _event(self, raw: _Raw) -> dict[str, Any]:
        name, lane, start_us, end_us, args = raw
        return {
            "name": name,
            "cat": lane,
            "ph": "X",
            "ts": start_us,
            "dur": max(end_us - start_us, 0.0),
            "pid": self.rank,
            "tid": _LANE_IDS[lane],
            "args": args,
        }

    @property
    def events(self) -> list[dict[str, Any]]:
        with self._lock:
            lists = list(self._by_step.values())
        return [self._event(raw) for evs in lists for raw in list(evs)]

    def step_events(self, step: int) -> list[dict[str, Any]]:
        with self._lock:
            raws = list(self._by_step.get(step, []))
        return [self._event(raw) for raw in raws]

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

    def busy_us(self, lanes: Iterable[str] = COMPUTE_LANES, step: int | None = None) -> float:
        """This worker's compute time (`busy_us` of its events, of one step or all kept)."""
        return busy_us(self.events if step is None else self.step_events(step), lanes)


def write_trace(
    path: Path,
    per_rank: list[tuple[list[dict[str, Any]], list[dict[str, Any]]]],
    other: dict[str, Any] | None = None,
) -> None:
    """Merge (metadata, events) of every rank into one Chrome trace, time zero at the first
    event; `other` goes to the trace's `otherData` (e.g. a simulated step's bound)."""
    events = [e for _, evs in per_rank for e in evs]
    t0 = min((e["ts"] for e in events), default=0.0)
    out = [m for meta, _ in per_rank for m in meta]
    for e in events:
        out.append({**e, "ts": round(e["ts"] - t0, 3), "dur": round(e["dur"], 3)})
    trace: dict[str, Any] = {"traceEvents": out, "displayTimeUnit": "ms"}
    if other:
        trace["otherData"] = other
    path.write_text(json.dumps(trace))


# ------------------------------------------------------------------ time covered by events


def union_intervals(spans: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering what `spans` cover (touching ones merged, empty
    ones dropped)."""
    out: list[Interval] = []
    for s, e in sorted(spans):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def total_length(spans: Iterable[Interval]) -> float:
    return sum(e - s for s, e in spans)


def overlap_length(a: list[Interval], b: list[Interval]) -> float:
    """Time covered by both `a` and `b` (each sorted and disjoint: see `union_intervals`)."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def subtract_intervals(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """Parts of `a` not covered by `b` (each sorted and disjoint: see `union_intervals`)."""
    out: list[Interval] = []
    for s, e in a:
        cur = s
        for bs, be in b:
            if be <= cur or bs >= e:
                continue
            if bs > cur:
                out.append((cur, bs))
            cur = max(cur, be)
        if cur < e:
            out.append((cur, e))
    return out


def event_spans(events: Iterable[dict[str, Any]]) -> list[Interval]:
    """Time covered by trace events ("X": start `ts`, duration `dur`), as `union_intervals`."""
    return union_intervals((e["ts"], e["ts"] + e["dur"]) for e in events)


def busy_us(events: Iterable[dict[str, Any]], lanes: Iterable[str] = COMPUTE_LANES) -> float:
    """Compute time of one worker: union of its events on `lanes` minus its blocking waits.

    An event flagged `blocking` (the ep-* stages wait for all-to-alls inside their
    computations) is communication, not compute; the AF-Pipe executor has none.
    """
    listed, chosen = list(events), set(lanes)
    compute = event_spans(e for e in listed if e["cat"] in chosen)
    waits = event_spans(e for e in listed if e["args"].get("blocking"))
    return total_length(compute) - overlap_length(compute, waits)
