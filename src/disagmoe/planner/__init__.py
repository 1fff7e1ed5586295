"""Adaptive worker allocation (docs/design.md §2.4): roofline cost model, MILP, local search.

`plan_for` is the one-call API used by `disagmoe plan` and `disagmoe train --plan auto`:
stages 1-2 (MILP or enumeration) for every candidate group count p, the best seed by the
profile, then stage 3 (profile-guided local search) unless `roofline_only`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from disagmoe.config import ClusterConfig, ModelConfig
from disagmoe.planner.plan import AnalyticProfile, Plan, Planner, PlanOptions, Profile, seed_plan
from disagmoe.planner.search import SearchResult, local_search, refine_plan

__all__ = [
    "AnalyticProfile",
    "Plan",
    "PlanOptions",
    "Planner",
    "Profile",
    "SearchResult",
    "local_search",
    "plan_for",
    "refine_plan",
    "seed_plan",
]


def plan_for(
    model: ModelConfig,
    cluster: ClusterConfig,
    *,
    gpus: int,
    seq_len: int,
    micro_batch_size: int,
    profile: Profile | None = None,
    **options: Any,
) -> Plan:
    """Best plan for `gpus` GPUs of `cluster`; `options` are `PlanOptions` fields.

    Raises ValueError naming the binding constraint when no plan is feasible.
    """
    unknown = set(options) - {f.name for f in dataclasses.fields(PlanOptions)}
    if unknown:
        raise ValueError(f"unknown planner option(s): {', '.join(sorted(unknown))}")
    planner = Planner(
        model=model,
        cluster=cluster,
        gpus=gpus,
        seq_len=seq_len,
        micro_batch_size=micro_batch_size,
        options=PlanOptions(**options),
    )
    prof = profile or AnalyticProfile(planner)
    seed = seed_plan(planner, prof)
    if planner.options.roofline_only or planner.options.search_moves == 0:
        return seed
    return refine_plan(planner, seed, prof).best
