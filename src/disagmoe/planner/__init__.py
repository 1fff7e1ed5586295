"""Adaptive worker allocation (docs/design.md §2.4): roofline cost model, MILP, local search.

`plan_for` is the one-call API used by `disagmoe plan` and `disagmoe train --plan auto`:
stages 1-2 (MILP or enumeration) for every candidate group count p, the best seed by the
profile, then stage 3 (profile-guided local search) unless `roofline_only`. The profile is
`PlanOptions.profile` (analytic formula or the simulator, `planner.sim_profile`) unless a
`profile_fn` callable is given.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from disagmoe.config import ClusterConfig, ModelConfig
from disagmoe.planner.plan import AnalyticProfile, Plan, Planner, PlanOptions, Profile
from disagmoe.planner.search import SearchResult, local_search, refine_plan
from disagmoe.planner.seed import seed_plan
from disagmoe.planner.sim_profile import SimulatorProfile, plan_with_profile
from disagmoe.simulator.costs import InstrCosts

__all__ = [
    "AnalyticProfile",
    "Plan",
    "PlanOptions",
    "Planner",
    "Profile",
    "SearchResult",
    "SimulatorProfile",
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
    profile_fn: Profile | None = None,
    costs: InstrCosts | None = None,
    **options: Any,
) -> Plan:
    """Best plan for `gpus` GPUs of `cluster`; `options` are `PlanOptions` fields.

    `profile_fn`: a custom `profile(plan) -> seconds per step` for every stage (overrides
    `options["profile"]`); `costs`: per-op costs for the simulator profile (default analytic).

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
    if profile_fn is None:
        return plan_with_profile(planner, costs)
    seed = seed_plan(planner, profile_fn)
    if planner.options.roofline_only or planner.options.search_moves == 0:
        return seed
    return refine_plan(planner, seed, profile_fn).best
