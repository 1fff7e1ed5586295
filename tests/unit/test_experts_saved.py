"""What the experts keep for backward (`models.moe.Experts`): exact gradients from the two
hand-written backwards, and the saved bytes equal to the runtime's memory model."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from disagmoe.costs import costmodel as cm
from disagmoe.costs import runtime_memory as rm
from disagmoe.models.moe import Assignments, Experts, sum_rows, weighted_swiglu
from disagmoe.presets import MODEL_PRESETS
from disagmoe.training.memory import ActivationMeter

TINY = MODEL_PRESETS["tiny"]


def test_weighted_swiglu_and_sum_rows_have_exact_gradients() -> None:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(7, 10, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.rand(7, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(weighted_swiglu, (h, w))
    gate, up = h.chunk(2, dim=-1)
    plain = F.silu(gate) * up * w.unsqueeze(-1)
    assert torch.equal(weighted_swiglu(h, w), plain)
    rows = torch.tensor([0, 2, 2, 1, 0, 3, 2])
    like = torch.zeros(4, 5, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda y: sum_rows(y, rows, like), (plain,))
    assert torch.equal(sum_rows(plain, rows, like), like.index_add(0, rows, plain))


def test_experts_save_what_the_memory_model_counts() -> None:
    """Balanced routing on one shard holding every expert: T*k pairs of T rows; the meter's
    peak is `ffn_act_bytes` (parameters not counted), b*(H + 3I + 1) + 16 per pair."""
    torch.manual_seed(0)
    tokens, k = 32, TINY.top_k
    experts = Experts(TINY.num_experts, TINY.dim, TINY.expert_dim)
    torch.nn.init.normal_(experts.gate_up, std=0.1)
    torch.nn.init.normal_(experts.down, std=0.1)
    plan = Assignments(
        token_ids=torch.arange(tokens),
        rows_A=torch.arange(tokens).repeat_interleave(k),
        experts_A=torch.arange(tokens * k) % TINY.num_experts,
        weights_A=torch.rand(tokens * k, requires_grad=True),
    )
    x = torch.randn(tokens, TINY.dim, requires_grad=True)
    meter = ActivationMeter(experts.parameters())
    with meter.saving():
        y = experts(x, plan)
    kept = rm.ffn_act_bytes(TINY, "none", cm.runtime_precision("float32"), tokens=tokens, shards=1)
    assert meter.current == kept
    y.square().sum().backward()
    assert meter.current == 0
