"""Stage 3 scored by the simulator: the JSON says so, the score is `simulate_disagg`'s, the
search never loses to its seed, and on a tiny cluster it is within 5% of an exhaustive sweep."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from disagmoe.planner import Plan, Planner, PlanOptions, plan_for, refine_plan, seed_plan
from disagmoe.planner.cli import add_plan_arguments, run_plan
from disagmoe.planner.plan import score
from disagmoe.planner.sim_profile import (
    AUTO_SIMULATOR_MAX_GPUS,
    MAX_MICRO_BATCHES_PER_REPLICA,
    SimulatorProfile,
    grid,
    grow_micro_batches,
    resolve_profile,
    step_over_bound,
    sweep_plans,
)
from disagmoe.presets import CLUSTER_PRESETS, MODEL_PRESETS
from disagmoe.simulator import SimResult, simulate_disagg

H800 = CLUSTER_PRESETS["h800"]
TINY = dataclasses.replace(MODEL_PRESETS["gpt-oss-20b"], num_layers=4)  # 8 GPUs, seconds


def tiny_planner(**options: object) -> Planner:
    return Planner(model=TINY, cluster=H800, gpus=8, seq_len=4096, micro_batch_size=1,
                   options=PlanOptions(profile="simulator", **options))  # type: ignore[arg-type]  # fmt: skip


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="disagmoe plan")
    add_plan_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("profile", ["simulator", "analytic"])
def test_plan_json_names_the_profile(profile: str, capsys: pytest.CaptureFixture[str]) -> None:
    args = parse("--model", "gpt-oss-20b", "--gpus", "8", "--seq-len", "4096", "--json",
                 "--search-moves", "4", "--profile", profile)  # fmt: skip
    assert run_plan(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["profile"] == profile
    if profile == "simulator":
        assert out["simulated_step_s"] == out["step_time_s"] > 0
    else:
        assert out["simulated_step_s"] is None


def test_auto_profile_switches_to_analytic_above_the_stated_size() -> None:
    def planner(gpus: int, **options: object) -> Planner:
        return Planner(model=MODEL_PRESETS["qwen3-30b-a3b"], cluster=H800, gpus=gpus,
                       seq_len=4096, micro_batch_size=1,
                       options=PlanOptions(profile="auto", **options))  # type: ignore[arg-type]  # fmt: skip

    assert resolve_profile(planner(AUTO_SIMULATOR_MAX_GPUS)) == "simulator"
    assert resolve_profile(planner(2 * AUTO_SIMULATOR_MAX_GPUS)) == "analytic"
    assert resolve_profile(planner(64, roofline_only=True)) == "analytic"
    with pytest.raises(ValueError, match="roofline"):
        PlanOptions(profile="simulator", roofline_only=True)
    with pytest.raises(ValueError, match="profile must be"):
        PlanOptions(profile="measured")


def replay(plan: Plan, **extra: object) -> SimResult:
    """`simulate_disagg` of the plan, as the simulator profile should call it."""
    m = plan.attn_gpus_per_group
    return simulate_disagg(
        TINY, H800, groups=plan.groups, attn_workers=m, expert_workers=plan.ffn_gpus_per_group,
        seq_len=4096, micro_batch_size=1, num_micro_batches=plan.micro_batches * m,
        max_in_flight=plan.in_flight, reduce=True, placement="node-aware",
        nic_split=(plan.attn_nics_per_group, plan.ffn_nics_per_group), recompute=plan.recompute,
        **extra,  # type: ignore[arg-type]
    )  # fmt: skip


def test_profile_is_the_simulators_step_of_the_plan() -> None:
    pl = tiny_planner()
    plan = seed_plan(pl)
    prof = SimulatorProfile(pl)
    direct = replay(plan)
    assert prof(plan) == direct.step_time_s
    assert direct.tokens_per_step == plan.sequences_per_step * 4096
    prof(plan)
    assert len(prof.cache) == 1


@pytest.mark.parametrize("rng_seed", range(3))
def test_search_under_the_simulator_never_loses_to_its_seed(rng_seed: int) -> None:
    pl = tiny_planner()
    prof = SimulatorProfile(pl)
    seed = seed_plan(pl, prof)
    res = refine_plan(pl, seed, prof, moves=24, radius=2, seed_rng=rng_seed)
    assert res.best_score <= res.seed_score == score(seed, prof(seed))
    assert res.best_score == score(res.best, prof(res.best))
    # the moves reach the in-flight cap and the recompute mode, not only the split
    caps = {key[5] for key in prof.cache}
    modes = {key[6] for key in prof.cache}
    assert len(caps) > 1 and modes == {"none", "full"}


def test_choice_is_within_5_percent_of_an_exhaustive_sweep() -> None:
    pl = tiny_planner()
    # stages 1-3: the sweep is at the ring formula's micro-batches, so is the choice
    chosen = plan_for(TINY, H800, gpus=8, seq_len=4096, micro_batch_size=1, profile="simulator",
                      batch_stage=False)  # fmt: skip
    assert chosen.micro_batches == pl.micro_batches(chosen.groups)
    assert chosen.profile == "simulator" and chosen.simulated_step_s is not None
    prof = SimulatorProfile(pl)
    swept: list[Plan] = []
    for groups in pl.group_candidates():  # every p, m, M_a, cap and recompute
        swept += sweep_plans(pl, groups, prof)
    best = min(score(plan, plan.step_time_s) for plan in swept)
    assert len(swept) > 50
    assert score(chosen, chosen.step_time_s) <= 1.05 * best


def test_profile_replays_the_options_exchange_chunks() -> None:
    pl = tiny_planner(exchange_chunks=4)
    plan = seed_plan(pl)
    direct = replay(plan, exchange_chunks=4)
    assert SimulatorProfile(pl)(plan) == direct.step_time_s
    assert direct.config["exchange_chunks"] == 4
    args = parse("--model", "gpt-oss-20b", "--gpus", "8", "--seq-len", "4096",
                 "--exchange-chunks", "0")  # fmt: skip
    assert args.exchange_chunks == 0
    with pytest.raises(ValueError, match="exchange_chunks must be"):
        PlanOptions(exchange_chunks=17)


def test_profile_replays_the_options_split_backward() -> None:
    pl = tiny_planner(split_backward="on")
    plan = seed_plan(pl)
    direct = replay(plan, split_backward=True)
    assert SimulatorProfile(pl)(plan) == direct.step_time_s
    assert direct.config["split_backward"] is True
    assert (
        parse("--model", "tiny", "--gpus", "8", "--split-backward", "auto").split_backward == "auto"
    )
    with pytest.raises(ValueError, match="split_backward must be one of off, on, auto"):
        PlanOptions(split_backward="yes")


def test_stage4_doubles_the_micro_batches_while_the_bubble_is_above_target() -> None:
    pl = tiny_planner()
    prof = SimulatorProfile(pl)
    seed = seed_plan(pl, prof)
    assert step_over_bound(prof, seed) > 1 + pl.options.bubble_target  # a bubble to remove
    grown = grow_micro_batches(pl, seed, prof)
    ratio = grown.micro_batches // seed.micro_batches
    assert grown.micro_batches == seed.micro_batches * ratio and ratio & (ratio - 1) == 0
    assert ratio > 1 and grown.micro_batches <= MAX_MICRO_BATCHES_PER_REPLICA
    assert grown.stage == "batch" and grown.in_flight >= seed.in_flight
    assert (grown.groups, grown.attn_gpus_per_group, grown.attn_nics_per_group) == (
        seed.groups, seed.attn_gpus_per_group, seed.attn_nics_per_group
    )  # fmt: skip
    # faster per sequence trained, by the same replay
    assert score(grown, prof(grown)) < score(seed, prof(seed))
    assert grown.step_time_s == prof(grown)
    # plan_for runs the stage; a plan within its target, or a fixed count, is kept
    chosen = plan_for(TINY, H800, gpus=8, seq_len=4096, micro_batch_size=1, profile="simulator")
    assert chosen.micro_batches > pl.micro_batches(chosen.groups)
    loose = tiny_planner(bubble_target=0.9)
    assert grow_micro_batches(loose, seed, SimulatorProfile(loose)) is seed
    fixed = plan_for(TINY, H800, gpus=8, seq_len=4096, micro_batch_size=1,
                     profile="simulator", micro_batches=3)  # fmt: skip
    assert fixed.micro_batches == 3


def test_grid() -> None:
    assert grid(1, 5, 0) == [1, 2, 3, 4, 5] == grid(1, 5, 9)
    assert grid(1, 63, 4) == [1, 22, 42, 63]
    assert grid(3, 2, 4) == []
