"""`disagmoe export`: a checkpoint as a HF Qwen3-MoE / Mixtral checkpoint that
`transformers` loads, with the tensors, config and logits of the model it came from."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from disagmoe.config import ModelConfig, TrainConfig
from disagmoe.export import export_hf, find_step
from disagmoe.models.hf_config import read_hf_config
from disagmoe.models.hf_export import hf_model_type
from disagmoe.training.checkpoint import load_model, save_checkpoint
from disagmoe.training.objective import build_optimizer
from tests.unit.test_hf_import import (
    ARCHS,
    FLOAT64_ATOL,
    build_hf,
    hf_logits,
    our_logits,
    ours_from,
    patch_hf_for_float64,
    tokens,
)


def checkpoint_of(model: torch.nn.Module, cfg: ModelConfig, run_dir: Path, step: int) -> Path:
    """A single-process checkpoint of `model`, as `disagmoe train --checkpoint-every` writes."""
    named = list(model.named_parameters())
    optimizer = build_optimizer(named, TrainConfig())
    return save_checkpoint(run_dir / "checkpoints", step, named, optimizer, None, cfg)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_export_is_the_imported_checkpoint(
    arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """import -> checkpoint -> export gives back the HF checkpoint: the same config, the
    same tensors under the same (per-expert) keys, and HF's logits in float64."""
    hf = build_hf(arch, torch.float64)
    hf.save_pretrained(tmp_path / "hf")
    ours = ours_from(tmp_path / "hf", torch.float64)
    step_dir = checkpoint_of(ours, ours.cfg, tmp_path / "run", 3)
    assert find_step(str(tmp_path / "run"), None) == step_dir
    assert export_hf(step_dir, tmp_path / "out") == arch

    exported_cfg, saved_cfg = (read_hf_config(tmp_path / d) for d in ("out", "hf"))
    # head_dim: always written resolved (a Mixtral config may leave it to hidden / heads)
    assert exported_cfg == dataclasses.replace(saved_cfg, head_dim=saved_cfg.head_dim_resolved)
    saved, exported = (
        load_file(tmp_path / "hf" / "model.safetensors"),
        load_file(tmp_path / "out" / "model.safetensors"),
    )
    assert exported.keys() == saved.keys()
    assert any(".experts.3." in k for k in exported)  # per-expert keys
    for key, tensor in saved.items():
        assert torch.equal(exported[key], tensor), key

    patch_hf_for_float64(monkeypatch)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", dtype=torch.float64
    ).eval()
    loaded.set_attn_implementation("sdpa")
    loaded.set_experts_implementation("eager")
    toks = tokens(loaded.config.vocab_size)
    expected, got = hf_logits(loaded, toks), our_logits(load_model(step_dir), toks)
    assert expected.dtype == got.dtype == torch.float64 and expected.abs().max() > 0.5
    assert (got - expected).abs().max().item() < FLOAT64_ATOL


def test_the_architecture_follows_from_the_model() -> None:
    assert hf_model_type(ModelConfig(qk_norm=True, num_dense_layers=1)) == "qwen3_moe"
    assert hf_model_type(ModelConfig()) == "mixtral"  # the `tiny` preset's shape
    with pytest.raises(ValueError, match="shared experts, which neither Qwen3-MoE nor Mixtral"):
        hf_model_type(ModelConfig(num_shared_experts=1, qk_norm=True))
    with pytest.raises(ValueError, match="neither Qwen3-MoE-shaped"):
        hf_model_type(ModelConfig(norm_topk_prob=False))


def test_export_finds_the_step_or_says_which_exist(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        find_step(str(tmp_path / "none"), None)
    (tmp_path / "run").mkdir()
    with pytest.raises(ValueError, match="no checkpoints in .*--checkpoint-every N"):
        find_step(str(tmp_path / "run"), None)
    cfg = ModelConfig(num_layers=2)
    model = torch.nn.Linear(2, 2)  # any parameters: the meta is what find_step reads
    for step in (2, 4):
        checkpoint_of(model, cfg, tmp_path / "run", step)
    assert find_step(str(tmp_path / "run"), 2).name == "step-00000002"
    assert (
        json.loads((find_step(str(tmp_path / "run"), None) / "meta.json").read_text())["step"] == 4
    )
    with pytest.raises(ValueError, match="has no checkpoint of step 3; it has steps 2, 4"):
        find_step(str(tmp_path / "run"), 3)
