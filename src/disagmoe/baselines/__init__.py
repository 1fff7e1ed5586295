"""Expert-parallel baselines measured in the same runtime as DisagMoE (docs/design.md §3).

Every worker holds attention (data parallel) and a shard of experts (expert
parallel, all-to-all dispatch/combine); layers are split into pipeline stages
run by PyTorch's `torch.distributed.pipelining` runtime, in the orders of
`schedule.pipelines` (pipeline sends and receives posted ahead of need, sends waited for
at the step's end):

* `ep-1f1b`        — Megatron-LM 1F1B (`fb_overlap.ScheduleOrdered`),
* `ep-combined`    — Megatron-LM combined 1F1B / DeepSeek-V3 two-micro-batch overlap: 1F1B
                     whose steady-state forward and backward run at once, each one's
                     all-to-alls under the other's compute (`baselines.fb_overlap`), and
                     from two `parallel.overlap_chunks` chunked expert compute as ep-overlap's,
* `ep-interleaved` — Megatron-LM interleaved 1F1B (`ScheduleInterleaved1F1B`'s order, with
                     `parallel.pipeline_warmup`),
* `ep-dualpipev`   — DeepSeek's DualPipeV (`ScheduleDualPipeV`, its F&B pairs at once; chunked
                     expert compute as ep-combined's),
* `ep-overlap`     — Tutel/Comet-style chunked expert compute overlapped with
                     async all-to-all, under the same 1F1B.

See docs/baselines.md for the supported layouts.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config import EP_RUNTIMES, RunConfig
from .trainer import EPTrainer, run_ep

TRAINERS: dict[str, type[EPTrainer]] = dict.fromkeys(EP_RUNTIMES, EPTrainer)
RUNNERS: dict[str, Callable[[RunConfig, Path], list[dict[str, Any]]]] = dict.fromkeys(
    EP_RUNTIMES, run_ep
)

__all__ = ["RUNNERS", "TRAINERS", "EPTrainer", "run_ep"]
