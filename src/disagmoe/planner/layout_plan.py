"""`disagmoe train --plan auto`: the plan `disagmoe plan` makes for the run, as its config.

The run's world size, model, `[cluster]`, sequence length and micro-batch size go to the
planner (`plan_for`: stages 1-2's MILP over each p and recompute mode, stage 3's search
scored by the simulator) with the run's global batch (`PlanOptions.global_batch`): each
plan shares the batch's micro-batches among its m replicas, the MILP keeps m <= M (a
replica without a micro-batch would idle), every plan holds as many slots in flight as
the `[cluster]`'s GPU memory admits by the runtime's memory model in bf16 mixed precision
(`Planner.max_in_flight`), and the simulator replays the run's own AF-Pipe order,
exchange chunks and split backward (`schedule.*`; what the run leaves to auto, the run
picks on the plan: `options.run_replays`). Every plan is runnable: p | L,
m + n = W / p, n <= E.

The run gets the plan's p, m, n (`parallel.*`), its in-flight cap
(`schedule.max_in_flight`) and its recompute mode (`train.recompute`).
"""

from __future__ import annotations

import dataclasses

from ..config import RunConfig
from . import plan_for
from .options import run_replays
from .plan import Plan


def auto_layout(cfg: RunConfig, world_size: int) -> tuple[RunConfig, Plan]:
    """The run's config with `parallel.groups/attn_workers/expert_workers`, the in-flight
    cap and recompute from the planner's plan for `world_size` workers and the run's batch."""
    train, sched = cfg.train, cfg.schedule
    chunks, split = run_replays(sched.exchange_chunks, sched.split_backward)
    try:
        plan = plan_for(
            cfg.model,
            cfg.cluster,
            gpus=world_size,
            seq_len=train.seq_len,
            micro_batch_size=train.micro_batch_size,
            global_batch=train.global_batch_size,
            loss_chunk_tokens=train.loss_chunk_tokens,
            profile="auto",
            order=sched.order,
            exchange_chunks=chunks,
            split_backward=split,
        )
    except ValueError as err:
        raise ValueError(
            f"no disaggregated layout for {world_size} workers of cluster "
            f"{cfg.cluster.name!r}: {err}; set --groups/--attn-workers/--expert-workers yourself"
        ) from None
    parallel = dataclasses.replace(
        cfg.parallel,
        groups=plan.groups,
        attn_workers=plan.attn_gpus_per_group,
        expert_workers=plan.ffn_gpus_per_group,
    )
    schedule = dataclasses.replace(sched, max_in_flight=plan.in_flight)
    # the plan's mode; a user's recompute_layers stands only where it picks full
    layers = train.recompute_layers if plan.recompute == "full" else 0
    train = dataclasses.replace(train, recompute=plan.recompute, recompute_layers=layers)
    return dataclasses.replace(cfg, parallel=parallel, schedule=schedule, train=train), plan
