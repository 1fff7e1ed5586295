"""Process groups of the expert-parallel baselines, built from their `EPLayout`.

Per rank (`distributed.ep_layout` for the rank order): its pipeline (p2p of the
pipeline schedule), its data-parallel replicas (dense gradients), its EP group
(dispatch/combine all-to-all; a second one for the backward lane where a forward and a
backward run at once; with chunked expert compute one more per lane for the asynchronous
all-to-alls) and its expert-data-parallel group (expert gradients).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from ..config import runs_chunked
from ..distributed.ep_layout import EPLayout
from ..schedule.pipelines import FB_OVERLAP_RUNTIMES


@dataclass
class EPGroups:
    """Process groups of one rank; built collectively (every rank calls `build` in the same order)."""

    pp: dist.ProcessGroup  # this replica's pipeline ranks (p2p of the pipeline schedule)
    dp: dist.ProcessGroup | None  # replicas of this pipeline rank (dense grads); None if dp == 1
    ep: dist.ProcessGroup | None  # EP group (dispatch/combine all-to-all); None if ep == 1
    edp: dist.ProcessGroup | None  # same expert shard on other EP groups (expert grads)
    a2a: dist.ProcessGroup | None  # EP group of chunked experts' async all-to-alls
    bwd: dist.ProcessGroup | None = None  # EP group of the backward lane (F&B overlap)
    a2a_bwd: dist.ProcessGroup | None = None  # the backward lane's async group (F&B, chunked)
    created: int = 0  # process groups the run created (the world group excluded)

    @classmethod
    def build(cls, layout: EPLayout, rank: int, chunks: int = 1) -> EPGroups:
        """`chunks`: `parallel.overlap_chunks` (`config.runs_chunked` says which runtimes
        post their all-to-alls asynchronously, on groups of their own)."""
        pp_rank, dp_rank, ep_rank, edp_rank = layout.coords(rank)
        found: dict[str, dist.ProcessGroup | None] = {
            "pp": None,
            "dp": None,
            "ep": None,
            "edp": None,
            "a2a": None,
            "bwd": None,
            "a2a_bwd": None,
        }
        fb_overlap = layout.runtime in FB_OVERLAP_RUNTIMES
        chunked = runs_chunked(layout.runtime, chunks)

        created = 0

        def make(name: str, ranks: list[int], needed: bool = True) -> None:
            nonlocal created
            group = dist.new_group(ranks)
            created += 1
            if rank in ranks and needed:
                found[name] = group

        for d in range(layout.dp):
            make("pp", [layout.rank_of(p, d) for p in range(layout.pp)])
        for p in range(layout.pp):
            make("dp", layout.dp_group_ranks(p), layout.dp > 1)
            for b in range(layout.dp // layout.ep):
                make("ep", layout.ep_group_ranks(p, b), layout.ep > 1)
                if chunked:
                    make("a2a", layout.ep_group_ranks(p, b), layout.ep > 1)
                if fb_overlap:
                    make("bwd", layout.ep_group_ranks(p, b), layout.ep > 1)
                if fb_overlap and chunked:
                    make("a2a_bwd", layout.ep_group_ranks(p, b), layout.ep > 1)
            for j in range(layout.ep):
                ranks = layout.edp_group_ranks(p, j)
                make("edp", ranks, len(ranks) > 1)
        assert found["pp"] is not None, (rank, pp_rank, dp_rank, ep_rank, edp_rank)
        return cls(
            found["pp"], found["dp"], found["ep"], found["edp"], found["a2a"], found["bwd"],
            found["a2a_bwd"], created,
        )  # fmt: skip
