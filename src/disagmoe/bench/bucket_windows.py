"""When a rank's gradient buckets can start, from its trace: which buckets only its final
backward completes (`last_buckets`), every bucket of a stage (`stage_buckets`), and the
earliest that stage's last backward can start on the rank's own work
(`final_backward_start`). `bench.bound` builds its fill bound on them."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ..trace import (
    BUCKET_EVENT,
    COMPUTE_LANES,
    event_spans,
    parse_event_name,
    subtract_intervals,
    total_length,
)

Event = dict[str, Any]


def bucket_key(name: str) -> tuple[int, float] | None:
    """(stage, key) of a gradient bucket's event, "allreduce [s<stage>] <l<layer> | embed |
    head> [experts]" (`baselines.grad_buckets`, `runtime.grad_sync`): stage -1 where the
    name has none, key -1 for the embedding and infinity for the head; None for any other
    event."""
    words = name.split()
    if len(words) < 2 or words[0] != BUCKET_EVENT:
        return None
    stage = -1
    if len(words) > 2 and words[1][:1] == "s" and words[1][1:].isdigit():
        stage, words = int(words[1][1:]), words[1:]
    key = words[1]
    if key in ("embed", "head"):
        return stage, -1.0 if key == "embed" else math.inf
    return (stage, float(key[1:])) if key[:1] == "l" and key[1:].isdigit() else None


def last_buckets(mine: list[Event]) -> tuple[list[Event], int]:
    """The gradient buckets of one rank's step that only its final backward completes,
    and the stage that backward is of (-1: no stages).

    That is the rank's lowest stage (a micro-batch's backward leaves it last): its first
    layer's bucket and the embedding's, with their expert shards'. No bucket is final before
    every micro-batch's backward has left its layer, and these layers are the last any
    backward of the rank leaves, so no order of its computations starts their all-reduce
    before every forward and backward of the rank (weight gradients of its other stages
    aside) has run."""
    keyed = [
        (k, e) for e in mine if e["cat"] == "sync" and (k := bucket_key(e["name"])) is not None
    ]
    if not keyed:
        return [], -1
    low = min(stage for (stage, _), _ in keyed)
    first = min(key for (stage, key), _ in keyed if stage == low and key >= 0)
    return [e for (stage, key), e in keyed if stage == low and key in (-1.0, first)], low


def stage_buckets(mine: list[Event], stage: int) -> list[Event]:
    """Every gradient bucket of one rank's step that names `stage` (`bucket_key`)."""
    return [
        e
        for e in mine
        if e["cat"] == "sync" and (k := bucket_key(e["name"])) is not None and k[0] == stage
    ]


def before_last_buckets(e: Event, stage: int) -> bool:
    """Whether a computation must end before `last_buckets` of its rank start: every one
    but a weight gradient of another stage (W) or on AF-Pipe's background "wgt" lane."""
    if e["cat"] == "wgt":
        return False
    if e["name"].startswith("W ") and "stage" in e["args"]:
        return int(e["args"]["stage"]) == stage
    return True


def compute_s(mine: list[Event], keep: Callable[[Event], bool] = lambda e: True) -> float:
    """Seconds of a rank's computations (those `keep` takes) less its blocking waits."""
    spans = event_spans(e for e in mine if e["cat"] in COMPUTE_LANES and keep(e))
    waits = event_spans(e for e in mine if e["args"].get("blocking"))
    return total_length(subtract_intervals(spans, waits)) / 1e6


def final_backward_start(mine: list[Event], stage: int) -> float:
    """The earliest a rank's last backward of `stage` (its lowest) can start, from its own
    work: after every computation of the rank but that backward and the weight gradients
    (W). Each micro-batch's backward of its lowest stage is the last of the rank's work on
    that micro-batch, and the runtimes run no two backwards at once on a rank, so when the
    last one starts every forward and every other backward has run. That backward is at
    most the rank's longest backward of the stage that ran alone (its span less its
    blocking waits), or where none did, the longest span less waits (an F&B pair's half
    also holds the other half's turns: more is subtracted, the bound stays one)."""

    def not_weight(e: Event) -> bool:
        return e["cat"] != "wgt" and not e["name"].startswith("W ")

    backwards = [
        e
        for e in mine
        if e["cat"] == "bwd"
        and int(e["args"].get("stage", -1)) == stage
        and parse_event_name(e["name"]).what in ("B", "I")
    ]
    waits = [e for e in mine if e["args"].get("blocking")]
    computes = [e for e in mine if e["cat"] in ("fwd", "bwd", "wgt")]

    def alone(e: Event) -> bool:
        t0, t1 = e["ts"], e["ts"] + e["dur"]
        return not any(f is not e and f["ts"] < t1 and t0 < f["ts"] + f["dur"] for f in computes)

    solo = [e for e in backwards if alone(e)] or backwards
    longest = max((compute_s([e, *waits]) for e in solo), default=0.0)
    return max(compute_s(mine, not_weight) - longest, 0.0)


__all__ = [
    "before_last_buckets",
    "bucket_key",
    "compute_s",
    "final_backward_start",
    "last_buckets",
    "stage_buckets",
]
