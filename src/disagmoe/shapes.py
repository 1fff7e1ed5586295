"""What a job runs on: the model's shape (`ModelConfig`) and the cluster's hardware
(`ClusterConfig`), two sections of a `config.RunConfig` (imported from there as well).

Frozen dataclasses that validate themselves in `__post_init__` (`ValueError` naming the
field to change); no flags: `disagmoe train` sets them through presets, TOML and `--set`.
"""

from __future__ import annotations

from dataclasses import dataclass


def require(condition: bool, message: str) -> None:
    """Raise `ValueError(message)` unless `condition`: the config classes' checks."""
    if not condition:
        raise ValueError(message)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """Shape of a decoder-only MoE transformer.

    Layers `0 .. num_dense_layers-1` use a dense SwiGLU MLP of width `dense_dim`
    (DeepSeek-MoE's `first_k_dense_replace`); every other layer is an MoE layer
    with `num_experts` routed experts of width `expert_dim`, `top_k` per token,
    plus `num_shared_experts` always-on experts of the same width.
    """

    name: str = "tiny"
    vocab_size: int = 256
    dim: int = 64
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 0  # 0 means dim // num_heads
    num_experts: int = 8
    top_k: int = 2
    expert_dim: int = 64
    num_shared_experts: int = 0
    num_dense_layers: int = 0
    dense_dim: int = 0  # 0 means 4 * dim
    norm_topk_prob: bool = True
    aux_loss_coef: float = 0.01
    qk_norm: bool = False
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    max_seq_len: int = 4096
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads", "expert_dim"):
            require(getattr(self, name) > 0, f"model.{name} must be > 0, got {getattr(self, name)}")
        require(self.num_experts >= 1, f"model.num_experts must be >= 1, got {self.num_experts}")
        require(
            self.num_heads % self.num_kv_heads == 0,
            f"model.num_heads ({self.num_heads}) must be divisible by model.num_kv_heads "
            f"({self.num_kv_heads})",
        )
        require(
            1 <= self.top_k <= self.num_experts,
            f"model.top_k ({self.top_k}) must be between 1 and model.num_experts "
            f"({self.num_experts})",
        )
        require(
            self.head_dim > 0 or self.dim % self.num_heads == 0,
            f"model.dim ({self.dim}) must be divisible by model.num_heads ({self.num_heads}), "
            "or set model.head_dim",
        )
        require(self.head_dim_resolved % 2 == 0, "model.head_dim must be even (RoPE)")
        require(
            0 <= self.num_dense_layers < self.num_layers,
            f"model.num_dense_layers ({self.num_dense_layers}) must be in [0, num_layers)",
        )
        require(self.num_shared_experts >= 0, "model.num_shared_experts must be >= 0")
        require(self.aux_loss_coef >= 0, "model.aux_loss_coef must be >= 0 (0 disables it)")
        require(self.norm_eps > 0 and self.rope_theta > 0, "model.norm_eps and rope_theta > 0")

    @property
    def head_dim_resolved(self) -> int:
        return self.head_dim if self.head_dim > 0 else self.dim // self.num_heads

    @property
    def dense_dim_resolved(self) -> int:
        return self.dense_dim if self.dense_dim > 0 else 4 * self.dim

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.num_dense_layers

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterConfig:
    """Hardware that the planner and the simulator reason about (per GPU / per NIC).

    Bandwidths are GB/s (1e9 bytes/s), one direction. `mfu` and `bw_efficiency`
    scale nominal peaks to achievable ones.
    """

    name: str = "h800"
    gpus_per_node: int = 8
    nics_per_node: int = 8
    nic_gbps: float = 50.0
    nvlink_gbps: float = 400.0
    peak_tflops: float = 989.0
    gpu_mem_gib: float = 80.0
    mfu: float = 0.45
    bw_efficiency: float = 0.8
    latency_us: float = 10.0

    def __post_init__(self) -> None:
        for name in ("gpus_per_node", "nics_per_node"):
            require(getattr(self, name) >= 1, f"cluster.{name} must be >= 1")
        for name in ("nic_gbps", "nvlink_gbps", "peak_tflops", "gpu_mem_gib"):
            require(getattr(self, name) > 0, f"cluster.{name} must be > 0")
        require(
            0 < self.mfu <= 1 and 0 < self.bw_efficiency <= 1, "cluster.mfu, bw_efficiency in (0,1]"
        )
        require(self.latency_us >= 0, "cluster.latency_us must be >= 0")
