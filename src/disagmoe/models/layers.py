"""Dense building blocks: RMSNorm, rotary embedding, grouped-query attention, SwiGLU MLP.

Shape legend: B batch, S sequence, H model dim, N query heads, K kv heads,
D head dim, F MLP hidden dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm; low-precision inputs (bf16/fp16) are normalised in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float() if dtype in (torch.bfloat16, torch.float16) else x
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def rope_tables(
    seq_len: int, head_dim: int, theta: float, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [S, D] for positions 0..S-1 (computed in float64, then cast)."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    )
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float64, device=device), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x_BNSD: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor) -> torch.Tensor:
    return x_BNSD * cos_SD + _rotate_half(x_BNSD) * sin_SD


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE (SDPA kernel).

    `qk_norm` adds Qwen3's per-head RMSNorm on queries and keys before RoPE.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        qk_norm: bool,
        norm_eps: float,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_proj = nn.Linear(dim, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(dim, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, dim, bias=False)
        self.q_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None

    def forward(
        self, x_BSH: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor
    ) -> torch.Tensor:
        B, S, _ = x_BSH.shape
        q = self.q_proj(x_BSH).view(B, S, self.num_heads, self.head_dim)
        k = self.k_proj(x_BSH).view(B, S, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x_BSH).view(B, S, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q_BNSD = apply_rope(q.transpose(1, 2), cos_SD, sin_SD)
        k_BKSD = apply_rope(k.transpose(1, 2), cos_SD, sin_SD)
        o_BNSD = self.core(q_BNSD, k_BKSD, v.transpose(1, 2))
        return self.o_proj(o_BNSD.transpose(1, 2).reshape(B, S, self.num_heads * self.head_dim))

    def core(
        self, q_BNSD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor
    ) -> torch.Tensor:
        """The attention core: causal scaled-dot-product attention of q, k, v after RoPE
        (a method of its own so that a variant can recompute it, `models.recompute`)."""
        return F.scaled_dot_product_attention(
            q_BNSD, k_BKSD, v_BKSD, is_causal=True, enable_gqa=self.num_heads != self.num_kv_heads
        )


class SwiGLU(nn.Module):
    """Dense SwiGLU MLP: `down(silu(gate(x)) * up(x))` (dense layers and shared experts)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
