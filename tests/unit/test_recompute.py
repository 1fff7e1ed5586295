"""Activation recompute (`train.recompute`, `models.recompute`): the same numbers, less memory.

Memory is counted as PyTorch sees it: every tensor autograd saves for backward during one
forward, through `saved_tensors_hooks`, once per storage, parameters excluded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

from disagmoe.bench.emulation import ComputeCosts, EmulatedAttentionBlock, EmulatedExperts, Linear
from disagmoe.config import RunConfig, replace_section
from disagmoe.distributed.layout import Layout
from disagmoe.models import AttentionBlock, Experts, build_meta_model
from disagmoe.models.layers import Attention
from disagmoe.models.recompute import (
    CoreRecomputedAttention,
    RecomputedAttentionBlock,
    RecomputedExperts,
    apply_recompute,
)
from disagmoe.runtime.objective import LossScale
from disagmoe.runtime.reference import ReferenceTrainer
from disagmoe.runtime.setup import apply_variants
from disagmoe.runtime.stages import AttnWorker, ExpertWorker, build_worker
from disagmoe.schedule.ir import Msg

MODES = ("none", "attn", "full")
B, S = 2, 32  # one micro-batch


def _cfg(recompute: str, **model: Any) -> RunConfig:
    cfg = replace_section(
        RunConfig(),
        "train",
        dtype="float64",
        seq_len=S,
        global_batch_size=4,
        micro_batch_size=B,
        recompute=recompute,
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


@pytest.mark.parametrize(
    "model", [{}, {"num_shared_experts": 1, "num_dense_layers": 1, "dense_dim": 96}]
)
def test_reference_trainer_is_bit_identical_under_recompute(model: dict[str, Any]) -> None:
    """Two steps (the second after an AdamW update): loss and every gradient unchanged."""
    runs = {}
    for mode in MODES:
        trainer = ReferenceTrainer(_cfg(mode, **model))
        runs[mode] = [trainer.step(s, capture_grads=True) for s in range(2)]
    for mode in ("attn", "full"):
        for want, got in zip(runs["none"], runs[mode], strict=True):
            assert got.loss == want.loss and got.aux_loss == want.aux_loss, mode
            for name, grad in want.grads.items():
                assert torch.equal(got.grads[name], grad), f"{mode}: {name}"


def _saved_bytes(run: Callable[[], Any], params: list[torch.nn.Parameter]) -> tuple[int, int]:
    """(float bytes, integer bytes) of the distinct storages that `run` saves for backward."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, tuple[int, bool]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = (storage.nbytes(), t.is_floating_point())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    floats = sum(n for n, is_float in seen.values() if is_float)
    return floats, sum(n for n, is_float in seen.values() if not is_float)


def _layer1_saved(mode: str) -> dict[str, tuple[int, int, int]]:
    """Saved bytes of the A component of layer 1 and the experts of layer 0, for one
    micro-batch on an m = n = 1 layout, driven through the workers' own forward.

    Returns per worker (float bytes, integer bytes, bytes of the compute's float inputs).
    """
    cfg = replace_section(_cfg(mode), "parallel", attn_workers=1, expert_workers=1)
    layout = Layout.build(cfg.model, cfg.parallel, 2)
    a_rank, f_rank = layout.attn_rank(0, 0), layout.expert_rank(0, 0)
    scale = LossScale.for_run(cfg.model, cfg.train)
    attn = build_worker(cfg, layout, a_rank, scale)
    experts = build_worker(cfg, layout, f_rank, scale)
    assert isinstance(attn, AttnWorker) and isinstance(experts, ExpertWorker)
    apply_variants(cfg, [attn.modules, experts.modules])
    tokens = torch.randint(0, cfg.model.vocab_size, (B, S + 1))
    attn.micro_batches = {0: (tokens[:, :-1], tokens[:, 1:])}
    to_f, to_a = Msg("dispatch", 0, 0, a_rank, f_rank), Msg("combine", 0, 0, f_rank, a_rank)
    dispatch = attn.forward(0, 0, {}, [to_f])[to_f]
    out: dict[str, tuple[int, int, int]] = {}
    f_params = [p for _, p in experts.named_parameters()]
    combine: dict[Msg, list[torch.Tensor]] = {}
    u, w = dispatch[0], dispatch[1]
    floats, ints = _saved_bytes(
        lambda: combine.update(experts.forward(0, 0, {to_f: dispatch}, [to_a])), f_params
    )
    out["F"] = (floats, ints, u.numel() * u.element_size() + w.numel() * w.element_size())
    a_params = [p for _, p in attn.named_parameters()]
    hidden = B * S * cfg.model.dim * 8
    rope = 2 * S * cfg.model.head_dim_resolved * 8  # cos, sin
    y = next(iter(combine.values()))[0]  # the expert rows it receives, summed into x
    floats, ints = _saved_bytes(lambda: attn.forward(1, 0, combine, []), a_params)
    out["A"] = (floats, ints, hidden + rope + y.numel() * y.element_size())
    return out


def test_recompute_saves_what_the_modes_say() -> None:
    """full: an A worker keeps its layer input x (+ RoPE tables) and the expert rows it
    received (the combine sum `index_add` keeps its source), an expert shard its received
    rows and combine weights, both plus integer routing indices; attn: the A component saves
    less than none (the core's own tensors), an expert shard exactly as much."""
    saved = {mode: _layer1_saved(mode) for mode in MODES}
    for worker in ("A", "F"):
        floats, _, inputs = saved["full"][worker]
        assert floats == inputs, (worker, saved)
    a = {mode: saved[mode]["A"][0] for mode in MODES}
    assert a["full"] < a["attn"] < a["none"], a
    f = {mode: saved[mode]["F"][0] for mode in MODES}
    assert f["full"] < f["attn"] == f["none"], f
    # Integer routing indices are kept in every mode and are small beside the floats.
    assert all(saved[m][w][1] < saved[m][w][0] for m in MODES for w in ("A", "F")), saved


@pytest.mark.parametrize(("mode", "extra"), [("none", 0.0), ("full", 1.0)])
def test_emulated_full_recompute_waits_the_forward_again(
    mode: str, extra: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Emulated compute prices full recompute as one more forward inside each backward."""
    from disagmoe.bench import emulation

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
