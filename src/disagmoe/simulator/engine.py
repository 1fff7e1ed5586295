"""Discrete-event core: a DAG of operations on per-rank resources.

A `Program` is what every front end (AF-Pipe replay, EP baselines) lowers to:

* `COMPUTE` — `work` seconds of GPU time at full rate. The compute ops of one
  rank share its GPU by processor sharing (two lanes active at once each run at
  half rate), unless `share_compute=False` (measured tables already contain the
  contention of their own run). With `cores=C` (a CPU host calibrated from a
  real run) the compute ops of *all* ranks share one pool of C processors
  instead: each runs at `min(1, C / active)`. A *background* compute
  (`Program.background`: a W on the "wgt" lane, `schedule.semantics`) gets its
  GPU (pool) only while no other compute is active there: the others share it as if
  it were idle, and it resumes where it stopped (a low-priority stream).
* `A2A` — a collective of `work` seconds when alone; the A2As of one rank share
  its network by processor sharing (two lanes exchanging at once each get half).
* `XFER` — a point-to-point message. It loads ports (NIC or NVLink, out and in,
  full duplex: out and in are separate ports) with bytes; the messages in flight
  share each port max-min fairly (`link_model="fair"`, `simulator.links`), or a port
  serves one message at a time in readiness order (`"fifo"`, for comparison).
  Alone, a message takes `max(bytes / bandwidth)` over its ports. Arrival =
  transfer end + latency.
* `DELAY` — a fixed wait (gradient all-reduce, latency-only steps).

Lanes (in-order streams) and FIFO message streams are expressed as ordinary
dependencies by the front ends. `run_program` returns start/end times; an op
that never becomes ready (a dependency cycle) raises `DeadlockError`.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Any

from .links import LINK_MODELS, FairLinks, FifoLinks, LinkModel, Links

COMPUTE, A2A, XFER, DELAY = 0, 1, 2, 3


class DeadlockError(RuntimeError):
    """Some operations can never start (cyclic dependencies)."""


@dataclass(slots=True)
class Port:
    """One direction of a link end: a NIC's egress or ingress, or a GPU's NVLink out/in."""

    name: str
    bytes_per_s: float


@dataclass
class Program:
    """Operations of one simulated optimizer step (parallel arrays, indexed by op id)."""

    num_ranks: int
    kind: list[int] = field(default_factory=list)
    rank: list[int] = field(default_factory=list)
    lane: list[str] = field(default_factory=list)  # trace lane (observe.LANES) or "" for XFER
    work: list[float] = field(default_factory=list)
    category: list[str] = field(default_factory=list)  # attn | ffn | other | comm
    label: list[str] = field(default_factory=list)
    args: list[dict[str, Any]] = field(default_factory=list)
    deps: list[list[int]] = field(default_factory=list)
    # XFER: ranks that count the transfer as their communication time, and port loads.
    xfer_ranks: dict[int, tuple[int, ...]] = field(default_factory=dict)
    xfer_ports: dict[int, list[tuple[int, float]]] = field(default_factory=dict)  # (port, bytes)
    xfer_unit: dict[int, float] = field(default_factory=dict)  # bytes of one real message
    ports: list[Port] = field(default_factory=list)
    latency_s: float = 0.0
    # Fan-out: how many real workers each simulated rank stands for (symmetry reduction).
    multiplicity: list[int] = field(default_factory=list)
    background: set[int] = field(default_factory=set)  # COMPUTE ops that yield (module doc)

    def add(
        self,
        kind: int,
        rank: int,
        lane: str,
        work: float,
        category: str,
        label: str,
        deps: list[int],
        args: dict[str, Any] | None = None,
    ) -> int:
        assert work >= 0.0, f"negative cost for {label}"
        self.kind.append(kind)
        self.rank.append(rank)
        self.lane.append(lane)
        self.work.append(work)
        self.category.append(category)
        self.label.append(label)
        self.args.append(args or {})
        self.deps.append([d for d in deps if d >= 0])
        return len(self.kind) - 1

    def add_port(self, name: str, bytes_per_s: float) -> int:
        assert bytes_per_s > 0
        self.ports.append(Port(name, bytes_per_s))
        return len(self.ports) - 1

    def add_xfer(
        self,
        src: int,
        dst: int,
        loads: list[tuple[int, float]],
        label: str,
        deps: list[int],
        args: dict[str, Any] | None = None,
        unit: float = 0.0,
    ) -> int:
        """A message of `loads` (port, bytes). `unit`: bytes of one real message when it
        stands for a bundle (`simulator.links`; 0: one message, its largest load)."""
        op = self.add(XFER, src, "", 0.0, "comm", label, deps, args)
        self.xfer_ranks[op] = (src, dst) if src != dst else (src,)
        self.xfer_ports[op] = [(p, b) for p, b in loads if b > 0]
        self.xfer_unit[op] = unit or max((b for _, b in loads), default=0.0)
        return op

    def __len__(self) -> int:
        return len(self.kind)


@dataclass
class Timeline:
    start: list[float]
    end: list[float]
    xfer_begin: dict[int, float]  # when a message's bytes start moving (fifo: after queueing)

    @property
    def makespan(self) -> float:
        return max(self.end, default=0.0)


class _Sharing:
    """Processor sharing of `capacity` processors among the ops active on it (each <= 1).

    Ops in `background` run only while no other op is active (then they share it among
    themselves); a paused one keeps its remaining work."""

    __slots__ = ("active", "background", "capacity", "last", "waiting")

    def __init__(self, capacity: float = 1.0, background: frozenset[int] = frozenset()) -> None:
        self.active: dict[int, float] = {}  # op -> remaining work
        self.background = background
        self.waiting = 0  # active ops in `background`
        self.capacity = capacity
        self.last = 0.0

    def _running(self) -> tuple[int, bool]:
        """(how many ops share the processors now, whether those are the background ones)."""
        front = len(self.active) - self.waiting
        return (front, False) if front else (self.waiting, True)

    def _rate(self, sharing: int) -> float:
        return min(1.0, self.capacity / sharing) if sharing else 1.0

    def _advance(self, now: float) -> None:
        if self.active:
            sharing, back = self._running()
            done = (now - self.last) * self._rate(sharing)
            for op in self.active:
                if (op in self.background) == back:
                    self.active[op] -= done
        self.last = now

    def change(self, now: float, add: int = -1, work: float = 0.0, remove: int = -1) -> None:
        self._advance(now)
        if remove >= 0:
            del self.active[remove]
            self.waiting -= remove in self.background
        if add >= 0:
            self.active[add] = work
            self.waiting += add in self.background

    def finishes(self, now: float) -> list[tuple[float, int]]:
        """When each active op ends at the current rates (a paused one: never, until the
        next change reschedules it)."""
        sharing, back = self._running()
        rate = self._rate(sharing)
        return [
            (now + max(rem, 0.0) / rate if (op in self.background) == back else math.inf, op)
            for op, rem in self.active.items()
        ]


def run_program(
    program: Program, *, share_compute: bool = True, cores: int = 0, link_model: LinkModel = "fair"
) -> Timeline:
    """Simulate `program`; every op starts as soon as its dependencies have finished.

    `cores > 0`: the compute ops of all ranks share one pool of `cores` processors
    (overrides `share_compute`). `link_model`: how messages share ports (`simulator.links`).

    Long because it is the simulator's hot event loop: its state (heap, versions, resources,
    links) stays in locals that its closures share rather than behind attribute lookups.
    """
    n = len(program)
    remaining = [len(d) for d in program.deps]
    dependents: list[list[int]] = [[] for _ in range(n)]
    for op, deps in enumerate(program.deps):
        for d in deps:
            dependents[d].append(op)
    start = [0.0] * n
    end = [-1.0] * n
    xfer_begin: dict[int, float] = {}
    version = [0] * n
    heap: list[tuple[float, int, int, int]] = []  # (time, seq, op, version)
    seq = 0
    background = frozenset(program.background)
    if cores > 0:
        pool = _Sharing(float(cores), background)
        gpus = [pool] * program.num_ranks
        share_compute = True
    else:
        gpus = [_Sharing(background=background) for _ in range(program.num_ranks)]
    nets = [_Sharing() for _ in range(program.num_ranks)]
    if link_model not in LINK_MODELS:
        raise ValueError(f"link model {link_model!r}: use one of {', '.join(LINK_MODELS)}")
    capacities = [p.bytes_per_s for p in program.ports]
    links: Links = FairLinks(capacities) if link_model == "fair" else FifoLinks(capacities)
    moving: set[int] = set()  # messages whose bytes move now (links that release)
    unsettled = False  # the links changed at `now` and have not been settled yet
    now = 0.0
    kinds, work, ranks = program.kind, program.work, program.rank

    def push(events: list[tuple[float, int]]) -> None:
        nonlocal seq
        for t, op in events:
            version[op] += 1  # (a paused op, t = inf: its earlier finish no longer holds)
            if t < math.inf:
                seq += 1
                heapq.heappush(heap, (t, seq, op, version[op]))

    def reschedule(res: _Sharing, now: float) -> None:
        push(res.finishes(now))

    def begin(op: int, now: float) -> None:
        nonlocal seq, unsettled
        start[op] = now
        kind = kinds[op]
        if kind == XFER:
            loads = program.xfer_ports[op]
            xfer_begin[op] = now
            if not loads:
                finish = now
            elif links.releases:
                moving.add(op)
                links.start(op, now, loads, program.xfer_unit[op])
                unsettled = True
                return
            else:
                links.start(op, now, loads, program.xfer_unit[op])
                [(done, _)] = links.settle(now)
                xfer_begin[op] = links.begin(op)
                finish = done + program.latency_s
        elif (kind == COMPUTE and share_compute) or kind == A2A:
            res = (gpus if kind == COMPUTE else nets)[ranks[op]]
            res.change(now, add=op, work=work[op])
            reschedule(res, now)
            return
        else:
            finish = now + work[op]
        seq += 1
        heapq.heappush(heap, (finish, seq, op, version[op]))

    for op in range(n):
        if remaining[op] == 0:
            begin(op, 0.0)
    while heap or unsettled:
        if unsettled and (not heap or heap[0][0] > now):  # every change of `now` is in
            push(links.settle(now))
            unsettled = False
            continue
        now, _, op, ver = heapq.heappop(heap)
        if ver != version[op] or end[op] >= 0.0:
            continue
        if op in moving:  # its last byte left: the others speed up, it arrives later
            moving.discard(op)
            links.finish(op, now)
            unsettled = True
            push([(now + program.latency_s, op)])
            continue
        end[op] = now
        kind = kinds[op]
        if kind == A2A or (kind == COMPUTE and share_compute):
            res = (gpus if kind == COMPUTE else nets)[ranks[op]]
            res.change(now, remove=op)
            reschedule(res, now)
        for nxt in dependents[op]:
            remaining[nxt] -= 1
            if remaining[nxt] == 0:
                begin(nxt, now)
    stuck = [op for op in range(n) if end[op] < 0.0]
    if stuck:
        names = ", ".join(f"rank {ranks[op]} {program.label[op]}" for op in stuck[:4])
        raise DeadlockError(f"deadlock: {len(stuck)} operations never start, e.g. {names}")
    return Timeline(start, end, xfer_begin)
