"""Import Hugging Face Qwen3-MoE and Mixtral checkpoints into `MoETransformer`.

A checkpoint directory holds `config.json` and safetensors weights (one
`model.safetensors`, or shards listed in `model.safetensors.index.json`).
Only safetensors are read: pickled `*.bin` checkpoints are refused, never
unpickled.

Name mapping (HF, after dropping the leading `model.` -> ours, `{i}` = layer):

    embed_tokens.weight                       -> embed.weight
    layers.{i}.input_layernorm.weight         -> layers.{i}.attn_block.norm1.weight
    layers.{i}.self_attn.{q,k,v,o}_proj.weight-> layers.{i}.attn_block.attn.{q,k,v,o}_proj.weight
    layers.{i}.self_attn.{q,k}_norm.weight    -> layers.{i}.attn_block.attn.{q,k}_norm.weight (Qwen3)
    layers.{i}.post_attention_layernorm.weight-> layers.{i}.attn_block.norm2.weight
    layers.{i}.<moe>.gate.weight              -> layers.{i}.attn_block.router.weight
    layers.{i}.<moe>.experts.{e}.<gate,up>    -> layers.{i}.experts.gate_up[e] = [gate.T | up.T]
    layers.{i}.<moe>.experts.{e}.<down>       -> layers.{i}.experts.down[e]    = down.T
    layers.{i}.mlp.{gate,up,down}_proj.weight -> layers.{i}.attn_block.mlp.*   (Qwen3 dense layers)
    norm.weight, lm_head.weight               -> norm.weight, lm_head.weight

`<moe>` is `mlp` (Qwen3, and Mixtral as transformers 5 names it in memory)
or `block_sparse_moe` (Mixtral as published and as transformers 5 saves it);
expert projections are `gate_proj/up_proj/down_proj` (Qwen3) or `w1/w3/w2`
(Mixtral). Experts stored per expert (published checkpoints and what
transformers 5 `save_pretrained` writes) and fused 3-D tensors
(`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I], the
in-memory layout of transformers 5) are both accepted.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..config import ModelConfig
from .model import MoETransformer

SUPPORTED_MODEL_TYPES = ("qwen3_moe", "mixtral")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# Config fields that change what the model computes; `load_hf_into` checks them.
_NUMERIC_FIELDS = (
    "vocab_size",
    "dim",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim_resolved",
    "num_experts",
    "top_k",
    "expert_dim",
    "num_shared_experts",
    "num_dense_layers",
    "dense_dim_resolved",
    "norm_topk_prob",
    "qk_norm",
    "tie_embeddings",
    "rope_theta",
    "norm_eps",
)


class _CheckpointError(ValueError):
    """A `ValueError` naming the checkpoint directory and what about it is unsupported."""


def _unsupported(path: Path, what: str) -> ValueError:
    return _CheckpointError(f"HF checkpoint {str(path)!r}: {what}")


def _read_json(path: Path, what: str) -> dict[str, Any]:
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
        raise _unsupported(path, f"RoPE type {rope_type!r} is unsupported (only 'default')")
    theta = params.get("rope_theta", hf.get("rope_theta"))
    if theta is None:
        raise _unsupported(path, "config.json has no rope_theta")
    return float(theta)


def _dense_prefix(path: Path, hf: dict[str, Any], num_layers: int) -> int:
    """Qwen3: number of leading dense layers; only `mlp_only_layers = [0..k-1]` maps to ours."""
    if hf.get("decoder_sparse_step", 1) != 1:
        raise _unsupported(
            path, f"decoder_sparse_step = {hf['decoder_sparse_step']} is unsupported (only 1)"
        )
    dense = sorted(hf.get("mlp_only_layers") or [])
    if dense != list(range(len(dense))) or len(dense) >= num_layers:
        raise _unsupported(
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
    if not path.is_dir():
        raise ValueError(f"HF checkpoint directory {str(path)!r} does not exist")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise _unsupported(path, "no config.json in the directory")
    hf = _read_json(config_file, "HF config")
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise _unsupported(
            path,
            f"model_type {model_type!r} is unsupported; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}",
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise _unsupported(path, f"hidden_act {hf['hidden_act']!r} is unsupported (only silu)")
    if hf.get("attention_bias", False):
        raise _unsupported(path, "attention_bias = true is unsupported (our attention has no bias)")

    try:
        num_layers = int(hf["num_hidden_layers"])
        num_heads = int(hf["num_attention_heads"])
        max_seq_len = int(hf.get("max_position_embeddings", 4096))
        window = hf.get("sliding_window")
        if model_type == "qwen3_moe" and not hf.get("use_sliding_window", False):
            window = None
        if window is not None:
            max_seq_len = min(max_seq_len, int(window))
        common: dict[str, Any] = dict(
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
        if model_type == "qwen3_moe":
            num_dense = _dense_prefix(path, hf, num_layers)
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
        if float(hf.get("router_jitter_noise") or 0.0) != 0.0:
            raise _unsupported(path, "router_jitter_noise > 0 is unsupported (our router is exact)")
        return ModelConfig(
            **common,
            num_experts=int(hf["num_local_experts"]),
            expert_dim=int(hf["intermediate_size"]),
            norm_topk_prob=True,
            qk_norm=False,
        )
    except _CheckpointError:
        raise
    except KeyError as err:
        raise _unsupported(path, f"config.json lacks {err.args[0]!r}") from None
    except (TypeError, ValueError) as err:
        raise _unsupported(path, f"config.json does not describe a valid model: {err}") from None


# ---------------------------------------------------------------------------- weights


def _weight_files(path: Path) -> list[Path]:
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index, "safetensors index").get("weight_map")
        if not isinstance(weight_map, dict):
            raise _unsupported(path, f"{INDEX_FILE} has no weight_map")
        files = [path / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise _unsupported(path, f"shard {file.name} listed in {INDEX_FILE} is missing")
        return files
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    if any(path.glob("*.bin")) or any(path.glob("*.pt")) or any(path.glob("*.pth")):
        raise _unsupported(
            path,
            "only safetensors weights are read (pickled *.bin/*.pt are never loaded); "
            "re-save the model with save_pretrained(..., safe_serialization=True)",
        )
    raise _unsupported(path, "no *.safetensors weights in the directory")


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in _weight_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                    tensors[key] = f.get_tensor(key)
        except (OSError, RuntimeError) as err:  # safetensors raises SafetensorError(OSError)
            raise _unsupported(path, f"cannot read {file.name}: {err}") from None
    return tensors


_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_ATTN = {
    "input_layernorm.weight": "attn_block.norm1.weight",
    "post_attention_layernorm.weight": "attn_block.norm2.weight",
    **{
        f"self_attn.{p}.weight": f"attn_block.attn.{p}.weight"
        for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
    },
}
_DENSE = {
    f"mlp.{p}.weight": f"attn_block.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")
}
_EXPERT = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_FUSED = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)")
_ROUTER = re.compile(r"(?:mlp|block_sparse_moe)\.gate\.weight")
# Per-expert projection names -> role (gate, up, down).
_EXPERT_ROLES = {
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
    "w1": "gate",
    "w3": "up",
    "w2": "down",
}


def _expected_shapes(cfg: ModelConfig) -> dict[str, torch.Size]:
    with torch.device("meta"):
        model = MoETransformer(cfg)
    return {name: t.shape for name, t in model.state_dict(keep_vars=True).items()}


def _stack_experts(
    path: Path, layer: int, parts: dict[tuple[int, str], torch.Tensor], num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert HF Linear weights -> our fused `gate_up` [E, H, 2I] and `down` [E, I, H]."""
    gate_up, down = [], []
    for e in range(num_experts):
        missing = [r for r in ("gate", "up", "down") if (e, r) not in parts]
        if missing:
            raise _unsupported(path, f"layer {layer} expert {e} lacks its {missing[0]} weight")
        gate, up = parts[(e, "gate")], parts[(e, "up")]
        if gate.shape != up.shape:
            raise _unsupported(
                path, f"layer {layer} expert {e}: gate {tuple(gate.shape)} != up {tuple(up.shape)}"
            )
        gate_up.append(torch.cat([gate.t(), up.t()], dim=1))
        down.append(parts[(e, "down")].t())
    extra = sorted({e for e, _ in parts if e >= num_experts})
    if extra:
        raise _unsupported(
            path, f"layer {layer} has expert {extra[0]} but num_experts={num_experts}"
        )
    return torch.stack(gate_up).contiguous(), torch.stack(down).contiguous()


def _map_layer(
    path: Path,
    layer: int,
    rest: str,
    tensor: torch.Tensor,
    out: dict[str, torch.Tensor],
    experts: dict[int, dict[tuple[int, str], torch.Tensor]],
) -> bool:
    """Map one per-layer HF tensor; False if the name is unknown."""
    prefix = f"layers.{layer}."
    if rest in _ATTN:
        out[prefix + _ATTN[rest]] = tensor
    elif rest in _DENSE:
        out[prefix + _DENSE[rest]] = tensor
    elif _ROUTER.fullmatch(rest):
        out[prefix + "attn_block.router.weight"] = tensor
    elif m := _EXPERT.fullmatch(rest):
        role = _EXPERT_ROLES.get(m.group(2))
        if role is None:
            return False
        experts.setdefault(layer, {})[(int(m.group(1)), role)] = tensor
    elif m := _FUSED.fullmatch(rest):
        if tensor.ndim != 3:
            raise _unsupported(path, f"fused expert tensor {rest} of layer {layer} is not 3-D")
        name = "gate_up" if m.group(1) == "gate_up_proj" else "down"
        # HF fused: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I].
        out[prefix + f"experts.{name}"] = tensor.transpose(1, 2).contiguous()
    else:
        return False
    return True


def load_hf_state_dict(path: str | Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Read a checkpoint's safetensors into our parameter names and layouts.

    Tensors keep the checkpoint's dtype. Every tensor the model needs must be
    present with the shape `cfg` implies, and every tensor in the checkpoint
    must map to one (rotary `inv_freq` buffers are ignored); otherwise
    `ValueError`. With tied embeddings `lm_head.weight` is the embedding.
    """
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"HF checkpoint directory {str(path)!r} does not exist")
    out: dict[str, torch.Tensor] = {}
    experts: dict[int, dict[tuple[int, str], torch.Tensor]] = {}
    unknown: list[str] = []
    for key, tensor in _read_tensors(path).items():
        name = key.removeprefix("model.")
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name in ("embed_tokens.weight", "norm.weight"):
            out["embed.weight" if name == "embed_tokens.weight" else name] = tensor
        elif key == "lm_head.weight":
            if not cfg.tie_embeddings:
                out[key] = tensor
        elif (m := _LAYER.fullmatch(name)) is None or not _map_layer(
            path, int(m.group(1)), m.group(2), tensor, out, experts
        ):
            unknown.append(key)
    if unknown:
        raise _unsupported(
            path, f"unsupported tensor {unknown[0]!r} ({len(unknown)} unmapped in total)"
        )
    for layer, parts in experts.items():
        gate_up, down = _stack_experts(path, layer, parts, cfg.num_experts)
        for name, t in (("gate_up", gate_up), ("down", down)):
            if f"layers.{layer}.experts.{name}" in out:
                raise _unsupported(path, f"layer {layer} stores experts both fused and per expert")
            out[f"layers.{layer}.experts.{name}"] = t
    if cfg.tie_embeddings and "embed.weight" in out:
        out["lm_head.weight"] = out["embed.weight"]

    expected = _expected_shapes(cfg)
    missing = [k for k in expected if k not in out]
    if missing:
        raise _unsupported(
            path,
            f"missing weights for {missing[0]!r} ({len(missing)} missing in total); "
            "does config.json match the weights?",
        )
    extra = [k for k in out if k not in expected]
    if extra:
        raise _unsupported(path, f"{extra[0]!r} has no place in the model built from its config")
    for name, shape in expected.items():
        if out[name].shape != shape:
            raise _unsupported(
                path,
                f"shape mismatch for {name!r}: checkpoint {tuple(out[name].shape)}, "
                f"model {tuple(shape)}",
            )
    return out


def load_hf_into(model: MoETransformer, path: str | Path) -> None:
    """Copy a checkpoint into `model` (cast to each parameter's dtype).

    The checkpoint's config must describe the same computation as `model.cfg`
    (shapes and numerics; `aux_loss_coef`, `max_seq_len`, `init_std` and the
    name may differ), else `ValueError`.
    """
    hf_cfg = read_hf_config(path)
    diffs = [
        f"{f} (model {getattr(model.cfg, f)}, checkpoint {getattr(hf_cfg, f)})"
        for f in _NUMERIC_FIELDS
        if getattr(model.cfg, f) != getattr(hf_cfg, f)
    ]
    if diffs:
        raise ValueError(
            f"HF checkpoint {str(path)!r} does not match the model config: {'; '.join(diffs)}"
        )
    state = load_hf_state_dict(path, model.cfg)
    model.load_state_dict(state, strict=True)
