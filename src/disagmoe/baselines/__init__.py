"""Expert-parallel baselines measured in the same runtime as DisagMoE (DESIGN.md §3).

Every worker holds attention (data parallel) and a shard of experts (expert
parallel, all-to-all dispatch/combine); layers are split into pipeline stages
run by PyTorch's `torch.distributed.pipelining` schedules:

* `ep-1f1b`        — Megatron-LM 1F1B (`Schedule1F1B`),
* `ep-interleaved` — Megatron-LM interleaved 1F1B (`ScheduleInterleaved1F1B`),
* `ep-dualpipev`   — DeepSeek's DualPipeV (`ScheduleDualPipeV`),
* `ep-overlap`     — Tutel/Comet-style chunked expert compute overlapped with
                     async all-to-all, under 1F1B.

See docs/baselines.md for the supported layouts.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config import RunConfig
from ..schedule.pipelines import EP_RUNTIMES as RUNTIMES
from .trainer import EPTrainer, run_ep

TRAINERS: dict[str, type[EPTrainer]] = dict.fromkeys(RUNTIMES, EPTrainer)
RUNNERS: dict[str, Callable[[RunConfig, Path], list[dict[str, Any]]]] = dict.fromkeys(
    RUNTIMES, run_ep
)

__all__ = ["RUNNERS", "RUNTIMES", "TRAINERS", "EPTrainer", "run_ep"]
