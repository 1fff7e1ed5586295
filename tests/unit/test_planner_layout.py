"""`train --plan auto`: only runnable layouts, and the split follows the workload."""

from __future__ import annotations

import dataclasses

import pytest

from disagmoe.config import RunConfig, TrainConfig
from disagmoe.planner import plan_for
from disagmoe.planner.layout_plan import auto_layout
from disagmoe.planner.options import PlanOptions, run_replays
from disagmoe.planner.plan import Planner
from disagmoe.presets import MODEL_PRESETS


def _cfg(**model: object) -> RunConfig:
    # A cluster with ample bandwidth, so that compute decides the split.
    return RunConfig(
        cluster=dataclasses.replace(RunConfig().cluster, nic_gbps=1e5, latency_us=0.0),
        model=dataclasses.replace(MODEL_PRESETS["small"], max_seq_len=32768, **model),  # type: ignore[arg-type]
        train=TrainConfig(seq_len=1024, global_batch_size=16, micro_batch_size=1),
    )


def _runnable(cfg: RunConfig, world: int) -> None:
    par = cfg.parallel
    m, n = par.attn_workers, par.expert_workers
    assert par.groups * (m + n) == world and cfg.model.num_layers % par.groups == 0
    assert 1 <= n <= cfg.model.num_experts and 1 <= m <= cfg.train.num_micro_batches


def test_auto_layout_plans_only_runnable_layouts_for_the_runs_batch() -> None:
    for batch in (4, 16, 64):
        train = TrainConfig(seq_len=1024, global_batch_size=batch, micro_batch_size=1)
        cfg, plan = auto_layout(dataclasses.replace(_cfg(), train=train), 12)
        _runnable(cfg, 12)
        assert plan.sequences_per_step == batch and plan.profile == "simulator"
        assert plan.micro_batches == -(-batch // cfg.parallel.attn_workers)
    # the run's default (4 local workers): experts as even as the search's moves leave them
    cfg, _ = auto_layout(RunConfig(), 4)
    _runnable(cfg, 4)


def test_auto_layout_is_the_plan_command_for_the_same_batch() -> None:
    cfg = dataclasses.replace(
        _cfg(), train=TrainConfig(seq_len=2048, global_batch_size=32, micro_batch_size=2)
    )
    run, plan = auto_layout(cfg, 12)
    same = plan_for(
        cfg.model, cfg.cluster, gpus=12, seq_len=2048, micro_batch_size=2,
        global_batch=32, profile="auto",
    )  # fmt: skip
    assert (same.groups, same.attn_gpus_per_group, same.in_flight, same.recompute) == (
        run.parallel.groups, run.parallel.attn_workers, run.schedule.max_in_flight,
        run.train.recompute,
    )  # fmt: skip
    assert plan.step_time_s == same.step_time_s


def test_what_the_run_picks_itself_is_planned_at_one_replay() -> None:
    """A run leaving exchange chunks and split backward to auto gets the plan ranked at one
    chunk with split backwards (`options.run_replays`); the run picks both on that plan."""
    cfg = _cfg()
    auto = dataclasses.replace(
        cfg, schedule=dataclasses.replace(cfg.schedule, exchange_chunks=0, split_backward="auto")
    )
    _, plan = auto_layout(auto, 12)
    same = plan_for(
        cfg.model, cfg.cluster, gpus=12, seq_len=1024, micro_batch_size=1, global_batch=16,
        profile="auto", exchange_chunks=1, split_backward="on",
    )  # fmt: skip
    assert plan == same and plan.schedule == "breadth, exchange chunks 1, split backward on"
    assert run_replays(0, "auto") == (1, "on") and run_replays(4, "off") == (4, "off")


def test_split_follows_the_workload() -> None:
    attention_heavy = dataclasses.replace(
        _cfg(), train=TrainConfig(seq_len=16384, global_batch_size=16, micro_batch_size=1)
    )
    expert_heavy = _cfg(expert_dim=4096, top_k=4)
    a, plan_a = auto_layout(attention_heavy, 12)
    f, plan_f = auto_layout(expert_heavy, 12)

    def share(c: RunConfig) -> float:
        return c.parallel.attn_workers / (c.parallel.attn_workers + c.parallel.expert_workers)

    assert share(a) > share(f), (a.parallel, f.parallel)
    assert plan_a.step_time_s > 0 and plan_f.step_time_s > 0


def test_no_runnable_layout_is_a_clear_error() -> None:
    # one micro-batch (m = 1) and one expert (n = 1): 3 workers leave no runnable layout
    cfg = dataclasses.replace(
        _cfg(num_experts=1, top_k=1),
        train=TrainConfig(seq_len=64, global_batch_size=1, micro_batch_size=1),
    )
    with pytest.raises(ValueError, match="no disaggregated layout for 3 workers.*yourself"):
        auto_layout(cfg, 3)


def test_auto_layout_sets_cap_and_recompute_from_the_plan() -> None:
    train = TrainConfig(seq_len=1024, global_batch_size=64, micro_batch_size=1)
    roomy = dataclasses.replace(_cfg(), train=train)
    cfg, plan = auto_layout(roomy, 12)
    slots = cfg.train.num_micro_batches // cfg.parallel.attn_workers
    assert cfg.schedule.max_in_flight == plan.in_flight == slots
    assert cfg.train.recompute == plan.recompute == "none"
    # 45 MiB GPUs: the plan holds fewer slots than it runs
    tight_cluster = dataclasses.replace(roomy.cluster, gpu_mem_gib=0.045)
    tight, tight_plan = auto_layout(dataclasses.replace(roomy, cluster=tight_cluster), 12)
    tight_slots = tight.train.num_micro_batches // tight.parallel.attn_workers
    assert tight.schedule.max_in_flight == tight_plan.in_flight < tight_slots
    assert tight.train.recompute == tight_plan.recompute


def test_auto_layout_lowers_the_cap_to_what_the_users_recompute_layers_admit() -> None:
    train = TrainConfig(seq_len=1024, global_batch_size=64, micro_batch_size=1)
    tight = dataclasses.replace(
        _cfg(), train=train, cluster=dataclasses.replace(_cfg().cluster, gpu_mem_gib=0.045)
    )
    every, plan = auto_layout(tight, 12)
    assert plan.recompute == "full" and every.train.recompute_layers == 0
    some_train = dataclasses.replace(train, recompute="full", recompute_layers=1)
    some, same = auto_layout(dataclasses.replace(tight, train=some_train), 12)
    assert (same.groups, same.attn_gpus_per_group) == (plan.groups, plan.attn_gpus_per_group)
    assert some.train.recompute == "full" and some.train.recompute_layers == 1
    cap = some.schedule.max_in_flight
    assert 1 <= cap < every.schedule.max_in_flight  # layer 0 of each group keeps its tensors
    planner = Planner(
        model=tight.model, cluster=tight.cluster, gpus=12, seq_len=1024, micro_batch_size=1
    )
    m, p = plan.attn_gpus_per_group, plan.groups
    assert planner.max_in_flight(p, m, "full", 1) == cap
    with pytest.raises(
        ValueError, match=r"full recompute on 1 layer\(s\) per group; use more --recompute-layers"
    ):
        tiny = dataclasses.replace(tight.cluster, gpu_mem_gib=0.015)
        auto_layout(dataclasses.replace(tight, train=some_train, cluster=tiny), 12)


def test_auto_layout_recomputes_only_the_first_layers_where_the_plan_does() -> None:
    """40 MiB GPUs: stage 5 (`sim_profile.recompute_first_layers`) finds the plan's split
    faster with only each group's first layers recomputed at the slots they admit than
    with every layer recomputed; the run gets that count and cap, which fit by the
    runtime's memory model, and its replay is the plan's step; with `--recompute full`
    given, every layer is recomputed."""
    from disagmoe.planner.sim_profile import SimulatorProfile

    train = TrainConfig(seq_len=1024, global_batch_size=64, micro_batch_size=1)
    tight = dataclasses.replace(
        _cfg(), train=train, cluster=dataclasses.replace(_cfg().cluster, gpu_mem_gib=0.04)
    )
    cfg, plan = auto_layout(tight, 12)
    layers, cap = cfg.train.recompute_layers, cfg.schedule.max_in_flight
    assert plan.stage == "layers" and cfg.train.recompute == plan.recompute == "full"
    assert 0 < layers == plan.recompute_layers < cfg.model.num_layers // plan.groups
    assert cap == plan.in_flight
    assert plan.recompute_label == f"full on {layers} layer(s) per group"
    chunks, split = run_replays(tight.schedule.exchange_chunks, tight.schedule.split_backward)
    options = PlanOptions(
        global_batch=64, profile="simulator", order=tight.schedule.order,
        exchange_chunks=chunks, split_backward=split,
        loss_chunk_tokens=tight.train.loss_chunk_tokens,
    )  # fmt: skip
    planner = Planner(
        model=tight.model, cluster=tight.cluster, gpus=12, seq_len=1024, micro_batch_size=1,
        options=options,
    )  # fmt: skip
    p, m = plan.groups, plan.attn_gpus_per_group
    assert planner.fewest_layers(p, m, cap) == layers  # the fewest that fit those slots
    assert planner.max_in_flight(p, m, "full", layers) >= cap
    profile = SimulatorProfile(planner)
    every = dataclasses.replace(plan, recompute_layers=0)  # the same slots, every layer
    assert plan.step_time_s == pytest.approx(profile(plan)) and profile(every) > profile(plan)
    # a mode given is planned as given: full recompute of every layer
    given = dataclasses.replace(options, recompute="full")
    kw = {f.name: getattr(given, f.name) for f in dataclasses.fields(given)}
    whole = plan_for(tight.model, tight.cluster, gpus=12, seq_len=1024, micro_batch_size=1, **kw)
    assert whole.recompute == "full" and whole.recompute_layers == 0
