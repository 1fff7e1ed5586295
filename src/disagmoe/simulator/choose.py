"""The AF-Pipe order of a run: the generator's costs priced here, candidates replayed.

`schedule_costs` turns the simulator's cost model into the plain data and callables the
generator orders against (`schedule.orders.ScheduleCosts`): each compute's seconds from
`InstrCosts`, and for each message of the reduced layout (`afpipe.reduced_layout`: one
replica per class, one shard per group) the ports its bundle crosses on the real
cluster — NIC egress/ingress or NVLink out/in, through the same `Symmetry.loads` and
`Ports` the replay uses — with the seconds it holds each (bytes / the port's rate).

`choose_order` generates every candidate — each order of `GENERATED_ORDERS`, ordered
with the nominal costs and with the run's, at each exchange chunk count it is given
(`schedule.ir`; `schedule.exchange_chunks = 0` gives `CHUNK_CANDIDATES`) — validates it,
replays it (`simulate_schedule` on the reduced layout, or with `reduce=False` on every
rank, with the run's costs and the fair link model) and keeps the shortest step; ties go
to the fewer chunks, then to the earlier candidate of `CANDIDATES`, so every rank that
calls it with the same inputs picks the same schedule (`schedule.order = auto`).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

from ..config import RunConfig, split_backward_flag
from ..distributed.layout import Layout
from ..schedule.afpipe import build_afpipe, reduced_layout, replica_classes
from ..schedule.ir import Msg, Op
from ..schedule.orders import (
    GENERATED_ORDERS,
    PortLoads,
    Resolved,
    ScheduleCosts,
    given_choice,
    order_label,
)
from .costs import AnalyticCosts, InstrCosts, Workload
from .engine import Program
from .links import LinkModel
from .measured import MeasuredCosts
from .network import Network, Ports
from .replay import check_schedule, simulate_schedule
from .symmetry import Symmetry

# (order, ordered with the run's costs?), in tie-break order: the nominal lists first.
CANDIDATES: tuple[tuple[str, bool], ...] = tuple(
    (order, costed) for costed in (False, True) for order in GENERATED_ORDERS
)
# exchange chunk counts `schedule.exchange_chunks = 0` lets auto pick from, fewest first
CHUNK_CANDIDATES: tuple[int, ...] = (1, 2, 4, 8)


def schedule_costs(
    layout: Layout, num_micro_batches: int, costs: InstrCosts, workload: Workload, net: Network
) -> ScheduleCosts:
    """The generator's costs of a step of `num_micro_batches` on the real `layout`, for
    the lists of its `reduced_layout` (see the module doc)."""
    symmetry = Symmetry.replicas(layout, replica_classes(layout, num_micro_batches))
    ports = Ports(Program(num_ranks=symmetry.num_ranks, latency_s=net.latency_s), net)
    shards = layout.expert_workers

    @functools.cache
    def message_ports(kind: str, layer: int, src: int, dst: int) -> PortLoads:
        nbytes = workload.message_bytes(kind, layer, shards)
        loads = symmetry.loads(Msg(kind, layer, 0, src, dst), nbytes, ports)
        return tuple(
            (ports.program.ports[port].name, load / ports.program.ports[port].bytes_per_s)
            for port, load in loads
        )

    @functools.cache
    def compute_s(op: Op, comp: str, layer: int) -> float:
        return costs.compute_s(op, comp, layer)

    return ScheduleCosts(compute_s, message_ports, net.latency_s, name="run")


@dataclass(frozen=True)
class OrderChoice:
    """The chosen candidate and every candidate's simulated step (seconds):
    `steps` holds (order, costed, exchange chunks, step, split backward) in the order they
    were tried."""

    order: str
    costed: bool  # ordered with the run's costs (else the nominal ones)
    step_s: float
    bound_s: float
    steps: tuple[tuple[str, bool, int, float, bool], ...]  # (..., split_backward)
    exchange_chunks: int = 1
    split_backward: bool = False  # weight gradients deferred (`schedule.semantics`)

    @property
    def label(self) -> str:
        chunks = f", {self.exchange_chunks} exchange chunks" if self.exchange_chunks > 1 else ""
        split = ", weight gradients deferred" if self.split_backward else ""
        return f"{order_label(self.order, self.costed)}{chunks}{split}"


def choose_order(
    layout: Layout,
    num_slots: int,
    max_in_flight: int,
    num_micro_batches: int,
    costs: InstrCosts,
    workload: Workload,
    net: Network,
    *,
    candidates: tuple[tuple[str, bool], ...] = CANDIDATES,
    chunks: tuple[int, ...] = (1,),
    link_model: LinkModel = "fair",
    reduce: bool = True,
    overlap_sync: bool = True,
    splits: tuple[bool, ...] = (False,),
) -> tuple[OrderChoice, ScheduleCosts]:
    """The candidate with the shortest simulated step on the real `layout` (module doc),
    and the run's generator costs (pass them to `build_afpipe` when `choice.costed`).
    `chunks`: the exchange chunk counts to try each candidate at (in tie-break order);
    `reduce`: replay the reduced schedules (else every rank's, as `simulate_disagg` does
    for small layouts); `overlap_sync`: `parallel.overlap_grad_sync`; `splits`:
    `schedule.split_backward` values to try each candidate with (in tie-break order)."""
    priced = schedule_costs(layout, num_micro_batches, costs, workload, net)
    reduced, reduced_micro = (
        reduced_layout(layout, num_micro_batches) if reduce else (layout, num_micro_batches)
    )
    best: tuple[float, float, str, bool, int, bool] | None = None
    steps: list[tuple[str, bool, int, float, bool]] = []
    for split, c, (order, costed) in itertools.product(splits, chunks, candidates):
        schedule = build_afpipe(
            reduced,
            num_slots,
            max_in_flight,
            order,
            num_micro_batches=reduced_micro,
            costs=priced if costed else None,
            exchange_chunks=c,
            split_backward=split,
        )
        peak = check_schedule(schedule)
        result = simulate_schedule(
            schedule,
            reduced,
            costs,
            workload,
            net,
            full=layout if reduce else None,
            num_micro_batches=num_micro_batches,
            peak_in_flight=peak,
            link_model=link_model,
            overlap_sync=overlap_sync,
        )
        steps.append((order, costed, c, result.step_time_s, split))
        bound = result.bound.seconds if result.bound else 0.0
        if best is None or result.step_time_s < best[0]:
            best = (result.step_time_s, bound, order, costed, c, split)
    assert best is not None, "no candidate order"
    step, bound, order, costed, c, split = best
    return OrderChoice(order, costed, step, bound, tuple(steps), c, split), priced


@functools.lru_cache(maxsize=8)
def run_choice(
    cfg: RunConfig, layout: Layout, num_slots: int, max_in_flight: int
) -> tuple[OrderChoice, ScheduleCosts]:
    """`choose_order` for a run of `cfg` on `layout` with its compute costs
    (`run_compute_costs`) and the links of `cfg.cluster`: among every candidate for `schedule.order = auto`, else of the given
    order and `schedule.costs` alone (its predicted step, for `disagmoe schedule`); at
    `schedule.exchange_chunks`, or for 0 at each of `CHUNK_CANDIDATES`."""
    workload = Workload.of_run(cfg)
    costs = run_compute_costs(cfg, layout, workload)
    net = Network.from_cluster(cfg.cluster)
    order = cfg.schedule.order
    candidates = CANDIDATES if order == "auto" else ((order, cfg.schedule.costs == "run"),)
    return choose_order(
        layout,
        num_slots,
        max_in_flight,
        cfg.train.num_micro_batches,
        costs,
        workload,
        net,
        candidates=candidates,
        chunks=run_chunk_candidates(cfg),
        overlap_sync=cfg.parallel.overlap_grad_sync,
        splits=run_split_candidates(cfg),
    )


def run_compute_costs(cfg: RunConfig, layout: Layout, workload: Workload) -> InstrCosts:
    """What a run's compute costs as the choice prices it: `schedule.costs_file`, else
    `train.emulate_compute`'s file, measured (`simulator.measured`, its fixed cost paid
    per exchange chunk), else the analytic costs of `cfg.cluster`."""
    m, n, recompute = layout.attn_workers, layout.expert_workers, cfg.train.recompute
    path = cfg.schedule.costs_file or cfg.train.emulate_compute
    if path:
        return MeasuredCosts.load(path).bound_to(workload, m, n, recompute)
    return AnalyticCosts.for_cluster(workload, cfg.cluster, m, n, recompute)


def run_split_candidates(cfg: RunConfig) -> tuple[bool, ...]:
    """The `schedule.split_backward` values a run of `cfg` chooses from (auto: both, unless
    the run cannot split its backwards, `RunConfig.split_backward_blocker`)."""
    given = split_backward_flag(cfg.schedule.split_backward)
    if given is None:
        return (False,) if cfg.split_backward_blocker() else (False, True)
    return (given,)


def run_chunk_candidates(cfg: RunConfig) -> tuple[int, ...]:
    """The exchange chunk counts a run of `cfg` chooses from: `schedule.exchange_chunks`,
    or `CHUNK_CANDIDATES` when it is 0 (auto)."""
    given = cfg.schedule.exchange_chunks
    return (given,) if given > 0 else CHUNK_CANDIDATES


def run_order(cfg: RunConfig, layout: Layout, num_slots: int, max_in_flight: int) -> Resolved:
    """(order, generator costs or None, exchange chunks, split backward) of a run:
    `schedule.order`, `schedule.costs`, `schedule.exchange_chunks` and
    `schedule.split_backward` as given (`schedule.orders.given_choice`), or where one is
    automatic ("auto", exchange_chunks 0) `run_choice`'s pick — the same pure computation
    on every rank. The `Chooser` the runtime takes for `schedule.order = auto`."""
    given = given_choice(cfg)
    if given is not None:
        return given
    choice, priced = run_choice(cfg, layout, num_slots, max_in_flight)
    costs = priced if choice.costed else None
    return choice.order, costs, choice.exchange_chunks, choice.split_backward
