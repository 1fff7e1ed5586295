"""Simulate one optimizer step of the disaggregated AF-Pipe runtime.

The schedule is the one the executor runs (`schedule.afpipe.build_afpipe`, in the
order `schedule.order` names or `simulator.choose` picks), replayed by
`simulator.replay.simulate_schedule`, which validates it first (`ScheduleRejected`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from ..config import ClusterConfig, ModelConfig, ParallelConfig
from ..distributed.layout import Layout
from ..schedule.afpipe import build_afpipe, reduced_layout
from ..schedule.ir import Schedule
from ..schedule.orders import ScheduleCosts
from .choose import CANDIDATES, CHUNK_CANDIDATES, choose_order, schedule_costs
from .costs import AnalyticCosts, InstrCosts, Workload
from .links import LinkModel
from .measured import MeasuredCosts
from .network import Network
from .placement import nic_shares
from .replay import ScheduleRejected, check_schedule, simulate_schedule
from .report import SimResult

__all__ = ["ScheduleRejected", "checked_afpipe", "simulate_disagg", "simulate_schedule"]

# Above this many messages per step the replay uses the symmetry reduction by default.
REDUCE_ABOVE_MESSAGES = 60_000


@functools.lru_cache(maxsize=32)
def checked_afpipe(
    layout: Layout,
    num_slots: int,
    max_in_flight: int,
    order: str,
    num_micro_batches: int,
    costs: ScheduleCosts | None = None,
    exchange_chunks: int = 1,
    split_backward: bool = False,
) -> tuple[Schedule, int]:
    """`build_afpipe` and `check_schedule`, cached: with the nominal costs (`costs` None)
    the schedule depends on neither the costs, the NIC split nor the recompute mode,
    which the planner's profile varies."""
    schedule = build_afpipe(
        layout, num_slots, max_in_flight, order, num_micro_batches=num_micro_batches,
        costs=costs, exchange_chunks=exchange_chunks, split_backward=split_backward,
    )  # fmt: skip
    return schedule, check_schedule(schedule)


def message_count(layout: Layout, num_micro_batches: int, exchange_chunks: int = 1) -> int:
    """Messages of one step of the full (unreduced) AF-Pipe schedule."""
    n, p = layout.expert_workers, layout.groups
    moe = len(layout.moe_layers)
    acts = layout.num_layers * 2 if p > 1 else 0
    return num_micro_batches * (moe * 4 * n * exchange_chunks + acts)


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
    costed: bool = False,
    overlap_sync: bool = True,
    exchange_chunks: int = 1,
    split_backward: bool | None = False,
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
    ports (`simulator.links`, default max-min fair). `order` (`schedule.order`): breadth,
    depth, steady, or auto (`simulator.choose`: the best candidate of a reduced replay);
    `costed`: the lanes are ordered with this run's costs (`choose.schedule_costs`), not
    the nominal ones (auto decides it itself). `overlap_sync` (`parallel.overlap_grad_sync`):
    the A gradients' all-reduce runs per layer bucket during the backward
    (`schedule.sync`), else after the rank's last op. `exchange_chunks`
    (`schedule.exchange_chunks`): each micro-batch's exchange with a shard in that many
    chunks (`schedule.ir`, priced by `replay.afpipe_pricing`); 0: `choose` picks 1, 2, 4 or 8
    (with an explicit order, among that order alone). `split_backward`
    (`schedule.split_backward`): every backward defers its weight gradients to a W
    (`schedule.semantics`); None: `choose` tries both — whole backwards only under
    recompute, which the runtime cannot split (`RunConfig.split_backward_blocker`), and
    True with recompute is a `ValueError`.
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
    if recompute != "none" and split_backward:
        raise ValueError(
            f"deferred weight gradients cannot run with recompute {recompute} (the runtime "
            "refuses it): split backwards without recompute, or keep them whole"
        )
    if exchange_chunks < 0:
        raise ValueError(f"exchange chunks must be >= 0 (0: auto picks), got {exchange_chunks}")
    if reduce is None:
        most = exchange_chunks or max(CHUNK_CANDIDATES)
        reduce = message_count(layout, num_micro_batches, most) > REDUCE_ABOVE_MESSAGES
    workload = Workload(model, seq_len, micro_batch_size)
    costs = costs or AnalyticCosts.for_cluster(
        workload, cluster, attn_workers, expert_workers, recompute
    )
    if isinstance(costs, MeasuredCosts):  # one costs file, priced for this layout
        costs = costs.bound_to(workload, attn_workers, expert_workers, recompute)
    net = Network.from_cluster(cluster)
    if nic_split is not None:
        if placement != "node-aware":
            raise ValueError("a NIC split pools a node's NICs: use placement 'node-aware'")
        net = dataclasses.replace(net, nic_share=nic_shares(layout, net, *nic_split))
    run_layout, run_micro = (
        reduced_layout(layout, num_micro_batches) if reduce else (layout, num_micro_batches)
    )
    chosen: dict[str, Any] = {}
    if order == "auto" or exchange_chunks == 0 or split_backward is None:
        candidates = CANDIDATES if order == "auto" else ((order, costed),)
        chunks = (exchange_chunks,) if exchange_chunks else CHUNK_CANDIDATES
        splits = (
            (False, True)
            if split_backward is None and recompute == "none"
            else ((bool(split_backward),))
        )
        choice, priced = choose_order(
            layout, slots, max_in_flight, num_micro_batches, costs, workload, net,
            candidates=candidates, chunks=chunks, link_model=link_model, reduce=reduce,
            overlap_sync=overlap_sync, splits=splits,
        )  # fmt: skip
        chosen = {
            "order_choice": order,
            "chunks_choice": "auto" if exchange_chunks == 0 else exchange_chunks,
            "split_choice": "auto" if split_backward is None else split_backward,
            "auto_steps": [list(c) for c in choice.steps],
        }
        order, costed, exchange_chunks = choice.order, choice.costed, choice.exchange_chunks
        split_backward = choice.split_backward
    elif costed:
        priced = schedule_costs(layout, num_micro_batches, costs, workload, net)
    schedule, peak = checked_afpipe(
        run_layout, slots, max_in_flight, order, run_micro, priced if costed else None,
        exchange_chunks, split_backward,
    )  # fmt: skip
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
        "costed": costed,
        "exchange_chunks": exchange_chunks,
        "split_backward": split_backward,
        "link_model": link_model,
        **chosen,
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
        overlap_sync=overlap_sync,
    )
