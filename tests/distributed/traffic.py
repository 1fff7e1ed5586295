"""What each rank of an expert-parallel run must send in one step, from the layout and the
routing alone, against what its trace says it sent (`bench.bound.send_bytes`, the
rule the bench's bound counts bytes with).

Per MoE layer and micro-batch, rank r sends EP peer j (r != j), with R[r][j] the tokens of
r routed to any of j's experts and A[r][j] their (token, expert) assignments, H the model
dim, e the bytes of an activation element and C the exchange chunks (ep-overlap):

* forward: counts (2 int64 per chunk), dispatch (rows and combine weights: (R H + A) e),
  assignment ints (2 int64 each), combine (the rows j sent r, back: R[j][r] H e);
* backward: combine's gradient (R[r][j] H e) and dispatch's ((R[j][r] H + A[j][r]) e).

Pipeline p2p: one activation (micro-batch x seq x H, parameter dtype) per micro-batch and
stage boundary between two pipeline ranks, its gradient back. Gradient all-reduce: dense
parameters over the DP group, expert shards over the EDP group, each a ring (every member
sends 2 (g-1)/g of the buffer to the next).

`expected_disagg_sends` does the same for the disaggregated AF-Pipe runtime (its own rule
in its docstring).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from disagmoe.bench.bound import send_bytes
from disagmoe.config import RunConfig
from disagmoe.distributed.ep_layout import EPLayout
from disagmoe.distributed.exchange import META_WORDS
from disagmoe.distributed.layout import Layout
from disagmoe.models.moe import Router, Routing, split_experts


def capture_routings(
    modules: list[torch.nn.Module],
) -> tuple[list[torch.Tensor], Callable[[], None]]:
    """Record the top-k expert ids of every router call under `modules`; (the list, a
    function that removes the hooks)."""
    seen: list[torch.Tensor] = []

    def hook(_m: torch.nn.Module, _args: Any, out: Routing) -> None:
        seen.append(out.indices_TK.detach().clone())

    handles = [
        m.register_forward_hook(hook)
        for module in modules
        for m in module.modules()
        if isinstance(m, Router)
    ]
    return seen, lambda: [h.remove() for h in handles]  # type: ignore[func-returns-value]


def routed_per_peer(indices: list[torch.Tensor], num_experts: int, ep: int) -> list[list[int]]:
    """[[rows, assignments] per EP peer] summed over the routings `indices`."""
    out = [[0, 0] for _ in range(ep)]
    for idx in indices:
        for j, experts in enumerate(split_experts(num_experts, ep)):
            mask = (idx >= experts.start) & (idx < experts.stop)
            out[j][0] += int(mask.any(dim=-1).sum())
            out[j][1] += int(mask.sum())
    return out


def traced_sends(events: list[dict[str, Any]], rank: int) -> dict[int, float]:
    """Bytes `rank` sent to each other rank in `events` (one step of its trace)."""
    out: dict[int, float] = defaultdict(float)
    for e in events:
        for dst, nbytes in send_bytes(e):
            if dst != rank:
                out[dst] += nbytes
    return dict(out)


def expected_sends(
    cfg: RunConfig, world: int, ranks: dict[int, dict[str, Any]], chunks: int
) -> dict[int, dict[int, float]]:
    """{src: {dst: bytes}} of one step; `ranks[r]` holds rank r's `routed` (routed_per_peer),
    `routings` (how many router calls), `dense_bytes` and `expert_bytes` (its gradients);
    STEP's world all-reduce as for AF-Pipe (`STEP_BYTES`)."""
    lay = EPLayout.build(cfg.model, cfg.parallel, cfg.train, world)
    H, e = cfg.model.dim, torch.finfo(getattr(torch, cfg.train.dtype)).bits // 8
    out: dict[int, dict[int, float]] = {r: defaultdict(float) for r in range(world)}
    for r in range(world):
        p, d, ep_rank, edp_rank = lay.coords(r)
        peers = lay.ep_group_ranks(p, edp_rank)
        mine = ranks[r]
        for j, peer in enumerate(peers):
            if peer == r:
                continue
            rows, asg = mine["routed"][j]
            back_rows, back_asg = ranks[peer]["routed"][ep_rank]
            out[r][peer] += 16 * chunks * mine["routings"]  # counts
            out[r][peer] += (
                (rows * H + asg) * e + 16 * asg + rows * H * e
            )  # dispatch, ints, combine.bwd
            out[r][peer] += (
                back_rows * H * e + (back_rows * H + back_asg) * e
            )  # combine, dispatch.bwd
        for group, key in (
            (lay.dp_group_ranks(p), "dense_bytes"),
            (lay.edp_group_ranks(p, ep_rank), "expert_bytes"),
        ):
            g = len(group)
            if g > 1:
                out[r][group[(group.index(r) + 1) % g]] += 2 * (g - 1) / g * mine[key]
    owner = lay.stage_to_pp_rank()
    act = cfg.train.micro_batch_size * cfg.train.seq_len * H * e
    for s in range(lay.num_stages - 1):
        if owner[s] == owner[s + 1]:
            continue
        for d in range(lay.dp):
            a, b = lay.rank_of(owner[s], d), lay.rank_of(owner[s + 1], d)
            out[a][b] += act * lay.num_local_micro_batches
            out[b][a] += act * lay.num_local_micro_batches
    if world > 1:  # STEP: the norm and the losses over the world (ring in rank order)
        for r in range(world):
            out[r][(r + 1) % world] += 2 * (world - 1) / world * STEP_BYTES
    return {r: {dst: v for dst, v in sends.items() if v} for r, sends in out.items()}


# Every AF-Pipe message travels with a header of this many bytes of fields, plus the bytes of
# its tensors (inline in the header or as payloads; 8-byte dtypes here, so no padding).
HEADER_BYTES = META_WORDS * 8
# STEP all-reduces over the world the squared gradient norm and the two loss sums (float64)
STEP_BYTES = 3 * 8


def expected_disagg_sends(
    cfg: RunConfig, lay: Layout, ranks: dict[int, dict[str, Any]]
) -> dict[int, dict[int, float]]:
    """{src: {dst: bytes}} of one step of the AF-Pipe runtime (`runtime.disagg`), from the
    layout and the routing alone. `ranks[r]` of an attention rank holds `calls`: per router
    call (a MoE layer's forward of one slot) the layer and `routed_per_peer` of its top-k
    ids over the n shards, and `grad_bytes`: its parameters' gradient bytes.

    Replica i runs `slots_of_replica(i, M)` slots of T = micro-batch x seq tokens; layer l's
    attention is on `attn_rank(l mod p, i)`, its experts' shard j on `expert_rank(l mod p,
    j)`. Per slot and layer l < L, with H the model dim, e the element bytes, c the exchange
    chunks, R_j the tokens routed to shard j (one row per (token, shard), however many of
    its experts the shard holds) and A_j their (token, expert) assignments, each message
    HEADER_BYTES plus its tensors:

    * act A(l) -> A(l+1) if another rank (p > 1): the residual (T H e); on a MoE layer also
      the n token counts and the sum_j R_j token ids (int64); grad_act back: T H e;
    * MoE layers, per shard j, c messages each way: dispatch A(l) -> F_j (R_j H e rows,
      A_j weights, A_j row and A_j local expert int64s), combine F_j -> A(l+1) (R_j H e),
      grad_combine A(l+1) -> F_j (R_j H e), grad_dispatch F_j -> A(l) (R_j H e + A_j e).

    SYNC: the attention replicas of a group all-reduce their gradients (ring in replica
    order, 2 (m-1)/m of the bytes to the next; expert shards hold distinct experts: none);
    STEP: every rank all-reduces `STEP_BYTES` over the world (ring in rank order).
    """
    H, e = cfg.model.dim, torch.finfo(getattr(torch, cfg.train.dtype)).bits // 8
    T = cfg.train.micro_batch_size * cfg.train.seq_len
    L, n, c = lay.num_layers, lay.expert_workers, cfg.schedule.exchange_chunks
    out: dict[int, dict[int, float]] = {r: defaultdict(float) for r in range(lay.world_size)}
    for i in range(lay.attn_workers):
        slots = lay.slots_of_replica(i, cfg.train.num_micro_batches)
        for l in range(L):
            a, nxt = lay.attn_rank(lay.group_of(l), i), lay.attn_rank(lay.group_of(l + 1), i)
            calls = [routed for layer, routed in ranks[a]["calls"] if layer == l]
            assert len(calls) == (slots if l in lay.moe_layers else 0), (l, i, len(calls))
            if a != nxt:
                ids = sum(rows for routed in calls for rows, _ in routed)
                counts = n * len(calls) if calls else 0
                out[a][nxt] += slots * (HEADER_BYTES + T * H * e) + (counts + ids) * 8
                out[nxt][a] += slots * (HEADER_BYTES + T * H * e)
            for routed in calls:
                for j, (rows, asg) in enumerate(routed):
                    f = lay.expert_rank(lay.group_of(l), j)
                    head = c * HEADER_BYTES
                    out[a][f] += head + rows * H * e + asg * e + 2 * asg * 8  # dispatch
                    out[f][nxt] += head + rows * H * e  # combine
                    out[nxt][f] += head + rows * H * e  # grad_combine
                    out[f][a] += head + rows * H * e + asg * e  # grad_dispatch
    for g in range(lay.groups):
        replicas = lay.attn_replicas(g)
        m = len(replicas)
        for k, r in enumerate(replicas):
            if m > 1:
                out[r][replicas[(k + 1) % m]] += 2 * (m - 1) / m * ranks[r]["grad_bytes"]
    world = lay.world_size
    for r in range(world):
        if world > 1:
            out[r][(r + 1) % world] += 2 * (world - 1) / world * STEP_BYTES
    return {r: {dst: v for dst, v in sends.items() if v} for r, sends in out.items()}
