"""The MoE model's units: shapes, routing, balance loss, grouped-GEMM experts, dispatch plans."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from disagmoe.config import ModelConfig, TrainConfig
from disagmoe.models import (
    Assignments,
    Experts,
    Router,
    Routing,
    build_model,
    flatten_routing,
    initial_value,
    load_balancing_loss,
    split_by_owner,
    split_experts,
)
from disagmoe.training.objective import LossScale

TINY = ModelConfig(
    vocab_size=53,
    dim=32,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    num_experts=8,
    top_k=2,
    expert_dim=24,
)
SHARED = dataclasses.replace(TINY, num_shared_experts=2, num_dense_layers=1, dense_dim=40)


def tokens(cfg: ModelConfig, batch: int = 2, seq: int = 16, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)


def random_routing(
    num_tokens: int, num_experts: int, top_k: int, *, seed: int = 0, norm: bool = True
) -> Routing:
    gen = torch.Generator().manual_seed(seed)
    router = Router(16, num_experts, top_k, norm_topk_prob=norm).double()
    with torch.no_grad():
        router.weight.copy_(torch.randn(num_experts, 16, generator=gen, dtype=torch.float64))
    return router(torch.randn(num_tokens, 16, generator=gen, dtype=torch.float64))


def random_experts(num_experts: int, dim: int, hidden: int, seed: int = 0) -> Experts:
    gen = torch.Generator().manual_seed(seed)
    experts = Experts(num_experts, dim, hidden).double()
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.3)
    return experts


def naive_experts(x_TH: torch.Tensor, experts: Experts, routing: Routing) -> torch.Tensor:
    """Per-token, per-choice loop: the definition the grouped GEMM must reproduce."""
    out = torch.zeros_like(x_TH)
    hidden = experts.down.shape[1]
    for t in range(x_TH.shape[0]):
        for k in range(routing.indices_TK.shape[1]):
            e = int(routing.indices_TK[t, k])
            w_gate, w_up = experts.gate_up[e, :, :hidden], experts.gate_up[e, :, hidden:]
            h = F.silu(x_TH[t] @ w_gate) * (x_TH[t] @ w_up)
            out[t] += routing.weights_TK[t, k] * (h @ experts.down[e])
    return out


# ---------------------------------------------------------------------------- whole model


@pytest.mark.parametrize("cfg", [TINY, SHARED], ids=["tiny", "shared-dense"])
def test_forward_shapes(cfg: ModelConfig) -> None:
    model = build_model(cfg, seed=0, dtype=torch.float32)
    logits, aux = model(tokens(cfg, batch=3, seq=7))
    assert logits.shape == (3, 7, cfg.vocab_size)
    assert len(aux) == cfg.num_moe_layers
    assert all(a.shape == () and torch.isfinite(a) for a in aux)


def test_forward_is_causal() -> None:
    model = build_model(TINY, seed=0, dtype=torch.float64)
    toks = tokens(TINY, seq=10)
    changed = toks.clone()
    changed[:, 6] = (changed[:, 6] + 1) % TINY.vocab_size
    a, b = model(toks)[0], model(changed)[0]
    # not bitwise: the expert GEMMs group rows differently when routing changes
    torch.testing.assert_close(a[:, :6], b[:, :6], rtol=0, atol=1e-14)
    assert not torch.allclose(a[:, 6:], b[:, 6:])


def test_bfloat16_forward_runs() -> None:
    model = build_model(SHARED, seed=0, dtype=torch.bfloat16)
    logits, aux = model(tokens(SHARED))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    assert len(aux) == SHARED.num_moe_layers


def test_dense_first_layer_and_shared_experts_compose() -> None:
    """Layer = h + (dense MLP | shared(u) + routed experts(u)), with h = x + Attn(Norm1(x))."""
    model = build_model(SHARED, seed=3, dtype=torch.float64)
    dense, moe = model.layers[0], model.layers[1]
    assert dense.attn_block.mlp is not None and dense.attn_block.router is None
    assert dense.experts is None and dense.attn_block.shared is None
    assert moe.attn_block.mlp is None and moe.experts is not None
    assert moe.attn_block.shared.gate_proj.weight.shape == (2 * SHARED.expert_dim, SHARED.dim)

    x = torch.randn(
        2, 5, SHARED.dim, dtype=torch.float64, generator=torch.Generator().manual_seed(1)
    )
    cos, sin = model.rope(5, x)
    for layer in (dense, moe):
        blk = layer.attn_block
        h = x + blk.attn(blk.norm1(x), cos, sin)
        u = blk.norm2(h)
        if blk.mlp is not None:
            expected = h + blk.mlp(u)
        else:
            u_TH = u.reshape(-1, SHARED.dim)
            routed = layer.experts(u_TH, flatten_routing(blk.router(u_TH)))
            expected = h + blk.shared(u) + routed.view_as(h)
        got, aux = layer(x, cos, sin)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
        assert (aux is None) == (blk.mlp is not None)


def test_tied_embeddings_share_storage() -> None:
    model = build_model(dataclasses.replace(TINY, tie_embeddings=True), seed=0, dtype=torch.float32)
    assert model.lm_head.weight is model.embed.weight


def test_gradient_reaches_every_parameter() -> None:
    cfg = SHARED
    model = build_model(cfg, seed=0, dtype=torch.float64)
    toks = tokens(cfg, batch=2, seq=32)
    logits, aux = model(toks[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), toks[:, 1:].reshape(-1))
    (loss + 0.01 * torch.stack(aux).sum()).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        if name.endswith(("experts.gate_up", "experts.down")):
            # every expert got tokens here, so every expert slice has a gradient
            assert (p.grad.flatten(1).abs().sum(1) > 0).all(), name
        else:
            assert p.grad.abs().sum() > 0, name


def test_aux_coefficient_zero_disables_balance_loss() -> None:
    """With coef 0 the objective has no aux term: router grads come from the CE alone."""
    train = TrainConfig(seq_len=15, global_batch_size=2, micro_batch_size=2)

    def router_grad(coef: float) -> torch.Tensor:
        cfg = dataclasses.replace(TINY, aux_loss_coef=coef)
        model = build_model(cfg, seed=0, dtype=torch.float64)
        scale = LossScale.for_run(cfg, train)
        toks = tokens(cfg, seq=16)
        logits, aux = model(toks[:, :-1])
        loss = scale.ce(logits, toks[:, 1:])
        aux_term = scale.aux(aux)
        assert (aux_term is None) == (coef == 0)
        if aux_term is not None:
            loss = loss + aux_term
        loss.backward()
        grad = model.layers[0].attn_block.router.weight.grad
        assert grad is not None
        return grad

    no_aux = router_grad(0.0)
    model = build_model(TINY, seed=0, dtype=torch.float64)
    toks = tokens(TINY, seq=16)
    ce = LossScale.for_run(TINY, train).ce(model(toks[:, :-1])[0], toks[:, 1:])
    ce.backward()
    assert torch.equal(no_aux, model.layers[0].attn_block.router.weight.grad)
    assert not torch.allclose(router_grad(0.5), no_aux)


def test_init_is_deterministic() -> None:
    a = build_model(SHARED, seed=5, dtype=torch.float32)
    b = build_model(SHARED, seed=5, dtype=torch.float32)
    c = build_model(SHARED, seed=6, dtype=torch.float32)
    d = build_model(SHARED, seed=5, dtype=torch.float64)
    for (name, pa), pb, pc, pd in zip(
        a.named_parameters(), b.parameters(), c.parameters(), d.parameters(), strict=True
    ):
        assert torch.equal(pa, pb), name
        assert torch.equal(pa, pd.float()), name  # same draws whatever the dtype
        if pa.ndim == 1:
            assert torch.equal(pa, torch.ones_like(pa)), name
        else:
            assert not torch.equal(pa, pc), name
            assert abs(pa.std().item() - SHARED.init_std) < 0.3 * SHARED.init_std, name


def test_init_of_a_parameter_depends_only_on_its_name_and_experts() -> None:
    """A parameter's value is the same whichever other parameters the model has, and an
    expert slice drawn alone equals the same experts of the whole fused tensor."""
    full = dict(build_model(SHARED, seed=5, dtype=torch.float32).named_parameters())
    shorter = build_model(dataclasses.replace(SHARED, num_layers=2), seed=5, dtype=torch.float32)
    for name, param in shorter.named_parameters():
        assert torch.equal(param, full[name]), name
    whole = full["layers.2.experts.gate_up"]
    kwargs = dict(seed=5, std=SHARED.init_std, dtype=torch.float32)
    part = initial_value("layers.2.experts.gate_up", (3, *whole.shape[1:]), range(2, 5), **kwargs)
    assert torch.equal(part, whole[2:5])
    assert not torch.equal(whole[0], whole[1])


# ---------------------------------------------------------------------------- route


@pytest.mark.parametrize("norm", [True, False])
def test_router_top_k(norm: bool) -> None:
    routing = random_routing(40, 8, 3, seed=1, norm=norm)
    probs = routing.probs_TE
    torch.testing.assert_close(probs.sum(-1), torch.ones(40, dtype=torch.float64))
    # indices are the k most probable experts, in descending order
    expected_idx = probs.argsort(dim=-1, descending=True)[:, :3]
    assert torch.equal(routing.indices_TK, expected_idx)
    top = probs.gather(1, routing.indices_TK)
    assert (top[:, :-1] >= top[:, 1:]).all()
    if norm:
        torch.testing.assert_close(routing.weights_TK, top / top.sum(-1, keepdim=True))
        torch.testing.assert_close(routing.weights_TK.sum(-1), torch.ones(40, dtype=torch.float64))
    else:
        torch.testing.assert_close(routing.weights_TK, top)
        assert (routing.weights_TK.sum(-1) < 1).all()


def test_router_on_known_logits() -> None:
    router = Router(2, 4, 2, norm_topk_prob=True).double()
    with torch.no_grad():
        router.weight.copy_(torch.tensor([[1.0, 0], [0, 1.0], [0, 0], [-1.0, 0]]))
    routing = router(torch.tensor([[2.0, 1.0]], dtype=torch.float64))
    p = torch.softmax(torch.tensor([2.0, 1.0, 0.0, -2.0], dtype=torch.float64), dim=0)
    assert routing.indices_TK.tolist() == [[0, 1]]
    torch.testing.assert_close(routing.weights_TK[0], p[:2] / p[:2].sum())


def test_load_balancing_loss_by_hand() -> None:
    # E=2, T=2, K=1; both tokens chose expert 0: f = [1, 0]; P = mean probs = [0.625, 0.375].
    probs = torch.tensor([[0.75, 0.25], [0.5, 0.5]], dtype=torch.float64, requires_grad=True)
    routing = Routing(indices_TK=torch.tensor([[0], [0]]), weights_TK=probs[:, :1], probs_TE=probs)
    loss = load_balancing_loss(routing, 2)
    assert loss.item() == pytest.approx(2 * (1.0 * 0.625 + 0.0 * 0.375))
    loss.backward()  # gradient flows through P only: d/dp[t, e] = E * f_e / T
    assert probs.grad is not None
    torch.testing.assert_close(
        probs.grad, torch.tensor([[1.0, 0.0], [1.0, 0.0]], dtype=torch.float64)
    )


def test_load_balancing_loss_counts_all_top_k_choices() -> None:
    # E=4, T=2, K=2, uniform probabilities and perfectly balanced choices: loss = 1.
    probs = torch.full((2, 4), 0.25, dtype=torch.float64)
    balanced = Routing(
        indices_TK=torch.tensor([[0, 1], [2, 3]]), weights_TK=probs[:, :2], probs_TE=probs
    )
    assert load_balancing_loss(balanced, 4).item() == pytest.approx(1.0)
    # all four choices on experts 0 and 1: f = [0.5, 0.5, 0, 0], P uniform -> 4 * 0.25 = 1.
    skewed = Routing(
        indices_TK=torch.tensor([[0, 1], [1, 0]]), weights_TK=probs[:, :2], probs_TE=probs
    )
    assert load_balancing_loss(skewed, 4).item() == pytest.approx(1.0)
    # now P follows f: loss = 4 * (0.5*0.5 + 0.5*0.5) = 2.
    peaked = torch.tensor([[0.5, 0.5, 0, 0], [0.5, 0.5, 0, 0]], dtype=torch.float64)
    skewed = dataclasses.replace(skewed, probs_TE=peaked)
    assert load_balancing_loss(skewed, 4).item() == pytest.approx(2.0)


# ---------------------------------------------------------------------------- compute / combine


@pytest.mark.parametrize(("num_tokens", "top_k"), [(37, 2), (5, 1), (9, 4)])
def test_grouped_gemm_matches_per_token_loop(num_tokens: int, top_k: int) -> None:
    experts = random_experts(8, 12, 10)
    routing = random_routing(num_tokens, 8, top_k, seed=num_tokens)
    x = torch.randn(num_tokens, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    got = experts(x, flatten_routing(routing))
    torch.testing.assert_close(got, naive_experts(x, experts, routing), rtol=0, atol=1e-12)


def test_experts_with_idle_experts_and_gradients() -> None:
    """Only experts 2 and 5 are chosen: the others get no rows and a zero gradient."""
    experts = random_experts(8, 6, 4)
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    w = torch.tensor([[0.7, 0.3], [0.4, 0.6], [0.5, 0.5], [1.0, 0.0]], dtype=torch.float64)
    routing = Routing(
        indices_TK=torch.tensor([[5, 2], [2, 5], [5, 2], [2, 5]]),
        weights_TK=w.requires_grad_(),
        probs_TE=torch.full((4, 8), 1 / 8, dtype=torch.float64),
    )
    y = experts(x, flatten_routing(routing))
    torch.testing.assert_close(y, naive_experts(x, experts, routing), rtol=0, atol=1e-12)
    y.pow(2).sum().backward()
    assert experts.gate_up.grad is not None and experts.down.grad is not None
    used = torch.zeros(8, dtype=torch.bool)
    used[[2, 5]] = True
    assert (experts.gate_up.grad.flatten(1).abs().sum(1) > 0).tolist() == used.tolist()
    assert x.grad is not None and w.grad is not None and w.grad.abs().sum() > 0


def test_experts_on_empty_plan() -> None:
    experts = random_experts(4, 6, 4)
    empty = Assignments(
        token_ids=torch.zeros(0, dtype=torch.long),
        rows_A=torch.zeros(0, dtype=torch.long),
        experts_A=torch.zeros(0, dtype=torch.long),
        weights_A=torch.zeros(0, dtype=torch.float64),
    )
    y = experts(torch.zeros(0, 6, dtype=torch.float64), empty)
    assert y.shape == (0, 6)


# ---------------------------------------------------------------------------- dispatch


def _owner_outputs(
    x_TH: torch.Tensor, experts: Experts, routing: Routing, num_owners: int
) -> torch.Tensor:
    """What the A-worker sums from `num_owners` expert workers, each with its slice of experts."""
    shards = split_experts(experts.num_experts, num_owners)
    plans = split_by_owner(routing, shards)
    assert len(plans) == num_owners
    total = torch.zeros_like(x_TH)
    for j, plan in enumerate(plans):
        shard = experts.narrow(shards[j].start, len(shards[j]))
        y_RH = shard(x_TH[plan.token_ids], plan)
        total = total.index_add(0, plan.token_ids, y_RH)
    return total


def test_narrow_holds_its_own_copy_of_a_contiguous_slice() -> None:
    experts = random_experts(8, 6, 5)
    shard = experts.narrow(2, 3)
    assert shard.num_experts == 3
    assert torch.equal(shard.gate_up, experts.gate_up[2:5])
    assert torch.equal(shard.down, experts.down[2:5])
    with torch.no_grad():
        shard.down.zero_()
    assert bool((experts.down[2:5] != 0).any())  # a copy: the full module is untouched


@pytest.mark.parametrize("num_owners", [1, 2, 3, 4, 5, 8])
def test_split_by_owner_plans(num_owners: int) -> None:
    T, E, K = 23, 8, 3
    routing = random_routing(T, E, K, seed=4)
    shards = split_experts(E, num_owners)
    owner_E = torch.tensor([j for j, r in enumerate(shards) for _ in r])
    plans = split_by_owner(routing, shards)
    seen = 0
    for j, plan in enumerate(plans):
        per_owner, first = len(shards[j]), shards[j].start
        owner_of = owner_E[routing.indices_TK]
        expected_tokens = torch.nonzero((owner_of == j).any(dim=1)).flatten()
        # each token at most once per owner, ascending, exactly the tokens routed there
        assert torch.equal(plan.token_ids, expected_tokens)
        assert plan.rows_A.numel() == plan.experts_A.numel() == plan.weights_A.numel()
        if plan.rows_A.numel():
            assert int(plan.rows_A.min()) >= 0 and int(plan.rows_A.max()) < plan.token_ids.numel()
            assert int(plan.experts_A.min()) >= 0 and int(plan.experts_A.max()) < per_owner
        # every (token, expert, weight) of this owner appears exactly once
        got = sorted(
            (int(plan.token_ids[r]), int(e) + first, float(w))
            for r, e, w in zip(plan.rows_A, plan.experts_A, plan.weights_A.detach(), strict=True)
        )
        want = sorted(
            (t, int(routing.indices_TK[t, k]), float(routing.weights_TK[t, k].detach()))
            for t in range(T)
            for k in range(K)
            if int(owner_E[routing.indices_TK[t, k]]) == j
        )
        assert got == want
        seen += len(got)
    assert seen == T * K


@pytest.mark.parametrize("num_owners", [2, 3, 4])
def test_owner_outputs_sum_to_single_owner(num_owners: int) -> None:
    experts = random_experts(8, 6, 5)
    routing = random_routing(19, 8, 3, seed=9)
    x = torch.randn(19, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    single = experts(x, flatten_routing(routing))
    torch.testing.assert_close(
        _owner_outputs(x, experts, routing, num_owners), single, rtol=0, atol=1e-12
    )


def test_split_by_owner_uneven_and_empty_owners() -> None:
    # 4 owners of 2 experts each; tokens choose experts 0, 1, 2 and 6 only:
    # owner 0 gets every token, owners 1 and 3 two each, owner 2 none.
    T = 6
    indices = torch.tensor([[0, 1], [1, 0], [2, 0], [6, 1], [0, 2], [1, 6]])
    weights = torch.rand(T, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    probs = torch.full((T, 8), 1 / 8, dtype=torch.float64)
    routing = Routing(indices_TK=indices, weights_TK=weights, probs_TE=probs)
    plans = split_by_owner(routing, split_experts(8, 4))
    assert [p.token_ids.tolist() for p in plans] == [[0, 1, 2, 3, 4, 5], [2, 4], [], [3, 5]]
    # owner 0 holds experts 0 and 1: token 0 (experts 0, 1) appears once with two rows
    assert plans[0].rows_A.tolist().count(0) == 2
    for empty in plans[2:3]:
        assert empty.rows_A.numel() == empty.experts_A.numel() == empty.weights_A.numel() == 0
    experts = random_experts(8, 6, 5)
    x = torch.randn(T, 6, dtype=torch.float64)
    single = experts(x, flatten_routing(routing))
    torch.testing.assert_close(_owner_outputs(x, experts, routing, 4), single, rtol=0, atol=1e-12)


def test_split_by_owner_rejects_shards_that_do_not_cover_the_experts() -> None:
    routing = random_routing(5, 8, 2)
    with pytest.raises(ValueError, match="must cover experts 0..7"):
        split_by_owner(routing, [range(0, 4), range(5, 8)])
    with pytest.raises(ValueError, match="every shard needs at least one expert"):
        split_experts(8, 9)


@pytest.mark.parametrize("mode", ["pure", "autocast"])
def test_bf16_grouped_kernel_equals_the_per_expert_loop(mode: str) -> None:
    """bf16 takes `torch._grouped_mm` (PyTorch's CPU fallback here, CUDA's kernel on a
    GPU): forward and both gradients equal the per-expert GEMMs', empty groups included;
    float32 / float64 and unaligned widths keep the loop."""
    from disagmoe.models.moe import _grouped_kernel_dtype, grouped_mm

    counts = [5, 0, 7, 4]
    counts_E = torch.tensor(counts)
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(16, 64, generator=gen), torch.randn(4, 64, 32, generator=gen)
    if mode == "pure":
        x, w = x.bfloat16(), w.bfloat16()

    def loop(x_AI: torch.Tensor, w_EIO: torch.Tensor) -> torch.Tensor:
        parts = x_AI.split(counts)
        return torch.cat([parts[e] @ w_EIO[e] for e in range(4) if counts[e]])

    results = []
    for fn in (grouped_mm, lambda a, b, _c: loop(a, b)):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
            assert _grouped_kernel_dtype(xg, wg) == torch.bfloat16
            y = fn(xg, wg, counts_E)
        y.float().pow(2).sum().backward()
        assert y.dtype == torch.bfloat16 and xg.grad is not None and wg.grad is not None
        assert xg.grad.dtype == x.dtype and wg.grad.dtype == w.dtype
        results.append((y, xg.grad, wg.grad))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    assert _grouped_kernel_dtype(x.float(), w.float()) is None
    assert _grouped_kernel_dtype(x.double(), w.double()) is None
    assert _grouped_kernel_dtype(x.bfloat16()[:, :60], w.bfloat16()[:, :60]) is None
