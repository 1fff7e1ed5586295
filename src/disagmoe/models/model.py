"""Decoder-only MoE transformer as plain modules, split into the units the runtime places.

Each layer is two components (docs/design.md §2.1):

* `AttentionBlock` ("A"): `h = x + Attn(Norm1(x))`, `u = Norm2(h)`, the router,
  and whatever needs every token anyway — shared experts (`h + Shared(u)`) or,
  on a dense layer, the dense MLP (`h + MLP(u)`). Its `residual` output is all
  of the next layer's input except the routed experts' contribution.
* `Experts` ("F"): the routed experts; `x' = residual + Experts(u)`.

Embedding, final norm and LM head sit beside layer 0's / after layer L-1's
attention. This module never imports torch.distributed: the runtime calls these
units on different workers.

Shape legend: B batch, S sequence, T = B*S tokens, H model dim, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..config import ModelConfig
from ..device import HOST
from .init import materialize, seeded_values
from .layers import Attention, RMSNorm, SwiGLU, rope_tables
from .moe import Experts, Router, Routing, flatten_routing, load_balancing_loss


@dataclass(frozen=True)
class AttnOutput:
    """What an A component produces for one micro-batch of one layer."""

    residual_BSH: torch.Tensor
    u_TH: torch.Tensor | None  # normed tokens for the routed experts (None on dense layers)
    routing: Routing | None
    aux: torch.Tensor | None  # unscaled balance loss of this layer (None on dense layers)


class AttentionBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(
            cfg.dim,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim_resolved,
            qk_norm=cfg.qk_norm,
            norm_eps=cfg.norm_eps,
        )
        self.norm2 = RMSNorm(cfg.dim, cfg.norm_eps)
        self.is_moe = cfg.is_moe_layer(layer)
        self.num_experts = cfg.num_experts
        self.router = (
            Router(cfg.dim, cfg.num_experts, cfg.top_k, norm_topk_prob=cfg.norm_topk_prob)
            if self.is_moe
            else None
        )
        self.shared = (
            SwiGLU(cfg.dim, cfg.num_shared_experts * cfg.expert_dim)
            if self.is_moe and cfg.num_shared_experts > 0
            else None
        )
        self.mlp = None if self.is_moe else SwiGLU(cfg.dim, cfg.dense_dim_resolved)

    def forward(
        self, x_BSH: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor
    ) -> AttnOutput:
        h = x_BSH + self.attn(self.norm1(x_BSH), cos_SD, sin_SD)
        u_BSH = self.norm2(h)
        if self.mlp is not None:
            return AttnOutput(residual_BSH=h + self.mlp(u_BSH), u_TH=None, routing=None, aux=None)
        assert self.router is not None
        u_TH = u_BSH.reshape(-1, u_BSH.shape[-1])
        routing = self.router(u_TH)
        residual = h if self.shared is None else h + self.shared(u_BSH)
        aux = load_balancing_loss(routing, self.num_experts)
        return AttnOutput(residual_BSH=residual, u_TH=u_TH, routing=routing, aux=aux)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.attn_block = AttentionBlock(cfg, layer)
        self.experts = (
            Experts(cfg.num_experts, cfg.dim, cfg.expert_dim) if cfg.is_moe_layer(layer) else None
        )

    def forward(
        self, x_BSH: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = self.attn_block(x_BSH, cos_SD, sin_SD)
        if self.experts is None:
            return out.residual_BSH, None
        assert out.u_TH is not None and out.routing is not None
        y_TH = self.experts(out.u_TH, flatten_routing(out.routing))
        return out.residual_BSH + y_TH.view_as(out.residual_BSH), out.aux


class MoETransformer(nn.Module):
    """The whole model on one process: the ground truth every runtime must reproduce."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def decoder_layer(self, index: int) -> DecoderLayer:
        layer = self.layers[index]
        assert isinstance(layer, DecoderLayer)
        return layer

    def rope(self, seq_len: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_tables(
            seq_len, self.cfg.head_dim_resolved, self.cfg.rope_theta, like.dtype, like.device
        )

    def head(self, x_BSH: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: logits [B, S, V]."""
        return self.lm_head(self.norm(x_BSH))

    def forward(self, tokens_BS: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Logits [B, S, V] and the per-MoE-layer balance losses (unscaled)."""
        x = self.embed(tokens_BS)
        cos, sin = self.rope(tokens_BS.shape[1], x)
        aux: list[torch.Tensor] = []
        for layer in self.layers:
            x, layer_aux = layer(x, cos, sin)
            if layer_aux is not None:
                aux.append(layer_aux)
        return self.head(x), aux


def build_meta_model(cfg: ModelConfig) -> MoETransformer:
    """The model's structure on the meta device: names, shapes and ties, no memory.

    A rank picks the modules it runs from it and `materialize`s only those.
    """
    with torch.device("meta"):
        return MoETransformer(cfg)


def build_model(
    cfg: ModelConfig, *, seed: int, dtype: torch.dtype, device: torch.device = HOST
) -> MoETransformer:
    """The whole model with its deterministic initial weights (`models.init`)."""
    model = build_meta_model(cfg)
    materialize([model], seeded_values(seed=seed, std=cfg.init_std, dtype=dtype, device=device))
    return model
