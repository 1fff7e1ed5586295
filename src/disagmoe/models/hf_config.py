"""The `ModelConfig` of a Hugging Face Qwen3-MoE or Mixtral checkpoint (its `config.json`).

Anything the model cannot represent exactly (another architecture, RoPE scaling,
attention biases, jitter noise, dense layers other than a prefix) is refused with a
`ValueError` naming the checkpoint directory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..config import ModelConfig

SUPPORTED_MODEL_TYPES = ("qwen3_moe", "mixtral")


class CheckpointError(ValueError):
    """A `ValueError` naming the checkpoint directory and what about it is unsupported."""


def unsupported(path: Path, what: str) -> ValueError:
    return CheckpointError(f"HF checkpoint {str(path)!r}: {what}")


def read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read {what} {str(path)!r}: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} {str(path)!r} must hold a JSON object")
    return data


def _rope_theta(path: Path, hf: dict[str, Any]) -> float:
    """RoPE base from `rope_parameters` (transformers 5) or top-level `rope_theta` (4.x)."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type != "default":
        raise unsupported(path, f"RoPE type {rope_type!r} is unsupported (only 'default')")
    theta = params.get("rope_theta", hf.get("rope_theta"))
    if theta is None:
        raise unsupported(path, "config.json has no rope_theta")
    return float(theta)


def _dense_prefix(path: Path, hf: dict[str, Any], num_layers: int) -> int:
    """Qwen3: number of leading dense layers; only `mlp_only_layers = [0..k-1]` maps to ours."""
    if hf.get("decoder_sparse_step", 1) != 1:
        raise unsupported(
            path, f"decoder_sparse_step = {hf['decoder_sparse_step']} is unsupported (only 1)"
        )
    dense = sorted(hf.get("mlp_only_layers") or [])
    if dense != list(range(len(dense))) or len(dense) >= num_layers:
        raise unsupported(
            path,
            f"mlp_only_layers = {dense} is unsupported (only a prefix [0, .., k-1] of the "
            "layers can be dense, with at least one MoE layer)",
        )
    return len(dense)


def read_hf_config(path: str | Path) -> ModelConfig:
    """The `ModelConfig` of a Qwen3-MoE or Mixtral checkpoint directory.

    `router_aux_loss_coef` becomes `aux_loss_coef` and `initializer_range`
    `init_std`. A sliding window caps `max_seq_len` at the window, so the
    window never changes what attention sees. Anything the model cannot
    represent exactly raises `ValueError`.
    """
    path = Path(path)
    hf = _supported_config(path)
    try:
        common = _common_fields(path, hf)
        if hf["model_type"] == "qwen3_moe":
            return _qwen3_moe_config(path, hf, common)
        return _mixtral_config(path, hf, common)
    except CheckpointError:
        raise
    except KeyError as err:
        raise unsupported(path, f"config.json lacks {err.args[0]!r}") from None
    except (TypeError, ValueError) as err:
        raise unsupported(path, f"config.json does not describe a valid model: {err}") from None


def _supported_config(path: Path) -> dict[str, Any]:
    """The checkpoint's config.json, of a supported model type, activation and attention."""
    if not path.is_dir():
        raise ValueError(f"HF checkpoint directory {str(path)!r} does not exist")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise unsupported(path, "no config.json in the directory")
    hf = read_json(config_file, "HF config")
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise unsupported(
            path,
            f"model_type {model_type!r} is unsupported; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}",
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise unsupported(path, f"hidden_act {hf['hidden_act']!r} is unsupported (only silu)")
    if hf.get("attention_bias", False):
        raise unsupported(path, "attention_bias = true is unsupported (our attention has no bias)")
    return hf


def _common_fields(path: Path, hf: dict[str, Any]) -> dict[str, Any]:
    """The `ModelConfig` fields both model types name alike (a sliding window caps
    `max_seq_len`)."""
    model_type = hf["model_type"]
    num_layers = int(hf["num_hidden_layers"])
    num_heads = int(hf["num_attention_heads"])
    max_seq_len = int(hf.get("max_position_embeddings", 4096))
    window = hf.get("sliding_window")
    if model_type == "qwen3_moe" and not hf.get("use_sliding_window", False):
        window = None
    if window is not None:
        max_seq_len = min(max_seq_len, int(window))
    return dict(
        name=f"hf-{model_type}",
        vocab_size=int(hf["vocab_size"]),
        dim=int(hf["hidden_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(hf.get("head_dim") or 0),
        top_k=int(hf["num_experts_per_tok"]),
        aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope_theta=_rope_theta(path, hf),
        norm_eps=float(hf["rms_norm_eps"]),
        max_seq_len=max_seq_len,
        init_std=float(hf.get("initializer_range", 0.02)),
    )


def _qwen3_moe_config(path: Path, hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    """Qwen3-MoE: a prefix of dense layers, optional top-k renormalisation, QK norm."""
    num_dense = _dense_prefix(path, hf, common["num_layers"])
    num_experts = hf.get("num_experts", hf.get("num_local_experts"))
    if num_experts is None:
        raise KeyError("num_experts")
    return ModelConfig(
        **common,
        num_experts=int(num_experts),
        expert_dim=int(hf["moe_intermediate_size"]),
        num_dense_layers=num_dense,
        dense_dim=int(hf["intermediate_size"]) if num_dense else 0,
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        qk_norm=True,
    )


def _mixtral_config(path: Path, hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    """Mixtral: every layer MoE, top-k renormalised, no QK norm, no router jitter."""
    if float(hf.get("router_jitter_noise") or 0.0) != 0.0:
        raise unsupported(path, "router_jitter_noise > 0 is unsupported (our router is exact)")
    return ModelConfig(
        **common,
        num_experts=int(hf["num_local_experts"]),
        expert_dim=int(hf["intermediate_size"]),
        norm_topk_prob=True,
        qk_norm=False,
    )
