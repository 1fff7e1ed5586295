"""The one set of FLOP formulas (planner and simulator) against the design's closed form."""

from __future__ import annotations

import dataclasses

import pytest

from disagmoe.config import ModelConfig
from disagmoe.costs import flops

# dim 8 = 4 heads of 2 (q = H), 2 kv heads (g = 2, kv = H/g), 4 experts, top-2, width 16
TINY = ModelConfig(name="t", dim=8, num_layers=4, num_heads=4, num_kv_heads=2, num_experts=4,
                   top_k=2, expert_dim=16, vocab_size=32, dense_dim=32)  # fmt: skip
S, H, G, K, E, D_E = 10, 8, 2, 2, 4, 16


def test_design_closed_form_by_hand() -> None:
    proj, core = flops.design_attn_flops(TINY, S)
    assert (proj, core) == (S * H**2 * (2 + 2 / G), 4 * S**2 * H)  # C_a = 1920 + 3200
    assert flops.design_expert_flops(TINY, S) == 4 * K * S * H * D_E  # C_f
    assert flops.routed_bytes(TINY, S, 2) == 2 * S * K * H  # V


def test_kernel_formulas_against_the_design_closed_form() -> None:
    """The runtime counts 2 FLOPs per multiply-add in the projections (the design counts
    the multiply-adds), skips the masked half of the causal score matrix, adds the router
    GEMM, and runs three expert GEMMs (SwiGLU) instead of two."""
    proj, core = flops.design_attn_flops(TINY, S)
    gemm, causal = flops.attn_flops(TINY, S, moe=1.0, dense=0.0)
    assert gemm == 2 * proj + 2 * S * H * E
    assert causal == core / 2
    assert flops.expert_flops(TINY, K * S) == 1.5 * flops.design_expert_flops(TINY, S)


def test_dense_and_shared_terms_and_their_average() -> None:
    model = dataclasses.replace(TINY, num_shared_experts=1)
    proj = 2 * flops.design_attn_flops(model, S)[0]
    moe_gemm, core = flops.attn_flops(model, S, moe=1.0, dense=0.0)
    dense_gemm, dense_core = flops.attn_flops(model, S, moe=0.0, dense=1.0)
    assert moe_gemm == proj + 2 * S * H * E + 6 * S * H * D_E  # router, one shared expert
    assert dense_gemm == proj + 6 * S * H * 32  # the dense SwiGLU MLP
    assert dense_core == core
    mean_gemm, _ = flops.attn_flops(model, S, moe=0.75, dense=0.25)
    assert mean_gemm == pytest.approx(0.75 * moe_gemm + 0.25 * dense_gemm)


def test_sequences_scale_linearly_and_head_and_factors() -> None:
    one = flops.attn_flops(TINY, S, moe=1.0, dense=0.0)
    assert flops.attn_flops(TINY, S, 3, moe=1.0, dense=0.0) == (3 * one[0], 3 * one[1])
    assert flops.lm_head_flops(TINY, S) == 2 * S * H * 32
    assert flops.backward_factors() == (2.0, 2.5)
    assert flops.train_factors() == (3.0, 3.5)
    assert flops.train_factors("full") == (4.0, 4.5)
    assert flops.train_factors("attn") == (3.0, 4.5)  # the core's forward again, GEMMs not
    with pytest.raises(ValueError, match="recompute must be one of none, attn, full"):
        flops.backward_factors("some")


def test_train_step_flops_by_hand() -> None:
    """metrics.jsonl's model FLOPs: 3x the forward GEMMs, 3.5x the attention core, no
    recompute; one dense first layer; routed pairs measured per MoE layer or top_k each."""
    model = dataclasses.replace(TINY, num_dense_layers=1)
    b, n = 3, 3 * S
    moe_gemm, core = flops.attn_flops(model, S, b, moe=1.0, dense=0.0)
    dense_gemm, _ = flops.attn_flops(model, S, b, moe=0.0, dense=1.0)
    pairs = [10.0, 0.0, float(n * K)]
    want = 3 * (dense_gemm + 3 * moe_gemm + flops.lm_head_flops(model, n))
    want += 3.5 * 4 * core + 3 * sum(6 * H * D_E * p for p in pairs)
    assert flops.train_step_flops(model, S, b, pairs) == pytest.approx(want, rel=1e-15)
    nominal = flops.train_step_flops(model, S, b)
    assert nominal == flops.train_step_flops(model, S, b, [n * K] * 3)
    with pytest.raises(ValueError, match="one count per MoE layer"):
        flops.train_step_flops(model, S, b, [1.0])


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("preset", ["tiny", "tiny-shared"])
def test_parameter_counts_are_the_models(preset: str, tied: bool) -> None:
    """attn_params / expert_params / head_params count exactly the model's parameters
    (q/k norms on, a dense first layer and shared experts with tiny-shared)."""
    from disagmoe.models import MoETransformer
    from disagmoe.presets import MODEL_PRESETS

    cfg = dataclasses.replace(MODEL_PRESETS[preset], qk_norm=True, tie_embeddings=tied)
    model = MoETransformer(cfg)
    for l, layer in enumerate(model.layers):
        assert sum(p.numel() for p in layer.attn_block.parameters()) == flops.attn_params(cfg, l)
        experts = sum(p.numel() for p in layer.experts.parameters()) if layer.experts else 0
        assert experts == (flops.expert_params(cfg) if cfg.is_moe_layer(l) else 0)
    body = sum(flops.attn_params(cfg, l) for l in range(cfg.num_layers))
    body += flops.expert_params(cfg) * sum(cfg.is_moe_layer(l) for l in range(cfg.num_layers))
    total = sum(p.numel() for p in model.parameters())  # tied weights counted once
    assert total == body + flops.head_params(cfg)


def test_a_chunked_loss_head_backward_reruns_its_forward_gemm() -> None:
    """`train.loss_chunk_tokens` > 0: the head's backward recomputes each chunk's logits, so
    the simulator prices it at 3x the forward GEMM (2x unchunked); other layers unchanged."""
    from disagmoe.config import RunConfig, TrainConfig
    from disagmoe.schedule.ir import Op
    from disagmoe.simulator.costs import AnalyticCosts, Workload

    assert (flops.head_backward_extra(0), flops.head_backward_extra(4096)) == (0.0, 1.0)
    plain = AnalyticCosts(Workload(TINY, S, 2, loss_chunk_tokens=0), 1e9)
    chunked = AnalyticCosts(Workload(TINY, S, 2, loss_chunk_tokens=8), 1e9)
    head = TINY.num_layers
    forward = flops.lm_head_flops(TINY, 2 * S) / 1e9
    assert plain.attn_s(Op.FWD, head) == chunked.attn_s(Op.FWD, head) == pytest.approx(forward)
    assert plain.attn_s(Op.BWD, head) == pytest.approx(2 * forward)
    assert chunked.attn_s(Op.BWD, head) == pytest.approx(3 * forward)
    assert chunked.attn_s(Op.BWD, 1) == plain.attn_s(Op.BWD, 1)
    cfg = RunConfig(train=TrainConfig(loss_chunk_tokens=512))
    assert Workload.of_run(cfg).loss_chunk_tokens == 512
