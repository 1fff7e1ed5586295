"""Numerics oracle: our model loaded from a HF checkpoint gives HF's logits.

Tiny random Qwen3-MoE and Mixtral models are built offline by `transformers`
from a config, saved with `save_pretrained`, imported with
`disagmoe.models.hf_import` and run on the same tokens.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.models.mixtral import modeling_mixtral as hf_mixtral
from transformers.models.qwen3_moe import modeling_qwen3_moe as hf_qwen3

from disagmoe.config import ModelConfig
from disagmoe.models import MoETransformer, build_model
from disagmoe.models.hf_import import load_hf_into, load_hf_state_dict, read_hf_config

# float32: HF computes RoPE angles from float32 inverse frequencies, we from
# float64 ones, and the expert/attention kernels sum in different orders;
# logits here are O(1) (max ~3.4) and the observed max difference ~1.2e-6.
FLOAT32_ATOL = 2e-5
FLOAT64_ATOL = 1e-9

COMMON: dict[str, Any] = dict(
    vocab_size=61,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts_per_tok=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
)


def qwen3_config(**overrides: Any) -> Any:
    # head_dim 16 != hidden/heads (8), one dense first layer, tied embeddings and
    # unnormalised top-k weights: the options our importer has to translate.
    kwargs = dict(
        COMMON,
        num_hidden_layers=3,
        head_dim=16,
        num_experts=4,
        moe_intermediate_size=24,
        intermediate_size=40,
        mlp_only_layers=[0],
        norm_topk_prob=False,
        tie_word_embeddings=True,
        router_aux_loss_coef=0.005,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
    )
    kwargs.update(overrides)
    return transformers.Qwen3MoeConfig(**kwargs)


def mixtral_config(**overrides: Any) -> Any:
    kwargs = dict(
        COMMON,
        num_hidden_layers=2,
        num_local_experts=4,
        intermediate_size=24,
        router_aux_loss_coef=0.02,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    kwargs.update(overrides)
    return transformers.MixtralConfig(**kwargs)


ARCHS: dict[str, tuple[Callable[..., Any], type]] = {
    "qwen3_moe": (qwen3_config, transformers.Qwen3MoeForCausalLM),
    "mixtral": (mixtral_config, transformers.MixtralForCausalLM),
}


def build_hf(arch: str, dtype: torch.dtype, **overrides: Any) -> Any:
    """A HF model with every parameter random, norm weights included.

    Random norm weights (around 1) make a swapped norm1/norm2 or q_norm/k_norm
    visible in the logits, which the default all-ones init would hide.
    """
    make_config, cls = ARCHS[arch]
    model = cls(make_config(**overrides)).to(dtype).eval()
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            p.copy_(1.0 + 0.2 * noise if p.ndim == 1 else 0.15 * noise)
    return model


def tokens(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, 12), generator=torch.Generator().manual_seed(7))


def ours_from(path: Path, dtype: torch.dtype) -> MoETransformer:
    model = build_model(read_hf_config(path), seed=0, dtype=dtype)
    load_hf_into(model, path)
    return model.eval()


def hf_logits(model: Any, toks: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=toks).logits


def our_logits(model: MoETransformer, toks: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(toks)[0]


# ---------------------------------------------------------------------------- float64 patches
#
# HF computes three things in float32 even in a float64 model, while ours keeps
# float64 throughout; for a 1e-9 comparison the float64 test replaces exactly
# these HF forwards (same maths, in the input dtype):
#   * `*RMSNorm.forward`: HF upcasts to float32 and normalises there;
#   * `*TopKRouter.forward`: HF takes the router softmax in float32;
#   * `*RotaryEmbedding.forward`: HF builds inverse frequencies and angles in
#     float32 (inv_freq is made in float32 at init, so the buffer is float32
#     values even after `.to(float64)`); the patch recomputes them in float64.
# Besides, experts run HF's "eager" implementation (grouped_mm has no float64
# CPU kernel) and attention uses "sdpa" (HF's eager attention takes its
# softmax in float32).


def _rms_norm_in_dtype(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _router_in_dtype(self: Any, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = torch.nn.functional.linear(hidden_states, self.weight)
    probs = torch.softmax(logits, dim=-1)
    top_value, top_index = torch.topk(probs, self.top_k, dim=-1)
    if getattr(self, "norm_topk_prob", True):  # Mixtral always renormalises
        top_value = top_value / top_value.sum(dim=-1, keepdim=True)
    return logits, top_value, top_index


def _rope_in_dtype(self: Any, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[Any, Any]:
    cfg = self.config
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    theta = cfg.rope_parameters["rope_theta"]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=x.dtype) / dim))
    freqs = position_ids[..., None].to(x.dtype) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def patch_hf_for_float64(monkeypatch: pytest.MonkeyPatch) -> None:
    for mod, prefix in ((hf_qwen3, "Qwen3Moe"), (hf_mixtral, "Mixtral")):
        monkeypatch.setattr(getattr(mod, f"{prefix}RMSNorm"), "forward", _rms_norm_in_dtype)
        monkeypatch.setattr(getattr(mod, f"{prefix}TopKRouter"), "forward", _router_in_dtype)
        monkeypatch.setattr(getattr(mod, f"{prefix}RotaryEmbedding"), "forward", _rope_in_dtype)


# ---------------------------------------------------------------------------- logits


@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_match_hf_float64(
    arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hf = build_hf(arch, torch.float64)
    # Mixtral is saved in small shards to exercise model.safetensors.index.json.
    hf.save_pretrained(tmp_path, max_shard_size="20KB" if arch == "mixtral" else "1GB")
    if arch == "mixtral":
        assert (tmp_path / "model.safetensors.index.json").is_file()
    ours = ours_from(tmp_path, torch.float64)
    assert ours.embed.weight.dtype == torch.float64

    patch_hf_for_float64(monkeypatch)
    hf.set_attn_implementation("sdpa")
    hf.set_experts_implementation("eager")
    toks = tokens(hf.config.vocab_size)
    expected, got = hf_logits(hf, toks), our_logits(ours, toks)
    assert expected.dtype == got.dtype == torch.float64
    assert expected.abs().max() > 0.5  # logits are O(1): the tolerance is meaningful
    assert (got - expected).abs().max().item() < FLOAT64_ATOL


@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_match_unmodified_hf_float32(arch: str, tmp_path: Path) -> None:
    hf = build_hf(arch, torch.float32)
    hf.save_pretrained(tmp_path)
    ours = ours_from(tmp_path, torch.float32)
    toks = tokens(hf.config.vocab_size)
    expected, got = hf_logits(hf, toks), our_logits(ours, toks)
    assert expected.abs().max() > 0.5
    torch.testing.assert_close(got, expected, atol=FLOAT32_ATOL, rtol=0)


def test_save_pretrained_writes_experts_per_expert(tmp_path: Path) -> None:
    """Pins the transformers 5 on-disk layout the importer is written for."""
    from safetensors import safe_open

    build_hf("mixtral", torch.float32).save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in keys
    assert not any("gate_up_proj" in k for k in keys)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_fused_expert_tensors_load_like_per_expert(arch: str, tmp_path: Path) -> None:
    """The in-memory transformers 5 layout (3-D `experts.gate_up_proj`) imports identically."""
    hf = build_hf(arch, torch.float32)
    per_expert, fused = tmp_path / "per_expert", tmp_path / "fused"
    hf.save_pretrained(per_expert)
    fused.mkdir()
    (fused / "config.json").write_text((per_expert / "config.json").read_text())
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if hf.config.tie_word_embeddings:
        state.pop("lm_head.weight")  # shared storage; tied checkpoints omit it
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, str(fused / "model.safetensors"))

    cfg = read_hf_config(per_expert)
    a, b = load_hf_state_dict(per_expert, cfg), load_hf_state_dict(fused, cfg)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


# ---------------------------------------------------------------------------- config


def test_read_qwen3_config(tmp_path: Path) -> None:
    qwen3_config().save_pretrained(tmp_path)
    cfg = read_hf_config(tmp_path)
    assert cfg == ModelConfig(
        name="hf-qwen3_moe",
        vocab_size=61,
        dim=32,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        num_experts=4,
        top_k=2,
        expert_dim=24,
        num_dense_layers=1,
        dense_dim=40,
        norm_topk_prob=False,
        aux_loss_coef=0.005,
        qk_norm=True,
        tie_embeddings=True,
        rope_theta=5000.0,
        norm_eps=1e-6,
        max_seq_len=64,
        init_std=0.02,
    )


def test_read_mixtral_config(tmp_path: Path) -> None:
    mixtral_config(sliding_window=32).save_pretrained(tmp_path)
    cfg = read_hf_config(tmp_path)
    assert (cfg.num_experts, cfg.expert_dim, cfg.top_k) == (4, 24, 2)
    assert cfg.norm_topk_prob and not cfg.qk_norm and not cfg.tie_embeddings
    assert cfg.head_dim_resolved == 8 and cfg.num_dense_layers == 0
    assert (cfg.rope_theta, cfg.norm_eps, cfg.aux_loss_coef) == (1e6, 1e-6, 0.02)
    assert cfg.max_seq_len == 32  # capped at the sliding window, so the window never applies


def _write_config(path: Path, arch: str, **changes: Any) -> Path:
    make_config, _ = ARCHS[arch]
    make_config().save_pretrained(path)
    data = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    (path / "config.json").write_text(json.dumps(data))
    return path


def test_published_style_qwen3_config(tmp_path: Path) -> None:
    """Published Qwen3 configs say `num_experts` and a top-level `rope_theta` (transformers 4)."""
    path = _write_config(
        tmp_path,
        "qwen3_moe",
        num_local_experts=None,
        num_experts=4,
        rope_parameters=None,
        rope_theta=1e6,
        rope_scaling=None,
        mlp_only_layers=[],
    )
    cfg = read_hf_config(path)
    assert (cfg.num_experts, cfg.rope_theta, cfg.num_dense_layers) == (4, 1e6, 0)


@pytest.mark.parametrize(
    ("arch", "changes", "message"),
    [
        ("mixtral", {"model_type": "llama"}, "model_type 'llama' is unsupported"),
        ("qwen3_moe", {"attention_bias": True}, "attention_bias"),
        ("qwen3_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step = 2"),
        ("qwen3_moe", {"mlp_only_layers": [1]}, "mlp_only_layers = [1]"),
        ("qwen3_moe", {"mlp_only_layers": [0, 1, 2]}, "at least one MoE layer"),
        ("mixtral", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise"),
        ("mixtral", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "'yarn'"),
        ("mixtral", {"num_local_experts": None}, "lacks 'num_local_experts'"),
        ("mixtral", {"num_attention_heads": 3}, "divisible"),
    ],
)
def test_unsupported_config_raises(
    arch: str, changes: dict[str, Any], message: str, tmp_path: Path
) -> None:
    path = _write_config(tmp_path, arch, **changes)
    with pytest.raises(ValueError, match="HF checkpoint") as err:
        read_hf_config(path)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_missing_directory_or_config(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        read_hf_config(tmp_path / "nope")
    with pytest.raises(ValueError, match="no config\\.json"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read HF config"):
        read_hf_config(tmp_path)


# ---------------------------------------------------------------------------- weights errors


@pytest.fixture(scope="module")
def mixtral_state(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The tensors of a Mixtral checkpoint as `save_pretrained` writes them (per expert)."""
    path = tmp_path_factory.mktemp("mixtral")
    build_hf("mixtral", torch.float32).save_pretrained(path)
    return load_file(str(path / "model.safetensors"))


def _checkpoint(path: Path, state: dict[str, torch.Tensor]) -> Path:
    _write_config(path, "mixtral")
    save_file(state, str(path / "model.safetensors"))
    return path


def test_missing_weights(tmp_path: Path) -> None:
    path = _write_config(tmp_path, "mixtral")
    with pytest.raises(ValueError, match=r"no \*\.safetensors weights"):
        load_hf_state_dict(path, read_hf_config(path))
    (path / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(ValueError, match="never loaded"):
        load_hf_state_dict(path, read_hf_config(path))


def test_missing_shard(tmp_path: Path) -> None:
    build_hf("mixtral", torch.float32).save_pretrained(tmp_path, max_shard_size="20KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    with pytest.raises(ValueError, match=f"shard {shards[-1].name} listed in"):
        load_hf_state_dict(tmp_path, read_hf_config(tmp_path))


@pytest.mark.parametrize(
    ("drop", "message"),
    [
        ("model.norm.weight", "missing weights for 'norm.weight'"),
        ("lm_head.weight", "missing weights for 'lm_head.weight'"),
        ("model.layers.1.block_sparse_moe.experts.3.w3.weight", "layer 1 expert 3 lacks its up"),
    ],
)
def test_missing_tensor(
    drop: str, message: str, tmp_path: Path, mixtral_state: dict[str, torch.Tensor]
) -> None:
    state = dict(mixtral_state)
    del state[drop]
    path = _checkpoint(tmp_path, state)
    with pytest.raises(ValueError, match=re.escape(message)):
        load_hf_state_dict(path, read_hf_config(path))


def test_unknown_tensor(tmp_path: Path, mixtral_state: dict[str, torch.Tensor]) -> None:
    state = dict(mixtral_state, **{"model.layers.0.self_attn.q_proj.bias": torch.zeros(32)})
    path = _checkpoint(tmp_path, state)
    with pytest.raises(
        ValueError, match=r"unsupported tensor 'model.layers.0.self_attn.q_proj.bias'"
    ):
        load_hf_state_dict(path, read_hf_config(path))


def test_shape_mismatch(tmp_path: Path, mixtral_state: dict[str, torch.Tensor]) -> None:
    path = _checkpoint(tmp_path, mixtral_state)
    cfg = read_hf_config(path)
    wrong = dataclasses.replace(cfg, vocab_size=60)
    with pytest.raises(
        ValueError, match=r"shape mismatch for 'embed.weight': checkpoint \(61, 32\)"
    ):
        load_hf_state_dict(path, wrong)


def test_load_into_mismatched_model(tmp_path: Path, mixtral_state: dict[str, torch.Tensor]) -> None:
    path = _checkpoint(tmp_path, mixtral_state)
    cfg = dataclasses.replace(read_hf_config(path), rope_theta=10000.0)
    with pytest.raises(ValueError, match=r"rope_theta \(model 10000.0, checkpoint 1000000.0\)"):
        load_hf_into(MoETransformer(cfg), path)
