"""Whole-plan behaviour: groups, memory limits, roofline-only mode, plan_for API."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from disagmoe.costs import costmodel as cm
from disagmoe.planner import Planner, PlanOptions, plan_for, seed_plan
from disagmoe.presets import CLUSTER_PRESETS, MODEL_PRESETS

H800 = CLUSTER_PRESETS["h800"]
QWEN = MODEL_PRESETS["qwen3-30b-a3b"]


def test_plan_totals_and_invariants() -> None:
    plan = plan_for(QWEN, H800, gpus=64, seq_len=4096, micro_batch_size=1)
    p = plan.groups
    assert plan.attn_gpus + plan.ffn_gpus == 64
    assert plan.attn_nics + plan.ffn_nics == p * (64 // (2 * p))
    assert plan.virtual_stages * p == QWEN.num_layers
    assert plan.ffn_gpus_per_group <= QWEN.num_experts
    assert plan.attn_nics_per_group <= plan.attn_gpus_per_group  # one NIC per GPU
    assert max(plan.mem_attn_gib, plan.mem_ffn_gib) <= plan.mem_cap_gib
    assert plan.t_stage_s == max(plan.t_attn_s, plan.t_ffn_s)
    d = plan.to_dict()
    assert d["attn_gpus"] == plan.attn_gpus and d["t_stage_s"] == plan.t_stage_s


def test_roofline_only_is_the_papers_problem() -> None:
    plan = plan_for(QWEN, H800, gpus=64, seq_len=4096, micro_batch_size=1, roofline_only=True)
    assert plan.groups == 1 and plan.roofline_only
    assert plan.attn_nics == plan.ffn_nics == 16  # V is the same for both: the NICs split evenly
    assert plan.binding.endswith("NICs")  # both components communication-bound (nominal)
    assert plan.i_attn == pytest.approx(1312.0) and plan.ridge == pytest.approx(19780.0)
    # longer sequences want more attention GPUs
    long = plan_for(QWEN, H800, gpus=64, seq_len=32768, micro_batch_size=1, roofline_only=True)
    assert long.attn_gpus > plan.attn_gpus


def test_ffn_memory_binds_and_relaxes_with_more_memory() -> None:
    kwargs = dict(gpus=64, seq_len=16384, micro_batch_size=1, groups=2, recompute="full",
                  search_moves=0)  # fmt: skip
    tight = plan_for(QWEN, H800, **kwargs)  # type: ignore[arg-type]
    roomy = plan_for(QWEN, dataclasses.replace(H800, gpu_mem_gib=400.0), **kwargs)  # type: ignore[arg-type]
    assert tight.attn_gpus < roomy.attn_gpus  # FFN memory holds the attention GPUs back
    planner = Planner(model=QWEN, cluster=H800, gpus=64, seq_len=16384, micro_batch_size=1,
                      options=PlanOptions(groups=2, recompute="full"))  # fmt: skip
    a, b = planner.ffn_terms(2, tight.in_flight, "full")
    m, n = tight.attn_gpus_per_group, tight.ffn_gpus_per_group
    assert (a + b * m) / n <= planner.cap_bytes
    assert (a + b * (m + 1)) / (n - 1) > planner.cap_bytes  # the MILP's constraint is tight


@pytest.mark.parametrize(
    ("model", "gpus", "seq_len", "groups"),
    [("qwen3-30b-a3b", 64, 8192, 1), ("qwen3-30b-a3b", 64, 16384, 2),
     ("deepseek-moe-16b", 32, 4096, 1), ("gpt-oss-20b", 16, 8192, 2), ("tiny", 8, 512, 2)],
)  # fmt: skip
def test_ffn_terms_bound_the_runtime_model(
    model: str, gpus: int, seq_len: int, groups: int
) -> None:
    """The MILP's linear FFN memory (A + B*m)/n is never below the runtime's figure for the
    shard, for every split, cap, recompute and split backward (it may reject a split the
    exact check of `evaluate` admits, never the reverse)."""
    for split_backward in ("off", "on"):
        planner = Planner(model=MODEL_PRESETS[model], cluster=H800, gpus=gpus, seq_len=seq_len,
                          micro_batch_size=1,
                          options=PlanOptions(groups=groups, split_backward=split_backward))  # fmt: skip
        per = gpus // groups
        for recompute in ("none", "full"):
            for k in (1, 3):
                a, b = planner.ffn_terms(groups, k, recompute)
                for m in range(max(1, per - MODEL_PRESETS[model].num_experts), per):
                    exact = planner.ffn_memory(groups, m, k, recompute).total
                    assert (a + b * m) / (per - m) >= exact * (1 - 1e-12), (recompute, k, m)


def test_planner_memory_is_the_runtime_models() -> None:
    """A plan's memory is what `train` predicts for its layout on a GPU (`predict_memory` in
    bf16 with fp32 parameters), against the whole of the GPU's memory, as `train` budgets."""
    from disagmoe.config import ParallelConfig, RunConfig, ScheduleConfig, TrainConfig
    from disagmoe.training.budget import in_flight_cap, predict_memory

    plan = plan_for(QWEN, H800, gpus=64, seq_len=8192, micro_batch_size=1, search_moves=0)
    cfg = RunConfig(
        model=QWEN, cluster=H800,
        parallel=ParallelConfig(groups=plan.groups, attn_workers=plan.attn_gpus_per_group,
                                expert_workers=plan.ffn_gpus_per_group),
        train=TrainConfig(dtype="bfloat16", seq_len=8192, micro_batch_size=1,
                          recompute=plan.recompute, memory_gib=H800.gpu_mem_gib),
        schedule=ScheduleConfig(split_backward="off"),
    )  # fmt: skip
    run = predict_memory(cfg, plan.in_flight)
    assert plan.mem_attn_gib == pytest.approx(run.attn.total / cm.GIB, rel=1e-12)
    assert plan.mem_ffn_gib == pytest.approx(run.ffn.total / cm.GIB, rel=1e-12)
    assert plan.mem_cap_gib == H800.gpu_mem_gib
    planner = Planner(model=QWEN, cluster=H800, gpus=64, seq_len=8192, micro_batch_size=1,
                      options=PlanOptions(groups=plan.groups))  # fmt: skip
    most = planner.max_in_flight(plan.groups, plan.attn_gpus_per_group, plan.recompute)
    assert most == in_flight_cap(cfg, slots=10**6) >= plan.in_flight


def test_attention_memory_caps_in_flight_micro_batches() -> None:
    plan = plan_for(QWEN, H800, gpus=64, seq_len=16384, micro_batch_size=1, groups=2,
                    recompute="none", search_moves=0)  # fmt: skip
    assert plan.in_flight < 4 and "memory" in plan.memory_binding
    assert plan.mem_attn_gib <= plan.mem_cap_gib


@pytest.mark.parametrize(
    ("model", "gpus", "options", "needle"),
    [
        ("mixtral-8x7b", 8, {"seq_len": 32768}, "memory"),
        ("qwen3-30b-a3b", 64, {"groups": 5}, "groups"),
        ("qwen3-30b-a3b", 64, {"seq_len": 10**6}, "max_seq_len"),
        ("qwen3-30b-a3b", 1, {}, "--gpus"),
        ("gpt-oss-20b", 4, {"groups": 4}, "GPUs per group"),
    ],
)
def test_infeasible_requests_raise_clear_errors(
    model: str, gpus: int, options: dict[str, int], needle: str
) -> None:
    kwargs: dict[str, Any] = {"seq_len": 4096, **options}
    seq = kwargs.pop("seq_len")
    with pytest.raises(ValueError, match=needle):
        plan_for(MODEL_PRESETS[model], H800, gpus=gpus, seq_len=seq, micro_batch_size=1, **kwargs)


def test_enumeration_solver_gives_the_same_plan_quality() -> None:
    kwargs = dict(gpus=32, seq_len=8192, micro_batch_size=1, search_moves=0)
    milp = plan_for(QWEN, H800, **kwargs)  # type: ignore[arg-type]
    enum = plan_for(QWEN, H800, solver="enumerate", **kwargs)  # type: ignore[arg-type]
    assert enum.t_stage_s / enum.attn_gpus_per_group == pytest.approx(
        milp.t_stage_s / milp.attn_gpus_per_group, rel=1e-9
    )
    assert enum.solver == "enumerate" and milp.solver == "milp"


def test_seed_choice_uses_the_profile() -> None:
    planner = Planner(model=QWEN, cluster=H800, gpus=64, seq_len=4096, micro_batch_size=1)
    best = seed_plan(planner)
    forced = seed_plan(planner, profile=lambda plan: 1.0 if plan.groups == 4 else 100.0)
    assert forced.groups == 4
    assert best.groups == 1  # the analytic profile prefers one group here (no residual hop)
    with pytest.raises(ValueError, match="unknown planner option"):
        plan_for(QWEN, H800, gpus=64, seq_len=4096, micro_batch_size=1, bogus=1)


def test_the_planned_loss_head_is_the_runs() -> None:
    """The planner prices the loss head as the run keeps it (`train.loss_chunk_tokens`, which
    `train --plan auto` passes): unchunked, group 0's A replica holds the fp32
    log-probabilities of every token in flight, and fewer micro-batches fit."""

    def planner(chunk: int) -> Planner:
        return Planner(model=QWEN, cluster=H800, gpus=64, seq_len=16384, micro_batch_size=1,
                       options=PlanOptions(groups=2, loss_chunk_tokens=chunk))  # fmt: skip

    chunked, plain = planner(4096), planner(0)
    assert PlanOptions().loss_chunk_tokens == 4096  # train's default
    per_mb = plain.attn_memory(2, 1, "full").total - chunked.attn_memory(2, 1, "full").total
    assert per_mb > 16384 * 4 * QWEN.vocab_size  # the log-probabilities and the logits
    assert plain.max_in_flight(2, 8, "full") == 4 < chunked.max_in_flight(2, 8, "full") == 19
