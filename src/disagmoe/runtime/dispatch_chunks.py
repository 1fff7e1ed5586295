"""A replica's dispatch plans cut into exchange chunks (`schedule.ir`, "Exchange chunks")."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..models import Assignments
from ..schedule.ir import chunk_rows


def split_rows(plans: Sequence[Assignments], num_chunks: Sequence[int]) -> list[list[Assignments]]:
    """Shard j's dispatch plan `plans[j]` as `num_chunks[j]` plans: chunk k holds the rows
    `chunk_rows(R, c, k)` of the plan's R rows (its token ids, in plan order) and the
    assignments of those rows, rows re-based to the chunk (`schedule.ir`, "Exchange
    chunks"). A plan's assignments must be ordered by row, as `split_by_owner` gives them
    (token-major); each chunk's are then one contiguous range. The ranges of every chunked
    plan are found on the plans' device and read to the host once, together."""
    bounds = [
        [chunk_rows(plan.token_ids.numel(), c, k) for k in range(c)]
        for plan, c in zip(plans, num_chunks, strict=True)
    ]
    chunked = [j for j, c in enumerate(num_chunks) if c > 1]
    searched = [
        torch.searchsorted(
            plans[j].rows_A,
            torch.tensor([lo for lo, _ in bounds[j]] + [plans[j].token_ids.numel()],
                         device=plans[j].rows_A.device),
        )
        for j in chunked
    ]  # fmt: skip
    flat = torch.cat(searched).tolist() if searched else []
    cuts: dict[int, list[int]] = {}
    for j in chunked:
        cuts[j], flat = flat[: num_chunks[j] + 1], flat[num_chunks[j] + 1 :]
    out: list[list[Assignments]] = []
    for j, plan in enumerate(plans):
        if j not in cuts:
            out.append([plan])
            continue
        at = cuts[j]
        out.append([
            Assignments(
                token_ids=plan.token_ids[lo:hi],
                rows_A=plan.rows_A[at[k] : at[k + 1]] - lo,
                experts_A=plan.experts_A[at[k] : at[k + 1]],
                weights_A=plan.weights_A[at[k] : at[k + 1]],
            )
            for k, (lo, hi) in enumerate(bounds[j])
        ])  # fmt: skip
    return out
