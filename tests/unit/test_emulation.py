"""Emulated compute: calibrated waits in place of the attention and expert math."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

from disagmoe.bench.emulation import calibrate
from disagmoe.config import RunConfig, replace_section
from disagmoe.costs.compute import ComputeCosts, Linear
from disagmoe.models import (
    AttentionBlock,
    Experts,
    MoETransformer,
    build_model,
    split_by_owner,
    split_experts,
)
from disagmoe.models.emulated import EmulatedAttentionBlock, EmulatedExperts, emulate_compute, wait
from disagmoe.presets import model_preset
from disagmoe.trace import take_device_wait_us
from disagmoe.training.reference import ReferenceTrainer
from disagmoe.training.setup import set_threads

ZERO = Linear(0.0, 0.0)


def test_wait_sleeps_in_forward_and_in_backward() -> None:
    x = torch.randn(4, 3, requires_grad=True)
    t0 = time.perf_counter()
    y = wait(x, 0.05, 0.08)
    t1 = time.perf_counter()
    y.backward(torch.full_like(y, 2.0))
    t2 = time.perf_counter()
    assert t1 - t0 >= 0.05 and t2 - t1 >= 0.08
    assert torch.equal(y, x) and torch.equal(x.grad, torch.full_like(x, 2.0))  # type: ignore[arg-type]


def test_two_lanes_take_turns_on_the_workers_one_device() -> None:
    """Two threads of one worker inside emulated computations at once: the second waits
    for the device (one GPU cannot run two kernels' worth of compute in the time of one),
    and that wait is its thread's device wait, which the executor traces."""
    waited: dict[str, float] = {}

    def lane(name: str) -> None:
        take_device_wait_us()
        wait(torch.ones(2, requires_grad=True), 0.2, 0.0)
        waited[name] = take_device_wait_us()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=lane, args=(n,)) for n in ("fwd", "bwd")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.perf_counter() - t0 >= 0.4  # the two waits did not overlap
    first, second = sorted(waited.values())
    assert first < 0.1e6 and second >= 0.15e6, waited


def test_emulated_layer_keeps_shapes_routing_and_gradient_paths() -> None:
    model = build_model(model_preset("tiny"), seed=0, dtype=torch.float32)
    cfg = model.cfg
    costs = ComputeCosts(Linear(0.0, 1e-5), ZERO, Linear(0.001, 0.0), ZERO)
    emulate_compute(model, costs)
    block = model.decoder_layer(0).attn_block
    x = torch.randn(2, 16, cfg.dim, requires_grad=True)
    cos, sin = model.rope(16, x)
    t0 = time.perf_counter()
    out = block(x, cos, sin)
    assert time.perf_counter() - t0 >= costs.attn_fwd(32)
    assert out.residual_BSH.shape == x.shape and out.u_TH is not None and out.routing is not None
    idx = out.routing.indices_TK
    assert idx.shape == (32, cfg.top_k) and int(idx.max()) < cfg.num_experts
    assert all(len(set(row)) == cfg.top_k for row in idx.tolist())  # distinct experts per token
    plans = split_by_owner(out.routing, split_experts(out.routing.probs_TE.shape[-1], 2))
    assert sum(int(p.rows_A.numel()) for p in plans) == 32 * cfg.top_k
    experts = model.decoder_layer(0).experts
    assert experts is not None
    u = out.u_TH[plans[0].token_ids]
    y = experts(u, plans[0])
    assert y.shape == u.shape
    (y.sum() + out.residual_BSH.sum()).backward()
    assert x.grad is not None and x.grad.shape == x.shape
    assert experts.gate_up.grad is None  # no math, no parameter gradient (zero-filled later)


def _real_compute(model: MoETransformer) -> bool:
    """Whether the first attention block of `model` computes (its output is not its input)."""
    x = torch.randn(1, 8, model.cfg.dim)
    cos, sin = model.rope(8, x)
    block = model.decoder_layer(0).attn_block
    return not torch.equal(block(x, cos, sin).residual_BSH, x)


def test_swap_keeps_parameter_names_and_objects() -> None:
    model = build_model(model_preset("tiny"), seed=0, dtype=torch.float32)
    before = [(name, id(p)) for name, p in model.named_parameters()]
    state = list(model.state_dict())
    emulate_compute(model, ComputeCosts(ZERO, ZERO, ZERO, ZERO))
    assert [(name, id(p)) for name, p in model.named_parameters()] == before
    assert list(model.state_dict()) == state
    kinds = {type(m) for m in model.modules() if isinstance(m, AttentionBlock | Experts)}
    assert kinds == {EmulatedAttentionBlock, EmulatedExperts}
    assert not _real_compute(model)


def test_a_fresh_model_after_an_emulated_one_computes_for_real() -> None:
    emulated = build_model(model_preset("tiny"), seed=0, dtype=torch.float32)
    emulate_compute(emulated, ComputeCosts(ZERO, ZERO, ZERO, ZERO))
    fresh = build_model(model_preset("tiny"), seed=0, dtype=torch.float32)
    assert _real_compute(fresh)
    assert not any(isinstance(m, EmulatedAttentionBlock | EmulatedExperts) for m in fresh.modules())


def test_set_threads_only_sets_threads() -> None:
    """The costs file is read where modules are built (`apply_variants`), not here."""
    cfg = replace_section(RunConfig(), "train", emulate_compute="/nonexistent.json")
    threads = torch.get_num_threads()
    try:
        set_threads(cfg, 1)
    finally:
        torch.set_num_threads(threads)
    assert _real_compute(build_model(model_preset("tiny"), seed=0, dtype=torch.float32))


def test_reference_runtime_runs_the_emulated_modules(tmp_path: Path) -> None:
    path = tmp_path / "costs.json"
    path.write_text(ComputeCosts(ZERO, ZERO, ZERO, ZERO).to_json())
    trainer = ReferenceTrainer(replace_section(RunConfig(), "train", emulate_compute=str(path)))
    assert not _real_compute(trainer.model)
    assert trainer.step(0).loss > 0


def test_calibrate_measures_and_round_trips(tmp_path: Path) -> None:
    model = build_model(model_preset("tiny"), seed=0, dtype=torch.float32)
    costs = calibrate(model, seq_len=16, micro_batch_size=2, repeats=2)
    for unit in (costs.attn_fwd, costs.attn_bwd, costs.expert_fwd, costs.expert_bwd):
        assert unit.fixed >= 0 and unit.per_row >= 0 and unit(64) > 0
    assert _real_compute(model)  # calibration leaves the model as it was
    path = tmp_path / "costs.json"
    path.write_text(costs.scaled(3.0).to_json())
    loaded = ComputeCosts.load(path)
    assert loaded.attn_fwd(64) == pytest.approx(3.0 * costs.attn_fwd(64))
    assert "x3" in loaded.note


@pytest.mark.parametrize(
    "content,match",
    [
        (None, "does not exist"),
        ("{not json", "not a costs JSON"),
        (json.dumps({"attn_fwd": {"fixed": 0}}), "not a costs JSON"),
        (
            json.dumps(
                {
                    k: {"fixed": -1, "per_row": 0}
                    for k in ("attn_fwd", "attn_bwd", "expert_fwd", "expert_bwd")
                }
            ),
            "finite and >= 0",
        ),
    ],
)
def test_bad_costs_files_say_what_is_wrong(tmp_path: Path, content: str | None, match: str) -> None:
    path = tmp_path / "costs.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=match):
        ComputeCosts.load(path)
