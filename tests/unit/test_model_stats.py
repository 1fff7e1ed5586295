"""Routing statistics and FLOP/s of metrics.jsonl (`models.moe.RoutingStats`,
`training.model_stats`): what a router records, when it records, and the step record.

The equality of these statistics across runtimes is checked in the spawned equivalence
runs (tests/distributed/equivalence.py, test_baselines.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from disagmoe.config import RunConfig, replace_section
from disagmoe.costs.flops import train_step_flops
from disagmoe.models import Router, build_model
from disagmoe.training.model_stats import StepStats
from disagmoe.training.observe import prepare_run_dir
from disagmoe.training.reference import ReferenceTrainer, run_reference


def _cfg(**train: Any) -> RunConfig:
    base = dict(dtype="float64", seq_len=16, global_batch_size=4, micro_batch_size=2)
    return replace_section(RunConfig(), "train", progress=False, **{**base, **train})


def _sums(stats: StepStats) -> torch.Tensor:
    sums = torch.zeros(stats.size, dtype=torch.float64)
    stats.fill(sums)
    return sums


def _recorded_step(trainer: ReferenceTrainer, cfg: RunConfig, step: int) -> dict[str, Any]:
    stats = StepStats(cfg, trainer.local_modules())
    with stats.recording():
        trainer.step(step)
    return stats.record(_sums(stats), 1.0, 1)


def test_router_records_counts_and_entropy_only_while_recording() -> None:
    torch.manual_seed(0)
    router = Router(8, 6, 2, norm_topk_prob=True).double()
    torch.nn.init.normal_(router.weight)
    u = torch.randn(40, 8, dtype=torch.float64)
    router(u)
    assert router.stats.counts_E is None and router.stats.num_tokens == 0  # off by default
    router.stats.recording = True
    routing = router(u)
    router(u[:10])
    stats = router.stats
    assert stats.counts_E is not None and stats.entropy_sum is not None
    want = torch.bincount(routing.indices_TK.flatten(), minlength=6)
    want += torch.bincount(routing.indices_TK[:10].flatten(), minlength=6)
    assert torch.equal(stats.counts_E, want) and stats.num_tokens == 50
    p = routing.probs_TE.detach()
    entropy = -(p * p.log()).sum(dim=-1)
    assert stats.entropy_sum.item() == pytest.approx((entropy.sum() + entropy[:10].sum()).item())
    stats.reset()
    assert int(stats.counts_E.sum()) == 0 and stats.num_tokens == 0


@pytest.mark.parametrize("mode", ["attn", "full"])
def test_recompute_counts_every_token_once(mode: str) -> None:
    """`full` reruns every attention block (router included) in backward; the rerun must
    not count: the same statistics as without recompute, exactly."""
    cfg = _cfg(log_expert_tokens=True)
    calls = []
    want = _recorded_step(ReferenceTrainer(cfg), cfg, 0)
    rerun = ReferenceTrainer(replace_section(cfg, "train", recompute=mode))
    for module in rerun.model.modules():
        if isinstance(module, Router):
            module.register_forward_hook(lambda *_: calls.append(1))
    got = _recorded_step(rerun, cfg, 0)
    runs = cfg.model.num_moe_layers * cfg.train.num_micro_batches
    assert len(calls) == (2 * runs if mode == "full" else runs)  # the rerun did happen
    assert got["expert_tokens"] == want["expert_tokens"]  # ratios alone would hide a 2x
    assert got["load_imbalance"] == want["load_imbalance"]
    assert got["router_entropy"] == pytest.approx(want["router_entropy"], rel=1e-12)


def test_forwards_outside_the_training_step_are_not_counted() -> None:
    cfg = _cfg()
    trainer = ReferenceTrainer(cfg)
    stats = StepStats(cfg, trainer.local_modules())
    tokens = torch.zeros(2, 16, dtype=torch.long)
    with stats.recording():
        trainer.step(0)
    with torch.no_grad():  # an evaluation forward after the step
        trainer.model(tokens)
    sums = _sums(stats).view(cfg.model.num_moe_layers, -1)
    assert sums[:, -1].tolist() == [4 * 16] * cfg.model.num_moe_layers  # the step's tokens


def test_record_fields_by_hand() -> None:
    cfg = replace_section(_cfg(log_expert_tokens=True), "model", num_experts=4, top_k=1)
    stats = StepStats(cfg, [])  # no router on this rank: it adds zeros
    assert stats.size == cfg.model.num_moe_layers * 6
    assert not _sums(stats).any()
    totals = torch.zeros(cfg.model.num_moe_layers, 6, dtype=torch.float64)
    totals[0] = torch.tensor([64, 0, 0, 0, 0.0, 64])  # one-hot router: all on expert 0
    totals[1] = torch.tensor([16, 16, 16, 16, 64 * math.log(4), 64])  # uniform
    rec = stats.record(totals.flatten(), 0.5, 4)
    assert rec["expert_tokens"][:2] == [[64, 0, 0, 0], [16, 16, 16, 16]]
    assert rec["load_imbalance"][:2] == [4.0, 1.0]
    assert rec["router_entropy"][:2] == [0.0, pytest.approx(math.log(4))]
    assert rec["load_imbalance"][2] is None and rec["router_entropy"][2] is None  # no token
    assert rec["model_flops"] == train_step_flops(cfg.model, 16, 4)  # dropless: N*k pairs
    assert rec["flops_per_s"] == rec["model_flops"] / 0.5
    assert rec["flops_per_s_per_worker"] == rec["flops_per_s"] / 4
    assert rec["mfu"] is None  # CPU
    stats.on_gpu = True
    mfu = stats.record(totals.flatten(), 0.5, 4)["mfu"]
    assert mfu == rec["flops_per_s"] / (4 * cfg.cluster.peak_tflops * 1e12)


def test_metrics_jsonl_of_a_run(tmp_path: Path) -> None:
    cfg = replace_section(
        _cfg(dtype="float32"), "train", steps=2, run_dir=str(tmp_path), log_expert_tokens=True
    )
    run_reference(cfg, prepare_run_dir(cfg))
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        counts = row["expert_tokens"]
        assert len(counts) == cfg.model.num_moe_layers
        assert all(len(c) == cfg.model.num_experts for c in counts)
        assert all(sum(c) == 4 * 16 * cfg.model.top_k for c in counts)  # the global batch
        assert all(1.0 <= x <= cfg.model.num_experts for x in row["load_imbalance"])
        assert all(0.0 < h <= math.log(cfg.model.num_experts) for h in row["router_entropy"])
        assert row["flops_per_s"] > 0 and row["mfu"] is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_recording_on_cuda_never_synchronises() -> None:
    model = build_model(RunConfig().model, seed=0, dtype=torch.float32, device=torch.device("cuda"))
    cfg = RunConfig()
    stats = StepStats(cfg, [model])
    assert stats.on_gpu
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 16), device="cuda")
    with stats.recording():
        torch.cuda.set_sync_debug_mode("error")
        try:
            for router in stats.routers.values():
                router(torch.randn(32, cfg.model.dim, device="cuda"))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        model(tokens)
    sums = _sums(stats).view(cfg.model.num_moe_layers, -1)
    assert sums[:, -1].tolist() == [32 + 32] * cfg.model.num_moe_layers
