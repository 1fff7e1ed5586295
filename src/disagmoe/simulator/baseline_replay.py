"""Replay the EP baselines' own instruction lists (`schedule.baselines.build_baseline_schedule`).

The analytic EP model (`simulator.ep`) prices one representative per pipeline
rank from `schedule.pipelines`; this module instead lowers the schedule IR the
`ep-*` runtimes are built from — every rank, every instruction — so that a
real CPU run can be replayed with its measured costs (`benchmarks/simulator_fidelity.py`).

Semantics (PyTorch's pipelining runtime, one compute stream per rank):

* a rank runs its list in order on one lane; FWD / BWD / W cost `cost(instr)`;
* SEND posts the message (lane time `overheads.post_s`), which arrives
  `latency_s` later; RECV blocks the lane until the message has arrived and the
  receiver has taken it (`overheads.receive_s(bytes)`, FIFO per sender);
* A2A blocks until every member of its EP group has reached the same
  `(phase, layer, slot)` all-to-all, then costs `a2a_s(instr)` on all of them;
* SYNC / STEP cost `sync_s` / `step_s` after everything else of the rank.
"""

from __future__ import annotations

from collections.abc import Callable

from ..runtime.observe import message_event_name
from ..schedule.ir import Instr, Msg, Op, Schedule, compute_event_name
from .costs import MessageOverheads
from .engine import A2A, COMPUTE, DELAY, Program, run_program
from .report import SimResult, summarize


def lower_baseline_schedule(
    schedule: Schedule,
    cost: Callable[[Instr], float],
    *,
    message_bytes: Callable[[Msg], float],
    latency_s: float = 0.0,
    overheads: MessageOverheads | None = None,
    a2a_s: Callable[[Instr], float] | None = None,
    sync_s: float = 0.0,
    step_s: float = 0.0,
) -> Program:
    """Program of one optimizer step of a baseline schedule (see the module doc)."""
    over = overheads or MessageOverheads()
    prog = Program(num_ranks=schedule.num_ranks, latency_s=latency_s)
    prog.multiplicity = [1] * schedule.num_ranks
    sent: dict[Msg, int] = {}
    ready: dict[Msg, int] = {}
    recv_last: dict[tuple[int, int], int] = {}
    barriers: dict[tuple[str, int, int, tuple[int, ...]], int] = {}
    waits: list[tuple[int, Msg]] = []  # (op that needs the message, message)
    for rank, instrs in enumerate(schedule.ranks):
        last = -1
        mine: list[int] = []
        for ins in instrs:
            args = {"layer": ins.layer, "slot": ins.slot, "step": 0}
            if ins.op in (Op.FWD, Op.BWD, Op.WGT):
                cat = "attn" if ins.comp == "A" else "ffn"
                label = compute_event_name(ins.op.value, ins.comp, ins.layer, ins.slot)
                last = prog.add(COMPUTE, rank, "compute", cost(ins), cat, label, [last], args)
            elif ins.op == Op.SEND:
                assert ins.msg is not None
                msg = ins.msg
                last = prog.add(
                    DELAY, rank, "compute", over.post_s, "comm", f"post {msg}", [last], args
                )
                name = message_event_name("send", str(msg))
                sent[msg] = prog.add(DELAY, rank, "send", latency_s, "comm", name, [last], args)
            elif ins.op == Op.RECV:
                assert ins.msg is not None
                last = prog.add(DELAY, rank, "compute", 0.0, "comm", f"wait {ins.msg}", [last])
                waits.append((last, ins.msg))
            elif ins.op == Op.A2A:
                if a2a_s is None:
                    raise ValueError("the schedule has all-to-alls: pass a2a_s")
                key = (ins.comp, ins.layer, ins.slot, ins.group)
                if key not in barriers:
                    barriers[key] = prog.add(DELAY, rank, "compute", 0.0, "comm", f"meet {key}", [])
                prog.deps[barriers[key]].append(last)
                last = prog.add(
                    A2A,
                    rank,
                    "compute",
                    a2a_s(ins),
                    "comm",
                    f"a2a {ins.comp} l{ins.layer}",
                    [barriers[key]],
                    args,
                )
            else:
                continue
            mine.append(last)
        sync = prog.add(DELAY, rank, "sync", sync_s, "comm", "SYNC grads", [*mine, last])
        prog.add(DELAY, rank, "sync", step_s, "other", "STEP", [sync])
    for msg, xfer in sent.items():
        stream = (msg.src, msg.dst)
        take = prog.add(
            DELAY,
            msg.dst,
            "recv",
            over.receive_s(message_bytes(msg)),
            "comm",
            f"take {msg}",
            [xfer, recv_last.get(stream, -1)],
            {"slot": msg.slot, "step": 0},
        )
        recv_last[stream] = take
        ready[msg] = take
    for op, msg in waits:
        if msg not in ready:
            raise ValueError(f"RECV of {msg} has no matching SEND")
        prog.deps[op].append(ready[msg])
    return prog


def simulate_baseline_schedule(
    schedule: Schedule,
    cost: Callable[[Instr], float],
    *,
    message_bytes: Callable[[Msg], float],
    tokens_per_step: int,
    latency_s: float = 0.0,
    overheads: MessageOverheads | None = None,
    a2a_s: Callable[[Instr], float] | None = None,
    sync_s: float = 0.0,
    step_s: float = 0.0,
    cores: int = 0,
) -> SimResult:
    """Simulate one step of an `ep-*` instruction list; `cores` as in `engine.run_program`."""
    prog = lower_baseline_schedule(
        schedule,
        cost,
        message_bytes=message_bytes,
        latency_s=latency_s,
        overheads=overheads,
        a2a_s=a2a_s,
        sync_s=sync_s,
        step_s=step_s,
    )
    timeline = run_program(prog, share_compute=False, cores=cores)
    return summarize(
        schedule.name,
        prog,
        timeline,
        tokens_per_step=tokens_per_step,
        roles=[str(r) for r in schedule.roles],
        real_ranks=list(range(schedule.num_ranks)),
        config={"schedule": schedule.name, **schedule.meta},
    )
