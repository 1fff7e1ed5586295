"""Roofline cost model of one disaggregated MoE layer, and the memory model's shared terms.

Two cost models share one result type, `LayerCosts` (forward pass of one layer for one
sequence of `S` tokens; bf16 activations on the wire); their FLOP and byte formulas are
those of `disagmoe.costs.flops`:

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
core backward = 2.5x forward (FlashAttention recomputes QK^T); activation recompute adds one
forward of the attention core ("attn") or of everything ("full"). Each exchange happens once forward and once backward, so wire bytes double.

Memory: `Precision`, `MemoryBreakdown` and which layers and parameters a worker holds; the
model of what a worker keeps is `costs.runtime_memory` (this runtime's modules, checked
against measured memory), which `train`, `simulate` and the planner all use.
"""

from __future__ import annotations

from dataclasses import dataclass

from disagmoe.config import RECOMPUTE, ClusterConfig, ModelConfig, recomputed_layers
from disagmoe.costs import flops

BYTES_ACT = 2  # bf16 activations / wire format
GIB = 1024**3
RECOMPUTE_MODES = RECOMPUTE  # none | attn (attention core) | full (whole stage)
# what the planner chooses between: attn frees only the attention softmax statistics with
# fused kernels (docs/design-notes.md, "Activation recompute"), so it is priced, not chosen
TIME_RECOMPUTE_MODES = ("none", "full")
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
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(
            f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {recompute!r}"
        )
    return flops.train_factors(recompute)


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


def distinct_worker_fraction(num_experts: int, top_k: int, shards: int) -> float:
    """E[# distinct shards among a token's top-k experts] / k, experts split evenly."""
    per = num_experts / shards
    none = 1.0
    for i in range(top_k):
        none *= max(0.0, (num_experts - per - i) / (num_experts - i))
    return shards * (1.0 - none) / top_k


def group_layers(model: ModelConfig, groups: int, group: int) -> list[int]:
    return list(range(group, model.num_layers, groups))


def group_recomputed(
    model: ModelConfig, groups: int, recompute: str, recompute_layers: int
) -> frozenset[int] | None:
    """The layers a full recompute of each AF-Pipe group's first `recompute_layers` layers
    covers (`config.recomputed_layers`, `train.recompute_layers`); None: every layer
    (`recompute_layers` 0, or a mode other than full)."""
    if recompute != "full" or recompute_layers <= 0:
        return None
    return frozenset().union(
        *(
            recomputed_layers(group_layers(model, groups, g), recompute_layers)
            for g in range(groups)
        )
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryBreakdown:
    """Bytes on one worker."""

    states: float  # weights + grads + optimizer states
    activations: float  # kept for backward, all in-flight micro-batches
    transient: float  # logits of one micro-batch (LM-head group only)
    # gradients kept for deferred weight gradients (schedule.split_backward): one slot's
    deferred: float = 0.0

    @property
    def total(self) -> float:
        return self.states + self.activations + self.transient + self.deferred


def attn_group_params(model: ModelConfig, groups: int, group: int) -> int:
    """Parameters of one A replica of `group`. Group 0 also holds embedding, final norm and LM
    head (the layer after L-1 maps to group L mod p, which is 0 when p divides L)."""
    params = sum(flops.attn_params(model, layer) for layer in group_layers(model, groups, group))
    if group == 0:
        params += flops.head_params(model)
    return params


def group_moe_layers(model: ModelConfig, groups: int) -> int:
    """MoE layers of the group that has most."""
    return max(
        sum(1 for layer in group_layers(model, groups, g) if model.is_moe_layer(layer))
        for g in range(groups)
    )
