"""How concurrent point-to-point messages share the ports of the links they cross.

A message (`XFER`) loads one or more ports (`Program.xfer_ports`: a NIC's egress or
ingress, a GPU's NVLink out or in) with a byte count each. Two models of a port:

* `"fair"` (default, `FairLinks`): flow-level max-min fair sharing. Every message in
  flight moves at once; whenever a message starts or finishes, the rates of the messages
  connected to it through shared ports are recomputed by progressive filling: all of them
  speed up together until some port is full, the messages through that port are frozen at
  its fair share, and the rest keep filling. That is what the runtime's transports do:
  gloo keeps one TCP connection per peer and channel and the kernel shares a link among
  all active connections (about equally under a common bottleneck); NCCL spreads its
  channels over many queue pairs. A message alone still takes `max(bytes / bandwidth)`
  over its ports.
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

from typing import Literal, Protocol

LinkModel = Literal["fair", "fifo"]
LINK_MODELS: tuple[LinkModel, ...] = ("fair", "fifo")


class Links(Protocol):
    """A link model: when do the messages in flight finish moving their bytes?

    `releases`: whether a message's end changes the others' finish times (then the engine
    reports it with `finish`; otherwise `start`'s answer is final)."""

    releases: bool

    def start(
        self, op: int, now: float, loads: list[tuple[int, float]], unit: float
    ) -> list[tuple[float, int]]:
        """Message `op` is ready at `now`; (finish time, message) for every message whose
        finish time is new (the others keep theirs)."""
        ...

    def finish(self, op: int, now: float) -> list[tuple[float, int]]:
        """Message `op` moved its last byte at `now`; new finish times of the others."""
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

    def start(
        self, op: int, now: float, loads: list[tuple[int, float]], unit: float
    ) -> list[tuple[float, int]]:
        t0 = max([now] + [self.free[p] for p, _ in loads])
        longest = 0.0
        for p, nbytes in loads:
            dur = nbytes / self.bytes_per_s[p]
            self.free[p] = t0 + dur
            longest = max(longest, dur)
        self.began[op] = t0
        return [(t0 + longest, op)]

    def finish(self, op: int, now: float) -> list[tuple[float, int]]:
        return []

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

    def start(
        self, op: int, now: float, loads: list[tuple[int, float]], unit: float
    ) -> list[tuple[float, int]]:
        assert loads and unit > 0.0, "a message without bytes does not use the links"
        flows = [(p, nbytes / unit) for p, nbytes in loads]
        self.flows[op], self.unit[op] = flows, unit
        self.left[op], self.since[op], self.rate[op] = 1.0, now, 0.0
        self.began[op] = now
        for p, count in flows:
            self.on_port[p][op] = count
        return self._refill(now, [p for p, _ in flows])

    def finish(self, op: int, now: float) -> list[tuple[float, int]]:
        ports = [p for p, _ in self.flows.pop(op)]
        for p in ports:
            del self.on_port[p][op]
        for table in (self.unit, self.left, self.since, self.rate):
            del table[op]
        return self._refill(now, ports)

    def begin(self, op: int) -> float:
        return self.began[op]

    def _component(self, seeds: list[int]) -> tuple[list[int], set[int]]:
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
        return sorted(ports), ops

    def _refill(self, now: float, seeds: list[int]) -> list[tuple[float, int]]:
        """Progressive filling of the component of `seeds`; new finish times.

        `level` is absolute: the unfrozen messages all sit at the same byte rate per real
        flow, so a port fills at (its capacity minus what the frozen ones use) / (its
        unfrozen flows); the lowest such port freezes its messages there."""
        ports, ops = self._component(seeds)
        for op in ops:  # bring every message of the component to `now` at its old rate
            self.left[op] -= (now - self.since[op]) * self.rate[op]
            self.since[op] = now
        residual = {p: self.capacity[p] for p in ports}
        weight = {p: sum(self.on_port[p].values()) for p in ports}  # unfrozen flows
        open_on = {p: set(self.on_port[p]) for p in ports}
        level: dict[int, float] = {}
        while len(level) < len(ops):
            full = min((p for p in ports if open_on[p]), key=lambda p: residual[p] / weight[p])
            fill = max(residual[full] / weight[full], 0.0)
            for op in list(open_on[full]):
                level[op] = fill
                for q, count in self.flows[op]:
                    residual[q] -= fill * count
                    weight[q] -= count
                    open_on[q].discard(op)
        changed = []
        for op in ops:
            rate = level[op] / self.unit[op]
            assert rate > 0.0, "a port left a message no bandwidth"
            if rate != self.rate[op]:  # a new message's rate is 0 until here
                self.rate[op] = rate
                changed.append((now + max(self.left[op], 0.0) / rate, op))
        return changed
