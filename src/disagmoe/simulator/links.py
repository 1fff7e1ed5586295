"""How concurrent point-to-point messages share the ports of the links they cross.

A message (`XFER`) loads one or more ports (`Program.xfer_ports`: a NIC's egress or
ingress, a GPU's NVLink out or in) with a byte count each. Two models of a port:

* `"fair"` (default, `FairLinks`): flow-level max-min fair sharing. Every message in
  flight moves at once; whenever a message starts or finishes, the rates of the messages
  connected to it through shared ports are recomputed by progressive filling: all of them
  speed up together until some port is full, the messages through that port are frozen at
  its fair share, and the rest keep filling. That is what the runtime's transports do:
  the executor posts every send of a compute at once (`isend`), gloo keeps one TCP
  connection per pair of ranks and process group, and the kernel shares a link among all
  active connections (about equally under a common bottleneck); NCCL spreads its
  channels over many queue pairs. A message alone still takes `max(bytes / bandwidth)`
  over its ports. Only the ports connected to the instant's changes (through messages in
  flight) are refilled.
* `"fifo"` (`FifoLinks`, kept for A/B comparisons): a port serves one message at a time,
  in the order messages become ready; a message starts when all its ports are free.
  With many senders and many receivers (M2N / N2M) this idles a sender's port while its
  message waits for a busy receiver (head-of-line blocking), which no real transport does.

**Real messages and bundles.** A symmetry-reduced replay (`simulator.symmetry`) lets one
`XFER` stand for a bundle of real messages (a replica's dispatch to n shards loads its
egress with n messages' bytes). Fairness is between *real* messages: an `XFER` of
`unit` bytes per real message counts as `bytes / unit` flows on a port that carries
`bytes` of it, and all its flows progress at one rate. With that, a bundle alone finishes
when its real messages, moving side by side, would (`max(bytes / bandwidth)`), and
bundles sharing a port split it as their real messages would.

Rates are in *fractions of the message per second*: a message with fraction rate `r`
moves `r * bytes_p` bytes/s on each port p it loads, and the water level is the byte
rate of each of its real flows, `r * unit`.
"""

from __future__ import annotations

import heapq
from typing import Literal, Protocol

LinkModel = Literal["fair", "fifo"]
LINK_MODELS: tuple[LinkModel, ...] = ("fair", "fifo")


class Links(Protocol):
    """A link model: when do the messages in flight finish moving their bytes?

    The engine reports every message that becomes ready (`start`) and, when `releases`,
    every one that moved its last byte (`finish`), then asks `settle` once per instant for
    the finish times that changed (messages not named keep theirs). Rates depend only on
    which messages are in flight, so settling the changes of one instant together is exact.
    """

    releases: bool  # whether a message's end changes the others' finish times

    def start(self, op: int, now: float, loads: list[tuple[int, float]], unit: float) -> None:
        """Message `op` (`loads`: (port, bytes); `unit`: bytes of one real message) is ready."""
        ...

    def finish(self, op: int, now: float) -> None:
        """Message `op` moved its last byte at `now`."""
        ...

    def settle(self, now: float) -> list[tuple[float, int]]:
        """(finish time, message) of every message whose finish time is new."""
        ...

    def begin(self, op: int) -> float:
        """When message `op`'s bytes started moving."""
        ...


class FifoLinks:
    """One message at a time per port, in readiness order (see the module doc)."""

    releases = False

    def __init__(self, bytes_per_s: list[float]) -> None:
        self.bytes_per_s = bytes_per_s
        self.free = [0.0] * len(bytes_per_s)
        self.began: dict[int, float] = {}
        self.pending: list[tuple[float, int]] = []

    def start(self, op: int, now: float, loads: list[tuple[int, float]], unit: float) -> None:
        t0 = max([now] + [self.free[p] for p, _ in loads])
        longest = 0.0
        for p, nbytes in loads:
            dur = nbytes / self.bytes_per_s[p]
            self.free[p] = t0 + dur
            longest = max(longest, dur)
        self.began[op] = t0
        self.pending.append((t0 + longest, op))

    def finish(self, op: int, now: float) -> None:
        pass

    def settle(self, now: float) -> list[tuple[float, int]]:
        done, self.pending = self.pending, []
        return done

    def begin(self, op: int) -> float:
        return self.began[op]


class FairLinks:
    """Max-min fair sharing of every port among the real flows crossing it (module doc)."""

    releases = True

    def __init__(self, bytes_per_s: list[float]) -> None:
        self.capacity = bytes_per_s
        self.on_port: list[dict[int, float]] = [{} for _ in bytes_per_s]  # port -> {op: flows}
        self.flows: dict[int, list[tuple[int, float]]] = {}  # op -> [(port, flows on it)]
        self.unit: dict[int, float] = {}  # op -> bytes of one real flow
        self.left: dict[int, float] = {}  # op -> fraction left at `since`
        self.since: dict[int, float] = {}
        self.rate: dict[int, float] = {}  # op -> fraction per second
        self.began: dict[int, float] = {}
        self.touched: set[int] = set()  # ports whose messages changed since the last settle

    def start(self, op: int, now: float, loads: list[tuple[int, float]], unit: float) -> None:
        assert loads and unit > 0.0, "a message without bytes does not use the links"
        flows = [(p, nbytes / unit) for p, nbytes in loads]
        self.flows[op], self.unit[op] = flows, unit
        self.left[op], self.since[op], self.rate[op] = 1.0, now, 0.0
        self.began[op] = now
        for p, count in flows:
            self.on_port[p][op] = count
            self.touched.add(p)

    def finish(self, op: int, now: float) -> None:
        for p, _ in self.flows.pop(op):
            del self.on_port[p][op]
            self.touched.add(p)
        for table in (self.unit, self.left, self.since, self.rate):
            del table[op]

    def begin(self, op: int) -> float:
        return self.began[op]

    def _component(self, seeds: set[int]) -> tuple[set[int], set[int]]:
        """Ports and messages connected to `seeds` through messages in flight."""
        ports, ops = set(seeds), set()
        todo = list(seeds)
        while todo:
            for op in self.on_port[todo.pop()]:
                if op not in ops:
                    ops.add(op)
                    for q, _ in self.flows[op]:
                        if q not in ports:
                            ports.add(q)
                            todo.append(q)
        return ports, ops

    def settle(self, now: float) -> list[tuple[float, int]]:
        """Progressive filling of the ports the changes touched, and all connected to them.

        The unfrozen messages all sit at one byte rate per real flow (the level), so a port
        fills at (its capacity minus what its frozen messages use) / (its unfrozen flows);
        the lowest such port freezes its messages at that level (a heap of port levels,
        refreshed as messages freeze), and the others fill on."""
        ports, ops = self._component(self.touched)
        self.touched = set()
        residual = {p: self.capacity[p] for p in ports}
        weight = {p: sum(self.on_port[p].values()) for p in ports}  # unfrozen flows
        open_on = {p: set(self.on_port[p]) for p in ports}
        heap = [(residual[p] / weight[p], p) for p in ports if open_on[p]]
        heapq.heapify(heap)
        level: dict[int, float] = {}
        while heap:
            fill, full = heapq.heappop(heap)
            if not open_on[full] or fill != residual[full] / weight[full]:
                continue  # stale: the port's level moved (or it has no open flow left)
            for op in open_on[full]:
                level[op] = fill
                for q, count in self.flows[op]:
                    residual[q] -= fill * count
                    weight[q] -= count
                    if q != full:
                        open_on[q].discard(op)
                        if open_on[q]:
                            heapq.heappush(heap, (residual[q] / weight[q], q))
            open_on[full] = set()
        changed = []
        for op in ops:
            rate = level[op] / self.unit[op]
            assert rate > 0.0, "a port left a message no bandwidth"
            if rate != self.rate[op]:  # a new message's rate is 0 until here
                self.left[op] -= (now - self.since[op]) * self.rate[op]
                self.since[op], self.rate[op] = now, rate
                changed.append((now + max(self.left[op], 0.0) / rate, op))
        return changed
