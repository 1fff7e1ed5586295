"""Trace helpers: event names, the time covered by events, busy time."""

from __future__ import annotations

from typing import Any

import pytest

from disagmoe.schedule.ir import compute_event_name
from disagmoe.trace import (
    EventName,
    Tracer,
    busy_us,
    event_spans,
    message_event_name,
    message_label,
    overlap_length,
    parse_event_name,
    stage_event_name,
    subtract_intervals,
    total_length,
    union_intervals,
)


def _event(lane: str, ts: float, dur: float, **args: Any) -> dict[str, Any]:
    return {"name": "x", "cat": lane, "ph": "X", "ts": ts, "dur": dur, "args": args}


def test_interval_algebra_by_hand() -> None:
    a = union_intervals([(5.0, 7.0), (0.0, 2.0), (1.0, 3.0), (3.0, 4.0), (6.0, 6.0)])
    assert a == [(0.0, 4.0), (5.0, 7.0)]  # overlapping and touching merged, empty dropped
    b = union_intervals([(1.0, 2.0), (3.5, 6.0)])
    assert total_length(a) == 6.0
    assert overlap_length(a, b) == 1.0 + 0.5 + 1.0
    assert subtract_intervals(a, b) == [(0.0, 1.0), (2.0, 3.5), (6.0, 7.0)]
    assert total_length(subtract_intervals(a, b)) == total_length(a) - overlap_length(a, b)


def test_busy_time_counts_overlapping_lanes_once_and_not_blocking_waits() -> None:
    events = [
        _event("fwd", 0.0, 10.0),
        _event("bwd", 5.0, 10.0),  # overlaps the forward: 0..15 busy
        _event("recv", 6.0, 2.0, blocking=True),  # a wait inside the computation
        _event("send", 20.0, 5.0),  # communication only
    ]
    assert event_spans(events) == [(0.0, 15.0), (20.0, 25.0)]
    assert busy_us(events) == pytest.approx(13.0)
    assert busy_us(events, lanes=("fwd",)) == pytest.approx(8.0)


def test_tracer_busy_time_per_step() -> None:
    tracer = Tracer(0, "A")
    tracer.add("FA l0 s0", "fwd", 0.0, 4.0, step=0)
    tracer.add("FA l0 s0", "fwd", 10.0, 13.0, step=1)
    assert tracer.busy_us(step=0) == 4.0 and tracer.busy_us(step=1) == 3.0
    assert tracer.busy_us() == 7.0


def test_event_names_and_their_parser() -> None:
    assert compute_event_name("F", "A", 3, 1) == "FA l3 s1"
    assert message_event_name("recv", message_label("grad_combine", 2, 0)) == (
        "recv grad_combine l2 s0"
    )
    assert stage_event_name("W", 1, 4) == "W s1 mb4"
    assert message_event_name("send", stage_event_name("act", 0, 2)) == "send act s0 mb2"
    cases = {
        "BF l12 s7": EventName("BF", layer=12, slot=7),
        "send act l3 s1": EventName("act", "send", layer=3, slot=1),
        "recv grad_combine l2 s0": EventName("grad_combine", "recv", layer=2, slot=0),
        "I s1 mb4": EventName("I", stage=1, micro_batch=4),
        "recv grad s0 mb2": EventName("grad", "recv", stage=0, micro_batch=2),
    }
    for name, parsed in cases.items():
        assert parse_event_name(name) == parsed
    assert (parse_event_name("BF l12 s7").op, parse_event_name("BF l12 s7").comp) == ("B", "F")
    for other in ("SYNC grads", "STEP", "a2a dispatch l0 mb1", "send act[l3,s1] 0->1"):
        with pytest.raises(ValueError, match="not a computation or message"):
            parse_event_name(other)
