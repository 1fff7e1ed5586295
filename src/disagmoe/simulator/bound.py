"""The step-time lower bound: what the hardware allows a run, whatever its schedule.

One optimizer step cannot end before any worker has done its own work on any resource:

    bound = max over workers w of  max(compute_w, network_w) + serial_w

* `compute_w` — seconds of compute the worker must run (forward, backward, recompute),
  at the rate it runs alone; on a host whose ranks share `cores` processors also the
  pool's share: (sum of all ranks' compute) / cores;
* `network_w` — the busiest link resource the worker's traffic crosses: each NIC or
  NVLink direction (port) it sends from or receives at, bytes / rate, summed over the
  step — a port is shared by every worker whose traffic crosses it; collectives
  (all-to-all, the gradient all-reduce) count their seconds alone on the worker;
* `serial_w` — work nothing can overlap: the optimizer step, which needs every gradient.

Per-message CPU costs of a runtime (posting, hand-over) are not hardware and are left
out, so a runtime's `step / bound` also shows what its host overheads cost.
`program_bound` reads a simulated `Program`; `bench.bound.trace_bound` the same terms
from a measured run's trace and byte counts (docs/design.md §4: every speed claim
states its bound; docs/simulator.md, docs/bench.md read it per setting).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from .engine import A2A, COMPUTE, DELAY, XFER, Program


@dataclass(frozen=True, slots=True)
class Bound:
    """A step-time lower bound and the resource that sets it."""

    seconds: float
    binding: str  # "compute", "network" or "serial" of the binding worker
    worker: str  # the binding worker (role or rank) or port
    compute_s: float  # the binding worker's terms
    network_s: float
    serial_s: float

    def describe(self) -> str:
        return f"{self.binding} ({self.worker})"

    def to_dict(self) -> dict[str, float | str]:
        return {
            "bound_s": self.seconds,
            "binding": self.binding,
            "binding_worker": self.worker,
            "bound_compute_s": self.compute_s,
            "bound_network_s": self.network_s,
            "bound_serial_s": self.serial_s,
        }


def worker_bound(
    compute: dict[int, float],
    network: dict[int, float],
    serial: dict[int, float],
    names: dict[int, str] | None = None,
    pool_s: float = 0.0,
) -> Bound:
    """The bound of per-worker terms (seconds), `pool_s` a floor on every worker's compute."""
    best = Bound(0.0, "compute", "-", 0.0, 0.0, 0.0)
    for w in sorted(set(compute) | set(network) | set(serial)):
        c = max(compute.get(w, 0.0), pool_s)
        n, s = network.get(w, 0.0), serial.get(w, 0.0)
        total = max(c, n) + s
        if total > best.seconds:
            binding = "compute" if c >= n else "network"
            if s > max(c, n):
                binding = "serial"
            name = (names or {}).get(w, f"rank {w}")
            best = Bound(total, binding, name, c, n, s)
    return best


def program_bound(program: Program, *, cores: int = 0, names: list[str] | None = None) -> Bound:
    """The bound of one simulated step (see the module doc).

    Representatives of a symmetry-reduced program stand for their class: their terms
    are the class's. With `cores`, the pool term weighs each rank by its multiplicity.
    """
    compute: dict[int, float] = defaultdict(float)
    collective: dict[int, float] = defaultdict(float)
    serial: dict[int, float] = defaultdict(float)
    port_load = [0.0] * len(program.ports)
    ports_of: dict[int, set[int]] = defaultdict(set)
    for op, kind in enumerate(program.kind):
        rank, lane = program.rank[op], program.lane[op]
        if kind == COMPUTE:
            compute[rank] += program.work[op]
        elif kind == A2A:
            collective[rank] += program.work[op]
        elif kind == XFER:
            for port, nbytes in program.xfer_ports[op]:
                port_load[port] += nbytes / program.ports[port].bytes_per_s
                for r in program.xfer_ranks[op]:
                    ports_of[r].add(port)
        elif kind == DELAY and lane == "sync":
            # SYNC grads (an all-reduce: network) and STEP (the optimizer: serial)
            target = collective if program.category[op] == "comm" else serial
            target[rank] += program.work[op]
    network = {
        r: max([collective.get(r, 0.0)] + [port_load[p] for p in ports_of.get(r, ())])
        for r in set(collective) | set(ports_of)
    }
    pool = 0.0
    if cores > 0:
        mult = program.multiplicity or [1] * program.num_ranks
        pool = sum(c * mult[r] for r, c in compute.items()) / cores
    return worker_bound(
        dict(compute), network, dict(serial), dict(enumerate(names)) if names else None, pool
    )
