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
(`schedule.max_in_flight`), its recompute mode (`train.recompute`) and, where the plan
recomputes only each group's first K layers (stage 5, `sim_profile.recompute_first_layers`),
K (`train.recompute_layers`). Where the plan recomputes in full and the run asks for only
its first K layers per group itself, the cap is lowered to what K admits by the same
memory model.
"""

from __future__ import annotations

import dataclasses

from ..config import RunConfig
from . import plan_for
from .options import PlanOptions, run_replays
from .plan import Plan, Planner


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
    # the plan's mode; a user's recompute_layers stands only where it picks full, at the
    # slots in flight that those layers leave room for
    layers = train.recompute_layers if plan.recompute == "full" else 0
    if not layers or layers == plan.recompute_layers:
        layers, cap = plan.recompute_layers, plan.in_flight
    else:
        cap = _cap_with_layers(cfg, world_size, plan, layers)
    schedule = dataclasses.replace(sched, max_in_flight=cap)
    train = dataclasses.replace(train, recompute=plan.recompute, recompute_layers=layers)
    return dataclasses.replace(cfg, parallel=parallel, schedule=schedule, train=train), plan


def _cap_with_layers(cfg: RunConfig, world_size: int, plan: Plan, layers: int) -> int:
    """The plan's in-flight cap lowered to what its memory admits with full recompute on
    only the first `layers` layers of each group (`Planner.max_in_flight`)."""
    train = cfg.train
    planner = Planner(
        model=cfg.model, cluster=cfg.cluster, gpus=world_size, seq_len=train.seq_len,
        micro_batch_size=train.micro_batch_size,
        options=PlanOptions(loss_chunk_tokens=train.loss_chunk_tokens),
    )  # fmt: skip
    fits = planner.max_in_flight(plan.groups, plan.attn_gpus_per_group, "full", layers)
    if fits < 1:
        raise ValueError(
            f"the plan p={plan.groups}, m={plan.attn_gpus_per_group}, "
            f"n={plan.ffn_gpus_per_group} does not fit cluster {cfg.cluster.name!r}'s "
            f"{cfg.cluster.gpu_mem_gib:g} GiB with full recompute on {layers} layer(s) per "
            f"group; use more --recompute-layers (0: every layer)"
        )
    return min(plan.in_flight, fits)
