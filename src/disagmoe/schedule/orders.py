"""What the AF-Pipe generator orders against: lane priorities and the costs it schedules with.

A generator (`schedule.afpipe`) turns a task graph into lists by a list schedule
(`schedule.graph.list_schedule`): each resource runs its best-priority ready task. Two
things decide the order it emits, and both are inputs here:

* the *order*, i.e. the priority of a ready compute (`priority`):

  - "breadth" — forwards before backwards, then the lowest layer (forward) / highest
    layer (backward), then the lowest slot: every slot of a layer goes before the next
    layer, so a layer's messages of all slots are on the wire while the next compute
    (without a cap: every forward before any backward, GPipe-like);
  - "depth" — the lowest slot, then the layer: a slot runs ahead through the layers and
    its backward starts early;
  - "steady" — a ready backward first (the oldest slot, the highest layer), else the
    oldest ready forward: 1F1B per stage. With the in-flight cap the worker settles in
    the time-multiplexed steady state of docs/design.md §2.3 — the forward of one
    micro-batch, the backward of an earlier one, a third on the wire — and holds at
    most `max_in_flight` slots.

* the *costs* (`ScheduleCosts`): nominal (forward 1, backward 2, message latency 0.5,
  links free — `NOMINAL`), or the run's: seconds per compute from the cost model and,
  per message, the seconds it holds each link port it crosses (every NIC direction and
  the intra-node link is a resource, so messages that would queue behind each other are
  seen to). With the run's costs — and always for "steady", whose point is the choice
  between a forward and a backward — a worker's forward and backward lanes share one
  compute resource, as they share the GPU; the nominal breadth/depth orders keep the two
  lanes independent (the lists they always produced).

Costs are plain data and callables built by the caller (`simulator.choose` prices them
with the simulator's cost model and network); nothing here imports the simulator. They
are given for the one-replica-per-class, one-shard-per-group layout
(`afpipe.reduced_layout`) whose lists every real rank's list expands from, so every rank
derives the same lists from the same inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..config import MAX_EXCHANGE_CHUNKS, RunConfig
from ..distributed.layout import Layout
from .ir import Op

GENERATED_ORDERS = ("breadth", "depth", "steady")


def order_label(order: str, costed: bool) -> str:
    """How output names an order: "depth", or "depth (run costs)" when the lanes were
    ordered with the run's own costs and links (`schedule.costs = run`)."""
    return f"{order} (run costs)" if costed else order


# Seconds a message holds each port it crosses: ((port name, seconds), ...).
PortLoads = tuple[tuple[str, float], ...]


@dataclass(frozen=True, eq=False)
class ScheduleCosts:
    """Costs a generator schedules against (see the module doc).

    `compute_s(op, comp, layer)`: seconds of one compute on its worker (`Op.WGT`: of the
    weight-gradient part of its backward, which a split backward defers). `message_ports(kind,
    layer, src, dst)`: the ports a message between ranks `src` and `dst` of the reduced
    layout (a representative's bundle) crosses and the seconds it holds each; empty: it
    holds none (arrives `latency_s` after it is posted). `shared_compute`: a worker's two
    compute lanes are one resource. `name` says where the costs came from (reports)."""

    compute_s: Callable[[Op, str, int], float]
    message_ports: Callable[[str, int, int, int], PortLoads]
    latency_s: float
    shared_compute: bool = True
    name: str = "run"


def _nominal_compute(op: Op, comp: str, layer: int) -> float:
    return 2.0 if op == Op.BWD else 1.0  # a W (weight gradients): 1 of the backward's 2


def _no_ports(kind: str, layer: int, src: int, dst: int) -> PortLoads:
    return ()


NOMINAL = ScheduleCosts(_nominal_compute, _no_ports, 0.5, shared_compute=False, name="nominal")


def check_chunks(exchange_chunks: int) -> None:
    """Exchange chunks (`schedule.ir`): 1 (not chunked) .. `MAX_EXCHANGE_CHUNKS`."""
    if not 1 <= exchange_chunks <= MAX_EXCHANGE_CHUNKS:
        raise ValueError(f"exchange chunks must be 1..{MAX_EXCHANGE_CHUNKS}, not {exchange_chunks}")


def check_order(order: str) -> None:
    if order not in GENERATED_ORDERS:
        raise ValueError(
            f"schedule.order must be one of {', '.join(GENERATED_ORDERS)} here, got {order!r} "
            "('auto' is resolved by its caller: simulator.choose)"
        )


LAST = 1 << 20  # before any slot or layer number: a priority after every order's own


def weight_priority(layer: int, slot: int) -> tuple[int, ...]:
    """The priority of a ready W (deferred weight gradients, `schedule.semantics`) under
    every order: after any ready forward or backward, the oldest slot's highest layer first
    (the order its backwards ran in)."""
    return (LAST, slot, -layer)


def priority(order: str, op: Op, layer: int, slot: int) -> tuple[int, ...]:
    """The priority of a ready compute (lower runs first) under `order`."""
    fwd = op == Op.FWD
    if order == "breadth":
        return (0, layer, slot) if fwd else (1, -layer, slot)
    if order == "depth":
        return (slot, 0, layer) if fwd else (slot, 1, -layer)
    assert order == "steady", order
    return (1, slot, layer) if fwd else (0, slot, -layer)


# (order, generator costs or None, exchange chunks, split backward): what a run executes
Resolved = tuple[str, ScheduleCosts | None, int, bool]
# what picks the automatic parts of a run's schedule: (cfg, layout, slots, in-flight cap)
Chooser = Callable[[RunConfig, Layout, int, int], Resolved]


def given_choice(cfg: RunConfig) -> Resolved | None:
    """`schedule.order`, `schedule.exchange_chunks` and `schedule.split_backward` as given,
    or None when one of them is automatic ("auto", exchange_chunks 0, `schedule.costs`
    "run"): then a simulated replay chooses (`simulator.choose.run_order`)."""
    given = cfg.schedule
    fixed = given.order != "auto" and given.costs == "nominal" and given.exchange_chunks > 0
    if not fixed or given.split_backward == "auto":
        return None
    return given.order, None, given.exchange_chunks, given.split_backward == "on"


def given_schedule(cfg: RunConfig, layout: Layout, num_slots: int, max_in_flight: int) -> Resolved:
    """A `Chooser` for a run whose schedule is fully given (`given_choice`); a ValueError
    naming the fields when something is left to the simulator's choice."""
    choice = given_choice(cfg)
    if choice is None:
        raise ValueError(
            "schedule.order=auto, schedule.exchange_chunks=0, schedule.split_backward=auto and "
            "schedule.costs=run are chosen by simulated replay: pass "
            "choose=simulator.choose.run_order (as `disagmoe train` does), or give them"
        )
    return choice
