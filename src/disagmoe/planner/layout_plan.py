"""`disagmoe train --plan auto`: the planner's best layout among those the runtime can run,
with its in-flight cap and recompute mode (`schedule.max_in_flight`, `train.recompute`).

The MILP answers over all integer splits; the disaggregated runtime additionally
needs p | L, n <= E (shards of ceil(E/n) or floor(E/n) experts) and at least one
micro-batch per replica, m <= M. This adapter enumerates exactly the runnable
(p, m, n) for the job's world size and scores each with the planner's stage times
(`Planner.evaluate`, best NIC split for that GPU split) for the job's *fixed* global
batch: m replicas share the M micro-batches, so a group runs ceil(M/m) slots of
v = L/p layers each (the busiest replica's), and the ring adds a fill of 2p - 1 stages:

    step ~ (max(1, 2p/K) * ceil(M/m) * v + 2p - 1) * max(T_attn, T_ffn)

for each recompute mode (none, full) with K, the slots in flight, as many as the
[cluster]'s GPU memory admits by the runtime's memory model in bf16 mixed precision
(`Planner.max_in_flight`: `training.budget.in_flight_cap`'s rule for that layout).

The enumeration is tiny: W is the world size of one job.
"""

from __future__ import annotations

import dataclasses

from ..config import RunConfig
from ..costs import costmodel as cm
from .plan import Plan, Planner, PlanOptions, ring_length


def runnable_layouts(cfg: RunConfig, world_size: int) -> list[tuple[int, int, int]]:
    model, train = cfg.model, cfg.train
    out = []
    for p in range(1, model.num_layers + 1):
        if model.num_layers % p or world_size % p:
            continue
        per_group = world_size // p
        for m in range(1, per_group):
            n = per_group - m
            if n <= model.num_experts and m <= train.num_micro_batches:
                out.append((p, m, n))
    return out


def auto_layout(cfg: RunConfig, world_size: int) -> tuple[RunConfig, Plan]:
    """The run's config with `parallel.groups/attn_workers/expert_workers` from the planner."""
    layouts = runnable_layouts(cfg, world_size)
    if not layouts:
        raise ValueError(
            f"no runnable disaggregated layout for {world_size} workers: need p | "
            f"num_layers ({cfg.model.num_layers}), n <= num_experts ({cfg.model.num_experts}) and "
            f"m <= micro-batches per step ({cfg.train.num_micro_batches})"
        )
    planner = Planner(
        model=cfg.model,
        cluster=cfg.cluster,
        gpus=world_size,
        seq_len=cfg.train.seq_len,
        micro_batch_size=cfg.train.micro_batch_size,
        options=PlanOptions(
            micro_batches=cfg.train.num_micro_batches,
            loss_chunk_tokens=cfg.train.loss_chunk_tokens,
        ),
    )
    best: Plan | None = None
    num_micro = cfg.train.num_micro_batches
    for p, m, _ in layouts:
        nics = planner.problem(p, 1, "none").nics
        slots = -(-num_micro // m)  # the busiest replica's
        for recompute in cm.TIME_RECOMPUTE_MODES:
            in_flight = min(slots, planner.max_in_flight(p, m, recompute))
            if in_flight < 1:
                continue
            for attn_nics in range(1, max(nics, 2)):
                plan = planner.evaluate(
                    groups=p, m=m, attn_nics=attn_nics, in_flight=in_flight, recompute=recompute
                )
                if plan is None:
                    continue
                # K < 2p slots in flight leave the ring's 2p components idle (plan.py's profile)
                slow = max(1.0, ring_length(p) / in_flight)
                step = (slow * slots * plan.virtual_stages + 2 * p - 1) * plan.t_stage_s
                plan = dataclasses.replace(plan, step_time_s=step)
                if best is None or plan.step_time_s < best.step_time_s:
                    best = plan
    if best is None:
        raise ValueError(
            f"the planner finds no feasible layout for {world_size} workers of cluster "
            f"{cfg.cluster.name!r} (memory or NIC constraints); set --groups/--attn-workers/"
            "--expert-workers yourself"
        )
    parallel = dataclasses.replace(
        cfg.parallel,
        groups=best.groups,
        attn_workers=best.attn_gpus_per_group,
        expert_workers=best.ffn_gpus_per_group,
    )
    schedule = dataclasses.replace(cfg.schedule, max_in_flight=best.in_flight)
    train = dataclasses.replace(cfg.train, recompute=best.recompute)
    return dataclasses.replace(cfg, parallel=parallel, schedule=schedule, train=train), best
