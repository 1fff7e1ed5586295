"""Every byte the AF-Pipe runtime sends in a step is in its trace: per (sender, receiver),
the bytes `bench.bound.send_bytes` reads from each rank's trace (the rule the bench's
bound counts with) equal what the layout and the step's routing say the ranks must send
(`traffic.expected_disagg_sends`): the token exchanges (dispatch, combine and their
gradients), the residual between groups and its gradient exactly, the gradient all-reduce
of the attention replicas and STEP's world all-reduce by the ring rule. Every step of
each case is checked, on one spawn of 4 ranks.
"""

from __future__ import annotations

from typing import Any

import pytest

from disagmoe.distributed.layout import run_layout

from . import trainers
from .equivalence import Case, chunked, spawn_cases
from .test_disagg import case, syncing_at_the_end
from .traffic import expected_disagg_sends

STEPS = 2


def cases() -> list[Case]:
    trainer = f"{trainers.__name__}:TrafficTrainer"
    return [
        Case(cfg, trainer)
        # each case at an explicit chunk count (the default, 0, lets the run pick one)
        for cfg in [
            chunked(case(1, 2, 2), 1),  # m = n = 2, top-2: a token may go to both shards
            # the ring A0 -> F0 -> A1 -> F1 -> A0: residuals cross groups, combine goes to
            # the next group's replica; a dense first layer and a shared expert; 2 chunks
            chunked(case(2, 1, 1, top_k=1, num_shared_experts=1, num_dense_layers=1), 2),
            chunked(case(1, 1, 3), 1),  # 8 experts on 3 shards (3, 3, 2)
            # 8 micro-batches on 3 replicas (slots 3, 3, 2), all-reduced at SYNC only
            chunked(syncing_at_the_end(case(1, 3, 1, micro=1)), 1),
        ]
    ]


def test_traced_bytes_equal_the_layout_and_routing() -> None:
    all_cases = cases()
    for c, rank_outs in zip(all_cases, spawn_cases(all_cases, 4, STEPS), strict=True):
        cfg = c.cfg
        what = (
            f"p={cfg.parallel.groups} m={cfg.parallel.attn_workers} "
            f"n={cfg.parallel.expert_workers} chunks={cfg.schedule.exchange_chunks}"
        )
        lay = run_layout(cfg, len(rank_outs))
        for step in range(STEPS):
            ranks: dict[int, dict[str, Any]] = {
                r: {**out["report"]["steps"][step], "grad_bytes": out["report"]["grad_bytes"]}
                for r, out in enumerate(rank_outs)
            }
            want = expected_disagg_sends(cfg, lay, ranks)
            assert sum(len(r["calls"]) for r in ranks.values()), f"{what}: nothing routed"
            for r, mine in ranks.items():
                assert mine["sent"] == pytest.approx(want[r], rel=1e-12), (
                    f"{what} step {step}: rank {r} ({lay.role(r)}) traced sends differ "
                    "from the layout and routing"
                )
