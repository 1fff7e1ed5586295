"""Replay one AF-Pipe schedule: validate it, price it, lower it, run it.

`simulate_schedule` is the one replay of an AF-Pipe schedule (any generator's, any
costs): `schedule.validate.validate` first — a schedule the validator rejects
(deadlock, unmatched message, broken FIFO) is reported as `ScheduleRejected` and not
simulated — then `afpipe_pricing` and `simulator.lower`. `simulator.disagg` builds the
schedule of a layout and calls it; `simulator.choose` calls it per candidate order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..distributed.layout import Layout
from ..schedule.afpipe import replica_classes
from ..schedule.ir import Instr, Msg, Op, Schedule
from ..schedule.validate import ScheduleError, validate
from .costs import InstrCosts, MessageOverheads, Workload, chunk_bytes, chunk_compute_s
from .engine import run_program
from .links import LinkModel
from .lower import Pricing, lower
from .network import Network
from .report import SimResult, summarize
from .symmetry import Symmetry


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


def afpipe_pricing(
    layout: Layout,
    costs: InstrCosts,
    workload: Workload,
    net: Network,
    *,
    sync: bool = True,
    step_s: float = 0.0,
    grad_bytes: int = 4,
    overheads: MessageOverheads | None = None,
    num_micro_batches: int = 0,
    overlap_sync: bool = True,
    exchange_chunks: int = 1,
    rank_compute_s: Callable[[int, Instr], float | None] | None = None,
    measured_bytes: Callable[[Msg], float | None] | None = None,
) -> Pricing:
    """AF-Pipe's prices on `layout` (the real one): compute from `costs`, messages over
    `net`, SYNC = ring all-reduce of a group's A gradients over its m replicas (`grad_bytes`
    per element: the weights' dtype, float32 under mixed precision, 2 for pure bf16); with
    `overlap_sync` (`parallel.overlap_grad_sync`) one ring all-reduce per layer bucket,
    issued during the backward (`schedule.sync`).

    `num_micro_batches` (M; 0: m divides it): an F compute of a slot that only k < m
    replicas run (the last one when m does not divide M) costs k/m of a full slot's.
    `exchange_chunks` (the schedule's `meta["exchange_chunks"]`): an F compute or an
    exchange message of one chunk costs its share (`costs.chunk_compute_s`, `chunk_bytes`).
    `rank_compute_s`: seconds of a compute on a real rank where it has them (measured
    instructions), before all of this (`lower.Pricing.rank_compute_s`); `measured_bytes`
    likewise the bytes of a message between real ranks (a run's own messages: its routing
    makes some shards' larger than the average the workload prices)."""
    sync_s, bucket_s, bucket_ring = _sync_prices(layout, workload, net, grad_bytes)
    return Pricing(
        compute_s=_compute_prices(layout, costs, num_micro_batches, exchange_chunks),
        message_bytes=_message_prices(
            workload, layout.expert_workers, exchange_chunks, measured_bytes
        ),
        net=net,
        sync_s=sync_s if sync else None,
        bucket_s=bucket_s if sync and overlap_sync else None,
        bucket_ring=bucket_ring if sync and overlap_sync else None,
        step_s=step_s,
        overheads=overheads,
        rank_compute_s=rank_compute_s,
    )


def _sync_prices(
    layout: Layout, workload: Workload, net: Network, grad_bytes: int
) -> tuple[
    Callable[[int], float],
    Callable[[int, int], float],
    Callable[[int, int], tuple[tuple[int, ...], float]],
]:
    """Seconds of a rank's SYNC (ring all-reduce of its group's A gradients over the m
    replicas) and of its all-reduce of one layer's bucket (`overlap_sync`), 0 on F ranks;
    and that bucket's ring and bytes (`lower.Pricing.bucket_ring`: it moves over the
    ports the rank's messages use)."""

    def sync_s(rank: int) -> float:
        role = layout.role(rank)
        if role.comp != "A":
            return 0.0  # expert gradients are complete on their shard
        group = role.group
        layers = layout.layers_of(layout.attn_rank(group, 0))
        params = sum(workload.attn_param_count(l) for l in layers)
        return net.allreduce_s(layout.attn_replicas(group), params * grad_bytes)

    def bucket_ring(rank: int, layer: int) -> tuple[tuple[int, ...], float]:
        role = layout.role(rank)
        if role.comp != "A":
            return (rank,), 0.0
        params = workload.attn_param_count(layer)
        model = workload.model
        if model.tie_embeddings and 0 in layout.layers_of(rank):
            # the tied embedding is final after layer 0's backward: layer 0's bucket holds it
            tied = model.vocab_size * model.dim
            params += tied if layer == 0 else -tied if layer == model.num_layers else 0
        return tuple(layout.attn_replicas(role.group)), params * grad_bytes

    def bucket_s(rank: int, layer: int) -> float:
        ring, nbytes = bucket_ring(rank, layer)
        return net.allreduce_s(list(ring), nbytes)

    return sync_s, bucket_s, bucket_ring


def _compute_prices(
    layout: Layout, costs: InstrCosts, num_micro_batches: int, exchange_chunks: int
) -> Callable[[Instr, str], float]:
    """Seconds of a compute of a kind (`Pricing.compute_s`): a chunk's share, a BWD whose W
    computes the weight gradients less the W, an F compute of a partial slot k/m of it."""
    m = layout.attn_workers

    def priced(op: Op, ins: Instr) -> float:
        if ins.chunk >= 0:
            return chunk_compute_s(costs, op, ins.comp, ins.layer, exchange_chunks)
        return costs.compute_s(op, ins.comp, ins.layer)

    def compute_s(ins: Instr, kind: str) -> float:
        # a BWD whose weight gradients a W computes ("I") costs the rest of the backward
        seconds = priced(ins.op, ins)
        if kind == "I":
            seconds = max(0.0, seconds - priced(Op.WGT, ins))
        if ins.comp == "F" and num_micro_batches:
            seconds *= layout.replicas_of_slot(ins.slot, num_micro_batches) / m
        return seconds

    return compute_s


def _message_prices(
    workload: Workload,
    shards: int,
    exchange_chunks: int,
    measured_bytes: Callable[[Msg], float | None] | None,
) -> Callable[[Msg], float]:
    """Bytes of a message (`Pricing.message_bytes`): measured where `measured_bytes` has
    them, else the workload's, a chunk's share for a chunk."""

    def message_bytes(msg: Msg) -> float:
        if measured_bytes is not None and (seen := measured_bytes(msg)) is not None:
            return seen
        nbytes = workload.message_bytes(msg.kind, msg.layer, shards)
        return chunk_bytes(nbytes, exchange_chunks) if msg.chunk >= 0 else nbytes

    return message_bytes


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
    overlap_sync: bool = True,
    rank_compute_s: Callable[[int, Instr], float | None] | None = None,
    measured_bytes: Callable[[Msg], float | None] | None = None,
    grad_bytes: int = 4,
) -> SimResult:
    """Validate, lower and simulate an AF-Pipe schedule of `layout`.

    `full`: the real layout when `schedule` was generated for one replica per class and
    one shard per group (`schedule.afpipe.reduced_layout`, `Symmetry.replicas`).
    `num_micro_batches`: the real step's M (0: the schedule's own, or num_slots * m of
    `full`). `overheads` and `cores` model a host runtime (see `simulator.lower` and
    `engine.run_program`). `peak_in_flight`: the validator's answer when the caller
    validated `schedule` already (`checked_afpipe`; 0: validate here). `link_model`: how
    messages share ports (`simulator.links`). `overlap_sync`: the A gradients' all-reduce
    runs per layer bucket during the backward (`parallel.overlap_grad_sync`), else at SYNC;
    `grad_bytes` per gradient element (`afpipe_pricing`).
    `rank_compute_s`, `measured_bytes`: a compute's seconds on a real rank and a message's
    bytes where they give them (a replay of a run's measured instructions and messages;
    real ranks, so with `full` unset), else `costs` and `workload`.
    """
    if full is not None and measured_bytes is not None:
        raise ValueError("measured_bytes name real ranks: replay the full schedule")
    peak = peak_in_flight or check_schedule(schedule)
    real_layout = full or layout
    num_micro, symmetry = _replay_frame(schedule, layout, full, num_micro_batches)
    pricing = afpipe_pricing(
        real_layout,
        costs,
        workload,
        net,
        sync=sync,
        step_s=step_s,
        overheads=overheads,
        num_micro_batches=num_micro,
        overlap_sync=overlap_sync,
        grad_bytes=grad_bytes,
        exchange_chunks=int(schedule.meta.get("exchange_chunks", 1)),
        rank_compute_s=rank_compute_s,
        measured_bytes=measured_bytes,
    )
    program = lower(schedule, pricing, symmetry)
    timeline = run_program(program, share_compute=share_compute, cores=cores, link_model=link_model)
    real = [symmetry.real(r) for r in range(schedule.num_ranks)]
    roles = [str(real_layout.role(r)) for r in real]
    tokens = num_micro * workload.tokens
    cfg = {
        **_replay_config(schedule, num_micro, peak, full is not None, overlap_sync),
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


def _replay_frame(
    schedule: Schedule, layout: Layout, full: Layout | None, num_micro_batches: int
) -> tuple[int, Symmetry]:
    """The real step's micro-batch count M (`simulate_schedule`'s `num_micro_batches`) and
    the symmetry that maps the schedule's ranks to real ones (identity unless reduced)."""
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
    return num_micro, symmetry


def _replay_config(
    schedule: Schedule, num_micro: int, peak: int, reduced: bool, overlap_sync: bool
) -> dict[str, Any]:
    """The result's config entries of the replay (before the caller's `config`)."""
    return {
        "schedule": schedule.name,
        "num_slots": schedule.num_slots,
        "num_micro_batches": num_micro,
        "max_in_flight": schedule.max_in_flight,
        "peak_in_flight": peak,
        "reduced": reduced,
        "overlap_sync": overlap_sync,
        "exchange_chunks": int(schedule.meta.get("exchange_chunks", 1)),
    }
