"""Export `MoETransformer` weights as a Hugging Face Qwen3-MoE or Mixtral checkpoint.

The inverse of `hf_import`, with its name tables (`ATTN_NAMES`, `DENSE_NAMES`,
`MOE_MODULE`, `EXPERT_PROJECTIONS`): our fused expert tensors are written per expert,
as published checkpoints store them,

    layers.{i}.experts.gate_up[e] = [gate.T | up.T] -> model.layers.{i}.<moe>.experts.{e}.<gate>, <up>
    layers.{i}.experts.down[e]    = down.T          -> model.layers.{i}.<moe>.experts.{e}.<down>

(`<moe>` `mlp` with `gate_proj/up_proj/down_proj` for Qwen3-MoE, `block_sparse_moe` with
`w1/w3/w2` for Mixtral), and `config.json` is the one `hf_config.read_hf_config` reads
back to the same `ModelConfig`.

The architecture follows from the model: QK-norm means Qwen3-MoE; no QK-norm,
normalised top-k, no dense layers means Mixtral. Shared experts have no place in either
and are refused.
"""

from __future__ import annotations

from typing import Any

import torch

from ..config import ModelConfig
from .hf_import import ATTN_NAMES, DENSE_NAMES, EXPERT_PROJECTIONS, MOE_MODULE

ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}


def hf_model_type(cfg: ModelConfig) -> str:
    """`qwen3_moe` or `mixtral`: the HF architecture that computes what `cfg` does."""
    if cfg.num_shared_experts:
        raise ValueError(
            f"model {cfg.name!r} has shared experts, which neither Qwen3-MoE nor Mixtral has; "
            "export supports Qwen3-MoE- and Mixtral-shaped models only"
        )
    if cfg.qk_norm:
        return "qwen3_moe"
    if cfg.norm_topk_prob and cfg.num_dense_layers == 0:
        return "mixtral"
    raise ValueError(
        f"model {cfg.name!r} is neither Qwen3-MoE-shaped (qk_norm) nor Mixtral-shaped (no "
        "qk_norm, norm_topk_prob, no dense layers); export supports those two only"
    )


def hf_config_dict(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """`config.json` of the export; `read_hf_config` maps it back to `cfg` (but the name)."""
    model_type = hf_model_type(cfg)
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim_resolved,
        "num_experts_per_tok": cfg.top_k,
        "router_aux_loss_coef": cfg.aux_loss_coef,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.max_seq_len,
        "initializer_range": cfg.init_std,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "dtype": str(dtype).removeprefix("torch."),
    }
    if model_type == "qwen3_moe":
        return out | {
            "num_experts": cfg.num_experts,
            "moe_intermediate_size": cfg.expert_dim,
            "intermediate_size": cfg.dense_dim_resolved,
            "mlp_only_layers": list(range(cfg.num_dense_layers)),
            "decoder_sparse_step": 1,
            "norm_topk_prob": cfg.norm_topk_prob,
            "use_sliding_window": False,
        }
    return out | {
        "num_local_experts": cfg.num_experts,
        "intermediate_size": cfg.expert_dim,
        "router_jitter_noise": 0.0,
        "sliding_window": None,
    }


def hf_state_dict(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our parameters (full model, `MoETransformer` names) under the HF names, per expert."""
    model_type = hf_model_type(cfg)
    moe, proj = MOE_MODULE[model_type], EXPERT_PROJECTIONS[model_type]
    ours_to_hf = {ours: hf for hf, ours in (ATTN_NAMES | DENSE_NAMES).items()}
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": state["embed.weight"]}
    out["model.norm.weight"] = state["norm.weight"]
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    for i in range(cfg.num_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        for name, tensor in state.items():
            rest = name.removeprefix(ours)
            if name.startswith(ours) and rest in ours_to_hf:
                out[hf + ours_to_hf[rest]] = tensor
        if not cfg.is_moe_layer(i):
            continue
        out[f"{hf}{moe}.gate.weight"] = state[ours + "attn_block.router.weight"]
        gate_up, down = state[ours + "experts.gate_up"], state[ours + "experts.down"]
        inter = cfg.expert_dim
        for e in range(cfg.num_experts):
            expert = f"{hf}{moe}.experts.{e}."
            out[expert + proj["gate"] + ".weight"] = gate_up[e][:, :inter].t()
            out[expert + proj["up"] + ".weight"] = gate_up[e][:, inter:].t()
            out[expert + proj["down"] + ".weight"] = down[e].t()
    return {k: v.contiguous() for k, v in out.items()}
