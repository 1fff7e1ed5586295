"""Stage 3: the local search never returns worse than its seed and is reproducible."""

from __future__ import annotations

import dataclasses
import random
import zlib
from collections.abc import Callable

import pytest

from disagmoe.planner import AnalyticProfile, Plan, Planner, PlanOptions, refine_plan, seed_plan
from disagmoe.planner.plan import ring_length, score
from disagmoe.planner.search import PlanMoves, descend, local_search
from disagmoe.presets import CLUSTER_PRESETS, MODEL_PRESETS


def step(x: int, rng: random.Random) -> int | None:
    y = x + rng.randint(-3, 3)
    return y if 0 <= y <= 100 else None


@pytest.mark.parametrize("seed", range(20))
def test_never_worse_than_seed_under_arbitrary_objectives(seed: int) -> None:
    table = random.Random(seed)
    values = [table.random() for _ in range(101)]
    res = local_search(50, propose=step, objective=lambda x: values[x], moves=40, seed_rng=seed)
    assert res.best_score <= res.seed_score == values[50]
    assert res.best_score == values[res.best]
    assert list(res.history) == sorted(res.history, reverse=True)


def test_search_finds_the_minimum_of_a_smooth_objective_and_is_deterministic() -> None:
    def run() -> int:
        return local_search(10, propose=step, objective=lambda x: (x - 70) ** 2, moves=200,
                            seed_rng=7).best  # fmt: skip

    assert run() == 70 and run() == run()
    assert local_search(10, propose=step, objective=float, moves=0).best == 10


def test_descent_walks_unit_steps_to_a_local_minimum() -> None:
    start = local_search(10, propose=step, objective=lambda x: (x - 70) ** 2, moves=0)
    res = descend(start, neighbours=lambda x: [x - 1, x + 1],
                  objective=lambda x: (x - 70) ** 2, max_steps=100)  # fmt: skip
    assert res.best == 70 and res.descended == res.improved == 60
    assert list(res.history) == sorted(res.history, reverse=True)
    # a plateau stops it: only strict improvements move
    level = local_search(10, propose=step, objective=lambda x: 0.0, moves=0)
    flat = descend(level, neighbours=lambda x: [x - 1, x + 1], objective=lambda x: 0.0)
    assert flat.best == 10 and flat.descended == 0

    def bits(x: int) -> float:  # differences in the last bits only
        return 1.0 - 1e-13 * x

    near = local_search(10, propose=step, objective=bits, moves=0)
    assert descend(near, neighbours=lambda x: [x + 1], objective=bits).best == 10
    capped = descend(start, neighbours=lambda x: [x + 1], objective=lambda x: -x, max_steps=5)
    assert capped.best == 15


def planner() -> Planner:
    return Planner(model=MODEL_PRESETS["qwen3-30b-a3b"], cluster=CLUSTER_PRESETS["h800"],
                   gpus=64, seq_len=8192, micro_batch_size=1,
                   options=PlanOptions(groups=1, recompute="none"))  # fmt: skip


def prefers_replicas(target: int) -> Callable[[Plan], float]:
    """A stand-in for a measured run: fastest per sequence at `target` replicas."""

    def profile(plan: Plan) -> float:
        return plan.sequences_per_step * (1.0 + abs(plan.attn_gpus_per_group - target) / 10)

    return profile


def test_refine_plan_follows_a_pluggable_profile() -> None:
    pl = planner()
    seed = seed_plan(pl)

    target = seed.attn_gpus_per_group - 6  # (more attention GPUs would not fit FFN memory)
    res = refine_plan(pl, seed, prefers_replicas(target), moves=60, radius=3, seed_rng=1)
    assert res.best.attn_gpus_per_group == target and res.best.stage == "search"
    assert res.best_score < res.seed_score and res.improved >= 1


def test_refine_plan_ends_where_no_unit_step_is_better() -> None:
    """No random move at all: the descent alone walks m to the profile's best, and no
    neighbour of the result (m and M_a by one, the cap, the even-shard jumps) beats it."""
    pl = planner()
    seed = seed_plan(pl)
    target = seed.attn_gpus_per_group - 4
    prefers = prefers_replicas(target)
    res = refine_plan(pl, seed, prefers, moves=0)
    assert res.best.attn_gpus_per_group == target and res.descended == res.improved >= 1
    best = score(res.best, res.best.step_time_s)
    around = PlanMoves(pl, prefers, radius=1).neighbours(res.best)
    assert around and all(score(p, p.step_time_s) >= best for p in around)


def test_no_descent_under_a_runs_global_batch() -> None:
    """With a global batch every candidate holds the most slots it admits, which the run
    then lowers: stage 3 keeps the random walk's plan rather than descend at that cap."""
    pl = Planner(model=MODEL_PRESETS["qwen3-30b-a3b"], cluster=CLUSTER_PRESETS["h800"],
                 gpus=64, seq_len=8192, micro_batch_size=1,
                 options=PlanOptions(groups=1, recompute="none", global_batch=512))  # fmt: skip
    seed = seed_plan(pl)
    target = seed.attn_gpus_per_group - 4
    prefers = prefers_replicas(target)
    res = refine_plan(pl, seed, prefers, moves=0)
    assert res.best.attn_gpus_per_group == seed.attn_gpus_per_group and res.descended == 0


@pytest.mark.parametrize("rng_seed", range(5))
def test_refine_plan_never_worse_than_seed(rng_seed: int) -> None:
    pl = planner()
    seed = seed_plan(pl)

    def noisy(plan: Plan) -> float:  # deterministic pseudo-random "measurement"
        key = f"{plan.attn_gpus_per_group},{plan.attn_nics_per_group}".encode()
        return plan.sequences_per_step * (1.0 + zlib.crc32(key) % 1000 / 1000)

    res = refine_plan(pl, seed, noisy, moves=30, radius=2, seed_rng=rng_seed)
    assert res.best_score <= res.seed_score == score(seed, noisy(seed))
    again = refine_plan(pl, seed, noisy, moves=30, radius=2, seed_rng=rng_seed)
    assert again.best == res.best


def test_analytic_profile_models_the_pipeline() -> None:
    pl = planner()
    plan = dataclasses.replace(seed_plan(pl), in_flight=ring_length(1))  # the ring full
    prof = AnalyticProfile(pl)
    t = prof(plan)
    # steady state N*v stage times, bubble (2p - 1) stages, one exposed exchange; no memory cap
    stage = max(plan.t_attn_s, plan.t_ffn_s)
    assert t >= plan.micro_batches * plan.virtual_stages * stage
    assert t < (plan.micro_batches * plan.virtual_stages + 2) * stage * 1.05
    capped = prof(dataclasses.replace(plan, in_flight=1))  # ring of 2 with 1 in flight: 2x
    assert capped == pytest.approx(2 * t, rel=0.05)
    dedup = AnalyticProfile(pl, dedup=True)(plan)
    assert dedup <= t


@pytest.mark.parametrize(
    ("model", "gpus", "seq_len"),
    [("tiny", 8, 4096), ("small", 16, 2048), ("qwen3-30b-a3b", 64, 8192)],
)
def test_memory_in_flight_is_the_most_that_evaluate_admits(
    model: str, gpus: int, seq_len: int
) -> None:
    """`memory_in_flight` (the runtime's model, closed form) is the largest count the exact
    check of `Planner.evaluate` admits for every split whose other constraints hold; splits
    no count admits give 1."""
    from disagmoe.planner.split import memory_in_flight

    planner = Planner(model=MODEL_PRESETS[model], cluster=CLUSTER_PRESETS["h800"], gpus=gpus,
                      seq_len=seq_len, micro_batch_size=1, options=PlanOptions())  # fmt: skip

    def admits(groups: int, m: int, ma: int, k: int, recompute: str) -> bool:
        plan = planner.evaluate(groups=groups, m=m, attn_nics=ma, in_flight=k, recompute=recompute)
        return plan is not None

    checked = 0
    for groups in planner.group_candidates()[:2]:
        prob = planner.problem(groups, 1, "none")
        for m in sorted({1, prob.gpus // 2, prob.gpus - 1}):
            for ma in sorted({1, prob.nics // 2}):
                for recompute in ("none", "full"):
                    got = memory_in_flight(planner, groups, m, recompute)
                    assert got >= 1
                    if admits(groups, m, ma, got, recompute):
                        assert not admits(groups, m, ma, got + 1, recompute)
                        checked += 1
                    else:  # no count fits, or a constraint besides memory fails
                        assert got == 1 or not admits(groups, m, ma, 1, recompute)
    assert checked > 0
