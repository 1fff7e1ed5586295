"""Stage 3: profile-guided local search around the MILP seed (Algorithm 1).

`local_search` is generic: from the current best it makes K random moves (each a call to
`propose(best, rng)`), scores every feasible candidate with `profile`, and keeps a candidate
only when it is strictly better. The seed is scored first, so the result is never worse than
the seed under the profile it was given, and a fixed `seed` makes the walk reproducible.

`descend` is its deterministic closing pass: from the incumbent it scores every neighbour
(`neighbours(best)`) and moves to the best one while that improves the score by more than a
relative `TIE`, so the result is a local minimum of the neighbourhood, which K random moves
alone do not promise (one neighbour among the dozens a move can reach is drawn with a few
percent chance per move).

`refine_plan` applies both to plans (`PlanMoves`): a move changes the attention GPUs m and
the attention NICs M_a of every group (n and M_f follow from the group's totals), the
in-flight cap, or the recompute mode, keeping p; infeasible moves (memory, locality, n > E)
are skipped. The random moves come first, then the descent over the unit steps (not under
a run's global batch: `refine_plan`). The profile is any `profile(plan) -> seconds per
step`: the analytic AF-Pipe model (`plan.AnalyticProfile`), the simulator
(`sim_profile.SimulatorProfile`), or a measured short run; plans are compared by seconds
per sequence trained (`plan.score`) because m changes the sequences per step.
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
    history: tuple[float, ...]  # best score after each move (random moves, then descent)
    descended: int = 0  # of `improved`, steps taken by the closing descent


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


TIE = 1e-9  # relative: a descent step must improve the score by more than this


def descend(
    start: SearchResult[T],
    *,
    neighbours: Callable[[T], list[T]],
    objective: Callable[[T], float],
    max_steps: int = 64,
) -> SearchResult[T]:
    """Steepest descent from `start.best`: move to the best-scoring neighbour while it is
    better than the incumbent by more than a relative `TIE` (at most `max_steps` moves;
    among equal neighbours the first). A tie is no step: a profile that prices two plans
    alike by different arithmetic (64 experts on 63 shards against 64 in the analytic
    profile's continuous share) differs in the last bits only."""
    best, best_score = start.best, start.best_score
    evaluated, steps = start.evaluated, 0
    history = list(start.history)
    while steps < max_steps:
        scored = [(objective(cand), i, cand) for i, cand in enumerate(neighbours(best))]
        evaluated += len(scored)
        if not scored:
            break
        value, _, cand = min(scored, key=lambda item: item[:2])
        if not value < best_score - TIE * abs(best_score):
            break
        best, best_score = cand, value
        steps += 1
        history.append(best_score)
    return dataclasses.replace(
        start,
        best=best,
        best_score=best_score,
        evaluated=evaluated,
        improved=start.improved + steps,
        history=tuple(history),
        descended=steps,
    )


def even_load_replicas(planner: Planner, plan: Plan) -> list[int]:
    """The replica counts m of `plan`'s group whose n shards are the fewest that hold
    the busiest shard's expert count (ceil(E/n)), or one expert less: shards as even as
    that load allows, the rest of the group's GPUs attention replicas."""
    experts = planner.model.num_experts
    per_group = plan.attn_gpus_per_group + plan.ffn_gpus_per_group
    load = -(-experts // plan.ffn_gpus_per_group)
    return [per_group - -(-experts // target) for target in (load, load - 1) if target >= 1]


class PlanMoves:
    """Moves over what the runtime can run, p fixed; a move is None when infeasible.

    `propose` (random, for `local_search`): half the moves change the split: m and M_a by
    up to r each, n = G/p - m and M_f follow (uneven shards: any n <= E), or n jumps to the
    fewest shards that keep the busiest shard's expert count ceil(E/n), or that hold one
    expert less (the expert time follows that count, so the space between such n is flat and
    a step of r cannot cross it). The others change the in-flight cap by up to r (at most
    the plan's micro-batches, at least 1) or jump to the most the memory admits, or flip
    the recompute mode (none <-> full, when `recompute` is auto) keeping the cap where the
    memory still admits it.

    `neighbours` (for `descend`): the same kinds of move at unit steps, all of them: m and
    M_a by -1, 0 or +1 each, the even-shard jumps, the cap by one or to the memory's most,
    the recompute flip. Every point is profiled once (cached by its key).
    """

    def __init__(self, planner: Planner, profile: Profile, radius: int) -> None:
        if radius < 1:
            raise ValueError(f"search radius must be >= 1, got {radius}")
        self.planner, self.profile, self.radius = planner, profile, radius
        self.flip = {"none": "full", "full": "none"} if planner.options.recompute == "auto" else {}
        self.cache: dict[tuple[int, int, int, int, str], Plan | None] = {}

    def most_in_flight(self, plan: Plan, recompute: str) -> int:
        k = memory_in_flight(self.planner, plan.groups, plan.attn_gpus_per_group, recompute)
        return min(k, plan.micro_batches)

    def candidate(self, plan: Plan, m: int, ma: int, k: int, mode: str) -> Plan | None:
        """`plan` with split m : M_a, cap k and recompute `mode`, profiled; None if it
        does not fit. With a global batch the cap is what the split's batch admits."""
        planner = self.planner
        binding = plan.memory_binding
        per_group = planner.gpus // plan.groups
        if planner.options.global_batch and 1 <= m < per_group:  # what its split admits
            k, binding = batch_in_flight(planner, plan.groups, m, mode)
        key = (plan.groups, m, ma, k, mode)
        if key not in self.cache:  # each point is profiled at most once
            self.cache[key] = planner.evaluate(
                groups=plan.groups,
                m=m,
                attn_nics=ma,
                in_flight=k,
                recompute=mode,
                profile=self.profile,
                memory_binding=binding,
                solver=plan.solver,
                stage="search",
            )
        return self.cache[key]

    def propose(self, plan: Plan, rng: random.Random) -> Plan | None:
        m, ma, k, mode = (
            plan.attn_gpus_per_group, plan.attn_nics_per_group, plan.in_flight, plan.recompute
        )  # fmt: skip
        radius = self.radius
        kind = rng.random()
        if kind < 0.15:  # the fewest shards at the busiest shard's load, or one expert less
            m = rng.choice(even_load_replicas(self.planner, plan))
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
            k = rng.choice([*(k + d for d in steps), self.most_in_flight(plan, mode)])
        elif self.flip:
            mode = self.flip[mode]
            k = min(k, self.most_in_flight(plan, mode))
        else:
            return None
        return self.candidate(plan, m, ma, k, mode)

    def neighbours(self, plan: Plan) -> list[Plan]:
        m, ma, k, mode = (
            plan.attn_gpus_per_group, plan.attn_nics_per_group, plan.in_flight, plan.recompute
        )  # fmt: skip
        points = [(m + dm, ma + dn, k, mode) for dm in (-1, 0, 1) for dn in (-1, 0, 1)]
        points += [(jump, ma, k, mode) for jump in even_load_replicas(self.planner, plan)]
        caps = {k - 1, k + 1, self.most_in_flight(plan, mode)}
        points += [(m, ma, cap, mode) for cap in sorted(caps) if 1 <= cap <= plan.micro_batches]
        if self.flip:
            other = self.flip[mode]
            points.append((m, ma, min(k, self.most_in_flight(plan, other)), other))
        here = (m, ma, k, mode)
        out = [self.candidate(plan, *point) for point in dict.fromkeys(points) if point != here]
        return [cand for cand in out if cand is not None]


def refine_plan(
    planner: Planner,
    seed: Plan,
    profile: Profile | None = None,
    *,
    moves: int | None = None,
    radius: int | None = None,
    seed_rng: int | None = None,
) -> SearchResult[Plan]:
    """Stage 3 on a plan from `seed_plan`: K random moves, then the descent over unit
    steps to a local minimum; defaults come from `planner.options`.

    With a global batch (`options.global_batch`, a run's batch: `simulate`, `train --plan
    auto`) the descent is skipped: there every candidate holds the most slots the batch
    and memory admit (`PlanMoves.candidate`), while the run then lowers the cap where that
    is faster (`simulate_cli._fewer_in_flight`), so a descent on splits scored at the
    highest cap optimises a cap the run does not keep."""
    opts = planner.options
    prof = profile or AnalyticProfile(planner)
    k = opts.search_moves if moves is None else moves
    r = opts.search_radius if radius is None else radius
    rng_seed = opts.seed if seed_rng is None else seed_rng
    mover = PlanMoves(planner, prof, r)

    def objective(plan: Plan) -> float:  # candidates carry step_time_s from `prof` already
        return score(plan, plan.step_time_s)

    walked = local_search(
        dataclasses.replace(seed, step_time_s=prof(seed)),
        propose=mover.propose,
        objective=objective,
        moves=k,
        seed_rng=rng_seed,
    )
    if opts.global_batch:
        return walked
    return descend(walked, neighbours=mover.neighbours, objective=objective)
