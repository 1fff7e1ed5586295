"""Schedule validator: matching messages, FIFO channels, F before B, in-flight cap, no deadlock
(training and forward-only schedules).

`validate(schedule)` raises `ScheduleError` naming the first violation. The
deadlock check executes the lists under the rules of `schedule.semantics` (the
ones the executor and the simulator use) with *blocking* sends: every rank runs
a "fwd" and a "bwd" compute lane (each compute followed by the SENDs it
produces) and one receive lane per (sender, channel); a SEND completes only when
the receiver's lane reaches the matching RECV, and a compute starts only when
`RankProgram.ready` says so.
"""

from __future__ import annotations

from collections import defaultdict, deque

from .ir import EXCHANGE_KINDS, Instr, Msg, Op, Schedule, compute_event_name
from .semantics import TaskKey, compile_ranks


class ScheduleError(ValueError):
    pass


def check_messages(schedule: Schedule) -> None:
    sends: dict[Msg, int] = {}
    recvs: dict[Msg, int] = {}
    for rank, instrs in enumerate(schedule.ranks):
        for i in instrs:
            if i.msg is None:
                continue
            table, owner = (sends, i.msg.src) if i.op == Op.SEND else (recvs, i.msg.dst)
            if owner != rank:
                raise ScheduleError(f"rank {rank} has {i} that belongs to rank {owner}")
            if i.msg in table:
                raise ScheduleError(f"{i} appears twice")
            table[i.msg] = rank
    for msg in sends.keys() - recvs.keys():
        raise ScheduleError(f"SEND {msg} has no matching RECV")
    for msg in recvs.keys() - sends.keys():
        raise ScheduleError(f"RECV {msg} has no matching SEND")


def check_chunks(schedule: Schedule) -> None:
    """Exchange chunks (`schedule.ir`): with c = `meta["exchange_chunks"]` > 1 every F
    compute and exchange message has each chunk 0..c-1 exactly once per (layer, slot) and
    peer, attention computes and act/grad_act none; unchunked schedules have none at all."""
    c = int(schedule.meta.get("exchange_chunks", 1))
    groups: dict[tuple[object, ...], set[int]] = defaultdict(set)
    for rank, instrs in enumerate(schedule.ranks):
        for i in instrs:
            if i.msg is not None:
                m = i.msg
                chunked = m.kind in EXCHANGE_KINDS
                key: tuple[object, ...] = (i.op, m.kind, m.layer, m.slot, m.src, m.dst)
                chunk = m.chunk
            elif i.is_compute:
                chunked = i.comp == "F"
                key, chunk = (rank, i.op, i.comp, i.layer, i.slot), i.chunk
            else:
                continue
            if not (chunked and c > 1):
                if chunk != -1:
                    raise ScheduleError(
                        f"rank {rank}: {i} has an exchange chunk, which {c} chunk(s) forbid"
                    )
                continue
            if not 0 <= chunk < c:
                raise ScheduleError(f"rank {rank}: {i} needs an exchange chunk 0..{c - 1}")
            groups[key].add(chunk)
    for key, seen in groups.items():
        if len(seen) != c:
            missing = sorted(set(range(c)) - seen)
            raise ScheduleError(f"{key}: exchange chunks {missing} of {c} are missing")


def fifo_streams(schedule: Schedule, op: Op) -> dict[tuple[int, int, str], list[Msg]]:
    streams: dict[tuple[int, int, str], list[Msg]] = defaultdict(list)
    for instrs in schedule.ranks:
        for i in instrs:
            if i.op == op and i.msg is not None:
                streams[(i.msg.src, i.msg.dst, i.msg.channel)].append(i.msg)
    return streams


def check_fifo(schedule: Schedule) -> None:
    sent, received = fifo_streams(schedule, Op.SEND), fifo_streams(schedule, Op.RECV)
    for stream, msgs in sent.items():
        if received.get(stream) != msgs:
            raise ScheduleError(
                f"channel {stream[0]}->{stream[1]} ({stream[2]}): sends and receives are in "
                "different orders"
            )


def check_forward_before_backward(schedule: Schedule) -> None:
    """Every BWD after its FWD, every FWD with its BWD, every W after its BWD; or (forward-only schedules, see
    `schedule.semantics`) no BWD, SYNC or STEP on any rank."""
    forward_only = not any(i.op == Op.BWD for instrs in schedule.ranks for i in instrs)
    for rank, instrs in enumerate(schedule.ranks):
        if forward_only:
            extra = next((i for i in instrs if i.op in (Op.SYNC, Op.STEP)), None)
            if extra is not None:
                raise ScheduleError(f"rank {rank}: forward-only schedule has {extra}")
        seen: set[tuple[str, int, int, int]] = set()
        backs: set[tuple[str, int, int, int]] = set()
        weights: set[tuple[str, int, int, int]] = set()  # W: after its BWD, once
        for i in instrs:
            if i.op == Op.FWD:
                if (i.comp, i.layer, i.slot, i.chunk) in seen:
                    raise ScheduleError(f"rank {rank}: {i} appears twice")
                seen.add((i.comp, i.layer, i.slot, i.chunk))
            elif i.op == Op.BWD and (i.comp, i.layer, i.slot, i.chunk) not in seen:
                raise ScheduleError(f"rank {rank}: {i} comes before its forward")
            elif i.op == Op.WGT:
                if (i.comp, i.layer, i.slot, i.chunk) in weights:
                    raise ScheduleError(f"rank {rank}: {i} appears twice")
                weights.add((i.comp, i.layer, i.slot, i.chunk))
                if (i.comp, i.layer, i.slot, i.chunk) not in backs:
                    raise ScheduleError(f"rank {rank}: {i} comes before its backward")
            if i.op == Op.BWD:
                backs.add((i.comp, i.layer, i.slot, i.chunk))
        backward = {(i.comp, i.layer, i.slot, i.chunk) for i in instrs if i.op == Op.BWD}
        if not forward_only and backward != seen:
            raise ScheduleError(
                f"rank {rank}: forwards and backwards differ: {sorted(seen ^ backward)[:3]}"
            )


def simulate(schedule: Schedule) -> int:
    """Run the lists under `schedule.semantics` with blocking sends; return the peak in-flight
    slots of any rank: the most (layer, slot, chunk) forwards it held at once (run, not yet
    released), in slots' worth (divided by one slot's forwards on the rank, rounded up).
    Raises `ScheduleError` naming the stuck instructions on a deadlock."""
    programs = compile_ranks(schedule)
    lanes: dict[tuple[int, str], deque[Instr]] = {}
    recv_lanes: dict[tuple[int, int, str], deque[Msg]] = {}
    for prog in programs:
        for lane, items in prog.lanes.items():
            lanes[(prog.rank, lane)] = deque(ins for _, ins in items)
        for (src, channel), msgs in prog.streams.items():
            recv_lanes[(src, prog.rank, channel)] = deque(msgs)
    delivered: set[Msg] = set()
    done: dict[int, set[TaskKey]] = defaultdict(set)
    pending_sends: dict[tuple[int, str], deque[Msg]] = defaultdict(deque)
    held: dict[int, set[tuple[int, int, int]]] = defaultdict(set)  # (layer, slot, chunk)
    per_slot = {  # one slot's forwards on the rank (slot 0: every rank has it)
        prog.rank: sum(1 for _, ins in prog.lanes["fwd"] if ins.slot == 0) for prog in programs
    }
    peak = 0
    progress = True
    while progress:
        progress = False
        for (rank, lane), queue in lanes.items():
            prog = programs[rank]
            sends = pending_sends[(rank, lane)]
            if sends:  # a blocking send completes when the receiver's lane reaches its RECV
                msg = sends[0]
                stream = recv_lanes[(msg.src, msg.dst, msg.channel)]
                if stream[0] != msg:
                    continue
                stream.popleft()
                sends.popleft()
                delivered.add(msg)
                progress = True
                continue
            if not queue:
                continue
            instr = queue[0]
            if not prog.ready(instr, done[rank], delivered.__contains__):
                continue
            if not prog.forward_only:
                units = held[rank]
                if instr.op == Op.FWD:
                    units.add((instr.layer, instr.slot, instr.chunk))
                    peak = max(peak, -(-len(units) // per_slot[rank]))
                elif prog.releases(instr):
                    units.discard((instr.layer, instr.slot, instr.chunk))
            queue.popleft()
            done[rank].add(instr.task)
            sends.extend(prog.outputs.get(instr.task, ()))
            progress = True
    stuck = []
    for (rank, lane), queue in lanes.items():
        if pending_sends[(rank, lane)]:
            stuck.append(f"rank {rank} {lane}: blocked sending {pending_sends[(rank, lane)][0]}")
        elif queue:
            msgs, tasks = programs[rank].waiting_for(queue[0], done[rank], delivered.__contains__)
            waits = [str(m) for m in msgs] + [compute_event_name(*t) for t in tasks]
            stuck.append(f"rank {rank} {lane}: {queue[0]} waits for {', '.join(waits)}")
    if stuck:
        raise ScheduleError("deadlock: " + "; ".join(stuck[:4]))
    return peak


def validate(schedule: Schedule) -> int:
    """Run every check; return the peak number of in-flight slots on any rank."""
    check_messages(schedule)
    check_chunks(schedule)
    check_fifo(schedule)
    check_forward_before_backward(schedule)
    return simulate(schedule)
