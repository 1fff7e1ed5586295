"""Cost-model formulas against values worked out by hand."""

from __future__ import annotations

import dataclasses

import pytest

from disagmoe.config import ClusterConfig, ModelConfig
from disagmoe.costs import costmodel as cm
from disagmoe.costs import flops
from disagmoe.presets import CLUSTER_PRESETS, MODEL_PRESETS

# dim 8, 4 heads of 2, 2 kv heads (g = 2), 4 experts, top-2, expert width 16
TINY = ModelConfig(name="t", dim=8, num_layers=4, num_heads=4, num_kv_heads=2, num_experts=4,
                   top_k=2, expert_dim=16, vocab_size=32)  # fmt: skip
UNIT = ClusterConfig(name="unit", peak_tflops=1.0, nic_gbps=1.0, mfu=0.5, bw_efficiency=0.5)


def test_paper_costs_by_hand() -> None:
    c = cm.paper_costs(TINY, 10)
    # C_a = S H^2 (2 + 2/g) + 4 S^2 H = 10*64*3 + 4*100*8
    assert c.attn_flops == 1920 + 3200
    assert c.ffn_flops == 4 * 2 * 10 * 8 * 16  # 4 k S H D_e
    assert c.dispatch_bytes == 2 * 10 * 2 * 8  # 2 S k H
    # I_attn = (H (2 + 2/g) + 4 S) / (2k) = (24 + 40) / 4,  I_ffn = 2 D_e
    assert c.i_attn == pytest.approx(16.0)
    assert c.i_ffn == pytest.approx(32.0)


@pytest.mark.parametrize(("seq", "i_attn"), [(4096, 1312.0), (32768, 8480.0)])
def test_qwen3_intensities_and_ridge_match_the_issue(seq: int, i_attn: float) -> None:
    c = cm.paper_costs(MODEL_PRESETS["qwen3-30b-a3b"], seq)
    assert c.i_attn == pytest.approx(i_attn)
    assert c.i_ffn == pytest.approx(1536.0)
    assert cm.ridge_point(CLUSTER_PRESETS["h800"]) == pytest.approx(19780.0)
    assert cm.ridge_point(CLUSTER_PRESETS["h800"], achievable=True) == pytest.approx(
        19780.0 * 0.45 / 0.8
    )


def test_detailed_costs_by_hand() -> None:
    c = cm.detailed_costs(TINY, 10, groups=2)
    # q = 8, kv = 4: projections 4 S H (q + kv) = 3840; causal core 2 S^2 q = 1600;
    # router 2 S H E = 640
    assert c.attn_core_flops == 1600
    assert c.attn_flops == 3840 + 1600 + 640
    assert c.ffn_flops == 6 * 2 * 10 * 8 * 16
    assert c.dispatch_bytes == 320
    assert c.hop_bytes == 2 * 10 * 8
    assert cm.detailed_costs(TINY, 10, groups=1).hop_bytes == 0


def test_dense_and_shared_terms_are_averaged_over_layers() -> None:
    model = dataclasses.replace(TINY, num_dense_layers=1, dense_dim=32, num_shared_experts=1)
    c = cm.detailed_costs(model, 10)
    moe = 3 / 4
    expect = 3840 + 1600 + 640 * moe + 6 * 10 * 8 * 16 * moe + 6 * 10 * 8 * 32 / 4
    assert c.attn_flops == pytest.approx(expect)
    assert c.ffn_flops == pytest.approx(6 * 2 * 10 * 8 * 16 * moe)


def test_unit_times_apply_training_multipliers_and_efficiencies() -> None:
    u = cm.unit_times(TINY, UNIT, 10, roofline_only=False)
    # backward = 2x forward for GEMMs, 2.5x for the attention core; 50% of 1e12 FLOP/s
    assert u.attn_gpu == pytest.approx((3 * (6080 - 1600) + 3.5 * 1600) / 5e11)
    assert u.ffn_gpu == pytest.approx(3 * 15360 / 5e11)
    assert u.attn_nic == pytest.approx(2 * 320 / 5e8)  # forward + backward exchange
    full = cm.unit_times(TINY, UNIT, 10, roofline_only=False, recompute="full")
    assert full.ffn_gpu == pytest.approx(4 * 15360 / 5e11)
    attn = cm.unit_times(TINY, UNIT, 10, roofline_only=False, recompute="attn")
    assert attn.attn_gpu == pytest.approx((3 * (6080 - 1600) + 4.5 * 1600) / 5e11)
    assert attn.ffn_gpu == u.ffn_gpu
    paper = cm.unit_times(TINY, UNIT, 10, roofline_only=True)
    assert paper.attn_gpu == pytest.approx(5120 / 1e12)
    assert paper.ffn_nic == pytest.approx(320 / 1e9)
    with pytest.raises(ValueError, match="recompute"):
        cm.unit_times(TINY, UNIT, 10, roofline_only=False, recompute="some")


def test_parameter_counts_by_hand() -> None:
    # h (q + 2 kv) + q h + 2 norms + router h E = 8*16 + 64 + 16 + 32
    assert flops.attn_params(TINY, 0) == 240
    assert flops.expert_params(TINY) == 4 * 3 * 8 * 16
