"""Mixture-of-Experts pieces, named by Megatron's phases: route / dispatch / compute / combine.

* route    — `Router`: softmax over experts, top-k, optional renormalisation;
             while the runtime has it record (`RoutingStats`), the tokens each
             expert received and the entropy of the softmax.
* dispatch — `flatten_routing` / `split_by_owner`: turn a routing into
             (row, expert, weight) assignments, optionally split by the worker
             that owns each expert (each token sent at most once per worker).
* compute  — `Experts.forward`: SwiGLU experts as a grouped GEMM over the
             assignments sorted by expert.
* combine  — inside `Experts.forward`: weighted outputs summed per row.

Shape legend: T tokens, H model dim, E experts, K top-k, A assignments
(token, expert) pairs, R rows held by one expert worker, I expert hidden dim.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import torch_private


@dataclass(frozen=True)
class Routing:
    """Result of the route phase for T tokens."""

    indices_TK: torch.Tensor  # int64 expert ids, descending by probability
    weights_TK: torch.Tensor  # combine weights (differentiable)
    probs_TE: torch.Tensor  # full softmax (differentiable, for the aux loss)


_RECOMPUTING = threading.local()  # .depth: recompute reruns this thread is inside


class _Recomputing:
    def __enter__(self) -> None:
        _RECOMPUTING.depth = getattr(_RECOMPUTING, "depth", 0) + 1

    def __exit__(self, *exc: object) -> None:
        _RECOMPUTING.depth -= 1


def recomputing() -> _Recomputing:
    """A context for a forward that this thread reruns for backward (activation recompute):
    routers record no statistics inside it, so every token is counted once per step.

    Re-entrant and reusable (not a generator): a checkpoint enters its recompute context
    once per rerun, and a split backward (input, then weight gradients) reruns twice.
    """
    return _Recomputing()


class RoutingStats:
    """What one router saw since the last `reset`: tokens per expert, summed entropy.

    Accumulated on the device of the routing with no host synchronisation (scatter_add,
    not bincount, which reads the largest id back on CUDA); the runtime reads the sums
    once per step. `recording` is off by default: a router only records when the runtime
    switches it on for a training step, so evaluation and other forwards leave no trace.
    """

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self.recording = False
        self.counts_E: torch.Tensor | None = None  # int64, assignments per expert
        self.entropy_sum: torch.Tensor | None = None  # float64, sum over tokens of H(p)
        self.num_tokens = 0

    def add(self, indices_TK: torch.Tensor, probs_TE: torch.Tensor) -> None:
        if self.counts_E is None or self.entropy_sum is None:
            device = indices_TK.device
            self.counts_E = torch.zeros(self.num_experts, dtype=torch.int64, device=device)
            self.entropy_sum = torch.zeros((), dtype=torch.float64, device=device)
        with torch.no_grad():
            flat = indices_TK.flatten()
            self.counts_E.scatter_add_(0, flat, torch.ones_like(flat))
            self.entropy_sum += torch.special.entr(probs_TE).sum(dtype=torch.float64)
        self.num_tokens += indices_TK.shape[0]

    def reset(self) -> None:
        if self.counts_E is not None and self.entropy_sum is not None:
            self.counts_E.zero_()
            self.entropy_sum.zero_()
        self.num_tokens = 0


class Router(nn.Module):
    """Top-k softmax router (Qwen3-MoE / Mixtral style; no bias, no noise)."""

    def __init__(self, dim: int, num_experts: int, top_k: int, *, norm_topk_prob: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.stats = RoutingStats(num_experts)

    def forward(self, u_TH: torch.Tensor) -> Routing:
        logits = F.linear(u_TH, self.weight)
        low = logits.dtype in (torch.bfloat16, torch.float16)
        probs = torch.softmax(logits.float() if low else logits, dim=-1)
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        if self.stats.recording and not getattr(_RECOMPUTING, "depth", 0):
            self.stats.add(top_i, probs.detach())
        return Routing(indices_TK=top_i, weights_TK=top_w.to(logits.dtype), probs_TE=probs)


def load_balancing_loss(routing: Routing, num_experts: int) -> torch.Tensor:
    """Switch-Transformer balance loss `E * sum_e f_e * P_e` for one layer and micro-batch.

    f_e is the fraction of the T*K assignments that chose expert e (no gradient),
    P_e the mean router probability of e over the T tokens.
    """
    chosen = routing.indices_TK.flatten()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=chosen.device)
    counts.scatter_add_(0, chosen, torch.ones_like(chosen))  # no host sync (bincount has one)
    frac = counts.to(routing.probs_TE.dtype) / routing.indices_TK.numel()
    return num_experts * torch.sum(frac * routing.probs_TE.mean(dim=0))


@dataclass(frozen=True)
class Assignments:
    """Dispatch plan for one expert worker: which rows, which local experts, which weights."""

    token_ids: torch.Tensor  # [R] positions in the sender's token list (unique, ascending)
    rows_A: torch.Tensor  # [A] index into the R rows
    experts_A: torch.Tensor  # [A] expert id local to the receiving worker
    weights_A: torch.Tensor  # [A] combine weight (differentiable)


def flatten_routing(routing: Routing) -> Assignments:
    """All T*K assignments for a worker that owns every expert (the single-process path)."""
    T, K = routing.indices_TK.shape
    rows = torch.arange(T, device=routing.indices_TK.device).repeat_interleave(K)
    return Assignments(
        token_ids=torch.arange(T, device=rows.device),
        rows_A=rows,
        experts_A=routing.indices_TK.flatten(),
        weights_A=routing.weights_TK.flatten(),
    )


def split_experts(num_experts: int, num_shards: int) -> tuple[range, ...]:
    """Contiguous expert ids of each of `num_shards` shards: the first `E mod n` shards
    hold ceil(E/n) experts, the others floor(E/n) (docs/design-notes.md, "Uneven splits")."""
    if not 1 <= num_shards <= num_experts:
        raise ValueError(
            f"{num_experts} experts cannot be split over {num_shards} shards: every shard "
            f"needs at least one expert; use 1 to {num_experts} expert shards"
        )
    base, extra = divmod(num_experts, num_shards)
    starts = [j * base + min(j, extra) for j in range(num_shards + 1)]
    return tuple(range(starts[j], starts[j + 1]) for j in range(num_shards))


@functools.lru_cache(maxsize=64)
def _owner_tables(
    bounds: tuple[tuple[int, int], ...], num_experts: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(owner j, first expert of j) of every expert, on `device`: built once per layout."""
    if [e for lo, hi in bounds for e in range(lo, hi)] != list(range(num_experts)):
        raise ValueError(
            f"expert shards {list(bounds)} must cover experts 0..{num_experts - 1} "
            "contiguously, in order"
        )
    owner = [j for j, (lo, hi) in enumerate(bounds) for _ in range(lo, hi)]
    first = [lo for lo, hi in bounds for _ in range(lo, hi)]
    return torch.tensor(owner, device=device), torch.tensor(first, device=device)


def split_by_owner(routing: Routing, shards: Sequence[range]) -> list[Assignments]:
    """Split assignments by owner j holding the contiguous experts `shards[j]`
    (`split_experts`, or `Layout.expert_range` of each shard).

    Each token appears at most once in an owner's `token_ids`, however many of
    its top-k experts that owner holds; owners with no tokens get empty plans.
    """
    device = routing.indices_TK.device
    bounds = tuple((r.start, r.stop) for r in shards)
    owner_E, first_E = _owner_tables(bounds, routing.probs_TE.shape[-1], device)
    T, K = routing.indices_TK.shape
    owner_TK = owner_E[routing.indices_TK]
    local_TK = routing.indices_TK - first_E[routing.indices_TK]
    rows_TK = torch.arange(T, device=device).unsqueeze(1).expand(T, K)
    plans = []
    for j in range(len(shards)):
        mask_TK = owner_TK == j
        token_ids = torch.nonzero(mask_TK.any(dim=1)).flatten()
        remap = torch.full((T,), -1, dtype=torch.long, device=device)
        remap[token_ids] = torch.arange(token_ids.numel(), device=device)
        plans.append(
            Assignments(
                token_ids=token_ids,
                rows_A=remap[rows_TK[mask_TK]],
                experts_A=local_TK[mask_TK],
                weights_A=routing.weights_TK[mask_TK],
            )
        )
    return plans


def grouped_mm(x_AI: torch.Tensor, w_EIO: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """Grouped GEMM: rows of x sorted by group, `counts_E[e]` rows multiply `w_EIO[e]`.

    In bf16 (pure, or under a bf16 autocast) with 16-byte aligned widths: one
    `torch._grouped_mm` call (CUDA's grouped kernel; PyTorch's own fallback on the CPU),
    group offsets computed where `counts_E` lives: no host read. Otherwise — float32,
    float64 (the exactness tests), unaligned widths — one GEMM per non-empty expert (no
    per-token loop; the counts are read on the host). The result is [A, O].
    """
    dtype = _grouped_kernel_dtype(x_AI, w_EIO)
    if dtype is not None and x_AI.shape[0] > 0:
        offs = counts_E.cumsum(0).to(torch.int32)
        with torch.autocast(x_AI.device.type, enabled=False):
            y = torch_private.grouped_mm(x_AI.to(dtype), w_EIO.to(dtype), offs)
        if y.requires_grad:  # its backward needs a dense incoming gradient
            y.register_hook(lambda g: g.contiguous())
        return y
    counts = counts_E.tolist()
    # unbind, not w_EIO[e]: the backward of E selects would materialise E full-size
    # zero gradients; unbind's backward stacks the E slices once.
    w_e = w_EIO.unbind(0)
    outs = [xe @ w_e[e] for e, xe in enumerate(x_AI.split(counts)) if counts[e] > 0]
    if not outs:
        return x_AI.new_zeros(0, w_EIO.shape[-1])
    return torch.cat(outs, dim=0)


_KERNEL_ALIGN = 8  # bf16 elements in 16 bytes: the grouped kernel's stride alignment


def _grouped_kernel_dtype(x_AI: torch.Tensor, w_EIO: torch.Tensor) -> torch.dtype | None:
    """bf16 when `grouped_mm` may call `torch._grouped_mm`, else None."""
    if not torch_private.has_grouped_mm():
        return None
    kind = x_AI.device.type
    dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x_AI.dtype
    aligned = x_AI.shape[-1] % _KERNEL_ALIGN == 0 and w_EIO.shape[-1] % _KERNEL_ALIGN == 0
    return torch.bfloat16 if dtype == torch.bfloat16 and aligned else None


class _WeightedSwiGLU(torch.autograd.Function):
    """`silu(gate) * up * w` of `h` = gate|up [A, 2I] and per-row weights `w` [A], saving
    only `h` and `w`: the backward recomputes SiLU and the product (elementwise) where
    autograd would keep SiLU(gate) and the product, b*2I more per pair."""

    @staticmethod
    def forward(ctx: Any, h_A2I: torch.Tensor, w_A: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(h_A2I, w_A)
        gate, up = h_A2I.chunk(2, dim=-1)
        return F.silu(gate) * up * w_A.to(h_A2I.dtype).unsqueeze(-1)

    @staticmethod
    def backward(ctx: Any, grad_AI: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h_A2I, w_A = ctx.saved_tensors
        gate, up = h_A2I.chunk(2, dim=-1)
        sig = torch.sigmoid(gate)
        silu = gate * sig
        grad_w = (grad_AI * silu * up).sum(-1).to(w_A.dtype)
        grad_a = grad_AI * w_A.to(h_A2I.dtype).unsqueeze(-1)
        grad_up = grad_a * silu
        grad_gate = grad_a * up * sig * (1 + gate * (1 - sig))
        return torch.cat([grad_gate, grad_up], dim=-1), grad_w


def weighted_swiglu(h_A2I: torch.Tensor, w_A: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up * w` per row (`_WeightedSwiGLU`; its backward recomputes SiLU)."""
    return _WeightedSwiGLU.apply(h_A2I, w_A)  # type: ignore[no-any-return]


class _SumRows(torch.autograd.Function):
    """`zeros_like(like).index_add(0, rows, y.to(like.dtype))`, saving only `rows` (the
    backward of `torch.index_add` would keep `y` as well)."""

    @staticmethod
    def forward(
        ctx: Any, y_AH: torch.Tensor, rows_A: torch.Tensor, like: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(rows_A)
        ctx.y_dtype = y_AH.dtype
        return like.new_zeros(like.shape).index_add(0, rows_A, y_AH.to(like.dtype))

    @staticmethod
    def backward(ctx: Any, grad_RH: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (rows_A,) = ctx.saved_tensors
        return grad_RH.index_select(0, rows_A).to(ctx.y_dtype), None, None


def sum_rows(y_AH: torch.Tensor, rows_A: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Rows of `y` summed into a zero tensor shaped and typed as `like` (`_SumRows`)."""
    return _SumRows.apply(y_AH, rows_A, like)  # type: ignore[no-any-return]


class Experts(nn.Module):
    """`num_experts` SwiGLU experts stored as fused 3-D weights.

    `gate_up[e]` is [H, 2I] (gate then up), `down[e]` is [I, H]. An expert
    worker holds a contiguous slice of the global experts (`narrow`); this
    module never knows which slice it holds.
    """

    def __init__(self, num_experts: int, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.gate_up = nn.Parameter(torch.empty(num_experts, dim, 2 * hidden_dim))
        self.down = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    def narrow(self, first: int, count: int) -> Experts:
        """Experts `[first, first + count)` as a new module with its own copy of their weights
        (on the meta device, a meta shard that a rank then materialises alone)."""
        assert 0 <= first <= first + count <= self.num_experts, (first, count, self.num_experts)
        with torch.device("meta"):  # placeholders, replaced below: nothing allocated
            shard = Experts(count, self.gate_up.shape[1], self.down.shape[1])
        shard.gate_up = nn.Parameter(self.gate_up.detach()[first : first + count].clone())
        shard.down = nn.Parameter(self.down.detach()[first : first + count].clone())
        return shard

    def forward(self, x_RH: torch.Tensor, plan: Assignments) -> torch.Tensor:
        """Compute and combine: `y[r] = sum_{a: rows[a]=r} w_a * E_{experts[a]}(x[r])`."""
        order = torch.argsort(plan.experts_A, stable=True)
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=order.device)
        counts.scatter_add_(0, plan.experts_A, torch.ones_like(plan.experts_A))
        rows = plan.rows_A[order]
        h = grouped_mm(x_RH[rows], self.gate_up, counts)
        # the routing weight scales the down GEMM's input, not its output (the GEMM is
        # linear): nothing of size H per pair is saved after the down GEMM
        out_AH = grouped_mm(weighted_swiglu(h, plan.weights_A[order]), self.down, counts)
        # summed in x's dtype (under autocast the GEMMs' output is the compute dtype)
        return sum_rows(out_AH, rows, x_RH)
