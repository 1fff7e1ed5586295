"""The planner at a run's global batch (`PlanOptions.global_batch`): each plan runs its
share of the batch per replica, never more replicas than micro-batches, and the
simulator profile sees each seed's split with shards as even as its load allows."""

from __future__ import annotations

import pytest

from disagmoe.planner import plan_for
from disagmoe.planner.plan import Planner, PlanOptions
from disagmoe.planner.search import even_load_replicas
from disagmoe.planner.split import planned_split
from disagmoe.presets import CLUSTER_PRESETS, model_preset

H800 = CLUSTER_PRESETS["h800"]


def _planner(**options: object) -> Planner:
    return Planner(
        model=model_preset("deepseek-moe-16b"), cluster=H800, gpus=16, seq_len=4096,
        micro_batch_size=2, options=PlanOptions(**options),  # type: ignore[arg-type]
    )  # fmt: skip


def test_each_replica_runs_its_share_of_the_batch() -> None:
    planner = _planner(global_batch=64)
    assert planner.micro_batches(1, 5) == 7  # ceil(64 / (5 * 2))
    plan = planner.evaluate(groups=1, m=5, attn_nics=4, in_flight=2, recompute="full")
    assert plan is not None
    assert plan.micro_batches == 7 and plan.sequences_per_step == 64  # the batch, not 70
    # more replicas than micro-batches (32 of 2 sequences) leaves one idle: not a plan
    assert _planner(global_batch=16).evaluate(
        groups=1, m=9, attn_nics=4, in_flight=1, recompute="full"
    ) is None  # fmt: skip


def test_bad_global_batches_are_refused() -> None:
    with pytest.raises(ValueError, match="not both"):
        PlanOptions(global_batch=64, micro_batches=4)
    with pytest.raises(ValueError, match="must be >= 0"):
        PlanOptions(global_batch=-1)
    with pytest.raises(ValueError, match="multiple of --micro-batch-size"):
        _planner(global_batch=63)


def test_even_load_replicas() -> None:
    planner = _planner()
    plan = planner.evaluate(groups=1, m=3, attn_nics=2, in_flight=1, recompute="full")
    assert plan is not None and plan.ffn_gpus_per_group == 13  # 64 experts: 5 on the busiest
    # 13 shards at 5 experts need 13 (no change); at 4 experts, 16 shards and no replica
    # left, so the one that keeps a replica is m = 16 - 13
    assert even_load_replicas(planner, plan) == [3, 0]


def test_the_split_is_planned_for_the_runs_batch() -> None:
    model = model_preset("gpt-oss-20b")
    kw = dict(gpus=8, seq_len=8192, micro_batch_size=1)
    small = planned_split(model, H800, micro_batches=2, **kw)  # type: ignore[arg-type]
    assert 1 <= small.attn_workers <= 2  # two micro-batches feed at most two replicas
    plan = plan_for(model, H800, global_batch=2, profile="simulator", **kw)  # type: ignore[arg-type]
    assert plan.sequences_per_step == 2 and plan.attn_gpus_per_group <= 2


def test_a_replica_holds_at_most_its_share_in_flight() -> None:
    planner = _planner(global_batch=64)
    plan = planner.evaluate(groups=1, m=5, attn_nics=2, in_flight=16, recompute="full")
    assert plan is not None and plan.micro_batches == 7 and plan.in_flight == 7


def test_too_small_a_batch_for_the_group_is_named() -> None:
    from disagmoe.planner.milp import explain_infeasible

    # 64 GPUs in one group, 8 micro-batches: at most 8 replicas and 32 shards (gpt-oss: 32 experts)
    planner = Planner(
        model=model_preset("gpt-oss-20b"), cluster=H800, gpus=64, seq_len=4096,
        micro_batch_size=1, options=PlanOptions(global_batch=8, groups=1),
    )  # fmt: skip
    why = explain_infeasible(planner.problem(1, 1, "full"))
    assert why.startswith("batch: 8 micro-batches per step feed at most 8 attention replicas")


def test_simulate_plans_with_the_order_and_chunks_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """`simulate --order depth --exchange-chunks 2 --micro-batches N`: the planner's
    simulator profile replays what the run will (`Plan.schedule` names it)."""
    import disagmoe.planner as planner_pkg

    seen: list[str] = []

    def recording(*args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        plan = plan_for(*args, **kwargs)  # type: ignore[arg-type]
        seen.append(plan.schedule)
        return plan

    monkeypatch.setattr(planner_pkg, "plan_for", recording)
    from disagmoe.cli import main

    rc = main(
        ["simulate", "--model", "tiny", "--nodes", "1", "--seq-len", "64", "--micro-batches",
         "8", "--order", "depth", "--exchange-chunks", "2", "--json"]
    )  # fmt: skip
    assert rc == 0 and seen and all("depth" in s and "2" in s for s in seen), seen
