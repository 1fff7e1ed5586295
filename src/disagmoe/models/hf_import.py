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

The checkpoint is checked whole against the model from its safetensors headers
alone; data is read only for the tensors asked for (`load_hf_tensors`), so a
rank reads its own parameters and, of the experts, only its shard's.
`config.json` is translated by `hf_config.read_hf_config`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..config import ModelConfig
from .hf_config import read_hf_config, read_json, unsupported
from .model import MoETransformer, build_meta_model

__all__ = [
    "check_hf_weights",
    "load_hf_into",
    "load_hf_state_dict",
    "load_hf_tensors",
    "read_hf_config",
]

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


# ---------------------------------------------------------------------------- weights


def _weight_files(path: Path) -> list[Path]:
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index, "safetensors index").get("weight_map")
        if not isinstance(weight_map, dict):
            raise unsupported(path, f"{INDEX_FILE} has no weight_map")
        files = [path / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise unsupported(path, f"shard {file.name} listed in {INDEX_FILE} is missing")
        return files
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    if any(path.glob("*.bin")) or any(path.glob("*.pt")) or any(path.glob("*.pth")):
        raise unsupported(
            path,
            "only safetensors weights are read (pickled *.bin/*.pt are never loaded); "
            "re-save the model with save_pretrained(..., safe_serialization=True)",
        )
    raise unsupported(path, "no *.safetensors weights in the directory")


@dataclass(frozen=True)
class _Stored:
    """One tensor of the checkpoint as its safetensors header describes it (no data read)."""

    file: Path
    shape: tuple[int, ...]


def _index(path: Path) -> dict[str, _Stored]:
    """Every tensor of the checkpoint, from the safetensors headers only."""
    index: dict[str, _Stored] = {}
    for file in _weight_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                    index[key] = _Stored(file, tuple(f.get_slice(key).get_shape()))
        except (OSError, RuntimeError) as err:  # safetensors raises SafetensorError(OSError)
            raise unsupported(path, f"cannot read {file.name}: {err}") from None
    return index


_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
ATTN_NAMES = {  # HF name in a layer -> ours (hf_export inverts it)
    "input_layernorm.weight": "attn_block.norm1.weight",
    "post_attention_layernorm.weight": "attn_block.norm2.weight",
    **{
        f"self_attn.{p}.weight": f"attn_block.attn.{p}.weight"
        for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
    },
}
DENSE_NAMES = {
    f"mlp.{p}.weight": f"attn_block.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")
}
_EXPERT = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_FUSED = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)")
_ROUTER = re.compile(r"(?:mlp|block_sparse_moe)\.gate\.weight")
# Per architecture: the MoE module's name and its per-expert projections by role.
MOE_MODULE = {"qwen3_moe": "mlp", "mixtral": "block_sparse_moe"}
EXPERT_PROJECTIONS = {
    "qwen3_moe": {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"},
    "mixtral": {"gate": "w1", "up": "w3", "down": "w2"},
}
_EXPERT_ROLES = {name: role for p in EXPERT_PROJECTIONS.values() for role, name in p.items()}


def _expected_shapes(cfg: ModelConfig) -> dict[str, torch.Size]:
    model = build_meta_model(cfg)
    return {name: t.shape for name, t in model.state_dict(keep_vars=True).items()}


@dataclass(frozen=True)
class _Source:
    """How one of our tensors is made from checkpoint tensors `keys`, by `kind`:

    * "direct"  — keys[0] as stored;
    * "fused"   — keys[0] is HF's fused `gate_up_proj` [E, 2I, H] or `down_proj` [E, H, I],
                  transposed to ours;
    * "gate_up" — keys are per-expert (gate, up) Linear weights [I, H], expert after expert:
                  `gate_up[e] = [gate.T | up.T]`;
    * "down"    — keys are per-expert down Linear weights [H, I]: `down[e] = down.T`.

    `shape` is our tensor's shape, known from the headers alone.
    """

    kind: str
    keys: tuple[str, ...]
    shape: tuple[int, ...]


def _expert_sources(
    path: Path,
    layer: int,
    parts: dict[tuple[int, str], str],
    index: dict[str, _Stored],
    num_experts: int,
) -> tuple[_Source, _Source]:
    """Per-expert HF Linear weights -> sources of our `gate_up` [E, H, 2I] and `down` [E, I, H]."""
    gate_up: list[str] = []
    down: list[str] = []
    first: tuple[tuple[int, ...], ...] = ()
    for e in range(num_experts):
        missing = [r for r in ("gate", "up", "down") if (e, r) not in parts]
        if missing:
            raise unsupported(path, f"layer {layer} expert {e} lacks its {missing[0]} weight")
        gate, up, d = (index[parts[(e, r)]].shape for r in ("gate", "up", "down"))
        if gate != up:
            raise unsupported(path, f"layer {layer} expert {e}: gate {gate} != up {up}")
        if first and (gate, d) != first:
            raise unsupported(
                path, f"layer {layer} expert {e}: gate, down {gate}, {d} != expert 0's {first}"
            )
        first = first or (gate, d)
        gate_up += [parts[(e, "gate")], parts[(e, "up")]]
        down.append(parts[(e, "down")])
    extra = sorted({e for e, _ in parts if e >= num_experts})
    if extra:
        raise unsupported(
            path, f"layer {layer} has expert {extra[0]} but num_experts={num_experts}"
        )
    (inter, dim), (dim_out, inter_out) = first
    return (
        _Source("gate_up", tuple(gate_up), (num_experts, dim, 2 * inter)),
        _Source("down", tuple(down), (num_experts, inter_out, dim_out)),
    )


def _map_layer(
    path: Path,
    layer: int,
    rest: str,
    key: str,
    shape: tuple[int, ...],
    out: dict[str, _Source],
    experts: dict[int, dict[tuple[int, str], str]],
) -> bool:
    """Map one per-layer HF tensor; False if the name is unknown."""
    prefix = f"layers.{layer}."
    if rest in ATTN_NAMES:
        out[prefix + ATTN_NAMES[rest]] = _Source("direct", (key,), shape)
    elif rest in DENSE_NAMES:
        out[prefix + DENSE_NAMES[rest]] = _Source("direct", (key,), shape)
    elif _ROUTER.fullmatch(rest):
        out[prefix + "attn_block.router.weight"] = _Source("direct", (key,), shape)
    elif m := _EXPERT.fullmatch(rest):
        role = _EXPERT_ROLES.get(m.group(2))
        if role is None:
            return False
        experts.setdefault(layer, {})[(int(m.group(1)), role)] = key
    elif m := _FUSED.fullmatch(rest):
        if len(shape) != 3:
            raise unsupported(path, f"fused expert tensor {rest} of layer {layer} is not 3-D")
        name = "gate_up" if m.group(1) == "gate_up_proj" else "down"
        # HF fused: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I].
        out[prefix + f"experts.{name}"] = _Source("fused", (key,), (shape[0], shape[2], shape[1]))
    else:
        return False
    return True


def _plan(path: Path, cfg: ModelConfig, index: dict[str, _Stored]) -> dict[str, _Source]:
    """Where each of the model's tensors comes from; validates the whole checkpoint against
    `cfg` from its headers (names, shapes), reading no tensor data."""
    out: dict[str, _Source] = {}
    experts: dict[int, dict[tuple[int, str], str]] = {}
    unknown: list[str] = []
    for key, stored in index.items():
        name = key.removeprefix("model.")
        direct = _Source("direct", (key,), stored.shape)
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name in ("embed_tokens.weight", "norm.weight"):
            out["embed.weight" if name == "embed_tokens.weight" else name] = direct
        elif key == "lm_head.weight":
            if not cfg.tie_embeddings:
                out[key] = direct
        elif (m := _LAYER.fullmatch(name)) is None or not _map_layer(
            path, int(m.group(1)), m.group(2), key, stored.shape, out, experts
        ):
            unknown.append(key)
    if unknown:
        raise unsupported(
            path, f"unsupported tensor {unknown[0]!r} ({len(unknown)} unmapped in total)"
        )
    for layer, parts in experts.items():
        sources = _expert_sources(path, layer, parts, index, cfg.num_experts)
        for name, source in zip(("gate_up", "down"), sources, strict=True):
            if f"layers.{layer}.experts.{name}" in out:
                raise unsupported(path, f"layer {layer} stores experts both fused and per expert")
            out[f"layers.{layer}.experts.{name}"] = source
    if cfg.tie_embeddings and "embed.weight" in out:
        out["lm_head.weight"] = out["embed.weight"]

    expected = _expected_shapes(cfg)
    missing = [k for k in expected if k not in out]
    if missing:
        raise unsupported(
            path,
            f"missing weights for {missing[0]!r} ({len(missing)} missing in total); "
            "does config.json match the weights?",
        )
    extra = [k for k in out if k not in expected]
    if extra:
        raise unsupported(path, f"{extra[0]!r} has no place in the model built from its config")
    for name, shape in expected.items():
        if out[name].shape != tuple(shape):
            raise unsupported(
                path,
                f"shape mismatch for {name!r}: checkpoint {out[name].shape}, model {tuple(shape)}",
            )
    return out


def _read(source: _Source, experts: range | None, open_file: Callable[[str], Any]) -> torch.Tensor:
    """Our tensor from `source`, only the rows of `experts` (None: all) of an expert tensor."""
    if source.kind == "direct":
        return open_file(source.keys[0]).get_tensor(source.keys[0])
    rows = range(source.shape[0]) if experts is None else experts
    if source.kind == "fused":
        part = open_file(source.keys[0]).get_slice(source.keys[0])[rows.start : rows.stop]
        return part.transpose(1, 2).contiguous()
    if source.kind == "gate_up":
        pairs = [source.keys[2 * e : 2 * e + 2] for e in rows]
        return torch.stack(
            [torch.cat([open_file(k).get_tensor(k).t() for k in pair], dim=1) for pair in pairs]
        ).contiguous()
    assert source.kind == "down", source
    return torch.stack(
        [open_file(source.keys[e]).get_tensor(source.keys[e]).t() for e in rows]
    ).contiguous()


def _validated(path: Path, cfg: ModelConfig) -> tuple[dict[str, _Stored], dict[str, _Source]]:
    if not path.is_dir():
        raise ValueError(f"HF checkpoint directory {str(path)!r} does not exist")
    index = _index(path)
    return index, _plan(path, cfg, index)


def check_hf_weights(path: str | Path, cfg: ModelConfig) -> None:
    """Raise `ValueError` unless the checkpoint's weights fit the model of `cfg`, reading
    only the safetensors headers (see `load_hf_state_dict` for what is checked)."""
    _validated(Path(path), cfg)


def load_hf_tensors(
    path: str | Path, cfg: ModelConfig, wanted: Mapping[str, range | None]
) -> dict[str, torch.Tensor]:
    """Read only the tensors `wanted` (our name -> global expert ids to read of an expert
    tensor, None for all) into our names and layouts, in the checkpoint's dtype.

    The whole checkpoint is validated first from its headers (`check_hf_weights`); the data
    read is exactly what is asked for: one expert shard reads its experts' slices (a
    `get_slice` of fused tensors, its experts' keys of per-expert ones).
    """
    path = Path(path)
    index, plan = _validated(path, cfg)
    out: dict[str, torch.Tensor] = {}
    with ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def open_file(key: str) -> Any:
            file = index[key].file
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(str(file), framework="pt"))
            return handles[file]

        for name, experts in wanted.items():
            assert name in plan, f"{name!r} is not a tensor of the model"
            try:
                out[name] = _read(plan[name], experts, open_file)
            except (OSError, RuntimeError) as err:
                file = index[plan[name].keys[0]].file
                raise unsupported(path, f"cannot read {file.name}: {err}") from None
    return out


def load_hf_state_dict(path: str | Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Read a checkpoint's safetensors into our parameter names and layouts.

    Tensors keep the checkpoint's dtype. Every tensor the model needs must be
    present with the shape `cfg` implies, and every tensor in the checkpoint
    must map to one (rotary `inv_freq` buffers are ignored); otherwise
    `ValueError`. With tied embeddings `lm_head.weight` is the embedding.
    """
    names = [n for n in _expected_shapes(cfg) if not (cfg.tie_embeddings and n == "lm_head.weight")]
    out = load_hf_tensors(path, cfg, dict.fromkeys(names))
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out["embed.weight"]
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
