"""Task graphs and list scheduling shared by schedule generators.

A generator describes one optimizer step as compute `Task`s with the messages
they consume/produce and local dependencies; `list_schedule` orders every
rank's lanes by a greedy event simulation with the graph's costs (each task's
seconds; per message the link ports it holds, `TaskGraph.ports`), and
`emit_schedule` turns that timeline into per-rank instruction lists (RECVs at
their arrival time, SENDs right after the producing compute), so that FIFO
order per (sender, receiver, channel) holds by construction.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass, field

from .ir import Instr, Msg, Op, Schedule


@dataclass(frozen=True, slots=True, order=True)
class Task:
    op: Op
    comp: str
    layer: int
    slot: int
    rank: int
    chunk: int = -1  # exchange chunk of an F compute (`schedule.ir`); -1: not chunked

    @property
    def lane(self) -> str:
        return Instr(self.op).lane


@dataclass
class TaskGraph:
    tasks: list[Task] = field(default_factory=list)
    inputs: dict[Task, list[Msg]] = field(default_factory=lambda: defaultdict(list))
    outputs: dict[Task, list[Msg]] = field(default_factory=lambda: defaultdict(list))
    local_deps: dict[Task, list[Task]] = field(default_factory=lambda: defaultdict(list))
    cost: dict[Task, float] = field(default_factory=dict)
    priority: dict[Task, tuple[int, ...]] = field(default_factory=dict)
    # Ports a message holds and for how long: ((port, seconds), ...); absent: none.
    ports: dict[Msg, tuple[tuple[str, float], ...]] = field(default_factory=dict)

    def add(self, task: Task, cost: float, priority: tuple[int, ...]) -> None:
        self.tasks.append(task)
        self.cost[task] = cost
        self.priority[task] = priority

    def message(self, producer: Task, consumer: Task, kind: str, layer: int) -> None:
        """`producer` sends a `kind` message to `consumer`, or a local dependency if same rank;
        an exchange message is of the chunk of its F end (`schedule.ir`)."""
        if producer.rank == consumer.rank:
            self.local_deps[consumer].append(producer)
            return
        chunk = producer.chunk if producer.comp == "F" else consumer.chunk
        msg = Msg(kind, layer, producer.slot, producer.rank, consumer.rank, chunk)
        self.outputs[producer].append(msg)
        self.inputs[consumer].append(msg)


@dataclass(frozen=True)
class Timeline:
    start: dict[Task, float]
    end: dict[Task, float]
    arrival: dict[Msg, float]


def list_schedule(graph: TaskGraph, latency: float, *, shared_compute: bool = False) -> Timeline:
    """Greedy non-delay list scheduling: each resource runs its best-priority ready task.

    A resource is a (rank, lane), or with `shared_compute` a rank's compute (its two lanes
    share it). A message leaves when its producer ends and every port it holds
    (`graph.ports`) is free, holds each for its seconds (ports are reserved in the order
    producers start) and arrives `latency` after the longest of them."""
    producer_of = {m: t for t, msgs in graph.outputs.items() for m in msgs}
    consumer_of = {m: t for t, msgs in graph.inputs.items() for m in msgs}
    local_consumers: dict[Task, list[Task]] = defaultdict(list)
    remaining: dict[Task, int] = {}
    for task in graph.tasks:
        deps = graph.local_deps.get(task, [])
        remaining[task] = len(graph.inputs.get(task, [])) + len(deps)
        for dep in deps:
            local_consumers[dep].append(task)
    assert all(m in producer_of for m in consumer_of), "a message without a producer"

    def resource(task: Task) -> tuple[int, str]:
        return (task.rank, "compute" if shared_compute else task.lane)

    ready_at: dict[Task, float] = defaultdict(float)
    lane_free: dict[tuple[int, str], float] = defaultdict(float)
    port_free: dict[str, float] = defaultdict(float)
    waiting: dict[tuple[int, str], list[tuple[float, tuple[int, ...], Task]]] = defaultdict(list)
    for task in graph.tasks:
        if remaining[task] == 0:
            waiting[resource(task)].append((0.0, graph.priority[task], task))
    start: dict[Task, float] = {}
    end: dict[Task, float] = {}
    arrival: dict[Msg, float] = {}
    # Event heap of resources to (re)consider: (time, resource).
    events: list[tuple[float, tuple[int, str]]] = [(0.0, lane) for lane in waiting]
    heapq.heapify(events)

    def release(nxt: Task, at: float) -> None:
        ready_at[nxt] = max(ready_at[nxt], at)
        remaining[nxt] -= 1
        if remaining[nxt] == 0:
            nlane = resource(nxt)
            waiting[nlane].append((ready_at[nxt], graph.priority[nxt], nxt))
            heapq.heappush(events, (max(ready_at[nxt], lane_free[nlane]), nlane))

    while events:
        now, lane = heapq.heappop(events)
        if lane_free[lane] > now or not waiting[lane]:
            continue
        ready = [item for item in waiting[lane] if item[0] <= now]
        if not ready:
            heapq.heappush(events, (min(item[0] for item in waiting[lane]), lane))
            continue
        best = min(ready, key=lambda item: item[1])
        waiting[lane].remove(best)
        task = best[2]
        start[task] = now
        finish = now + graph.cost[task]
        end[task] = finish
        lane_free[lane] = finish
        heapq.heappush(events, (finish, lane))
        for msg in graph.outputs.get(task, []):
            loads = graph.ports.get(msg, ())
            leave = max([finish] + [port_free[port] for port, _ in loads])
            for port, seconds in loads:
                port_free[port] = leave + seconds
            arrival[msg] = leave + max([0.0] + [seconds for _, seconds in loads]) + latency
            release(consumer_of[msg], arrival[msg])
        for nxt in local_consumers[task]:
            release(nxt, finish)
    missing = [t for t in graph.tasks if t not in end]
    assert not missing, f"task graph has a cycle or missing producer: {missing[:3]}"
    return Timeline(start, end, arrival)


def emit_schedule(
    graph: TaskGraph,
    timeline: Timeline,
    *,
    name: str,
    num_ranks: int,
    num_slots: int,
    max_in_flight: int,
    roles: tuple[str, ...],
    meta: dict[str, int | str],
    sync: bool = True,
) -> Schedule:
    """Per-rank lists ordered by simulated time; at equal times RECVs, then SENDs, then
    computes, RECVs of equal time by exchange chunk (every sender's chunk 0 first: the order
    a shard consumes them in, and the one `afpipe.build_afpipe_rank` expands to)."""
    events: list[list[tuple[float, int, int, int, Instr]]] = [[] for _ in range(num_ranks)]
    seq = 0
    for task in graph.tasks:
        t0, t1 = timeline.start[task], timeline.end[task]
        events[task.rank].append(
            (t0, 2, 0, seq, Instr(task.op, task.comp, task.layer, task.slot, chunk=task.chunk))
        )
        seq += 1
        for msg in graph.outputs.get(task, []):
            events[task.rank].append((t1, 1, 0, seq, Instr(Op.SEND, msg=msg)))
            seq += 1
            events[msg.dst].append(
                (timeline.arrival[msg], 0, msg.chunk, seq, Instr(Op.RECV, msg=msg))
            )
            seq += 1
    ranks = []
    for rank_events in events:
        rank_events.sort(key=lambda e: e[:4])
        instrs = [e[4] for e in rank_events]
        if sync:
            instrs += [Instr(Op.SYNC), Instr(Op.STEP)]
        ranks.append(tuple(instrs))
    return Schedule(
        name=name,
        num_ranks=num_ranks,
        num_slots=num_slots,
        max_in_flight=max_in_flight,
        roles=roles,
        ranks=tuple(ranks),
        meta=meta,
    )
