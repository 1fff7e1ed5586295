"""Schedule validator: matching messages, FIFO channels, F before B, in-flight cap, no deadlock.

`validate(schedule)` raises `ScheduleError` naming the first violation. The
deadlock check executes the lists under the executor's semantics with
*blocking* sends: every rank runs a "fwd" and a "bwd" compute lane (each
compute followed by the SENDs it produces) and one receive lane per
(sender, channel); a SEND completes only when the receiver's lane reaches the
matching RECV, and a compute starts only when all its input messages arrived,
its own forward ran (for a backward) and the in-flight cap allows it.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable

from .afpipe import message_consumer, message_producer
from .ir import Instr, Msg, Op, Schedule

TaskKey = tuple[str, str, int, int]  # (op, comp, layer, slot)


class ScheduleError(ValueError):
    pass


def _key(op: Op, comp: str, layer: int, slot: int) -> TaskKey:
    return (op.value, comp, layer, slot)


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
    for rank, instrs in enumerate(schedule.ranks):
        seen: set[tuple[str, int, int]] = set()
        for i in instrs:
            if i.op == Op.FWD:
                if (i.comp, i.layer, i.slot) in seen:
                    raise ScheduleError(f"rank {rank}: {i} appears twice")
                seen.add((i.comp, i.layer, i.slot))
            elif i.op == Op.BWD and (i.comp, i.layer, i.slot) not in seen:
                raise ScheduleError(f"rank {rank}: {i} comes before its forward")
        backward = {(i.comp, i.layer, i.slot) for i in instrs if i.op == Op.BWD}
        if backward != seen:
            raise ScheduleError(
                f"rank {rank}: forwards and backwards differ: {sorted(seen ^ backward)[:3]}"
            )


def simulate(
    schedule: Schedule,
    producer: Callable[[Msg], tuple[Op, str, int]] = message_producer,
    consumer: Callable[[Msg], tuple[Op, str, int]] = message_consumer,
) -> int:
    """Run the lists under blocking-send semantics; return the peak in-flight slots of any rank."""
    cap = schedule.max_in_flight
    lanes: dict[tuple[int, str], deque[Instr]] = {}
    needs: dict[tuple[int, TaskKey], set[Msg]] = defaultdict(set)
    sends_of: dict[tuple[int, TaskKey], list[Msg]] = defaultdict(list)
    for rank, instrs in enumerate(schedule.ranks):
        for lane in ("fwd", "bwd"):
            lanes[(rank, lane)] = deque(i for i in instrs if i.is_compute and i.lane == lane)
        for i in instrs:
            if i.op == Op.RECV and i.msg is not None:
                lanes.setdefault((rank, f"recv{i.msg.src}{i.msg.channel}"), deque()).append(i)
                needs[(rank, _key(*consumer(i.msg), i.msg.slot))].add(i.msg)
            elif i.op == Op.SEND and i.msg is not None:
                sends_of[(rank, _key(*producer(i.msg), i.msg.slot))].append(i.msg)
    delivered: set[Msg] = set()
    posted: set[Msg] = set()  # RECVs at the head of their lane, ready to match a SEND
    done: set[tuple[int, TaskKey]] = set()
    pending_sends: dict[tuple[int, str], deque[Msg]] = defaultdict(deque)
    in_flight: dict[int, set[int]] = defaultdict(set)
    first_layer: dict[int, int] = {}
    for rank, instrs in enumerate(schedule.ranks):
        layers = [i.layer for i in instrs if i.is_compute]
        if layers:
            first_layer[rank] = min(layers)
    peak = 0
    progress = True
    while progress:
        progress = False
        for (rank, lane), queue in lanes.items():
            if lane.startswith("recv"):
                if queue and queue[0].msg is not None:
                    posted.add(queue[0].msg)
                continue
            if pending_sends[(rank, lane)]:
                msg = pending_sends[(rank, lane)][0]
                if msg not in posted:
                    continue
                posted.discard(msg)
                delivered.add(msg)
                pending_sends[(rank, lane)].popleft()
                lanes_key = (msg.dst, f"recv{msg.src}{msg.channel}")
                lanes[lanes_key].popleft()
                progress = True
                continue
            if not queue:
                continue
            instr = queue[0]
            key = instr.task
            if not needs[(rank, key)] <= delivered:
                continue
            if (
                instr.op == Op.BWD
                and (rank, ("F", instr.comp, instr.layer, instr.slot)) not in done
            ):
                continue
            starts_slot = instr.op == Op.FWD and instr.layer == first_layer.get(rank)
            if starts_slot and len(in_flight[rank]) >= cap:
                continue
            if starts_slot:
                in_flight[rank].add(instr.slot)
                peak = max(peak, len(in_flight[rank]))
            if instr.op == Op.BWD and instr.layer == first_layer.get(rank):
                in_flight[rank].discard(instr.slot)
            queue.popleft()
            done.add((rank, key))
            pending_sends[(rank, lane)].extend(sends_of[(rank, key)])
            progress = True
    stuck = [
        f"rank {rank} {lane}: {queue[0]}" for (rank, lane), queue in lanes.items() if queue
    ] + [f"rank {r} {lane}: blocked sending {q[0]}" for (r, lane), q in pending_sends.items() if q]
    if stuck:
        raise ScheduleError("deadlock: " + "; ".join(stuck[:4]))
    return peak


def validate(schedule: Schedule) -> int:
    """Run every check; return the peak number of in-flight slots on any rank."""
    check_messages(schedule)
    check_fifo(schedule)
    check_forward_before_backward(schedule)
    return simulate(schedule)
