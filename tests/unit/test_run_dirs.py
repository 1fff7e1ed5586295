"""Run directories and checkpoint housekeeping (single process)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from disagmoe.config import ParallelConfig, RunConfig, replace_section
from disagmoe.distributed.layout import Layout
from disagmoe.presets import MODEL_PRESETS
from disagmoe.train import mean_tokens_per_s
from disagmoe.training.checkpoint import resolve_checkpoint, save_checkpoint
from disagmoe.training.observe import prepare_run_dir


def test_fresh_run_refuses_a_used_run_dir(tmp_path: Path) -> None:
    cfg = replace_section(RunConfig(), "train", run_dir=str(tmp_path / "r"))
    run = prepare_run_dir(cfg)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ValueError, match="already holds a run; continue it with --resume"):
        prepare_run_dir(cfg)
    with pytest.raises(ValueError, match="has no checkpoint"):
        prepare_run_dir(replace_section(cfg, "train", resume="latest"))
    assert prepare_run_dir(replace_section(cfg, "train", resume="auto")) == run


def test_prune_keeps_the_new_checkpoint_and_drops_abandoned_later_ones(tmp_path: Path) -> None:
    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([param])
    root = tmp_path / "checkpoints"
    for step in (4, 8):
        save_checkpoint(root, step, [("w", param)], opt, None, MODEL_PRESETS["tiny"], keep=3)
    # resumed from step 4: the next save (5) must survive, step 8 is an abandoned future
    save_checkpoint(root, 5, [("w", param)], opt, None, MODEL_PRESETS["tiny"], keep=1)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000005"]
    assert resolve_checkpoint(root).name == "step-00000005"


def test_every_group_needs_a_moe_layer() -> None:
    model = dataclasses.replace(MODEL_PRESETS["tiny"], num_dense_layers=1)
    with pytest.raises(ValueError, match=r"expert group\(s\) \[0\] would hold no MoE layer"):
        Layout.build(model, ParallelConfig(groups=4, attn_workers=1, expert_workers=1))


def test_summary_tokens_per_s_is_the_mean_over_measured_steps() -> None:
    # 100 tokens per step; the first step (warm-up) is left out; total tokens / total time
    records = [
        {"tokens_per_s": 10.0, "step_time_s": 10.0},
        {"tokens_per_s": 100.0, "step_time_s": 1.0},
        {"tokens_per_s": 50.0, "step_time_s": 2.0},
    ]
    assert mean_tokens_per_s(records) == pytest.approx(200 / 3)
    assert mean_tokens_per_s(records[:1]) == pytest.approx(10.0)
