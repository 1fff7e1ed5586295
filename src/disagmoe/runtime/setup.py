"""Pieces every runtime needs before its first step: the initial model and the data."""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
from torch import nn

from ..bench.emulation import ComputeCosts, emulate_compute
from ..config import RunConfig
from ..data import TokenBatches, build_batches
from ..models import MoETransformer, build_model
from .objective import torch_dtype


def build_initial_model(cfg: RunConfig) -> MoETransformer:
    """The full model with the run's initial weights (seeded init, or a HF checkpoint).

    Every worker calls this and keeps only its part, so all workers start from
    exactly the reference trainer's weights without a broadcast.
    """
    dtype = torch_dtype(cfg.train.dtype)
    model = build_model(cfg.model, seed=cfg.train.seed, dtype=dtype)
    if cfg.train.init_from_hf:
        from ..models.hf_import import load_hf_state_dict

        state = load_hf_state_dict(cfg.train.init_from_hf, cfg.model)
        missing, unexpected = model.load_state_dict(
            {k: v.to(dtype) for k, v in state.items()}, strict=False
        )
        missing = [k for k in missing if not (cfg.model.tie_embeddings and k == "lm_head.weight")]
        if missing or unexpected:
            raise ValueError(
                f"checkpoint {cfg.train.init_from_hf!r} does not fit the model: "
                f"missing {missing[:3]}, unexpected {unexpected[:3]}"
            )
    return model


def build_data(cfg: RunConfig) -> TokenBatches:
    t = cfg.train
    return build_batches(
        t.data,
        t.data_dtype,
        seq_len=t.seq_len,
        global_batch_size=t.global_batch_size,
        seed=t.seed,
        vocab_size=cfg.model.vocab_size,
    )


def set_threads(cfg: RunConfig, local_world_size: int) -> int:
    """Give each local rank `cores / local ranks` intra-op threads (at least one)."""
    threads = cfg.parallel.threads_per_rank or max((os.cpu_count() or 1) // local_world_size, 1)
    torch.set_num_threads(threads)
    return threads


def load_emulation(cfg: RunConfig) -> ComputeCosts | None:
    """The run's emulated compute costs, or None for real compute."""
    path = cfg.train.emulate_compute
    return ComputeCosts.load(path) if path else None


def apply_emulation(cfg: RunConfig, modules: Iterable[nn.Module]) -> None:
    """If the run asks for emulated compute (`train.emulate_compute`), make the attention
    blocks and experts under `modules` wait their calibrated durations instead of computing.

    Call on the modules a worker runs, once it has built them (an expert shard is a new
    module, sliced from the full model's).
    """
    costs = load_emulation(cfg)
    if costs is not None:
        for module in modules:
            emulate_compute(module, costs)
