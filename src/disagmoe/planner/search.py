"""Stage 3: profile-guided local search around the MILP seed (Algorithm 1).

`local_search` is generic: from the current best it makes K random moves (each a call to
`propose(best, rng)`), scores every feasible candidate with `profile`, and keeps a candidate
only when it is strictly better. The seed is scored first, so the result is never worse than
the seed under the profile it was given, and a fixed `seed` makes the walk reproducible.

`refine_plan` applies it to plans (`plan_mover`): a move changes the attention GPUs m and
the attention NICs M_a of every group (n and M_f follow from the group's totals), the
in-flight cap, or the recompute mode, keeping p; infeasible moves (memory, locality, n > E)
are skipped. The profile is any `profile(plan) -> seconds per step`: the analytic AF-Pipe
model (`plan.AnalyticProfile`), the simulator (`sim_profile.SimulatorProfile`), or a
measured short run; plans are compared by
seconds per sequence trained (`plan.score`) because m changes the sequences per step.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from disagmoe.planner.plan import AnalyticProfile, Plan, Planner, Profile, score
from disagmoe.planner.seed import batch_in_flight
from disagmoe.planner.split import memory_in_flight

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchResult(Generic[T]):
    best: T
    best_score: float
    seed_score: float
    evaluated: int  # candidates scored (feasible proposals), seed excluded
    improved: int  # accepted moves
    history: tuple[float, ...]  # best score after each move


def local_search(
    seed: T,
    *,
    propose: Callable[[T, random.Random], T | None],
    objective: Callable[[T], float],
    moves: int,
    seed_rng: int = 0,
) -> SearchResult[T]:
    """K random moves from the incumbent; keep strict improvements (lower is better)."""
    if moves < 0:
        raise ValueError(f"moves must be >= 0, got {moves}")
    rng = random.Random(seed_rng)
    best, best_score = seed, objective(seed)
    seed_score = best_score
    evaluated = improved = 0
    history: list[float] = []
    for _ in range(moves):
        cand = propose(best, rng)
        if cand is not None:
            value = objective(cand)
            evaluated += 1
            if value < best_score:
                best, best_score = cand, value
                improved += 1
        history.append(best_score)
    return SearchResult(
        best=best,
        best_score=best_score,
        seed_score=seed_score,
        evaluated=evaluated,
        improved=improved,
        history=tuple(history),
    )


def even_load_replicas(planner: Planner, plan: Plan) -> list[int]:
    """The replica counts m of `plan`'s group whose n shards are the fewest that hold
    the busiest shard's expert count (ceil(E/n)), or one expert less: shards as even as
    that load allows, the rest of the group's GPUs attention replicas."""
    experts = planner.model.num_experts
    per_group = plan.attn_gpus_per_group + plan.ffn_gpus_per_group
    load = -(-experts // plan.ffn_gpus_per_group)
    return [per_group - -(-experts // target) for target in (load, load - 1) if target >= 1]


def plan_mover(
    planner: Planner, profile: Profile, radius: int
) -> Callable[[Plan, random.Random], Plan | None]:
    """Random moves over what the runtime can run, p fixed; None when infeasible.

    Half the moves change the split: m and M_a by up to r each, n = G/p - m and M_f follow
    (uneven shards: any n <= E), or n jumps to the fewest shards that keep the busiest
    shard's expert count ceil(E/n), or that hold one expert less (the expert time follows
    that count, so the space between such n is flat and a step of r cannot cross it). The others change the in-flight cap by up to r (at most
    the plan's micro-batches, at least 1) or jump to the most the memory admits, or flip
    the recompute mode (none <-> full, when `recompute` is auto) keeping the cap where the
    memory still admits it.
    """
    if radius < 1:
        raise ValueError(f"search radius must be >= 1, got {radius}")
    flip = {"none": "full", "full": "none"} if planner.options.recompute == "auto" else {}
    cache: dict[tuple[int, int, int, int, str], Plan | None] = {}

    def most_in_flight(plan: Plan, recompute: str) -> int:
        k = memory_in_flight(planner, plan.groups, plan.attn_gpus_per_group, recompute)
        return min(k, plan.micro_batches)

    def propose(plan: Plan, rng: random.Random) -> Plan | None:
        m, ma, k, mode = (
            plan.attn_gpus_per_group, plan.attn_nics_per_group, plan.in_flight, plan.recompute
        )  # fmt: skip
        kind = rng.random()
        if kind < 0.15:  # the fewest shards at the busiest shard's load, or one expert less
            m = rng.choice(even_load_replicas(planner, plan))
            if m == plan.attn_gpus_per_group:
                return None
        elif kind < 0.5:
            dm = rng.randint(-radius, radius)
            dn = rng.randint(-radius, radius)
            if dm == 0 and dn == 0:
                dm = rng.choice((-1, 1))
            m, ma = m + dm, ma + dn
        elif kind < 0.8:
            steps = [
                d for d in range(-radius, radius + 1) if d and 1 <= k + d <= plan.micro_batches
            ]
            k = rng.choice([*(k + d for d in steps), most_in_flight(plan, mode)])
        elif flip:
            mode = flip[mode]
            k = min(k, most_in_flight(plan, mode))
        else:
            return None
        binding = plan.memory_binding
        per_group = planner.gpus // plan.groups
        if planner.options.global_batch and 1 <= m < per_group:  # what its split admits
            k, binding = batch_in_flight(planner, plan.groups, m, mode)
        key = (plan.groups, m, ma, k, mode)
        if key not in cache:  # each point is profiled at most once
            cache[key] = planner.evaluate(
                groups=plan.groups,
                m=m,
                attn_nics=ma,
                in_flight=k,
                recompute=mode,
                profile=profile,
                memory_binding=binding,
                solver=plan.solver,
                stage="search",
            )
        return cache[key]

    return propose


def refine_plan(
    planner: Planner,
    seed: Plan,
    profile: Profile | None = None,
    *,
    moves: int | None = None,
    radius: int | None = None,
    seed_rng: int | None = None,
) -> SearchResult[Plan]:
    """Stage 3 on a plan from `seed_plan`; defaults come from `planner.options`."""
    opts = planner.options
    prof = profile or AnalyticProfile(planner)
    k = opts.search_moves if moves is None else moves
    r = opts.search_radius if radius is None else radius
    rng_seed = opts.seed if seed_rng is None else seed_rng

    def objective(plan: Plan) -> float:  # candidates carry step_time_s from `prof` already
        return score(plan, plan.step_time_s)

    return local_search(
        dataclasses.replace(seed, step_time_s=prof(seed)),
        propose=plan_mover(planner, prof, r),
        objective=objective,
        moves=k,
        seed_rng=rng_seed,
    )
