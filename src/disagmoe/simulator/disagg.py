"""Simulate one optimizer step of the disaggregated AF-Pipe runtime.

The schedule is the one the executor runs (`schedule.afpipe.build_afpipe`),
checked by `schedule.validate.validate` first: a schedule the validator rejects
(deadlock, unmatched message, broken FIFO) is reported as `ScheduleRejected`
and not simulated.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from ..config import ClusterConfig, ModelConfig, ParallelConfig
from ..distributed.layout import Layout
from ..schedule.afpipe import build_afpipe, reduced_layout, replica_classes
from ..schedule.ir import Instr, Schedule
from ..schedule.validate import ScheduleError, validate
from .costs import AnalyticCosts, InstrCosts, MessageOverheads, Workload
from .engine import run_program
from .links import LinkModel
from .lower import Pricing, lower
from .network import Network
from .placement import nic_shares
from .report import SimResult, summarize
from .symmetry import Symmetry

# Above this many messages per step the replay uses the symmetry reduction by default.
REDUCE_ABOVE_MESSAGES = 60_000


class ScheduleRejected(ValueError):
    """The validator rejected the schedule; it was not simulated."""


def check_schedule(schedule: Schedule) -> int:
    """`validate` with its error re-raised as `ScheduleRejected`; returns peak in-flight slots."""
    try:
        return validate(schedule)
    except ScheduleError as err:
        raise ScheduleRejected(
            f"schedule {schedule.name!r} rejected by the validator: {err}"
        ) from err


@functools.lru_cache(maxsize=32)
def checked_afpipe(
    layout: Layout, num_slots: int, max_in_flight: int, order: str, num_micro_batches: int
) -> tuple[Schedule, int]:
    """`build_afpipe` and `check_schedule`, cached: the schedule depends on neither the
    costs, the NIC split nor the recompute mode, which the planner's profile varies."""
    schedule = build_afpipe(
        layout, num_slots, max_in_flight, order, num_micro_batches=num_micro_batches
    )
    return schedule, check_schedule(schedule)


def afpipe_pricing(
    layout: Layout,
    costs: InstrCosts,
    workload: Workload,
    net: Network,
    *,
    sync: bool = True,
    step_s: float = 0.0,
    grad_bytes: int = 2,
    overheads: MessageOverheads | None = None,
    num_micro_batches: int = 0,
) -> Pricing:
    """AF-Pipe's prices on `layout` (the real one): compute from `costs`, messages over
    `net`, SYNC = ring all-reduce of a group's A gradients over its m replicas.

    `num_micro_batches` (M; 0: m divides it): an F compute of a slot that only k < m
    replicas run (the last one when m does not divide M) costs k/m of a full slot's."""

    def sync_s(rank: int) -> float:
        role = layout.role(rank)
        if role.comp != "A":
            return 0.0  # expert gradients are complete on their shard
        group = role.group
        layers = layout.layers_of(layout.attn_rank(group, 0))
        params = sum(workload.attn_param_count(l) for l in layers)
        return net.allreduce_s(layout.attn_replicas(group), params * grad_bytes)

    shards, m = layout.expert_workers, layout.attn_workers

    def compute_s(ins: Instr, kind: str) -> float:
        seconds = costs.compute_s(ins.op, ins.comp, ins.layer)
        if ins.comp == "F" and num_micro_batches:
            seconds *= layout.replicas_of_slot(ins.slot, num_micro_batches) / m
        return seconds

    return Pricing(
        compute_s=compute_s,
        message_bytes=lambda msg: workload.message_bytes(msg.kind, msg.layer, shards),
        net=net,
        sync_s=sync_s if sync else None,
        step_s=step_s,
        overheads=overheads,
    )


def simulate_schedule(
    schedule: Schedule,
    layout: Layout,
    costs: InstrCosts,
    workload: Workload,
    net: Network,
    *,
    full: Layout | None = None,
    share_compute: bool = True,
    sync: bool = True,
    step_s: float = 0.0,
    config: dict[str, Any] | None = None,
    overheads: MessageOverheads | None = None,
    cores: int = 0,
    num_micro_batches: int = 0,
    peak_in_flight: int = 0,
    link_model: LinkModel = "fair",
) -> SimResult:
    """Validate, lower and simulate an AF-Pipe schedule of `layout`.

    `full`: the real layout when `schedule` was generated for one replica per class and
    one shard per group (`schedule.afpipe.reduced_layout`, `Symmetry.replicas`).
    `num_micro_batches`: the real step's M (0: the schedule's own, or num_slots * m of
    `full`). `overheads` and `cores` model a host runtime (see `simulator.lower` and
    `engine.run_program`). `peak_in_flight`: the validator's answer when the caller
    validated `schedule` already (`checked_afpipe`; 0: validate here). `link_model`: how
    messages share ports (`simulator.links`).
    """
    peak = peak_in_flight or check_schedule(schedule)
    real_layout = full or layout
    num_micro = num_micro_batches or (
        schedule.num_slots * real_layout.attn_workers
        if full
        else int(schedule.meta.get("num_micro_batches", schedule.num_slots * layout.attn_workers))
    )
    symmetry = (
        Symmetry.replicas(real_layout, replica_classes(real_layout, num_micro))
        if full
        else Symmetry.identity(schedule.num_ranks)
    )
    pricing = afpipe_pricing(
        real_layout,
        costs,
        workload,
        net,
        sync=sync,
        step_s=step_s,
        overheads=overheads,
        num_micro_batches=num_micro,
    )
    program = lower(schedule, pricing, symmetry)
    timeline = run_program(program, share_compute=share_compute, cores=cores, link_model=link_model)
    real = [symmetry.real(r) for r in range(schedule.num_ranks)]
    roles = [str(real_layout.role(r)) for r in real]
    tokens = num_micro * workload.tokens
    cfg = {
        "schedule": schedule.name,
        "num_slots": schedule.num_slots,
        "num_micro_batches": num_micro,
        "max_in_flight": schedule.max_in_flight,
        "peak_in_flight": peak,
        "reduced": full is not None,
        **(config or {}),
    }
    return summarize(
        "disagg",
        program,
        timeline,
        tokens_per_step=tokens,
        roles=roles,
        real_ranks=real,
        config=cfg,
        cores=cores,
    )


def message_count(layout: Layout, num_micro_batches: int) -> int:
    """Messages of one step of the full (unreduced) AF-Pipe schedule."""
    n, p = layout.expert_workers, layout.groups
    moe = len(layout.moe_layers)
    acts = layout.num_layers * 2 if p > 1 else 0
    return num_micro_batches * (moe * 4 * n + acts)


def simulate_disagg(
    model: ModelConfig,
    cluster: ClusterConfig,
    *,
    groups: int,
    attn_workers: int,
    expert_workers: int,
    seq_len: int,
    micro_batch_size: int,
    num_micro_batches: int,
    max_in_flight: int = 0,
    reduce: bool | None = None,
    costs: InstrCosts | None = None,
    placement: str = "node-aware",
    nic_split: tuple[int, int] | None = None,
    recompute: str = "none",
    order: str = "breadth",
    link_model: LinkModel = "fair",
) -> SimResult:
    """AF-Pipe with p groups of m attention replicas and n expert shards.

    `num_micro_batches` counts the global batch (train.global_batch_size /
    micro_batch_size); replica r runs ceil((M - r) / m) slots (`Layout.slots_of_replica`).
    `reduce`: replay the one-replica(-per-class)-one-shard schedule with bundled messages
    (None: only when the full schedule has more than REDUCE_ABOVE_MESSAGES messages).
    `placement`: `parallel.placement`, the runtime's rule (`distributed.placement`; rank r
    runs on GPU r). `nic_split` (the planner's M_a, M_f per group; None: one fair NIC
    share per GPU): see `simulator.placement`; the split needs `node-aware`.
    `recompute`: activation recompute none | attn | full (analytic costs: each backward adds
    one forward of the attention core, or of everything). `link_model`: how messages share
    ports (`simulator.links`, default max-min fair).
    """
    parallel = ParallelConfig(
        groups=groups, attn_workers=attn_workers, expert_workers=expert_workers,
        placement=placement,
    )  # fmt: skip
    layout = Layout.build(model, parallel, ranks_per_node=cluster.gpus_per_node)
    if num_micro_batches < attn_workers:
        raise ValueError(
            f"--micro-batches ({num_micro_batches}) leaves some of the {attn_workers} attention "
            "workers per group without a micro-batch; give at least one per replica"
        )
    slots = layout.slots_of_replica(0, num_micro_batches)
    if reduce is None:
        reduce = message_count(layout, num_micro_batches) > REDUCE_ABOVE_MESSAGES
    workload = Workload(model, seq_len, micro_batch_size)
    costs = costs or AnalyticCosts.for_cluster(
        workload, cluster, attn_workers, expert_workers, recompute
    )
    net = Network.from_cluster(cluster)
    if nic_split is not None:
        if placement != "node-aware":
            raise ValueError("a NIC split pools a node's NICs: use placement 'node-aware'")
        net = dataclasses.replace(net, nic_share=nic_shares(layout, net, *nic_split))
    run_layout, run_micro = (
        reduced_layout(layout, num_micro_batches) if reduce else (layout, num_micro_batches)
    )
    schedule, peak = checked_afpipe(run_layout, slots, max_in_flight, order, run_micro)
    cfg = {
        "model": model.name,
        "cluster": cluster.name,
        "groups": groups,
        "attn_workers": attn_workers,
        "expert_workers": expert_workers,
        "seq_len": seq_len,
        "micro_batch_size": micro_batch_size,
        "micro_batches": num_micro_batches,
        "placement": placement,
        "nic_split": list(nic_split) if nic_split else None,
        "recompute": recompute,
        "order": order,
        "link_model": link_model,
    }
    return simulate_schedule(
        schedule,
        run_layout,
        costs,
        workload,
        net,
        full=layout if reduce else None,
        config=cfg,
        num_micro_batches=num_micro_batches,
        peak_in_flight=peak,
        link_model=link_model,
    )
