"""One readiness rule: the executor and the validator accept and reject the same lists."""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import pytest

from disagmoe.device import HOST
from disagmoe.runtime.executor import Executor, HangError, Payload
from disagmoe.schedule.afpipe import build_afpipe
from disagmoe.schedule.ir import MESSAGE_KINDS, Instr, Msg, Op, Schedule
from disagmoe.schedule.semantics import RankProgram, compile_ranks, consumer, producer
from disagmoe.schedule.validate import ScheduleError, validate
from disagmoe.trace import Tracer

from .test_schedule import layout


def _fwd(layer: int, slot: int) -> Instr:
    return Instr(Op.FWD, "A", layer, slot)


def _bwd(layer: int, slot: int) -> Instr:
    return Instr(Op.BWD, "A", layer, slot)


def _one_rank(cap: int, slots_fwd: list[int], slots_bwd: list[int]) -> Schedule:
    """A single attention rank holding layers 0 and 1 (no messages: p = 1 hand-overs)."""
    fwd = [_fwd(l, s) for s in slots_fwd for l in (0, 1)]
    bwd = [_bwd(l, s) for s in slots_bwd for l in (1, 0)]
    return Schedule(
        name="hand-written",
        num_ranks=1,
        num_slots=2,
        max_in_flight=cap,
        roles=("A(g0,r0)",),
        ranks=((*fwd, *bwd, Instr(Op.SYNC), Instr(Op.STEP)),),
    )


class _Worker:
    """Records the computes and hooks in the order the executor runs them."""

    def __init__(self) -> None:
        self.ran: list[str] = []

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
        self.ran.append(f"F l{layer} s{slot}")
        return {}

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
        self.ran.append(f"B l{layer} s{slot}")
        return {}

    def kept(self, layer: int, slot: int, *, chunk: int = -1) -> Payload:
        return []

    def sync(self, step: int) -> int:
        self.ran.append("SYNC")
        return 0

    def optimizer_step(self, step: int) -> int:
        self.ran.append("STEP")
        return 0


def _execute(schedule: Schedule) -> list[str]:
    worker = _Worker()
    topo: Any = types.SimpleNamespace(rank=0, device=HOST)  # no messages: no process group
    executor = Executor(
        RankProgram.build(schedule, 0),
        schedule.roles[0],
        topo,
        worker,
        worker,
        Tracer(0, schedule.roles[0]),
        timeout_s=0.5,
    )
    executor.run_step(0)
    return worker.ran


def test_out_of_order_slots_rejected_by_both() -> None:
    # Slot 1 enters first with a cap of 1: its first forward waits for the backward of
    # slot 0 (slot - cap; with two layers, of the lowest: `semantics.cap_gates`), whose
    # forward sits behind it on the same lane.
    sched = _one_rank(cap=1, slots_fwd=[1, 0], slots_bwd=[1, 0])
    with pytest.raises(ScheduleError, match=r"deadlock: .*FA l0 s1 waits for BA l0 s0"):
        validate(sched)
    # whichever lane times out first reports: the forward lane, or the backward lane behind it
    with pytest.raises(HangError, match=r"waited .* for (BA l0 s0|FA l1 s1) of its own"):
        _execute(sched)


def test_out_of_order_slots_accepted_by_both() -> None:
    sched = _one_rank(cap=2, slots_fwd=[1, 0], slots_bwd=[1, 0])
    assert 1 <= validate(sched) <= 2
    ran = _execute(sched)
    assert ran[-2:] == ["SYNC", "STEP"]  # the hooks run SYNC and STEP, last, in list order
    assert sorted(ran[:-2]) == sorted(
        f"{k} l{l} s{s}" for k in "FB" for l in (0, 1) for s in (0, 1)
    )
    # local hand-overs: layer 1's forward after layer 0's, layer 0's backward after layer 1's
    assert ran.index("F l1 s1") > ran.index("F l0 s1")
    assert ran.index("B l0 s0") > ran.index("B l1 s0")


def test_in_order_slots_under_the_cap_accepted_by_both() -> None:
    sched = _one_rank(cap=1, slots_fwd=[0, 1], slots_bwd=[0, 1])
    assert validate(sched) == 1
    assert _execute(sched)[-1] == "STEP"


def test_local_hand_over_out_of_order_rejected() -> None:
    # Layer 1's forward of a slot before layer 0's on the same rank: the residual is not there.
    fwd = (_fwd(1, 0), _fwd(0, 0))
    sched = dataclasses.replace(
        _one_rank(cap=1, slots_fwd=[0], slots_bwd=[0]),
        num_slots=1,
        ranks=((*fwd, _bwd(1, 0), _bwd(0, 0), Instr(Op.SYNC), Instr(Op.STEP)),),
    )
    with pytest.raises(ScheduleError, match="FA l1 s0 waits for FA l0 s0"):
        validate(sched)
    with pytest.raises(HangError, match=r"waited .* for FA l[01] s0 of its own"):
        _execute(sched)


def test_every_message_kind_declares_its_ends() -> None:
    """Producer and consumer come from the kind table; generated lists agree with it."""
    sched = build_afpipe(layout(2, 2, 2, layers=4), 2)
    programs = compile_ranks(sched)
    seen = set()
    for rank, instrs in enumerate(sched.ranks):
        computes = {i.task for i in instrs if i.is_compute}
        for i in instrs:
            if i.op == Op.SEND and i.msg is not None:
                assert producer(i.msg) in computes
                assert i.msg in programs[rank].outputs[producer(i.msg)]
                seen.add(i.msg.kind)
            if i.op == Op.RECV and i.msg is not None:
                assert consumer(i.msg) in computes
                assert i.msg in programs[rank].inputs[consumer(i.msg)]
    assert seen == set(MESSAGE_KINDS)
    assert all(kind.payload for kind in MESSAGE_KINDS.values())


def test_in_order_schedules_are_not_run_on_lanes() -> None:
    sched = dataclasses.replace(_one_rank(1, [0], [0]), execution="in-order")
    with pytest.raises(ValueError, match="not on lanes"):
        RankProgram.build(sched, 0)
