"""Pieces every runtime needs before its first step: the initial model and the data."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from ..config import RunConfig, recomputed_layers
from ..costs.compute import ComputeCosts
from ..data import TokenBatches, build_batches
from ..device import HOST
from ..models import MoETransformer, build_meta_model, held_parameters, materialize, seeded_values
from ..models.emulated import emulate_compute
from ..models.recompute import apply_recompute
from .objective import torch_dtype
from .precision import param_dtype_name


def materialize_initial_weights(
    cfg: RunConfig,
    modules: Sequence[nn.Module],
    *,
    first_expert: int = 0,
    device: torch.device = HOST,
) -> None:
    """Give the meta parameters of one rank's `modules` the run's initial weights, on `device`.

    `modules` name their parameters as the full model does (`MoETransformer` or
    `NamedParts` of a meta model); every `Experts` among them holds global experts
    `first_expert ..`. Seeded init draws exactly these tensors (`models.init`); with
    `train.init_from_hf` the checkpoint is checked whole from its headers and only these
    tensors (and, of the experts, only this shard) are read. Either way each tensor equals
    the reference model's, so all ranks start from its weights without a broadcast.
    """
    dtype = torch_dtype(param_dtype_name(cfg.train))
    if not cfg.train.init_from_hf:
        values = seeded_values(
            seed=cfg.train.seed, std=cfg.model.init_std, dtype=dtype, device=device
        )
        materialize(modules, values, first_expert)
        return
    from ..models.hf_import import load_hf_tensors

    wanted = held_parameters(modules, first_expert)
    tensors = load_hf_tensors(cfg.train.init_from_hf, cfg.model, wanted)
    materialize(
        modules,
        lambda name, _param, _experts: tensors.pop(name).to(device=device, dtype=dtype),
        first_expert,
    )


def build_initial_model(cfg: RunConfig, device: torch.device = HOST) -> MoETransformer:
    """The whole model with the run's initial weights (seeded init, or a HF checkpoint)."""
    model = build_meta_model(cfg.model)
    materialize_initial_weights(cfg, [model], device=device)
    return model


def build_data(cfg: RunConfig, *, evaluation: bool = False) -> TokenBatches:
    """The run's training batches (or, with `evaluation`, those of `train.eval_data`, checked
    the same way); refuses byte tokens for a `--init-from-hf` checkpoint unless
    `train.allow_byte_data` (its vocabulary is the tokenizer's, not bytes)."""
    t = cfg.train
    data, flag = (t.eval_data, "--eval-data") if evaluation else (t.data, "--data")
    if t.init_from_hf and not t.allow_byte_data and (not data or data.endswith(".txt")):
        raise ValueError(
            "--init-from-hf with byte tokens (the built-in corpus or a .txt file) "
            f"{'evaluates' if evaluation else 'trains'} the checkpoint on another vocabulary; "
            f"give {flag} PREFIX from `disagmoe prepare-data` with its tokenizer, or "
            "--allow-byte-data"
        )
    return build_batches(
        data,
        t.data_dtype,
        flag=flag,
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


def apply_variants(
    cfg: RunConfig, modules: Iterable[nn.Module], layers: list[int] | None = None
) -> None:
    """Give the modules a worker runs the variants the run asks for, in place.

    Activation recompute (`train.recompute`, `models.recompute`), or, with emulated compute
    (`train.emulate_compute`), attention blocks and experts that wait their calibrated
    durations instead of computing (a "full" recompute adds the forward's duration to each
    backward). `layers`: the decoder layers the worker holds, in order (an AF-Pipe group's,
    an EP pipeline rank's; None: the model's), of which `train.recompute_layers` picks
    those that recompute (`config.recomputed_layers`). Call once the worker has built and
    materialised its modules.
    """
    recompute = cfg.train.recompute
    only = None
    if recompute == "full" and cfg.train.recompute_layers > 0:
        held = list(range(cfg.model.num_layers)) if layers is None else layers
        only = recomputed_layers(held, cfg.train.recompute_layers)
    costs = load_emulation(cfg)
    if costs is not None and recompute == "attn":
        raise ValueError(
            "train.recompute=attn cannot be emulated (the calibrated costs do not separate "
            "the attention core); use recompute none or full with train.emulate_compute"
        )
    for module in modules:
        if costs is not None:
            emulate_compute(module, costs, recompute, only)
        else:
            apply_recompute(module, recompute, only)
