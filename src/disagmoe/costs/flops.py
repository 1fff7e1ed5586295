"""FLOP, byte and parameter formulas of one layer: the planner's and the simulator's single
source.

Shapes: b sequences of S tokens (N = b*S tokens), H = model dim, g = heads / kv_heads,
q / kv = query / key-value widths (heads * head_dim, kv_heads * head_dim), k = top-k,
E experts of width D_e, D_dense the dense MLP width, V the vocabulary.

* design closed forms (docs/design.md §2.4, one sequence, forward): attention
  `C_a = S*H^2*(2 + 2/g) + 4*S^2*H`, routed experts `C_f = 4*k*S*H*D_e`, exchanged
  bytes `2*S*k*H` (bf16, one copy per (token, expert) pair);
* kernels of this runtime, forward: projections `4*N*H*(q + kv)` (Q, K, V, O GEMMs),
  causal attention core `2*b*S^2*q` (QK^T and PV, half the score matrix skipped),
  router `2*N*H*E` and shared experts `6*N*H*D_e*num_shared` on MoE layers, the dense
  SwiGLU MLP `6*N*H*D_dense` on dense layers, the LM head `2*N*H*V`, SwiGLU routed
  experts `6*H*D_e` per (token, expert) pair (gate, up and down GEMMs);
* backward = 2x forward for GEMMs, 2.5x for the attention core (FlashAttention
  recomputes QK^T); activation recompute (`train.recompute`) adds one forward of what it
  recomputes: the attention core for "attn", everything for "full"; a chunked loss head
  (`train.loss_chunk_tokens`, `models.loss_head`) adds one forward of the LM head's GEMM
  to its backward (`head_backward_extra`).

Parameter counts (`attn_params`, `expert_params`, `head_params`) are the model's own
(`models/`: RMSNorm weights, no biases), so memory, gradient all-reduce bytes and
optimizer states all derive from one count.

Imports only the config, so that `planner` and `simulator` both import it.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from ..config import RECOMPUTE, ModelConfig

GEMM_BACKWARD = 2.0  # backward / forward FLOPs of a GEMM
CORE_BACKWARD = 2.5  # backward / forward FLOPs of the attention core (recomputes QK^T)


def design_attn_flops(model: ModelConfig, seq_len: int) -> tuple[float, float]:
    """(projection FLOPs, attention-core FLOPs) of `C_a`, the design's closed form."""
    h, s = model.dim, seq_len
    g = model.num_heads / model.num_kv_heads
    return s * h * h * (2.0 + 2.0 / g), 4.0 * s * s * h


def design_expert_flops(model: ModelConfig, seq_len: int) -> float:
    """`C_f`, the design's closed form (two GEMMs per expert, no gate)."""
    return 4.0 * model.top_k * seq_len * model.dim * model.expert_dim


def routed_bytes(model: ModelConfig, tokens: float, act_bytes: int) -> float:
    """Bytes of `tokens` dispatched with one copy per (token, expert) pair."""
    return float(act_bytes * tokens * model.top_k * model.dim)


def attn_flops(
    model: ModelConfig, seq_len: int, num_seqs: int = 1, *, moe: float, dense: float
) -> tuple[float, float]:
    """(GEMM FLOPs, attention-core FLOPs) of one attention block, forward.

    `moe` / `dense`: 1 and 0 for a MoE layer, 0 and 1 for a dense one, or the shares
    of such layers for a per-layer average (router and shared experts on MoE layers,
    the dense MLP on dense layers).
    """
    n = float(seq_len * num_seqs)
    h = model.dim
    q = model.num_heads * model.head_dim_resolved
    kv = model.num_kv_heads * model.head_dim_resolved
    gemm = 4.0 * n * h * (q + kv)
    gemm += 2.0 * n * h * model.num_experts * moe
    gemm += 6.0 * n * h * model.expert_dim * model.num_shared_experts * moe
    gemm += 6.0 * n * h * model.dense_dim_resolved * dense
    core = 2.0 * num_seqs * float(seq_len) ** 2 * q
    return gemm, core


def lm_head_flops(model: ModelConfig, tokens: float) -> float:
    """Forward FLOPs of the LM head over `tokens` tokens."""
    return 2.0 * tokens * model.dim * model.vocab_size


def head_backward_extra(loss_chunk_tokens: int) -> float:
    """Extra backward FLOPs of the LM head / its forward FLOPs: 1 when the loss head runs in
    chunks (its backward reruns each chunk's logits GEMM: 3x the forward in all), else 0.
    Not in `train_step_flops`, which counts the work the model needs."""
    return 1.0 if loss_chunk_tokens > 0 else 0.0


def expert_flops(model: ModelConfig, pairs: float) -> float:
    """Forward FLOPs of `pairs` (token, expert) pairs through the SwiGLU experts."""
    return pairs * 6.0 * model.dim * model.expert_dim


def backward_factors(recompute: str = "none") -> tuple[float, float]:
    """(GEMM, attention core): backward FLOPs / forward FLOPs, with activation recompute
    `recompute` (none | attn | full): the backward reruns the forward of what it recomputes."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}")
    gemm_extra = 1.0 if recompute == "full" else 0.0
    core_extra = 1.0 if recompute in ("attn", "full") else 0.0
    return GEMM_BACKWARD + gemm_extra, CORE_BACKWARD + core_extra


def layer_recompute(recompute: str, recomputed: Collection[int] | None, layer: int) -> str:
    """The recompute mode of `layer`: `recompute` on the layers of `recomputed` (those
    `train.recompute_layers` picks, `config.recomputed_layers`; None: every layer), none
    elsewhere."""
    return recompute if recomputed is None or layer in recomputed else "none"


def train_factors(recompute: str = "none") -> tuple[float, float]:
    """(GEMM, attention core): forward + backward FLOPs / forward FLOPs."""
    gemm, core = backward_factors(recompute)
    return 1.0 + gemm, 1.0 + core


def train_step_flops(
    model: ModelConfig, seq_len: int, num_seqs: int, pairs: Sequence[float] | None = None
) -> float:
    """Model FLOPs of one training step on `num_seqs` sequences of `seq_len` tokens.

    Forward + backward with `train_factors("none")`: activation recompute is not counted
    (the MFU convention: work the model needs, not work a memory saving adds). Every
    layer's attention block (router, shared experts or dense MLP included), the routed
    experts of `pairs[i]` (token, expert) pairs on the i-th MoE layer (default: top_k
    per token, what a dropless router sends), and the LM head; embedding lookups and
    norms are not counted.
    """
    gemm_factor, core_factor = train_factors("none")
    tokens = float(seq_len * num_seqs)
    moe_layers = [l for l in range(model.num_layers) if model.is_moe_layer(l)]
    if pairs is None:
        pairs = [tokens * model.top_k] * len(moe_layers)
    if len(pairs) != len(moe_layers):
        raise ValueError(f"pairs: one count per MoE layer ({len(moe_layers)}), got {len(pairs)}")
    total = lm_head_flops(model, tokens) * gemm_factor
    for l in range(model.num_layers):
        moe = 1.0 if model.is_moe_layer(l) else 0.0
        gemm, core = attn_flops(model, seq_len, num_seqs, moe=moe, dense=1.0 - moe)
        total += gemm * gemm_factor + core * core_factor
    total += sum(expert_flops(model, p) for p in pairs) * gemm_factor
    return total


def attn_params(model: ModelConfig, layer: int) -> int:
    """Parameters of layer `layer`'s attention block (everything but its routed experts):
    Q, K, V, O, the two norms (+ q/k norms), and the router and shared experts of a MoE
    layer or the dense SwiGLU MLP of a dense one."""
    h, hd = model.dim, model.head_dim_resolved
    q, kv = model.num_heads * hd, model.num_kv_heads * hd
    params = h * (q + 2 * kv) + q * h + 2 * h + (2 * hd if model.qk_norm else 0)
    if model.is_moe_layer(layer):
        return params + h * model.num_experts + 3 * h * model.expert_dim * model.num_shared_experts
    return params + 3 * h * model.dense_dim_resolved


def expert_params(model: ModelConfig, experts: int | None = None) -> int:
    """Parameters of `experts` routed SwiGLU experts of one MoE layer (default: all E)."""
    count = model.num_experts if experts is None else experts
    return count * 3 * model.dim * model.expert_dim


def head_params(model: ModelConfig) -> int:
    """Embedding, final norm and LM head (one matrix when the embeddings are tied)."""
    return model.vocab_size * model.dim * (1 if model.tie_embeddings else 2) + model.dim
