"""Simulate one optimizer step of the disaggregated AF-Pipe runtime.

The schedule is the one the executor runs (`schedule.afpipe.build_afpipe`, in the
order `schedule.order` names or `simulator.choose` picks), replayed by
`simulator.replay.simulate_schedule`, which validates it first (`ScheduleRejected`).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from ..config import LOSS_CHUNK_TOKENS, ClusterConfig, ModelConfig, ParallelConfig
from ..costs import costmodel as cm
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
    loss_chunk_tokens: int = LOSS_CHUNK_TOKENS,
    recompute_layers: int = 0,
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
    True with recompute is a `ValueError`. `loss_chunk_tokens` (`train.loss_chunk_tokens`):
    the loss head's chunks, > 0 pricing the rerun of each chunk's logits in its backward.
    `recompute_layers` (`train.recompute_layers`): full recompute on each group's first K only.

    Long because its signature takes one keyword per knob of a step (23 of them); the body
    is the few named steps below."""
    layout, slots = _checked_layout(
        model, cluster, groups, attn_workers, expert_workers, placement, num_micro_batches,
        recompute, split_backward, exchange_chunks,
    )  # fmt: skip
    reduce = (
        _many_messages(layout, num_micro_batches, exchange_chunks) if reduce is None else reduce
    )
    workload = Workload(model, seq_len, micro_batch_size, loss_chunk_tokens=loss_chunk_tokens)
    recomputed = cm.group_recomputed(model, groups, recompute, recompute_layers)
    costs = _layout_costs(
        costs, workload, cluster, attn_workers, expert_workers, recompute, recomputed
    )
    net = _network(cluster, layout, placement, nic_split)
    pick = _pick(
        layout, slots, max_in_flight, num_micro_batches, costs, workload, net, order=order,
        costed=costed, exchange_chunks=exchange_chunks, split_backward=split_backward,
        recompute=recompute, link_model=link_model, reduce=reduce, overlap_sync=overlap_sync,
    )  # fmt: skip
    run_layout, run_micro = (
        reduced_layout(layout, num_micro_batches) if reduce else (layout, num_micro_batches)
    )
    schedule, peak = checked_afpipe(
        run_layout, slots, max_in_flight, pick.order, run_micro, pick.schedule_costs,
        pick.exchange_chunks, pick.split_backward,
    )  # fmt: skip
    cfg = _step_config(
        cluster, layout, workload, num_micro_batches, nic_split, recompute, link_model, pick,
        recompute_layers if recomputed is not None else 0,
    )  # fmt: skip
    return simulate_schedule(
        schedule, run_layout, costs, workload, net, full=layout if reduce else None,
        config=cfg, num_micro_batches=num_micro_batches, peak_in_flight=peak,
        link_model=link_model, overlap_sync=overlap_sync,
    )  # fmt: skip


def _checked_layout(
    model: ModelConfig,
    cluster: ClusterConfig,
    groups: int,
    attn_workers: int,
    expert_workers: int,
    placement: str,
    num_micro_batches: int,
    recompute: str,
    split_backward: bool | None,
    exchange_chunks: int,
) -> tuple[Layout, int]:
    """The request's layout (rank r on GPU r of `cluster`) and replica 0's slot count;
    `ValueError` for what the runtime refuses."""
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
    if recompute != "none" and split_backward:
        raise ValueError(
            f"deferred weight gradients cannot run with recompute {recompute} (the runtime "
            "refuses it): split backwards without recompute, or keep them whole"
        )
    if exchange_chunks < 0:
        raise ValueError(f"exchange chunks must be >= 0 (0: auto picks), got {exchange_chunks}")
    return layout, layout.slots_of_replica(0, num_micro_batches)


def _many_messages(layout: Layout, num_micro_batches: int, exchange_chunks: int) -> bool:
    """`reduce`'s default: whether the full schedule, in as many chunks as `choose` may
    pick when `exchange_chunks` is 0, has more than REDUCE_ABOVE_MESSAGES messages."""
    most = exchange_chunks or max(CHUNK_CANDIDATES)
    return message_count(layout, num_micro_batches, most) > REDUCE_ABOVE_MESSAGES


def _layout_costs(
    costs: InstrCosts | None,
    workload: Workload,
    cluster: ClusterConfig,
    attn_workers: int,
    expert_workers: int,
    recompute: str,
    recomputed: frozenset[int] | None = None,
) -> InstrCosts:
    """`costs` for this layout (None: the cluster's analytic ones; a measured costs file is
    priced for the layout's m, n and recompute, on the layers of `recomputed` where given)."""
    costs = costs or AnalyticCosts.for_cluster(
        workload, cluster, attn_workers, expert_workers, recompute, recomputed
    )
    if isinstance(costs, MeasuredCosts):  # one costs file, priced for this layout
        costs = costs.bound_to(workload, attn_workers, expert_workers, recompute, recomputed)
    return costs


def _network(
    cluster: ClusterConfig, layout: Layout, placement: str, nic_split: tuple[int, int] | None
) -> Network:
    """The cluster's network; with `nic_split`, the NICs of a node shared M_a:M_f between
    its A and F workers (`simulator.placement`)."""
    net = Network.from_cluster(cluster)
    if nic_split is None:
        return net
    if placement != "node-aware":
        raise ValueError("a NIC split pools a node's NICs: use placement 'node-aware'")
    return dataclasses.replace(net, nic_share=nic_shares(layout, net, *nic_split))


@dataclass(frozen=True, slots=True)
class _Pick:
    """What the step runs: lane order, generator costs, exchange chunks, split backward."""

    order: str
    costed: bool
    exchange_chunks: int
    split_backward: bool
    schedule_costs: ScheduleCosts | None  # the run's costs when `costed`, else None (nominal)
    chosen: dict[str, Any]  # what `choose_order` was asked and its candidates' steps, or {}


def _pick(
    layout: Layout,
    slots: int,
    max_in_flight: int,
    num_micro_batches: int,
    costs: InstrCosts,
    workload: Workload,
    net: Network,
    *,
    order: str,
    costed: bool,
    exchange_chunks: int,
    split_backward: bool | None,
    recompute: str,
    link_model: LinkModel,
    reduce: bool,
    overlap_sync: bool,
) -> _Pick:
    """The request's order, costs, chunks and split where it names them all; else
    `choose_order`'s best candidate among what it leaves open (order auto, chunks 0,
    split None; whole backwards only under recompute)."""
    if order != "auto" and exchange_chunks != 0 and split_backward is not None:
        priced = schedule_costs(layout, num_micro_batches, costs, workload, net) if costed else None
        return _Pick(order, costed, exchange_chunks, split_backward, priced, {})
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
    return _Pick(
        choice.order, choice.costed, choice.exchange_chunks, choice.split_backward,
        priced if choice.costed else None, chosen,
    )  # fmt: skip


def _step_config(
    cluster: ClusterConfig,
    layout: Layout,
    workload: Workload,
    num_micro_batches: int,
    nic_split: tuple[int, int] | None,
    recompute: str,
    link_model: LinkModel,
    pick: _Pick,
    recompute_layers: int = 0,
) -> dict[str, Any]:
    """The result's config: the request, then what it resolved to (`pick`)."""
    return {
        **({"recompute_layers": recompute_layers} if recompute_layers else {}),
        "model": workload.model.name,
        "cluster": cluster.name,
        "groups": layout.groups,
        "attn_workers": layout.attn_workers,
        "expert_workers": layout.expert_workers,
        "seq_len": workload.seq_len,
        "micro_batch_size": workload.micro_batch_size,
        "loss_chunk_tokens": workload.loss_chunk_tokens,
        "micro_batches": num_micro_batches,
        "placement": layout.placement,
        "nic_split": list(nic_split) if nic_split else None,
        "recompute": recompute,
        "order": pick.order,
        "costed": pick.costed,
        "exchange_chunks": pick.exchange_chunks,
        "split_backward": pick.split_backward,
        "link_model": link_model,
        **pick.chosen,
    }
