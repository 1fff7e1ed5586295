"""Pipeline orders of the expert-parallel baselines, defined once as pure functions.

The `ep-*` runtimes execute these orders on PyTorch's `torch.distributed.pipelining`
runtime (`baselines.fb_overlap.ScheduleOrdered`: 1F1B, combined and interleaved 1F1B;
PyTorch's `ScheduleDualPipeV`); this module states the order each of them runs, with no
process group or stage object, for the runtimes, the baselines' IR export
(`schedule.baselines`) and the simulator (`simulator.simulate_ep`).
`tests/unit/test_baseline_schedules.py` pins every order without a warm-up to PyTorch's
(its runtime loop for 1F1B, its `pipeline_order` for the others).

An order is a list per pipeline rank of steps: an `Action` (F: forward, B: full
backward, I: backward for inputs, W: backward for weights, of one stage and
micro-batch) or an `Overlap` (DualPipeV's forward of one micro-batch paired with
the backward of another; PyTorch's `OVERLAP_F_B`).

Published bubbles, per rank, with uniform chunk costs (checked by the simulator's tests):

* 1F1B, p ranks, M micro-batches: step `(M + p - 1)(F + B)`;
* combined 1F1B: the same order with the steady state's F and B paired (`Overlap`), so
  a pair costs about max(F, B) plus what of their communication the other hides;
* interleaved 1F1B, v chunks per rank (F, B per chunk): step
  `v*M*(F + B) + (p - 1)(F + B)` — the bubble shrinks v-fold against the whole
  per-rank stage time `v(F + B)`;
* DualPipeV, p ranks (2p stages), M micro-batches: bubble `(p - 1)(F&B + B - 3W)`
  (the DualPipe repository's table writes it `(PP/2 - 1)(F&B + B - 3W)` with PP =
  2p stages), F&B being an overlapped forward+backward pair.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from ..config import EP_RUNTIMES, WARMUP_RUNTIMES

# runtimes whose orders pair a forward with a backward (`Overlap`) and run the two at once
FB_OVERLAP_RUNTIMES = ("ep-dualpipev", "ep-combined")


@dataclass(frozen=True, slots=True)
class Action:
    kind: str  # "F", "B", "I" or "W"
    stage: int
    mb: int


@dataclass(frozen=True, slots=True)
class Overlap:
    forward: Action
    backward: Action


Step = Action | Overlap


def actions(step: Step) -> list[Action]:
    """The actions of a step in execution order (an overlapped pair: forward first)."""
    return [step.forward, step.backward] if isinstance(step, Overlap) else [step]


def in_flight_walk(steps: Sequence[Step]) -> list[dict[int, int]]:
    """Micro-batches each stage of one rank holds for backward, at every point of its order
    where a forward has just run (the points where what is held can grow): per stage, the
    forwards whose backward has not finished. A full backward (B) releases its micro-batch;
    a split one releases it at its W, not its I (PyTorch's `stage_backward_input` keeps the
    graph, and with it the saved activations, for the weight gradients). An overlapped
    pair's forward runs while its backward's micro-batch is still held, so the point after
    it counts both."""
    held: dict[int, int] = defaultdict(int)
    points: list[dict[int, int]] = []
    for step in steps:
        for act in actions(step):
            if act.kind == "F":
                held[act.stage] += 1
                points.append(dict(held))
            elif act.kind in ("B", "W"):
                held[act.stage] -= 1
                assert held[act.stage] >= 0, f"{act} before its forward"
    assert not any(held.values()), f"forwards without a backward: {dict(held)}"
    return points


def max_in_flight(steps: Sequence[Step]) -> int:
    """The most micro-batches one rank holds for backward at once, all its stages together
    (`in_flight_walk`)."""
    return max((sum(point.values()) for point in in_flight_walk(steps)), default=0)


def pipeline_order(
    runtime: str, pp: int, num_mb: int, virtual_stages: int, warmup: int = 0
) -> list[list[Step]]:
    """Per-rank steps of an EP runtime with `num_mb` micro-batches per pipeline; `warmup`
    (`parallel.pipeline_warmup`): forwards each rank runs ahead of 1F1B's own warm-up
    (`WARMUP_RUNTIMES` only)."""
    if warmup and runtime not in WARMUP_RUNTIMES:
        raise ValueError(
            f"parallel.pipeline_warmup applies to {', '.join(WARMUP_RUNTIMES)}, not {runtime}"
        )
    if runtime in ("ep-1f1b", "ep-overlap"):
        return one_f_one_b(pp, num_mb, warmup)
    if runtime == "ep-combined":
        return combined_1f1b(pp, num_mb, warmup)
    if runtime == "ep-interleaved":
        return interleaved_1f1b(pp, num_mb, virtual_stages, warmup)
    if runtime == "ep-dualpipev":
        return dualpipev(pp, num_mb)
    raise ValueError(f"unknown EP runtime {runtime!r}; choose one of {', '.join(EP_RUNTIMES)}")


def one_f_one_b(num_ranks: int, num_mb: int, extra: int = 0) -> list[list[Step]]:
    """1F1B (the order of PyTorch's Schedule1F1B loop): rank r warms up with p-1-r
    forwards, alternates F/B, drains. With `extra` forwards more in each rank's warm-up, a
    rank holds up to `extra` micro-batches more and a micro-batch's round trip through
    the pipeline (its hand-overs included) can take that much longer before a stage
    waits for it; with `extra` >= the micro-batch count every forward runs first (GPipe's
    order)."""
    orders: list[list[Step]] = []
    for rank in range(num_ranks):
        warmup = min(num_ranks - 1 - rank + extra, num_mb)
        steps: list[Step] = [Action("F", rank, i) for i in range(warmup)]
        for i in range(num_mb - warmup):
            steps += [Action("F", rank, warmup + i), Action("B", rank, i)]
        steps += [Action("B", rank, i) for i in range(num_mb - warmup, num_mb)]
        orders.append(steps)
    return orders


def combined_1f1b(num_ranks: int, num_mb: int, extra: int = 0) -> list[list[Step]]:
    """1F1B whose steady state runs a forward and a backward at once (Megatron-LM's combined
    1F1B, `--overlap-moe-expert-parallel-comm`; DeepSeek-V3's two-micro-batch overlap):
    rank r warms up with one forward more than 1F1B (p - r), then pairs the forward of
    micro-batch `warmup + i` with the backward of micro-batch i (`Overlap`), then drains.
    Each pair's all-to-alls hide under the other half's compute; one more micro-batch is
    in flight than under 1F1B. `extra`: forwards more in the warm-up (`one_f_one_b`)."""
    orders: list[list[Step]] = []
    for rank in range(num_ranks):
        warmup = min(num_ranks - rank + extra, num_mb)
        steps: list[Step] = [Action("F", rank, i) for i in range(warmup)]
        steps += [
            Overlap(Action("F", rank, warmup + i), Action("B", rank, i))
            for i in range(num_mb - warmup)
        ]
        steps += [Action("B", rank, i) for i in range(num_mb - warmup, num_mb)]
        orders.append(steps)
    return orders


def interleaved_1f1b(num_ranks: int, num_mb: int, chunks: int, extra: int = 0) -> list[list[Step]]:
    """Megatron's interleaved 1F1B (torch's ScheduleInterleaved1F1B): stage `c*p + r` on rank r.

    With `extra` forwards more in each rank's warm-up (stage forwards, in the same order) a
    rank holds up to `extra` stage forwards' micro-batches more before its first backward,
    as `one_f_one_b`'s; with `extra` >= the micro-batch count every forward runs first
    (in this order's rounds, not stage by stage as PyTorch's `ScheduleLoopedBFS`). The
    forwards keep their order and the backwards theirs; only where they meet moves."""
    rounds = max(1, num_mb // num_ranks)
    if num_mb % rounds:
        raise ValueError(
            f"interleaved 1F1B needs the micro-batches per pipeline ({num_mb}) to be a multiple "
            f"of {rounds} (micro-batches // pipeline stages)"
        )
    per_round = num_mb // rounds
    total = chunks * num_mb
    orders: list[list[Step]] = []
    for rank in range(num_ranks):
        ahead = total if extra >= num_mb else extra
        warmup = min((chunks - 1) * per_round + 2 * (num_ranks - 1 - rank) + ahead, total)
        fwd_count: dict[int, int] = defaultdict(int)
        bwd_count: dict[int, int] = defaultdict(int)

        def fwd_stage(op: int, rank: int = rank) -> int:
            return ((op // per_round) % chunks) * num_ranks + rank

        def bwd_stage(op: int, rank: int = rank, warmup: int = warmup) -> int:
            return (chunks - 1 - ((op - warmup) // per_round) % chunks) * num_ranks + rank

        steps: list[Step] = []
        for op in range(total + warmup):
            if op < total:
                st = fwd_stage(op)
                steps.append(Action("F", st, fwd_count[st]))
                fwd_count[st] += 1
            if op >= warmup:
                st = bwd_stage(op)
                steps.append(Action("B", st, bwd_count[st]))
                bwd_count[st] += 1
        orders.append(steps)
    return orders


def dualpipev(num_ranks: int, num_mb: int) -> list[list[Step]]:
    """DualPipeV (DeepSeek's DualPipe "cut in half"), as torch's ScheduleDualPipeV orders it."""
    if num_mb < 2 * num_ranks:
        raise ValueError(
            f"DualPipeV needs at least 2*pp = {2 * num_ranks} micro-batches per pipeline, "
            f"got {num_mb}"
        )
    return [_dualpipev_rank(num_ranks, num_mb, r) for r in range(num_ranks)]


def _dualpipev_rank(p: int, num_mb: int, rank: int) -> list[Step]:
    s0, s1 = rank, 2 * p - 1 - rank  # the V: rank r holds stages r and 2p-1-r
    count: dict[tuple[int, str], int] = defaultdict(int)
    weights: list[tuple[int, int]] = []
    steps: list[Step] = []

    def take(stage: int, kind: str) -> Action:
        key = (stage, "I" if kind in ("B", "I") else kind)
        act = Action(kind, stage, count[key])
        count[key] += 1
        if kind == "I":
            weights.append((stage, act.mb))
        return act

    def add(stage: int, kind: str) -> None:
        steps.append(take(stage, kind))

    def overlap(f_stage: int, b_stage: int) -> None:
        steps.append(Overlap(take(f_stage, "F"), take(b_stage, "B")))

    def weight() -> None:
        if weights:
            stage, mb = weights.pop(0)
            steps.append(Action("W", stage, mb))

    for _ in range((p - rank - 1) * 2):  # 1: F0
        add(s0, "F")
    for _ in range(rank + 1):  # 2: F0 F1
        add(s0, "F")
        add(s1, "F")
    for _ in range(p - rank - 1):  # 3: I1 W1 F1
        add(s1, "I")
        weight()
        add(s1, "F")
    for i in range(num_mb - 2 * p + rank + 1):  # 4: F0B1 - F1B0
        if i == 0 and rank == p - 1:
            add(s0, "F")
            add(s1, "B")
        else:
            overlap(s0, s1)
        overlap(s1, s0)
    for _ in range(p - rank - 1):  # 5: B1 - F1B0
        add(s1, "B")
        overlap(s1, s0)
    zero_bubble = False
    for i in range(rank + 1):  # 6: B1 B0, second half zero-bubble
        if i == (rank + 1) // 2 and rank % 2 == 1:
            zero_bubble = True
        add(s1, "I" if zero_bubble else "B")
        if i == (rank + 1) // 2 and rank % 2 == 0:
            zero_bubble = True
        add(s0, "I" if zero_bubble else "B")
    for _ in range(p - rank - 1):  # 7: W0 B0
        weight()
        add(s0, "I" if zero_bubble else "B")
    for _ in range(rank + 1):  # 8: W0
        weight()
    return steps
