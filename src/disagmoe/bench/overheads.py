"""Per-message software costs of a measured AF-Pipe run, read off its own trace.

The simulator's replay of a run (`bench.analysis.predict_disagg`) moves bytes over the
emulated links and runs the traced compute; what a message costs the host — posting its
sends, its receive lane taking it in, waking its consumer — is no hardware, and without
it the replay is optimistic by about that much per message (docs/bench.md). This fits
`simulator.MessageOverheads` from the trace's own events, the same way for every run:

* `post_s`: the producing lane's time per message after its compute — each send event
  starts when its sends were posted (`runtime.executor`: the span begins after
  `send_message` returns), so a compute's first message costs `send.ts - compute end`
  and each further one `send.ts - previous send.ts`;
* `recv_s`: the receive lane's time per message — consecutive header arrivals on one
  stream where the later header was already in when the lane asked for it (`waited_us`
  below `READY_US`): the gap is what the lane spent on the earlier message;
* `handoff_s`: from a consumed message being in (its receive span's end) to its consumer
  starting, for computes whose lane was free before their last input came.

Medians (a few slow samples from other jobs on the host do not move them); trace
microseconds in, seconds out. A run with too few samples of a term leaves it at 0.
"""

from __future__ import annotations

import itertools
import statistics
from collections import defaultdict
from typing import Any

from ..schedule.ir import Msg, compute_event_name
from ..schedule.semantics import consumer, producer
from ..simulator.costs import MessageOverheads
from ..trace import parse_event_name

Event = dict[str, Any]
READY_US = 20.0  # a header that came at most this long after its lane asked was waiting
MIN_SAMPLES = 8  # fewer samples of a term than this: the term is left at 0


def _median_s(samples_us: list[float]) -> float:
    return statistics.median(samples_us) / 1e6 if len(samples_us) >= MIN_SAMPLES else 0.0


def _end(e: Event) -> float:
    return float(e["ts"]) + float(e.get("dur", 0.0))


def _msg(e: Event) -> Msg:
    name = parse_event_name(e["name"])
    a = e["args"]
    src, dst = (e["pid"], a["dst"]) if e["cat"] == "send" else (a["src"], e["pid"])
    chunk = name.chunk if name.chunk is not None else -1
    return Msg(name.what, a["layer"], a["slot"], src, dst, chunk)


def fit_message_overheads(events: list[Event]) -> MessageOverheads:
    """The per-message costs of the AF-Pipe run whose trace events (of its measured steps)
    are `events`; see the module doc."""
    computes: dict[tuple[int, str, int], Event] = {}
    sent: dict[tuple[int, str, int], list[Event]] = defaultdict(list)
    consumed: dict[tuple[int, str, int], list[Event]] = defaultdict(list)
    streams: dict[tuple[int, int, int], list[Event]] = defaultdict(list)
    for e in events:
        cat = e.get("cat")
        if cat in ("fwd", "bwd", "wgt"):
            computes[(e["pid"], e["name"], e["args"]["step"])] = e
        elif cat in ("send", "recv"):
            msg, step = _msg(e), e["args"]["step"]
            if cat == "send":
                sent[(msg.src, compute_event_name(*producer(msg)), step)].append(e)
            else:
                consumed[(msg.dst, compute_event_name(*consumer(msg)), step)].append(e)
                streams[(e["pid"], e["tid"], step)].append(e)
    posts: list[float] = []
    for key, sends in sent.items():
        comp = computes.get(key)
        if comp is None:
            continue
        mark = _end(comp)
        for s in sorted(sends, key=lambda e: e["ts"]):
            posts.append(max(float(s["ts"]) - mark, 0.0))
            mark = float(s["ts"])
    receives: list[float] = []
    for recvs in streams.values():
        recvs.sort(key=lambda e: e["ts"])
        for prev, e in itertools.pairwise(recvs):
            if float(e["args"].get("waited_us", 0.0)) <= READY_US:
                receives.append(max(float(e["ts"]) - float(prev["ts"]), 0.0))
    handoffs: list[float] = []
    lanes: dict[tuple[int, int, int], list[Event]] = defaultdict(list)
    for key, comp in computes.items():
        lanes[(comp["pid"], comp["tid"], key[2])].append(comp)
    for seq in lanes.values():
        seq.sort(key=lambda e: e["ts"])
        for prev, e in itertools.pairwise(seq):
            got = consumed.get((e["pid"], e["name"], e["args"]["step"]))
            if not got:
                continue
            prev_sends = sent.get((prev["pid"], prev["name"], prev["args"]["step"]), [])
            free = max([_end(prev), *(float(s["ts"]) for s in prev_sends)])
            ready = max(_end(r) for r in got)
            if ready > free:
                handoffs.append(max(float(e["ts"]) - ready, 0.0))
    return MessageOverheads(
        post_s=_median_s(posts), recv_s=_median_s(receives), handoff_s=_median_s(handoffs)
    )


__all__ = ["fit_message_overheads"]
