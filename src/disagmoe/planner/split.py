"""The planner's split as the simulator and the bench run it (`planned_split`), and the
most micro-batches in flight its memory model admits for a given split.

These call the planner and are called by `disagmoe simulate`, the bench and Stage 3's
moves; they live here, not in `simulator`, so that the simulator never imports the
planner (the planner's simulator profile imports the simulator).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config import ClusterConfig, ModelConfig


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


def memory_in_flight(planner: Any, groups: int, m: int, attn_nics: int, recompute: str) -> int:
    """Most micro-batches in flight the planner's memory model admits (at least 1).

    Memory grows with the count in flight, so the admitted counts are 1..k: a bisection
    over [1, what fits on the attention side] (a small model admits thousands; a scan
    down from there took the planner tens of seconds). A split that no count admits
    (its other constraints fail) gives 1, as a scan would.
    """

    def fits(k: int) -> bool:
        plan = planner.evaluate(
            groups=groups, m=m, attn_nics=attn_nics, in_flight=k, recompute=recompute
        )
        return plan is not None

    lo, hi = 1, max(1, planner.max_in_flight_attn(groups, recompute))
    if fits(hi):
        return hi
    while hi - lo > 1:  # fits(lo) or lo == 1; not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


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
    """`memory_in_flight` for a given split (one fair NIC share per GPU)."""
    from .plan import Planner, PlanOptions

    planner = Planner(
        model=model, cluster=cluster, gpus=gpus, seq_len=seq_len,
        micro_batch_size=micro_batch_size, options=PlanOptions(groups=groups),
    )  # fmt: skip
    nics = planner.problem(groups, 1, recompute).nics
    ma = max(1, min(nics - 1, round(nics * attn_workers / (gpus // groups))))
    return memory_in_flight(planner, groups, attn_workers, ma, recompute)


def planned_split(
    model: ModelConfig,
    cluster: ClusterConfig,
    *,
    gpus: int,
    seq_len: int,
    micro_batch_size: int,
    groups: int = 0,
    micro_batches: int = 0,
) -> PlannedSplit:
    """The planner's (p, m, n, M_a, M_f), in-flight cap and recompute choice.

    The split is the planner's own (its MILP keeps n <= E; the runtime runs uneven
    shards and replicas); `micro_batches`, when given, must leave every one of the m
    replicas at least one. In flight: the most micro-batches its memory model admits
    for that split. (The plan's own `in_flight` stops at its ring length 2p — enough to
    keep the 2p compute components busy, but AF-Pipe also has 2p exchange stages to
    overlap.)
    """
    from . import plan_for
    from .plan import Planner, PlanOptions

    plan = plan_for(
        model, cluster, gpus=gpus, seq_len=seq_len, micro_batch_size=micro_batch_size,
        groups=groups,
    )  # fmt: skip
    p, m, ma = plan.groups, plan.attn_gpus_per_group, plan.attn_nics_per_group
    n = gpus // p - m
    if micro_batches and micro_batches < m:
        raise ValueError(
            f"the planner's split has m={m} attention replicas per group but there are only "
            f"{micro_batches} micro-batches; give at least {m} (--micro-batches)"
        )
    assert n <= model.num_experts, (n, model.num_experts)  # the MILP's constraint
    planner = Planner(
        model=model, cluster=cluster, gpus=gpus, seq_len=seq_len,
        micro_batch_size=micro_batch_size, options=PlanOptions(groups=p),
    )  # fmt: skip
    k = memory_in_flight(planner, p, m, ma, plan.recompute)
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
