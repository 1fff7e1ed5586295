"""A run replayed with its own costs: per-rank compute instructions and per-message bytes
override the cost table (`simulator.replay`, `bench.analysis.predict_disagg`), and the
per-message host costs read off a trace (`bench.overheads`)."""

from __future__ import annotations

from typing import Any

import pytest

from disagmoe.bench.overheads import MIN_SAMPLES, fit_message_overheads
from disagmoe.config import ModelConfig, ParallelConfig
from disagmoe.distributed.layout import Layout
from disagmoe.schedule.afpipe import build_afpipe, reduced_layout
from disagmoe.schedule.ir import Instr, Msg, Op
from disagmoe.simulator import Network, Workload, simulate_schedule

MODEL = ModelConfig(num_layers=2, num_experts=4)


class _Flat:
    """Every compute costs `fwd` forward and twice that backward."""

    def __init__(self, fwd: float) -> None:
        self.fwd = fwd

    def compute_s(self, op: Op, comp: str, layer: int) -> float:
        return self.fwd if op == Op.FWD else 2 * self.fwd


def _step(layout: Layout, net: Network, **kw: Any) -> float:
    schedule = build_afpipe(layout, 2)
    workload = Workload(MODEL, 64, 8)
    return simulate_schedule(
        schedule, layout, _Flat(1e-3), workload, net, share_compute=False, sync=False, **kw
    ).step_time_s


def test_a_rank_slower_in_the_run_is_slower_in_the_replay() -> None:
    layout = Layout.build(MODEL, ParallelConfig(attn_workers=2, expert_workers=2))
    net = Network.single_node(1e30, 0.0, layout.world_size)
    base = _step(layout, net)
    assert _step(layout, net, rank_compute_s=lambda rank, ins: None) == pytest.approx(base)
    shard = layout.expert_rank(0, 0)

    def slow_shard(rank: int, ins: Instr) -> float | None:
        return 10e-3 if rank == shard and ins.comp == "F" else None

    slowed = _step(layout, net, rank_compute_s=slow_shard)
    # the slow shard's 2 layers x 2 slots of forwards run in series on its fwd lane
    assert slowed >= 2 * 2 * 10e-3 and slowed > base + 0.02


def test_measured_bytes_price_the_messages_they_name() -> None:
    layout = Layout.build(MODEL, ParallelConfig(attn_workers=2, expert_workers=2))
    net = Network.single_node(1e6, 0.0, layout.world_size)  # 1 MB/s: bytes dominate
    base = _step(layout, net)
    shard = layout.expert_rank(0, 0)

    def big_to_shard(msg: Msg) -> float | None:
        return 1e5 if msg.dst == shard and msg.kind == "dispatch" else None

    assert _step(layout, net, measured_bytes=lambda msg: None) == pytest.approx(base)
    assert _step(layout, net, measured_bytes=big_to_shard) > base + 0.1  # 0.1 s per message


def test_measured_bytes_need_the_real_ranks() -> None:
    full = Layout.build(MODEL, ParallelConfig(attn_workers=2, expert_workers=2))
    small, _ = reduced_layout(full, 4)
    with pytest.raises(ValueError, match="real ranks"):
        simulate_schedule(
            build_afpipe(small, 2), small, _Flat(1e-3), Workload(MODEL, 64, 8),
            Network.single_node(1e9, 0.0, full.world_size), full=full, sync=False,
            measured_bytes=lambda msg: 1.0,
        )  # fmt: skip


def _events(steps: int) -> list[dict[str, Any]]:
    """Rank 0 computes "FA l0 s0" (ends at t0 + 100 us) and posts its dispatch 30 us later;
    rank 1 receives it and a second message on one stream, the second header waiting,
    and its consumer starts 40 us after the first message is in."""
    events: list[dict[str, Any]] = []
    for step in range(steps):
        t0 = step * 10_000.0

        def ev(
            name: str,
            cat: str,
            pid: int,
            tid: int,
            ts: float,
            dur: float,
            step: int = step,
            **a: Any,
        ) -> None:
            events.append(
                {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid, "ts": ts,
                 "dur": dur, "args": {"step": step, **a}}
            )  # fmt: skip

        ev("FA l0 s0", "fwd", 0, 1, t0, 100.0, layer=0, slot=0)
        ev("send dispatch l0 s0", "send", 0, 3, t0 + 130, 50.0, dst=1, layer=0, slot=0, bytes=8)
        ev("FA l0 s1", "fwd", 0, 1, t0 + 200, 100.0, layer=0, slot=1)
        ev("send dispatch l0 s1", "send", 0, 3, t0 + 330, 50.0, dst=1, layer=0, slot=1, bytes=8)
        ev("recv dispatch l0 s0", "recv", 1, 4, t0 + 200, 0.0, src=0, layer=0, slot=0,
           waited_us=150.0, bytes=8)  # fmt: skip
        ev("recv dispatch l0 s1", "recv", 1, 4, t0 + 260, 0.0, src=0, layer=0, slot=1,
           waited_us=5.0, bytes=8)  # fmt: skip
        ev("FF l0 s0", "fwd", 1, 1, t0 + 240, 10.0, layer=0, slot=0)
        ev("FF l0 s1", "fwd", 1, 1, t0 + 290, 10.0, layer=0, slot=1)
    return events


def test_message_overheads_are_read_off_the_trace() -> None:
    over = fit_message_overheads(_events(MIN_SAMPLES))
    assert over.post_s == pytest.approx(30e-6)
    assert over.recv_s == pytest.approx(60e-6)  # the second header was in: 260 - 200
    assert over.handoff_s == pytest.approx(30e-6)  # FF s1: in at 260, free at 250, ran at 290


def test_too_few_samples_leave_a_term_at_zero() -> None:
    over = fit_message_overheads(_events(1))  # 2 posts, 1 receive, 1 hand-off
    assert over.post_s == over.recv_s == over.handoff_s == 0.0
