"""The chunked LM head + cross-entropy (`models.loss_head`) against the plain path
(`lm_head(norm(x))` then `LossScale.ce`): values and gradients, chunk sizes, tied weights,
ignored targets, precisions, and the split backward (`runtime.wgrad`) through it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from disagmoe.models.layers import RMSNorm
from disagmoe.models.loss_head import IGNORE_INDEX, chunked_head_loss
from disagmoe.runtime.wgrad import backward_inputs, backward_weights
from disagmoe.training.objective import LossScale

B, S, H, V = 2, 7, 8, 11  # 14 tokens: chunks of 1, 3, 5, 14, 64 (3 and 5 do not divide it)
SCALE = 1.0 / 17


def _head(dtype: torch.dtype, tied: bool = False, seed: int = 0) -> nn.ModuleDict:
    torch.manual_seed(seed)
    head = nn.ModuleDict(
        {"embed": nn.Embedding(V, H), "norm": RMSNorm(H, 1e-6), "lm_head": nn.Linear(H, V, False)}
    ).to(dtype)
    with torch.no_grad():
        head["norm"].weight.uniform_(0.5, 1.5)
    if tied:
        head["lm_head"].weight = head["embed"].weight
    return head


def _loss(
    head: nn.ModuleDict, tokens: torch.Tensor, targets: torch.Tensor, chunk: int
) -> torch.Tensor:
    """Embed, normalise and score: the plain path (`chunk` 0) or the chunked one."""
    x = head["embed"](tokens)
    h = head["norm"](x)
    if chunk == 0:
        return LossScale(SCALE, 0.0).ce(head["lm_head"](h), targets)
    return chunked_head_loss(h, head["lm_head"].weight, targets, scale=SCALE, chunk_tokens=chunk)


def _run(
    dtype: torch.dtype, chunk: int, *, tied: bool = False, autocast: bool = False,
    targets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # fmt: skip
    head = _head(dtype, tied)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, V, (B, S), generator=gen)
    if targets is None:
        targets = torch.randint(0, V, (B, S), generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = _loss(head, tokens, targets, chunk)
    loss.backward()
    grads = {n: p.grad for n, p in head.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _assert_same(got: tuple, want: tuple, **tol: float) -> None:
    assert got[0].dtype == want[0].dtype
    torch.testing.assert_close(got[0], want[0], **tol)
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        assert got[1][name].dtype == want[1][name].dtype, name
        torch.testing.assert_close(got[1][name], want[1][name], **tol, msg=name)


@pytest.mark.parametrize("chunk", [1, 3, 5, B * S, 64])
@pytest.mark.parametrize("tied", [False, True])
def test_chunked_equals_plain_in_float64(chunk: int, tied: bool) -> None:
    """The same sums in another order: equal to float64 rounding."""
    _assert_same(
        _run(torch.float64, chunk, tied=tied),
        _run(torch.float64, 0, tied=tied),
        rtol=1e-12,
        atol=1e-14,
    )


def test_chunked_differs_from_plain_when_the_objective_differs() -> None:
    """The comparison can fail: a wrong scale shows."""
    got = _run(torch.float64, 3)
    head = _head(torch.float64)
    tokens = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(1))
    h = head["norm"](head["embed"](tokens))
    wrong = chunked_head_loss(h, head["lm_head"].weight, tokens, scale=SCALE, chunk_tokens=3)
    assert not torch.allclose(got[0], wrong.detach())


def test_ignored_targets_count_nothing_as_in_cross_entropy() -> None:
    targets = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(2))
    targets[0, :3] = IGNORE_INDEX
    targets[1, -1] = IGNORE_INDEX
    for chunk in (2, 4):
        _assert_same(
            _run(torch.float64, chunk, targets=targets),
            _run(torch.float64, 0, targets=targets),
            rtol=1e-12,
            atol=1e-14,
        )


@pytest.mark.parametrize("chunk", [3, B * S])
def test_mixed_precision_under_autocast_matches_plain(chunk: int) -> None:
    """float32 weights, bf16 autocast: logits in bf16 upcast to fp32, gradients in fp32. One
    chunk runs the plain path's GEMMs; smaller chunks round dW's partial sums apart."""
    got, want = _run(torch.float32, chunk, autocast=True), _run(torch.float32, 0, autocast=True)
    assert got[0].dtype == torch.float32
    tol = {"rtol": 0.0, "atol": 0.0} if chunk == B * S else {"rtol": 2e-2, "atol": 2e-3}
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    for name in want[1]:
        assert got[1][name].dtype == torch.float32
        torch.testing.assert_close(got[1][name], want[1][name], **tol, msg=name)


def test_pure_bf16_matches_plain() -> None:
    got, want = _run(torch.bfloat16, 4), _run(torch.bfloat16, 0)
    assert got[0].dtype == want[0].dtype == torch.float32
    _assert_same(got, want, rtol=2e-2, atol=2e-3)


def test_float32_matches_plain() -> None:
    _assert_same(_run(torch.float32, 3), _run(torch.float32, 0), rtol=1e-5, atol=1e-6)


def test_split_backward_through_the_chunked_head_is_exact() -> None:
    """`runtime.wgrad`: the input gradient now, the head's weight gradients later, equal to
    one whole backward (as the AF-Pipe head and ep-dualpipev's split I/W run it)."""
    results = []
    for split in (False, True):
        head = _head(torch.float64, tied=False)
        x = torch.randn(B, S, H, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
        leaf = x.requires_grad_()
        targets = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(4))
        h = head["norm"](leaf)
        loss = chunked_head_loss(h, head["lm_head"].weight, targets, scale=SCALE, chunk_tokens=4)
        params = [head["norm"].weight, head["lm_head"].weight]
        if split:
            deferred = backward_inputs([loss], [torch.ones_like(loss)], [leaf], params)
            assert all(p.grad is None for p in params)  # nothing for the weights yet
            backward_weights(deferred)
        else:
            loss.backward()
        results.append([leaf.grad, *(p.grad for p in params)])
    for got, want in zip(results[1], results[0], strict=True):
        assert got is not None and want is not None
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_chunk_size_below_one_is_refused() -> None:
    h = torch.zeros(1, 2, H)
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
        chunked_head_loss(h, torch.zeros(V, H), torch.zeros(1, 2, dtype=torch.long),
                          scale=1.0, chunk_tokens=0)  # fmt: skip


def test_cross_entropy_reference_is_the_plain_formula() -> None:
    """Sanity of the plain path used above: `LossScale.ce` is scale * sum CE."""
    logits = torch.randn(5, V, dtype=torch.float64)
    t = torch.arange(5)
    want = F.cross_entropy(logits, t, reduction="sum") * SCALE
    torch.testing.assert_close(LossScale(SCALE, 0.0).ce(logits, t), want)
