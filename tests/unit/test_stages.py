"""Parameters of a worker's parts: each distinct parameter once; a shard's dispatch plan
split into exchange chunks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from disagmoe.models.moe import Routing, split_by_owner
from disagmoe.models.parts import NamedParts, unique_named_parameters
from disagmoe.runtime.dispatch_chunks import split_rows
from disagmoe.schedule.ir import chunk_rows


def test_tied_and_shared_parameters_are_listed_once_under_their_first_name() -> None:
    embed, head, norm = nn.Embedding(5, 3), nn.Linear(3, 5, bias=False), nn.LayerNorm(3)
    head.weight = embed.weight  # tied embedding / LM head
    first, last = NamedParts(), NamedParts()
    first.add("embed", embed)
    first.add("norm", norm)
    last.add("norm", norm)  # a module held by two stages of one rank
    last.add("lm_head", head)
    got = unique_named_parameters(first, last)
    assert [name for name, _ in got] == ["embed.weight", "norm.weight", "norm.bias"]
    assert all(
        p is q for (_, p), q in zip(got, [embed.weight, norm.weight, norm.bias], strict=True)
    )
    assert unique_named_parameters(last)[0][0] == "norm.weight"


def _plans(num_tokens: int, num_experts: int, top_k: int, shards: list[range], seed: int = 0):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    probs = torch.rand(num_tokens, num_experts, generator=gen, dtype=torch.float64).softmax(-1)
    weights, indices = probs.topk(top_k, dim=-1)
    return split_by_owner(Routing(indices, weights, probs), shards)


@pytest.mark.parametrize("num_chunks", [1, 2, 3, 7])
def test_split_rows_partitions_a_plan_into_its_chunks(num_chunks: int) -> None:
    """Chunk k holds the rows `chunk_rows(R, c, k)` and exactly their assignments, rows
    re-based: together the chunks are the plan, in order. Shard 1 gets fewer rows than 7
    chunks (empty chunks); shard 2 gets none."""
    plans = _plans(12, 8, 2, [range(0, 6), range(6, 7), range(7, 8)])
    plans[2] = split_by_owner(Routing(*_top1_to(0, 12, 8)), [range(0, 7), range(7, 8)])[1]
    assert plans[2].token_ids.numel() == 0 and 0 < plans[1].token_ids.numel() < 7
    together = split_rows(plans, [num_chunks] * len(plans))
    assert split_rows(plans, [1, num_chunks, 1])[0] == [plans[0]]  # unchunked: the plan
    for plan, parts in zip(plans, together, strict=True):
        alone = split_rows([plan], [num_chunks])[0]  # alone or together: the same chunks
        assert all(
            torch.equal(getattr(a, f), getattr(b, f))
            for a, b in zip(parts, alone, strict=True)
            for f in ("token_ids", "rows_A", "experts_A", "weights_A")
        )
        assert len(parts) == num_chunks
        num_rows = plan.token_ids.numel()
        for k, part in enumerate(parts):
            lo, hi = chunk_rows(num_rows, num_chunks, k)
            assert torch.equal(part.token_ids, plan.token_ids[lo:hi])
            assert part.rows_A.numel() == 0 or (
                part.rows_A.min() >= 0 and part.rows_A.max() < hi - lo
            )
        assert torch.equal(
            torch.cat([p.rows_A + chunk_rows(num_rows, num_chunks, k)[0]
                       for k, p in enumerate(parts)]),
            plan.rows_A,
        )  # fmt: skip
        for field in ("experts_A", "weights_A"):
            assert torch.equal(torch.cat([getattr(p, field) for p in parts]), getattr(plan, field))


def _top1_to(expert: int, num_tokens: int, num_experts: int) -> tuple[torch.Tensor, ...]:
    """Routing of every token to `expert` alone."""
    probs = torch.full((num_tokens, num_experts), 1.0 / num_experts, dtype=torch.float64)
    indices = torch.full((num_tokens, 1), expert, dtype=torch.long)
    return indices, torch.ones(num_tokens, 1, dtype=torch.float64), probs


def test_split_rows_keeps_the_weights_differentiable() -> None:
    """A chunk's weights are views of the plan's: their gradients reach the routing."""
    probs = torch.rand(6, 4, dtype=torch.float64).softmax(-1).requires_grad_()
    weights, indices = probs.topk(2, dim=-1)
    (plan,) = split_by_owner(Routing(indices, weights, probs), [range(0, 4)])
    (parts,) = split_rows([plan], [2])
    sum(p.weights_A.sum() * (k + 1) for k, p in enumerate(parts)).backward()  # type: ignore[union-attr]
    assert probs.grad is not None and probs.grad.abs().sum() > 0


def _workers(recompute: str):  # type: ignore[no-untyped-def]
    """An A and an F worker of one replica and one shard (p = 1), tiny model, float64."""
    from disagmoe.config import RunConfig, TrainConfig, replace_section
    from disagmoe.distributed.layout import Layout
    from disagmoe.runtime.stages import AttnWorker, ExpertWorker, build_worker
    from disagmoe.training.objective import LossScale
    from disagmoe.training.setup import apply_variants

    cfg = RunConfig(train=TrainConfig(dtype="float64", recompute=recompute, progress=False))
    cfg = replace_section(cfg, "parallel", groups=1, attn_workers=1, expert_workers=1)
    layout = Layout.build(cfg.model, cfg.parallel, 2)
    a_rank, f_rank = layout.attn_rank(0, 0), layout.expert_rank(0, 0)
    scale = LossScale.for_run(cfg.model, cfg.train)
    attn, experts = (
        build_worker(cfg, layout, a_rank, scale),
        build_worker(cfg, layout, f_rank, scale),
    )
    assert isinstance(attn, AttnWorker) and isinstance(experts, ExpertWorker)
    apply_variants(cfg, [attn.modules, experts.modules])
    B, S = cfg.train.micro_batch_size, cfg.train.seq_len
    tokens = torch.randint(
        0, cfg.model.vocab_size, (B, S + 1), generator=torch.Generator().manual_seed(0)
    )
    attn.micro_batches = {0: (tokens[:, :-1], tokens[:, 1:])}
    return attn, experts, a_rank, f_rank


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_a_stage_keeps_none_of_its_messages_until_its_backward(recompute: str) -> None:
    """Once the caller (the executor, the outbox) drops a forward's payloads, nothing of the
    stage holds their storage: the stash keeps gradient edges and catches gradients, and
    no op saves the rows (the combine's index-add saves their token ids only). Under the
    old design (received tensors as leaves, outputs as backward roots) two more held each.
    The backward still sends the gradients of the messages."""
    from disagmoe.schedule.ir import Msg
    from disagmoe.torch_private import storage_use_count

    attn, experts, a, f = _workers(recompute)
    to_f, to_a = Msg("dispatch", 0, 0, a, f), Msg("combine", 0, 0, f, a)
    grad_f, grad_a = Msg("grad_dispatch", 0, 0, f, a), Msg("grad_combine", 0, 0, a, f)
    sent = attn.forward(0, 0, {}, [to_f])[to_f]
    u, sent_w_shape = sent[0], sent[1].shape
    combine = experts.forward(0, 0, {to_f: sent}, [to_a])
    y = combine[to_a][0]
    del sent
    probe = torch.zeros(1)
    alone = storage_use_count(probe.untyped_storage())  # a tensor's and the query's own
    assert storage_use_count(u.untyped_storage()) == alone  # A keeps no dispatched rows, F
    # no received ones
    attn.forward(1, 0, combine, [])
    del combine
    assert storage_use_count(y.untyped_storage()) == alone  # F keeps no output, A no rows
    g_y = torch.randn_like(y)
    g_u, g_w = experts.backward(0, 0, {grad_a: [g_y]}, [grad_f])[grad_f]
    assert g_u.shape == u.shape and g_u.abs().sum() > 0 and g_w.shape == sent_w_shape
