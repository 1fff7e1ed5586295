"""Activation recompute (`train.recompute`, `models.recompute`): the same numbers, less memory.

Memory is counted as PyTorch sees it (`testing.memory`): every tensor autograd saves for
backward during one forward, through `saved_tensors_hooks`, once per storage, parameters
excluded.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from disagmoe.config import RunConfig, replace_section
from disagmoe.costs.compute import ComputeCosts, Linear
from disagmoe.models import AttentionBlock, Experts, build_meta_model
from disagmoe.models.emulated import EmulatedAttentionBlock, EmulatedExperts
from disagmoe.models.layers import Attention
from disagmoe.models.recompute import (
    CoreRecomputedAttention,
    RecomputedAttentionBlock,
    RecomputedExperts,
    apply_recompute,
)
from disagmoe.testing.memory import stage_saved_bytes
from disagmoe.training.reference import ReferenceTrainer
from disagmoe.training.setup import apply_variants

MODES = ("none", "attn", "full")
B, S = 2, 32  # one micro-batch


def _cfg(recompute: str, layers: int = 0, **model: Any) -> RunConfig:
    cfg = replace_section(
        RunConfig(),
        "train",
        dtype="float64",
        seq_len=S,
        global_batch_size=4,
        micro_batch_size=B,
        recompute=recompute,
        recompute_layers=layers,
        progress=False,
    )
    return replace_section(cfg, "model", **model) if model else cfg


def test_variants_keep_every_parameter_name_and_unknown_modes_are_rejected() -> None:
    model = build_meta_model(_cfg("none").model)
    names = [n for n, _ in model.named_parameters()]
    apply_recompute(model, "full")
    assert [n for n, _ in model.named_parameters()] == names
    kinds = {type(m) for m in model.modules()}
    assert {RecomputedAttentionBlock, RecomputedExperts} <= kinds
    assert not kinds & {AttentionBlock, Experts}
    attn = build_meta_model(_cfg("none").model)
    apply_recompute(attn, "attn")
    kinds = {type(m) for m in attn.modules()}
    assert CoreRecomputedAttention in kinds and Attention not in kinds and AttentionBlock in kinds
    with pytest.raises(ValueError, match="recompute must be one of none, attn, full"):
        apply_recompute(model, "some")


def test_recompute_layers_picks_the_first_layers_a_worker_holds() -> None:
    """`train.recompute_layers` 1 on a worker holding layers 1 and 3 (an AF-Pipe group of
    p = 2, an EP rank's stages): layer 1's block and experts recompute, layer 3's and the
    layers it does not hold save as usual; 0 recomputes every layer."""
    cfg = _cfg("full", layers=1)
    model = build_meta_model(cfg.model)
    apply_variants(cfg, [model], [1, 3])
    kinds = {
        i: (type(layer.attn_block), type(layer.experts)) for i, layer in enumerate(model.layers)
    }
    assert kinds[1] == (RecomputedAttentionBlock, RecomputedExperts), kinds
    assert all(kinds[i] == (AttentionBlock, Experts) for i in (0, 2, 3)), kinds
    every = build_meta_model(cfg.model)
    apply_variants(_cfg("full"), [every], [1, 3])
    assert all(type(layer.attn_block) is RecomputedAttentionBlock for layer in every.layers)


@pytest.mark.parametrize(
    "model", [{}, {"num_shared_experts": 1, "num_dense_layers": 1, "dense_dim": 96}]
)
def test_reference_trainer_is_bit_identical_under_recompute(model: dict[str, Any]) -> None:
    """Two steps (the second after an AdamW update): loss and every gradient unchanged,
    under every mode and under full recompute of the first 2 layers only."""
    runs = {}
    for mode in MODES:
        trainer = ReferenceTrainer(_cfg(mode, **model))
        runs[mode] = [trainer.step(s, capture_grads=True) for s in range(2)]
    partial = ReferenceTrainer(_cfg("full", layers=2, **model))
    assert {type(layer.attn_block) for layer in partial.model.layers} == {
        AttentionBlock,
        RecomputedAttentionBlock,
    }
    runs["full:2"] = [partial.step(s, capture_grads=True) for s in range(2)]
    for mode in ("attn", "full", "full:2"):
        for want, got in zip(runs["none"], runs[mode], strict=True):
            assert got.loss == want.loss and got.aux_loss == want.aux_loss, mode
            for name, grad in want.grads.items():
                assert torch.equal(got.grads[name], grad), f"{mode}: {name}"


def test_recompute_saves_what_the_modes_say() -> None:
    """full: an A worker keeps its layer input x (+ RoPE tables; not the expert rows it
    received: `runtime.stages` adds them saving their token ids only), an expert shard its
    received rows and combine weights, both plus integer routing indices; attn: the A component saves
    less than none (the core's own tensors), an expert shard exactly as much."""
    saved = {mode: stage_saved_bytes(_cfg(mode)) for mode in MODES}
    for worker in ("A", "F"):
        full = saved["full"][worker]
        assert full.floats == full.inputs, (worker, saved)
    a = {mode: saved[mode]["A"].floats for mode in MODES}
    assert a["full"] < a["attn"] < a["none"], a
    f = {mode: saved[mode]["F"].floats for mode in MODES}
    assert f["full"] < f["attn"] == f["none"], f
    # Integer routing indices are kept in every mode and are small beside the floats.
    assert all(saved[m][w].ints < saved[m][w].floats for m in MODES for w in ("A", "F")), saved


@pytest.mark.parametrize(("mode", "extra"), [("none", 0.0), ("full", 1.0)])
def test_emulated_full_recompute_waits_the_forward_again(
    mode: str, extra: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Emulated compute prices full recompute as one more forward inside each backward."""
    from disagmoe.models import emulated as emulation

    waits: list[tuple[float, float]] = []

    def record(x: torch.Tensor, fwd_s: float, bwd_s: float) -> torch.Tensor:
        waits.append((fwd_s, bwd_s))
        return x.clone()

    monkeypatch.setattr(emulation, "wait", record)
    costs = ComputeCosts(Linear(0.0, 1.0), Linear(0.0, 2.0), Linear(0.0, 3.0), Linear(0.0, 5.0))
    model = build_meta_model(_cfg(mode).model)
    emulation.emulate_compute(model, costs, mode)
    block = model.decoder_layer(0).attn_block
    shard = model.decoder_layer(0).experts
    assert isinstance(block, EmulatedAttentionBlock) and isinstance(shard, EmulatedExperts)
    x = torch.zeros(1, 4, model.cfg.dim)
    out = block(x, torch.zeros(4, 1), torch.zeros(4, 1))
    assert out.u_TH is not None and out.routing is not None
    from disagmoe.models import flatten_routing

    shard(out.u_TH, flatten_routing(out.routing))
    tokens, pairs = 4, 4 * model.cfg.top_k
    assert waits == [
        (1.0 * tokens, (2.0 + extra * 1.0) * tokens),
        (3.0 * pairs, (5.0 + extra * 3.0) * pairs),
    ]


def test_emulated_recompute_of_some_layers_waits_there_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`emulate_compute(..., layers=)`: the backward waits the forward again on those
    layers only."""
    from disagmoe.models import emulated as emulation

    model = build_meta_model(_cfg("full").model)
    costs = ComputeCosts(Linear(0.0, 1.0), Linear(0.0, 2.0), Linear(0.0, 3.0), Linear(0.0, 5.0))
    emulation.emulate_compute(model, costs, "full", layers={0})
    modes = [
        (getattr(layer.attn_block, "recompute", ""), getattr(layer.experts, "recompute", ""))
        for layer in model.layers
    ]
    assert modes[0] == ("full", "full") and set(modes[1:]) == {("none", "none")}, modes


def test_attn_recompute_cannot_be_emulated(tmp_path: Any) -> None:
    costs = tmp_path / "costs.json"
    zero = Linear(0.0, 0.0)
    costs.write_text(ComputeCosts(zero, zero, zero, zero).to_json())
    cfg = replace_section(_cfg("attn"), "train", emulate_compute=str(costs))
    with pytest.raises(ValueError, match="recompute=attn cannot be emulated"):
        apply_variants(cfg, [build_meta_model(cfg.model)])
    full = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, recompute="full"))
    model = build_meta_model(full.model)
    apply_variants(full, [model])
    assert all(m.recompute == "full" for m in model.modules() if isinstance(m, EmulatedExperts))
