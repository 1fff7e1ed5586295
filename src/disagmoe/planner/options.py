"""What a plan is asked for: `PlanOptions` (the `disagmoe plan` flags and the API's
options, each checked) and the profiles that can score it."""

from __future__ import annotations

from dataclasses import dataclass

import disagmoe.costs.costmodel as cm
from disagmoe.config import (
    LOSS_CHUNK_TOKENS,
    MAX_EXCHANGE_CHUNKS,
    SCHEDULE_ORDERS,
    SPLIT_BACKWARD,
    check_loss_chunk_tokens,
)

PROFILES = ("auto", "analytic", "simulator")


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanOptions:
    roofline_only: bool = False  # the paper's problem: p = 1, sums + integrality, peaks
    groups: int = 0  # 0: the planner chooses p
    micro_batches: int = 0  # 0: smallest count with bubble <= bubble_target
    # sequences per step of the run planned for (0: the planner sizes the batch): each plan
    # runs ceil(global_batch / (m * b)) micro-batches per replica, as many in flight as the
    # memory admits, and the simulator profile replays exactly global_batch / b of them
    global_batch: int = 0
    recompute: str = "auto"  # auto | none | full
    solver: str = "milp"  # milp | enumerate
    epsilon: float = 0.02  # stage 2 band around the stage 1 optimum
    time_limit_s: float = 1.0  # per HiGHS solve
    mip_gap: float = 1e-6
    bubble_target: float = 0.1
    search_moves: int = 64  # stage 3: K random moves (0 disables)
    search_radius: int = 2  # stage 3: r, max change of m, M_a and the in-flight cap per move
    profile: str = "analytic"  # auto | analytic | simulator (sim_profile.py); CLI default auto
    order: str = "breadth"  # schedule.order the simulator profile replays (auto: best of all)
    # schedule.exchange_chunks the simulator profile replays (0: auto's pick of 1, 2, 4 or 8)
    exchange_chunks: int = 1
    # schedule.split_backward the simulator profile replays: off | on | auto (both, per plan)
    split_backward: str = "off"
    # stage 4 (sim_profile.grow_micro_batches): with the simulator profile, micro_batches 0
    # and global_batch 0, double the micro-batches while the replay stays above 1 + bubble_target of its bound
    batch_stage: bool = True
    # stage 5 (sim_profile.recompute_first_layers): with the simulator profile and recompute
    # auto, the plan's split with only each group's first layers recomputed in full
    # (the fewest that fit) at caps around the plan's, kept where its replay is faster
    layers_stage: bool = True
    seed: int = 0
    # train.loss_chunk_tokens of the run planned for: the loss head's memory (0: unchunked)
    loss_chunk_tokens: int = LOSS_CHUNK_TOKENS

    def __post_init__(self) -> None:
        if self.recompute not in ("auto", *cm.RECOMPUTE_MODES):
            raise ValueError(
                f"recompute must be auto, {', '.join(cm.RECOMPUTE_MODES)}, got {self.recompute!r}"
            )
        if self.profile not in PROFILES:
            raise ValueError(f"profile must be {', '.join(PROFILES)}, got {self.profile!r}")
        if self.profile == "simulator" and self.roofline_only:
            raise ValueError("--roofline-only plans are scored by the roofline: use --profile auto")
        if self.order not in SCHEDULE_ORDERS:
            raise ValueError(
                f"order must be one of {', '.join(SCHEDULE_ORDERS)}, got {self.order!r}"
            )
        if not 0 <= self.exchange_chunks <= MAX_EXCHANGE_CHUNKS:
            raise ValueError(
                f"exchange_chunks must be 1..{MAX_EXCHANGE_CHUNKS} or 0 (auto), "
                f"got {self.exchange_chunks}"
            )
        if self.split_backward not in SPLIT_BACKWARD:
            raise ValueError(
                f"split_backward must be one of {', '.join(SPLIT_BACKWARD)}, "
                f"got {self.split_backward!r}"
            )
        if self.solver not in ("milp", "enumerate"):
            raise ValueError(f"solver must be milp or enumerate, got {self.solver!r}")
        if min(self.groups, self.micro_batches, self.global_batch, self.search_moves) < 0:
            raise ValueError("groups, micro_batches, global_batch and search_moves must be >= 0")
        if self.global_batch and self.micro_batches:
            raise ValueError(
                "give micro_batches (--micro-batches, per replica) or global_batch "
                "(--global-batch-size), not both"
            )
        if not 0 <= self.epsilon < 1:
            raise ValueError(f"epsilon must be in [0, 1), got {self.epsilon}")
        if self.search_radius < 1 or not 0 < self.bubble_target < 1:
            raise ValueError("search_radius must be >= 1 and bubble_target in (0, 1)")
        check_loss_chunk_tokens(self.loss_chunk_tokens)


def run_replays(exchange_chunks: int, split_backward: str) -> tuple[int, str]:
    """The exchange chunks and split backward the planner replays each plan with for a run
    (`simulate`, `train --plan auto`) given `schedule.exchange_chunks` and
    `schedule.split_backward`. What the run leaves to auto the run itself picks on the plan
    it runs (`simulator.choose`: 1, 2, 4 or 8 chunks, whole or split backwards), so the
    planner ranks plans at one chunk and with split backwards where they may split (room
    for the deferred weight gradients kept), one replay a plan instead of up to eight
    (docs/planner.md "For a run's batch")."""
    return exchange_chunks or 1, "on" if split_backward == "auto" else split_backward
