"""Model and cluster presets: public shapes for planning/simulation, small ones for training.

A TOML config starts a section from one with `preset = "name"` (`disagmoe.config_io`).
"""

from __future__ import annotations

from .config import ClusterConfig, ModelConfig

# Public shapes (config.json of the released checkpoints). Large presets are for the
# planner and simulator; they are not meant to train on a CPU.
MODEL_PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(name="tiny"),
    "tiny-shared": ModelConfig(
        name="tiny-shared", num_shared_experts=1, num_dense_layers=1, dense_dim=128
    ),
    "small": ModelConfig(
        name="small",
        dim=128,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        num_experts=16,
        top_k=2,
        expert_dim=128,
    ),
    "deepseek-moe-16b": ModelConfig(
        name="deepseek-moe-16b",
        vocab_size=102400,
        dim=2048,
        num_layers=28,
        num_heads=16,
        num_kv_heads=16,
        head_dim=128,
        num_experts=64,
        top_k=6,
        expert_dim=1408,
        num_shared_experts=2,
        num_dense_layers=1,
        dense_dim=10944,
        norm_topk_prob=False,
        aux_loss_coef=0.001,
        rope_theta=10000.0,
        norm_eps=1e-6,
        max_seq_len=32768,
    ),
    "qwen3-30b-a3b": ModelConfig(
        name="qwen3-30b-a3b",
        vocab_size=151936,
        dim=2048,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        num_experts=128,
        top_k=8,
        expert_dim=768,
        norm_topk_prob=True,
        aux_loss_coef=0.001,
        qk_norm=True,
        rope_theta=1e6,
        norm_eps=1e-6,
        max_seq_len=40960,
    ),
    "gpt-oss-20b": ModelConfig(
        name="gpt-oss-20b",
        vocab_size=201088,
        dim=2880,
        num_layers=24,
        num_heads=64,
        num_kv_heads=8,
        head_dim=64,
        num_experts=32,
        top_k=4,
        expert_dim=2880,
        norm_topk_prob=True,
        aux_loss_coef=0.0,
        rope_theta=150000.0,
        norm_eps=1e-5,
        max_seq_len=131072,
    ),
    "mixtral-8x7b": ModelConfig(
        name="mixtral-8x7b",
        vocab_size=32000,
        dim=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        num_experts=8,
        top_k=2,
        expert_dim=14336,
        norm_topk_prob=True,
        aux_loss_coef=0.02,
        rope_theta=1e6,
        norm_eps=1e-5,
        max_seq_len=32768,
    ),
}

# Nominal per-GPU figures (dense bf16 peak, one 400 Gbit/s NIC per GPU = 50 GB/s).
CLUSTER_PRESETS: dict[str, ClusterConfig] = {
    "h800": ClusterConfig(name="h800", nvlink_gbps=200.0, peak_tflops=989.0, gpu_mem_gib=80.0),
    "h100": ClusterConfig(name="h100", nvlink_gbps=450.0, peak_tflops=989.0, gpu_mem_gib=80.0),
    "h200": ClusterConfig(name="h200", nvlink_gbps=450.0, peak_tflops=989.0, gpu_mem_gib=141.0),
}


def model_preset(name: str) -> ModelConfig:
    if name not in MODEL_PRESETS:
        raise ValueError(
            f"unknown model preset {name!r}; choose one of: {', '.join(MODEL_PRESETS)}"
        )
    return MODEL_PRESETS[name]


def cluster_preset(name: str) -> ClusterConfig:
    if name not in CLUSTER_PRESETS:
        raise ValueError(
            f"unknown cluster preset {name!r}; choose one of: {', '.join(CLUSTER_PRESETS)}"
        )
    return CLUSTER_PRESETS[name]
