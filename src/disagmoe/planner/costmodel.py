"""Roofline cost model of one disaggregated MoE layer, and the per-worker memory model.

Two cost models share one result type, `LayerCosts` (forward pass of one layer for one
sequence of `S` tokens; bf16 activations on the wire); their FLOP and byte formulas are
those of `disagmoe.flops`:

* `paper_costs` — exactly the formulas of docs/design.md §2.4 (H = model dim, g = heads/kv_heads):
  `C_a = S*H^2*(2 + 2/g) + 4*S^2*H`, `C_f = 4*k*S*H*D_e`, `V = 2*S*k*H` bytes.
* `detailed_costs` — what the kernels of this runtime execute. Terms beyond the design:
  - projections counted in FLOPs with the real widths q = heads*head_dim and
    kv = kv_heads*head_dim: `4*S*H*(q + kv)` (Q, K, V and O GEMMs);
  - causal attention core `2*S^2*q` (QK^T and PV, half the score matrix skipped);
  - router GEMM `2*S*H*E` and shared experts `6*S*H*D_e*num_shared` (they live with the
    attention block, see docs/planner.md);
  - SwiGLU experts `6*k*S*H*D_e` (gate, up and down GEMMs);
  - dense first layers (`num_dense_layers`) run their `6*S*H*D_dense` MLP on the A-group and
    exchange nothing; costs are averaged over the layers;
  - with p > 1 groups the residual `h` hops A(g) -> A(g+1): `2*S*H` more bytes each way on
    the attention NICs (`hop_bytes`).

Training multipliers (`train_time_factors`): backward = 2x forward for GEMMs; the attention
core backward = 2.5x forward (FlashAttention recomputes QK^T); full activation recompute adds
one forward. Each exchange happens once forward and once backward, so wire bytes double.

Memory (`attn_worker_memory`, `ffn_memory_terms`): 16 bytes per parameter (bf16 weight and
gradient, fp32 master weight and two Adam moments), plus bf16 activations kept for backward per
in-flight micro-batch and layer, plus one micro-batch of bf16 logits on the A-group that holds
the LM head.
"""

from __future__ import annotations

from dataclasses import dataclass

from disagmoe import flops
from disagmoe.config import ClusterConfig, ModelConfig

BYTES_ACT = 2  # bf16 activations / wire format
GIB = 1024**3
RECOMPUTE_MODES = ("none", "attn", "full")  # what the memory model knows (config.RECOMPUTE)
TIME_RECOMPUTE_MODES = ("none", "full")  # what the planner's time model chooses between
INDEX_BYTES = 8  # int64 token ids, rows, expert ids
DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2}


@dataclass(frozen=True, kw_only=True, slots=True)
class Precision:
    """Bytes per activation element and per parameter (weight + gradient + optimizer states)."""

    act: int
    state: int

    @property
    def hi(self) -> int:
        """Bytes of what is computed in at least fp32 (norm statistics, softmaxes)."""
        return max(self.act, 4)


# What the planner plans for: bf16 activations, bf16 weight and gradient, fp32 master
# weight and Adam moments (2 + 2 + 12 bytes per parameter).
MIXED_BF16 = Precision(act=2, state=16)


def runtime_precision(dtype: str) -> Precision:
    """This runtime trains in one dtype: weight, gradient and AdamW's two moments in it."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    return Precision(act=DTYPE_BYTES[dtype], state=4 * DTYPE_BYTES[dtype])


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerCosts:
    """Forward FLOPs and exchanged bytes of one (average) layer for one sequence."""

    attn_flops: float  # C_a: attention block (+ router, shared experts, dense MLPs)
    attn_core_flops: float  # the S^2 part of attn_flops (different backward factor)
    ffn_flops: float  # C_f: routed experts
    dispatch_bytes: float  # V: A -> F (M2N); the N2M combine moves the same amount back
    hop_bytes: float  # residual A(g) -> A(g+1) when p > 1 (detailed model only)

    @property
    def i_attn(self) -> float:
        """Arithmetic intensity of attention, FLOP per exchanged byte."""
        return self.attn_flops / self.dispatch_bytes

    @property
    def i_ffn(self) -> float:
        return self.ffn_flops / self.dispatch_bytes


def paper_costs(model: ModelConfig, seq_len: int) -> LayerCosts:
    """docs/design.md §2.4 formulas for b = 1 (GEMMs only, projections as written there)."""
    proj, core = flops.design_attn_flops(model, seq_len)
    return LayerCosts(
        attn_flops=proj + core,
        attn_core_flops=core,
        ffn_flops=flops.design_expert_flops(model, seq_len),
        dispatch_bytes=flops.routed_bytes(model, seq_len, BYTES_ACT),
        hop_bytes=0.0,
    )


def detailed_costs(model: ModelConfig, seq_len: int, groups: int = 1) -> LayerCosts:
    """Per-layer average costs of the kernels actually run (terms listed in the module doc)."""
    moe_frac = model.num_moe_layers / model.num_layers
    dense_frac = model.num_dense_layers / model.num_layers
    gemm, core = flops.attn_flops(model, seq_len, moe=moe_frac, dense=dense_frac)
    return LayerCosts(
        attn_flops=gemm + core,
        attn_core_flops=core,
        ffn_flops=flops.expert_flops(model, model.top_k * seq_len) * moe_frac,
        dispatch_bytes=flops.routed_bytes(model, seq_len, BYTES_ACT) * moe_frac,
        hop_bytes=BYTES_ACT * seq_len * model.dim if groups > 1 else 0.0,
    )


def train_time_factors(recompute: str) -> tuple[float, float]:
    """(GEMM factor, attention-core factor): training FLOPs / forward FLOPs."""
    if recompute not in TIME_RECOMPUTE_MODES:
        raise ValueError(
            f"recompute must be one of {', '.join(TIME_RECOMPUTE_MODES)}, got {recompute!r}"
        )
    return flops.train_factors(recompute == "full")


@dataclass(frozen=True, kw_only=True, slots=True)
class UnitTimes:
    """Seconds per sequence per layer on ONE GPU (compute) or ONE NIC (wire).

    With m attention GPUs, M_a attention NICs, n FFN GPUs and M_f FFN NICs, the stage time
    per sequence is `max(attn_gpu/m, attn_nic/M_a)` and `max(ffn_gpu/n, ffn_nic/M_f)`.
    """

    attn_gpu: float
    ffn_gpu: float
    attn_nic: float
    ffn_nic: float
    flops_per_s: float
    bytes_per_s: float


def unit_times(
    model: ModelConfig,
    cluster: ClusterConfig,
    seq_len: int,
    *,
    roofline_only: bool,
    groups: int = 1,
    recompute: str = "none",
) -> UnitTimes:
    """Per-sequence unit times.

    roofline_only: the paper's problem — forward pass, design formulas, nominal peaks.
    Otherwise: forward + backward, detailed formulas, peaks scaled by `cluster.mfu` and
    `cluster.bw_efficiency` (achievable, not nominal, FLOP/s and bytes/s).
    """
    peak = cluster.peak_tflops * 1e12
    nic = cluster.nic_gbps * 1e9
    if roofline_only:
        c = paper_costs(model, seq_len)
        return UnitTimes(
            attn_gpu=c.attn_flops / peak,
            ffn_gpu=c.ffn_flops / peak,
            attn_nic=c.dispatch_bytes / nic,
            ffn_nic=c.dispatch_bytes / nic,
            flops_per_s=peak,
            bytes_per_s=nic,
        )
    c = detailed_costs(model, seq_len, groups)
    gemm, core = train_time_factors(recompute)
    flops_s = peak * cluster.mfu
    bytes_s = nic * cluster.bw_efficiency
    attn = gemm * (c.attn_flops - c.attn_core_flops) + core * c.attn_core_flops
    return UnitTimes(
        attn_gpu=attn / flops_s,
        ffn_gpu=gemm * c.ffn_flops / flops_s,
        attn_nic=2.0 * (c.dispatch_bytes + c.hop_bytes) / bytes_s,
        ffn_nic=2.0 * c.dispatch_bytes / bytes_s,
        flops_per_s=flops_s,
        bytes_per_s=bytes_s,
    )


def ridge_point(cluster: ClusterConfig, *, achievable: bool = False) -> float:
    """FLOP per byte where one GPU with its own NIC share turns compute-bound."""
    nics_per_gpu = cluster.nics_per_node / cluster.gpus_per_node
    flops = cluster.peak_tflops * 1e12 * (cluster.mfu if achievable else 1.0)
    bw = cluster.nic_gbps * 1e9 * nics_per_gpu * (cluster.bw_efficiency if achievable else 1.0)
    return flops / bw


# ------------------------------------------------------------------------------ memory


def attn_params_per_layer(model: ModelConfig) -> int:
    """Q/K/V/O, two norms (+ q/k norms), router and shared experts of one MoE layer."""
    h, hd = model.dim, model.head_dim_resolved
    q, kv = model.num_heads * hd, model.num_kv_heads * hd
    qk_norm = 2 * hd if model.qk_norm else 0
    router = h * model.num_experts
    shared = 3 * h * model.expert_dim * model.num_shared_experts
    return h * (q + 2 * kv) + q * h + 2 * h + qk_norm + router + shared


def expert_params_per_layer(model: ModelConfig) -> int:
    return model.num_experts * 3 * model.dim * model.expert_dim


def distinct_worker_fraction(num_experts: int, top_k: int, shards: int) -> float:
    """E[# distinct shards among a token's top-k experts] / k, experts split evenly."""
    per = num_experts / shards
    none = 1.0
    for i in range(top_k):
        none *= max(0.0, (num_experts - per - i) / (num_experts - i))
    return shards * (1.0 - none) / top_k


def shards_per_token(model: ModelConfig, shards: int) -> float:
    """Rows a token makes across the expert shards (it goes once to each shard holding one of
    its experts; uniform routing). `shards=0` (not known): the bound top_k."""
    if shards <= 0:
        return float(model.top_k)
    return model.top_k * distinct_worker_fraction(model.num_experts, model.top_k, shards)


def _norm_bytes(h: int, prec: Precision) -> int:
    """RMSNorm: its input at >= fp32, 1/rms, the normed input, its output (saved by the next op)."""
    return prec.hi * h + prec.hi + 2 * prec.act * h


def attn_layer_act_bytes(
    model: ModelConfig,
    layer: int,
    recompute: str,
    prec: Precision = MIXED_BF16,
    *,
    seq_len: int,
    micro_batch_size: int,
    shards: int = 0,
    groups: int = 1,
) -> float:
    """Bytes an attention worker keeps from the forward of `layer` (L: the loss head) of one
    micro-batch until its backward: what autograd saves plus the stage's inputs and outputs.

    Per token of the stage (b = activation bytes, f = max(b, 4), index tensors 8 bytes,
    rho = `shards_per_token`):
    * inputs: the combines of the previous MoE layer, rho * (b*H + 8) (outputs and token ids),
      and with p > 1 the residual received from the previous group, b*H;
    * two RMSNorms, `_norm_bytes` each; q, k, v after RoPE and the attention output, b*(2q + 2kv),
      and the attention's log-sum-exp f*N (`recompute=attn` drops what the attention core saves
      beyond its inputs and output: the log-sum-exp);
    * MoE: router probabilities f*E, top-k ids 8k, renormalised weights f*(k+1); the dispatched
      rows rho*(b*H + 8), their weights b*k, rows and expert ids 16k, the boolean masks n*k bytes;
      the next layer's token ids 8*rho when they are sent (p > 1); shared experts 4b*I_s;
    * a residual that is a new tensor (shared experts, dense MLP, or b < 4 where the norm saves
      an upcast copy instead), b*H; a dense MLP 4b*D_dense;
    * layer 0: the token ids, 8; per micro-batch the RoPE tables 2*S*D*b and the balance loss 2f*E.
    The loss head keeps its inputs, a norm, the log-probabilities f*V and the targets, 8.
    `recompute=full` keeps the stage's inputs and outputs only (the recomputed forward is a
    transient).
    """
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(
            f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {recompute!r}"
        )
    b, f, idx = prec.act, prec.hi, INDEX_BYTES
    h, hd, k = model.dim, model.head_dim_resolved, model.top_k
    q, kv = model.num_heads * hd, model.num_kv_heads * hd
    rho = shards_per_token(model, shards)
    n = shards if shards > 0 else model.num_experts
    tokens = micro_batch_size * seq_len
    inputs = 0.0
    if layer > 0:
        inputs += rho * (b * h + idx) if model.is_moe_layer(layer - 1) else 0.0
        inputs += b * h if groups > 1 else 0.0
    if layer == model.num_layers:  # loss head
        kept = inputs + (
            idx if recompute == "full" else _norm_bytes(h, prec) + f * model.vocab_size
        )
        return tokens * (kept + idx)
    moe = model.is_moe_layer(layer)
    shared_dim = model.num_shared_experts * model.expert_dim if moe else 0
    new_residual = shared_dim > 0 or not moe or b < 4
    outputs = b * h if new_residual or recompute == "full" else 0.0
    if moe:
        outputs += rho * b * h + k * (b + 2 * idx) + (rho * idx if groups > 1 else 0.0)
    if recompute == "full":
        return tokens * (inputs + outputs)
    per_token = inputs + outputs + 2 * _norm_bytes(h, prec) + b * (2 * q + 2 * kv)
    per_token += f * model.num_heads if recompute == "none" else 0.0
    per_token += idx if layer == 0 else 0.0
    per_mb = 2 * seq_len * hd * b
    if moe:
        per_token += f * model.num_experts + idx * k + (f * (k + 1) if model.norm_topk_prob else 0)
        per_token += rho * idx + n * k + 4 * b * shared_dim
        per_mb += 2 * f * model.num_experts
    else:
        per_token += 4 * b * model.dense_dim_resolved
    return tokens * per_token + per_mb


def ffn_act_bytes(
    model: ModelConfig,
    recompute: str,
    prec: Precision = MIXED_BF16,
    *,
    tokens: int,
    shards: int,
    rows_known: bool = True,
) -> float:
    """Bytes one expert shard keeps for one replica's micro-batch of `tokens` tokens and one
    layer, balanced routing: P = tokens*k/n token-expert pairs, R = tokens*rho/n rows
    (R = P when `rows_known` is False: the bound for an n not fixed yet).

    Inputs u (b*H per row), weights b, rows and expert ids 16 per pair; outputs b*H per row.
    Without full recompute also the SwiGLU experts' saved tensors per pair: the gathered
    input, gate|up, SiLU(gate), the product, the expert output and the weighted output,
    b*(3H + 4I), the sorted weights b and two index tensors 16.
    """
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(
            f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {recompute!r}"
        )
    b, idx, h = prec.act, INDEX_BYTES, model.dim
    pairs = tokens * model.top_k / shards
    rows = tokens * shards_per_token(model, shards) / shards if rows_known else pairs
    kept = rows * 2 * b * h + pairs * (b + 2 * idx)
    if recompute != "full":
        kept += pairs * (b * (3 * h + 4 * model.expert_dim + 1) + 2 * idx)
    return kept


def group_layers(model: ModelConfig, groups: int, group: int) -> list[int]:
    return list(range(group, model.num_layers, groups))


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryBreakdown:
    """Bytes on one worker."""

    states: float  # weights + grads + optimizer states
    activations: float  # kept for backward, all in-flight micro-batches
    transient: float  # logits of one micro-batch (LM-head group only)

    @property
    def total(self) -> float:
        return self.states + self.activations + self.transient


def attn_group_params(model: ModelConfig, groups: int, group: int) -> int:
    """Parameters of one A replica of `group`. Group 0 also holds embedding, final norm and LM
    head (the layer after L-1 maps to group L mod p, which is 0 when p divides L)."""
    params = 0
    for layer in group_layers(model, groups, group):
        params += attn_params_per_layer(model)
        if not model.is_moe_layer(layer):
            params -= model.dim * model.num_experts
            params -= 3 * model.dim * model.expert_dim * model.num_shared_experts
            params += 3 * model.dim * model.dense_dim_resolved
    if group == 0:
        emb = model.vocab_size * model.dim
        params += emb * (1 if model.tie_embeddings else 2) + model.dim
    return params


def attn_worker_memory(
    model: ModelConfig,
    *,
    groups: int,
    seq_len: int,
    micro_batch_size: int,
    in_flight: int,
    recompute: str,
    prec: Precision = MIXED_BF16,
    shards: int = 0,
) -> MemoryBreakdown:
    """Worst A-group replica: states, `in_flight` micro-batches' activations of all its layers
    (`attn_layer_act_bytes`, the loss head on group 0), and one micro-batch of logits."""
    worst = MemoryBreakdown(states=0.0, activations=0.0, transient=0.0)
    tokens = micro_batch_size * seq_len
    for g in range(groups):
        layers = group_layers(model, groups, g) + ([model.num_layers] if g == 0 else [])
        kw = {"seq_len": seq_len, "micro_batch_size": micro_batch_size, "shards": shards}
        per_mb = sum(
            attn_layer_act_bytes(model, layer, recompute, prec, groups=groups, **kw)
            for layer in layers
        )
        logits = prec.act + (4 if prec.act < 4 else 0)  # + the fp32 copy the loss takes
        cand = MemoryBreakdown(
            states=float(attn_group_params(model, groups, g) * prec.state),
            activations=float(in_flight * per_mb),
            transient=float(tokens * model.vocab_size * logits) if g == 0 else 0.0,
        )
        if cand.total > worst.total:
            worst = cand
    return worst


def ffn_memory_terms(
    model: ModelConfig,
    *,
    groups: int,
    seq_len: int,
    micro_batch_size: int,
    in_flight: int,
    recompute: str,
    prec: Precision = MIXED_BF16,
) -> tuple[float, float]:
    """(A, B) with bytes per FFN worker = (A + B*m)/n for m attention replicas, n shards.

    A: the group's expert states (shared by n shards; uniform fluid split E/n).
    B: activations per attention replica (`ffn_act_bytes` times n, rows bounded by pairs so
    that B does not depend on n): each replica sends b*S*k token-expert pairs per layer and
    in-flight micro-batch, spread evenly over the n shards (balanced routing).
    """
    moe_layers = max(
        sum(1 for layer in group_layers(model, groups, g) if model.is_moe_layer(layer))
        for g in range(groups)
    )
    a = float(moe_layers * expert_params_per_layer(model) * prec.state)
    tokens = micro_batch_size * seq_len
    per_mb = ffn_act_bytes(model, recompute, prec, tokens=tokens, shards=1, rows_known=False)
    return a, float(in_flight * moe_layers * per_mb)


def usable_memory_bytes(cluster: ClusterConfig, reserve: float) -> float:
    """Device memory minus a reserve fraction (CUDA context, NCCL buffers, fragmentation)."""
    return cluster.gpu_mem_gib * GIB * (1.0 - reserve)
