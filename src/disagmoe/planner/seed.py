"""Stages 1-2 of the planner: for every candidate p and recompute mode, the MILP's split at
the largest in-flight count memory admits (halved while a smaller one lets the FFN memory
admit a split the profile prefers), each scored by the profile; the best seeds stage 3.
"""

from __future__ import annotations

import dataclasses

import disagmoe.costs.costmodel as cm
from disagmoe.planner.milp import Split, SplitProblem, solve_enumerate, solve_milp
from disagmoe.planner.plan import AnalyticProfile, Plan, Planner, Profile, ring_length, score


def _solve(planner: Planner, prob: SplitProblem) -> Split:
    opts = planner.options
    if opts.solver == "enumerate":
        return solve_enumerate(prob, eps=opts.epsilon)
    return solve_milp(prob, eps=opts.epsilon, time_limit_s=opts.time_limit_s, mip_gap=opts.mip_gap)


def batch_in_flight(planner: Planner, groups: int, m: int, recompute: str) -> tuple[int, str]:
    """For a run's global batch: the micro-batches a replica of the split (p = `groups`, m
    replicas) holds in flight, as the run holds them (what the memory admits, at most its
    share of the batch), and the plan's memory note."""
    slots = planner.micro_batches(groups, m)
    held = min(slots, planner.max_in_flight(groups, m, recompute))
    return max(held, 1), f"in-flight {held} of {slots} (memory)" if held < slots else ""


def _seed_for(planner: Planner, groups: int, recompute: str, profile: Profile) -> Plan:
    """Stages 1-2 for fixed p and recompute mode.

    The in-flight count K trades memory for pipeline occupancy: K = min(ring, N) if it fits,
    else the attention memory limit, then halved while smaller K lets the FFN memory admit a
    split that the profile prefers (more attention GPUs for long sequences). For a run's
    global batch the plan holds what its split's memory admits (`batch_in_flight`), as the
    run does; K then only sizes the FFN memory the solver plans for.
    """
    opts = planner.options
    if opts.global_batch:  # the run holds what the memory admits, up to its replica's slots
        want = opts.global_batch // planner.micro_batch_size
    else:
        want = min(planner.micro_batches(groups), ring_length(groups))
    if planner.options.roofline_only:
        k_attn = want
    else:
        k_attn = planner.max_in_flight_attn(groups, recompute)
        if k_attn < 1:
            mem = planner.attn_memory(groups, 1, recompute)
            raise ValueError(
                "attention memory: one replica needs "
                f"{mem.total / cm.GIB:.1f} GiB with one micro-batch in flight (states "
                f"{mem.states / cm.GIB:.1f}, activations {mem.activations / cm.GIB:.1f}, logits "
                f"{mem.transient / cm.GIB:.1f}) > {planner.cap_bytes / cm.GIB:.1f} GiB per GPU"
            )
    k = min(want, k_attn)
    best: Plan | None = None
    error = ""
    while True:
        try:
            split = _solve(planner, planner.problem(groups, k, recompute))
        except ValueError as err:
            error = str(err)
            if "FFN memory" not in error:
                break
        else:
            why = "attention" if k == k_attn else "FFN"
            if opts.global_batch:
                held, binding = batch_in_flight(planner, groups, split.m, recompute)
            else:
                held = k
                binding = f"in-flight {k} of {want} ({why} memory)" if k < want else ""
            plan = planner.evaluate(
                groups=groups, m=split.m, attn_nics=split.attn_nics, in_flight=held,
                recompute=recompute, profile=profile, memory_binding=binding,
                solver=split.solver,
            )  # fmt: skip
            assert plan is not None, "the solver returned a point that violates a constraint"
            plan = dataclasses.replace(plan, stage1_gap=split.tau / split.tau_opt - 1.0)
            if best is not None and score(plan, plan.step_time_s) >= score(best, best.step_time_s):
                break  # a smaller K no longer pays for itself
            best = plan
        if k == 1 or planner.options.roofline_only:
            break
        k = max(1, k // 2)
    if best is None:
        raise ValueError(error)
    return best


def seed_plans(planner: Planner, profile: Profile | None = None) -> list[Plan]:
    """Stages 1-2 for every candidate p and recompute mode: the best plan of each, by the
    profile. Raises ValueError with the reasons when none is feasible."""
    prof = profile or AnalyticProfile(planner)
    modes = ["none"] if planner.options.roofline_only else (
        ["none", "full"] if planner.options.recompute == "auto" else [planner.options.recompute]
    )  # fmt: skip
    seeds: list[Plan] = []
    errors: dict[str, list[str]] = {}  # reason -> the (p, recompute) it ruled out
    for groups in planner.group_candidates():
        for mode in modes:
            try:
                seeds.append(_seed_for(planner, groups, mode, prof))
            except ValueError as err:
                errors.setdefault(str(err), []).append(f"p={groups}/{mode}")
    if not seeds:
        assert errors, "p = 1 is always a candidate"
        reasons = [f"{why} [{', '.join(where)}]" for why, where in list(errors.items())[:3]]
        raise ValueError("no feasible plan: " + "; ".join(reasons))
    return seeds


def seed_plan(planner: Planner, profile: Profile | None = None) -> Plan:
    """Stages 1-2 for every candidate p (and recompute mode); the best by the profile wins."""
    return min(seed_plans(planner, profile), key=lambda plan: score(plan, plan.step_time_s))
