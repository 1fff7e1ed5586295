"""The planner's split as the simulator and the bench run it (`planned_split`), and the
most micro-batches in flight a given split holds by the runtime's memory model (the one
`train` caps its in-flight micro-batches with; `Planner.worker_memory`).

These call the planner and are called by `disagmoe simulate`, the bench and Stage 3's
moves; they live here, not in `simulator`, so that the simulator never imports the
planner (the planner's simulator profile imports the simulator).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config import LOSS_CHUNK_TOKENS, ClusterConfig, ModelConfig
from ..costs.flops import expert_flops, train_factors
from ..simulator.costs import Workload
from .options import run_replays


@dataclass(frozen=True, slots=True)
class PlannedSplit:
    groups: int
    attn_workers: int
    expert_workers: int
    attn_nics: int  # per group, the planner's M_a
    ffn_nics: int  # per group, the planner's M_f
    in_flight: int  # micro-batches a worker may hold: the planner's memory limit
    recompute: str  # the planner's activation recompute: none | attn | full
    note: str  # how the planner's answer was adapted


def memory_in_flight(planner: Any, groups: int, m: int, recompute: str) -> int:
    """Most micro-batches in flight the split with m replicas per group holds on a GPU by the
    runtime's memory model (`Planner.max_in_flight`, as `train` caps it), at least 1."""
    return max(1, planner.max_in_flight(groups, m, recompute))


def split_planner(
    model: ModelConfig,
    cluster: ClusterConfig,
    *,
    gpus: int,
    seq_len: int,
    micro_batch_size: int,
    groups: int,
    split_backward: bool = False,
    loss_chunk_tokens: int = LOSS_CHUNK_TOKENS,
) -> Any:
    """A `Planner` of p = `groups` whose memory model (`worker_memory`, `max_in_flight`)
    prices a given split; `split_backward`: with room for deferred weight gradients;
    `loss_chunk_tokens`: the run's `train.loss_chunk_tokens`."""
    from .plan import Planner, PlanOptions

    options = PlanOptions(
        groups=groups, split_backward="on" if split_backward else "off",
        loss_chunk_tokens=loss_chunk_tokens,
    )  # fmt: skip
    return Planner(
        model=model, cluster=cluster, gpus=gpus, seq_len=seq_len,
        micro_batch_size=micro_batch_size, options=options,
    )  # fmt: skip


def runnable_in_flight(
    model: ModelConfig,
    cluster: ClusterConfig,
    *,
    gpus: int,
    seq_len: int,
    micro_batch_size: int,
    groups: int,
    attn_workers: int,
    recompute: str,
) -> int:
    """`memory_in_flight` for a given split."""
    planner = split_planner(
        model, cluster, gpus=gpus, seq_len=seq_len, micro_batch_size=micro_batch_size,
        groups=groups,
    )  # fmt: skip
    return memory_in_flight(planner, groups, attn_workers, recompute)


def memory_error(
    planner: Any, groups: int, m: int, in_flight: int, recompute: str, layers: int = 0
) -> str:
    """One line, or "" when the split with m replicas per group and `in_flight` micro-batches
    fits the planner's budget: the role that does not, by how much, and what to change
    (`layers`: `train.recompute_layers`)."""
    from ..costs.costmodel import GIB

    attn, ffn = planner.worker_memory(groups, m, in_flight, recompute, layers)
    role, mem = max((("attention replica", attn), ("expert shard", ffn)), key=lambda r: r[1].total)
    cap = planner.cap_bytes
    if mem.total <= cap:
        return ""
    parts = [f"states {mem.states / GIB:.1f}", f"activations {mem.activations / GIB:.1f}"]
    parts += [f"logits {mem.transient / GIB:.1f}"] if mem.transient else []
    parts += [f"deferred gradients {mem.deferred / GIB:.1f}"] if mem.deferred else []
    fixes = [] if recompute == "full" and not layers else ["--recompute full"]
    if layers:
        fixes = ["more --recompute-layers (0: every layer)"]
    fits = planner.max_in_flight(groups, m, recompute, layers)
    if 1 <= fits < in_flight:
        fixes.append(f"--max-in-flight {fits}")
    fixes.append("more GPUs (--nodes)" if role == "expert shard" else "more --groups or GPUs")
    fix = ", ".join(fixes[:-1]) + (", or " if len(fixes) > 1 else "") + fixes[-1]
    return (
        f"the {role} of p={groups}, m={m}, n={planner.gpus // groups - m} with recompute "
        f"{recompute}{f' on {layers} layer(s) per group' if layers else ''} and {in_flight} "
        f"micro-batch(es) in flight needs {mem.total / GIB:.1f} GiB "
        f"({', '.join(parts)}), {(mem.total - cap) / GIB:.1f} GiB over the "
        f"{cap / GIB:g} GiB of a GPU; use {fix}"
    )


def planned_split(
    model: ModelConfig,
    cluster: ClusterConfig,
    *,
    gpus: int,
    seq_len: int,
    micro_batch_size: int,
    groups: int = 0,
    micro_batches: int = 0,
    split_backward: bool = False,
    recompute: str = "auto",
    loss_chunk_tokens: int = LOSS_CHUNK_TOKENS,
    order: str = "breadth",
    exchange_chunks: int = 1,
    costs: Any = None,
) -> PlannedSplit:
    """The planner's (p, m, n, M_a, M_f), in-flight cap and recompute choice.

    The split is the planner's own (its MILP keeps n <= E; the runtime runs uneven
    shards and replicas). `micro_batches` (the run's global count), when given, is planned
    for: the simulator profile (`sim_profile`) scores each plan at that batch with the
    in-flight count the memory admits, and m never exceeds it (docs/planner.md "For a
    run's batch"); without it the analytic profile plans at the planner's own count.
    `split_backward`: room for deferred weight gradients; `recompute`: the planner's
    choice (auto) or the one given; `loss_chunk_tokens`: the run's
    `train.loss_chunk_tokens`, which the memory model prices; `order`, `exchange_chunks`
    (`schedule.*`) and `costs` (measured per-op costs, `schedule.costs_file`): what the
    simulator profile replays, the run's own (exchange chunks 0: one, `run_replays`). In
    flight: the most micro-batches that split holds by the runtime's memory model.
    """
    from . import plan_for

    plan = plan_for(
        model, cluster, gpus=gpus, seq_len=seq_len, micro_batch_size=micro_batch_size,
        groups=groups, split_backward="on" if split_backward else "off", recompute=recompute,
        layers_stage=False,  # simulate searches the recomputed layers itself, in every order
        global_batch=micro_batches * micro_batch_size,
        profile="auto" if micro_batches else "analytic", loss_chunk_tokens=loss_chunk_tokens,
        order=order, exchange_chunks=run_replays(exchange_chunks, "off")[0],
        costs=costs if micro_batches else None,
    )  # fmt: skip
    p, m, ma = plan.groups, plan.attn_gpus_per_group, plan.attn_nics_per_group
    n = gpus // p - m
    assert not micro_batches or m <= micro_batches, (m, micro_batches)  # the MILP's bound
    assert n <= model.num_experts, (n, model.num_experts)  # the MILP's constraint
    planner = split_planner(
        model, cluster, gpus=gpus, seq_len=seq_len, micro_batch_size=micro_batch_size,
        groups=p, split_backward=split_backward, loss_chunk_tokens=loss_chunk_tokens,
    )  # fmt: skip
    k = memory_in_flight(planner, p, m, plan.recompute)
    return PlannedSplit(
        groups=p,
        attn_workers=m,
        expert_workers=n,
        attn_nics=ma,
        ffn_nics=plan.ffn_nics_per_group,
        in_flight=k,
        recompute=plan.recompute,
        note=f"planner m={m}, n={n}, M_a={ma}; memory allows {k} in flight",
    )


def default_disagg_split(
    model: ModelConfig,
    cluster: ClusterConfig,
    gpus: int,
    seq_len: int,
    groups: int,
    micro_batches: int = 0,
) -> tuple[int, int]:
    """(m, n) with m + n = gpus/groups balancing attention and expert compute per layer.

    A replica's attention takes a per layer, the largest shard's experts take
    m*f*ceil(E/n)/E (f: one replica's routed experts on one GPU; m*f/n when n | E), so
    m/n ~ a/f balances them; any n <= E (uneven shards) and m <= `micro_batches`, when
    given.
    """
    per = gpus // groups
    w = Workload(model, seq_len, 1)
    gemm, core = w.attn_flops(model.num_layers - 1)
    gemm_factor, core_factor = train_factors()
    a = gemm * gemm_factor + core * core_factor
    f = expert_flops(model, w.tokens * model.top_k) * gemm_factor
    best: tuple[float, int, int] | None = None
    for n in range(1, min(model.num_experts, per - 1) + 1):
        m = per - n
        if micro_batches and micro_batches < m:
            continue
        share = -(-model.num_experts // n) / model.num_experts  # the largest shard's
        cost = max(a, m * f * share)  # stage time per replica micro-batch, per layer
        score = cost / m  # time per micro-batch of the whole group
        if best is None or score < best[0]:
            best = (score, m, n)
    if best is None:
        raise ValueError(f"{per} GPUs per group leave no room for attention and expert workers")
    return best[1], best[2]
