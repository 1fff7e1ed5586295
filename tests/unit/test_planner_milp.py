"""Stages 1-2: the HiGHS MILP agrees with exhaustive enumeration; infeasibility is explained."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest

from disagmoe.planner.milp import SplitProblem, solve_enumerate, solve_milp


def random_problem(rng: random.Random) -> SplitProblem:
    return SplitProblem(
        gpus=rng.randint(2, 48),
        nics=rng.randint(2, 48),
        attn_gpu=10 ** rng.uniform(-4, -1),
        ffn_gpu=10 ** rng.uniform(-4, -1),
        attn_nic=10 ** rng.uniform(-4, -1),
        ffn_nic=10 ** rng.uniform(-4, -1),
        nics_per_gpu=rng.choice([None, 0.5, 1.0, 2.0]),
        max_ffn_gpus=rng.choice([None, rng.randint(1, 48)]),
        ffn_mem=rng.choice([None, (rng.uniform(0.0, 4.0), rng.uniform(0.0, 0.2), 1.0)]),
    )


def test_milp_matches_enumeration_on_random_instances() -> None:
    rng = random.Random(2024)
    solved = infeasible = 0
    for _ in range(200):
        prob = random_problem(rng)
        try:
            ref = solve_enumerate(prob, eps=0.02)
        except ValueError as err:
            with pytest.raises(ValueError) as got:
                solve_milp(prob, eps=0.02, mip_gap=1e-9)
            assert str(got.value) == str(err)
            infeasible += 1
            continue
        got_split = solve_milp(prob, eps=0.02, mip_gap=1e-9)
        assert got_split.tau_opt == pytest.approx(ref.tau_opt, rel=1e-9), prob
        assert got_split.balance == pytest.approx(ref.balance, rel=1e-9), prob
        assert got_split.tau <= ref.tau_opt * 1.02 * (1 + 1e-9)
        # the NIC split is the fastest one for the chosen GPU split (Stage 2 ignores NICs)
        assert got_split.tau == pytest.approx(ref.tau, rel=1e-9), prob
        r = prob.nics_per_gpu
        fastest = min(
            prob.tau(got_split.m, got_split.n, ma, prob.nics - ma)
            for ma in range(1, prob.nics)
            if r is None
            or (ma <= r * got_split.m + 1e-9 and prob.nics - ma <= r * got_split.n + 1e-9)
        )
        assert got_split.tau == pytest.approx(fastest, rel=1e-12)
        assert got_split.m + got_split.n == prob.gpus
        assert got_split.attn_nics + got_split.ffn_nics == prob.nics
        solved += 1
    assert solved >= 100 and infeasible >= 1


def test_stage1_optimum_is_a_true_minimum() -> None:
    prob = SplitProblem(gpus=16, nics=8, attn_gpu=3.0, ffn_gpu=1.0, attn_nic=1.0, ffn_nic=1.0)
    split = solve_milp(prob)
    best = min(prob.tau(m, 16 - m, ma, 8 - ma) for m in range(1, 16) for ma in range(1, 8))
    assert split.tau_opt == pytest.approx(best)
    assert split.binding in ("attention compute", "attention NICs", "FFN compute", "FFN NICs")


def test_stage2_balances_compute_inside_the_band() -> None:
    # NIC-bound: tau* = 1/4 for any GPU split with m >= 4 and n >= 4; stage 2 splits the
    # 32 GPUs in proportion to compute (3 : 1) -> m = 24, n = 8
    prob = SplitProblem(gpus=32, nics=8, attn_gpu=0.3, ffn_gpu=0.1, attn_nic=1.0, ffn_nic=1.0)
    for solve in (solve_milp, solve_enumerate):
        split = solve(prob)
        assert split.binding in ("attention NICs", "FFN NICs")
        assert (split.m, split.n, split.attn_nics) == (24, 8, 4)


def test_locality_and_expert_bounds_are_respected() -> None:
    prob = SplitProblem(gpus=32, nics=16, attn_gpu=0.3, ffn_gpu=0.1, attn_nic=1.0,
                        ffn_nic=1.0, nics_per_gpu=1.0, max_ffn_gpus=6)  # fmt: skip
    split = solve_milp(prob)
    assert split.n <= 6 and split.attn_nics <= split.m and split.ffn_nics <= split.n


def test_ffn_memory_constraint_binds() -> None:
    base = SplitProblem(gpus=32, nics=8, attn_gpu=0.3, ffn_gpu=0.1, attn_nic=1.0, ffn_nic=1.0)
    free = solve_milp(base)
    # (A + B m) / n <= cap with A = 4, B = 0.5: m = 24, n = 8 needs 16 > 1; m = 10 -> 9/22
    tight = dataclasses.replace(base, ffn_mem=(4.0, 0.5, 1.0))
    split = solve_milp(tight)
    assert split.m < free.m
    assert 4.0 + 0.5 * split.m <= split.n
    assert 4.0 + 0.5 * (split.m + 1) > split.n - 1  # one more attention GPU would not fit


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"gpus": 1}, "GPUs per group"),
        ({"nics": 1}, "NICs per group"),
        ({"nics_per_gpu": 0.25, "gpus": 6, "nics": 2}, "NIC locality"),
        ({"ffn_mem": (40.0, 0.0, 1.0)}, "FFN memory"),
    ],
)
def test_infeasible_requests_name_the_binding_constraint(
    changes: dict[str, Any], needle: str
) -> None:
    prob = dataclasses.replace(
        SplitProblem(gpus=16, nics=8, attn_gpu=1.0, ffn_gpu=1.0, attn_nic=1.0, ffn_nic=1.0),
        **changes,
    )
    for solve in (solve_milp, solve_enumerate):
        with pytest.raises(ValueError, match=needle):
            solve(prob)


def test_roofline_plan_sits_at_the_stage1_optimum_when_its_gpu_split_allows() -> None:
    """qwen3-30b-a3b, 128 GPUs, 64 NIC pairs, 32K (the roofline case of `disagmoe plan`):
    Stage 2 picks m = 108 for compute balance; with the NICs split 32 : 32 that point is at
    the Stage 1 optimum, where an arbitrary NIC split inside the band was 1.6% slower."""
    prob = SplitProblem(gpus=128, nics=64, attn_gpu=0.009206603303862488,
                        ffn_gpu=0.0016676111644732053, attn_nic=0.00268435456,
                        ffn_nic=0.00268435456)  # fmt: skip
    for solve in (solve_milp, solve_enumerate):
        split = solve(prob)
        assert (split.m, split.attn_nics) == (108, 32)
        assert split.tau == pytest.approx(split.tau_opt, rel=1e-12)
