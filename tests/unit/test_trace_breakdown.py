"""The bench's compute / communication / bubble breakdown of a trace (`bench.analysis`):
a message is communication on its receiver from its sender's post to its receive's end,
also when its tensors came inline with the header (a receive span of one instant)."""

from __future__ import annotations

from typing import Any

import pytest

from disagmoe.bench.analysis import trace_breakdown


def _ev(name: str, cat: str, pid: int, ts: float, dur: float, **args: Any) -> dict[str, Any]:
    return {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": 0, "ts": ts, "dur": dur,
            "args": {"step": 0, **args}}  # fmt: skip


def _trace(recv_dur: float) -> list[dict[str, Any]]:
    """Rank 0 computes 0-100 us and posts a dispatch at 100 (done at 110); rank 1 has it
    at 150 (+ `recv_dur`) and computes until 200."""
    return [
        _ev("FA l0 s0", "fwd", 0, 0.0, 100.0, layer=0, slot=0),
        _ev("send dispatch l0 s0", "send", 0, 100.0, 10.0, dst=1, layer=0, slot=0, bytes=64),
        _ev("recv dispatch l0 s0", "recv", 1, 150.0, recv_dur, src=0, layer=0, slot=0, bytes=64),
        _ev("FF l0 s0", "fwd", 1, 150.0 + recv_dur, 50.0 - recv_dur, layer=0, slot=0),
    ]


@pytest.mark.parametrize("recv_dur", [0.0, 20.0])
def test_a_message_in_flight_is_communication_on_its_receiver(recv_dur: float) -> None:
    b = trace_breakdown(_trace(recv_dur), {0: 200e-6})
    # rank 0: 100 compute, then its send's 10 (exposed), 90 idle
    # rank 1: compute 50 - recv_dur, comm = flight 100 -> 150 + recv_dur, idle the rest
    rank0 = (100e-6, 10e-6, 10e-6, 90e-6)
    rank1 = ((50 - recv_dur) * 1e-6, (50 + recv_dur) * 1e-6, (50 + recv_dur) * 1e-6, 100e-6)
    want = [(x + y) / 2 for x, y in zip(rank0, rank1, strict=True)]
    got = [b.compute_s, b.comm_s, b.exposed_comm_s, b.bubble_s]
    assert got == pytest.approx(want)


def test_a_receive_without_its_send_counts_only_its_own_span() -> None:
    events = [e for e in _trace(20.0) if e["cat"] != "send"]
    b = trace_breakdown(events, {0: 200e-6})
    assert b.comm_s == pytest.approx((0.0 + 20e-6) / 2)
