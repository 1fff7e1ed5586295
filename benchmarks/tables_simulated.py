"""The tables of `benchmarks/report.py` for simulated and planned results: AF-Pipe's
orders and timelines, the planner's choices, and the cluster-scale comparison.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from report_columns import S3, S4, Col, Getter, Table, ratio


def _whatif_rows(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (setting, order) of schedule_whatif.json's `timeline_s` keys
    ("breadth c4 as is", "breadth c4 +W head/c", ...)."""
    out: list[dict[str, Any]] = []
    for row in payload["rows"]:
        by_order: dict[str, dict[str, float]] = {}
        for key, seconds in row["timeline_s"].items():
            order, chunks, variant = key.split(" ", 2)
            by_order.setdefault(f"{order} {chunks}", {})[variant] = seconds
        for order, variants in by_order.items():
            out.append({"setting": row["setting"], "bound_s": row["bound_s"], "order": order,
                        **variants})  # fmt: skip
    return out


def _over_bound(variant: str) -> Getter:
    return lambda r: f"{r[variant]:.4f} ({r[variant] / r['bound_s']:.3f})"


SIMULATED: dict[str, Table] = {
    "schedule_orders": Table(
        title="AF-Pipe orders, exchange chunks and deferred weight gradients against the bound",
        about="Simulated (fair links, nominal clusters), seconds per step: the six orders "
        "unchunked with whole backwards (`+c`: ordered with the run's costs), the best of "
        "them with 2, 4 and 8 exchange chunks, the best with deferred weight gradients "
        "(`+W`), and what `schedule.order = auto` picks with `exchange_chunks = 0` and "
        "`split_backward = auto`, its bound, the best unchunked whole-backward step over "
        "the bound, and one micro-batch per replica (docs/simulator.md).",
        cols=(
            Col(head="setting", get="setting"),
            Col(
                head="p/m/n",
                get=lambda r: f"{r['groups']}/{r['attn_workers']}/{r['expert_workers']}",
            ),
            Col(head="M", get="num_micro_batches"),
            Col(head="cap", get=lambda r: r.get("max_in_flight", 0)),
            *(
                Col(head=order, get=f"candidate_steps_s.{order}", fmt=S4)
                for order in ("breadth", "depth", "steady", "breadth+c", "depth+c", "steady+c")
            ),
            *(Col(head=f"best c{c}", get=f"best_step_by_chunks_s.{c}", fmt=S4) for c in (2, 4, 8)),
            Col(head="best +W", get="best_split_backward_step_s", fmt=S4),
            Col(head="chosen", get="chosen"),
            Col(head="chunks", get="exchange_chunks"),
            Col(head="step s", get="step_s", fmt=S4),
            Col(head="bound s", get="bound_s", fmt=S4),
            Col(head="step/bound", get="step_over_bound", fmt=S3),
            Col(head="unchunked step/bound", get="unchunked_step_over_bound", fmt=S3),
            Col(head="one slot s", get="one_slot_step_s", fmt=S4),
            Col(head="binding", get="binding"),
        ),
    ),
    "schedule_whatif": Table(
        title="The generator's own timeline of each plan, with and without deferred weight "
        "gradients and a head split by tokens",
        about="Seconds (and over the bound) of the list schedule the generator emits, with "
        "the run's costs and links; `+W`: deferred weight gradients; `head/c`: a what-if, the "
        "LM head split into as many token pieces as exchange chunks (not built).",
        rows=_whatif_rows,
        cols=(
            Col(head="setting", get="setting"),
            Col(head="order", get="order"),
            Col(head="bound s", get="bound_s", fmt=S4),
            Col(head="as is", get=_over_bound("as is")),
            Col(head="head/c", get=_over_bound("head/c")),
            Col(head="+W", get=_over_bound("+W")),
            Col(head="+W head/c", get=_over_bound("+W head/c")),
        ),
    ),
    "schedule_chain": Table(
        title="Where AF-Pipe's step leaves its bound: micro-batches, cap and chunks",
        about="gpt-oss-20b at 8K on 64 nominal H800, p=1, m=n=32, breadth, simulated; the "
        "expert shard F(g0,j0)'s busy share of each tenth of the step.",
        cols=(
            Col(head="micro-batches", get="micro_batches"),
            Col(head="cap", get="max_in_flight"),
            Col(head="chunks", get="exchange_chunks"),
            Col(head="step s", get="step_s", fmt=S3),
            Col(head="bound s", get="bound_s", fmt=S3),
            Col(head="step/bound", get=ratio("step_s", "bound_s"), fmt=S3),
            Col(head="F(g0,j0) busy per tenth", get="busy_by_tenth", fmt="{:.2f}"),
        ),
    ),
    "schedule_chain_plans": Table(
        title="The presets' plans with the LM head as it is and at a quarter (a what-if)",
        about="Each preset's planned batch and cap at 8K on 8 nominal H800 nodes, replayed as "
        "`schedule.order = auto` picks; `head` scales the LM head's seconds.",
        cols=(
            Col(head="model", get="model"),
            Col(head="M", get="micro_batches"),
            Col(head="cap", get="max_in_flight"),
            Col(head="head", get="head_scale"),
            Col(head="step s", get="step_s", fmt=S4),
            Col(head="bound s", get="bound_s", fmt=S4),
            Col(head="step/bound", get=ratio("step_s", "bound_s"), fmt=S3),
            Col(head="order", get="order"),
            Col(head="chunks", get="exchange_chunks"),
        ),
    ),
    "plan_split_vs_seqlen": Table(
        title="The planner's A:F split against sequence length",
        about="The full planner (stages 1-3, memory) and the paper's roofline-only problem, "
        "nominal H800, micro-batch 1 (docs/planner.md).",
        cols=(
            Col(head="model", get="model"),
            Col(head="GPUs", get="gpus"),
            Col(head="seq", get="seq_len"),
            Col(head="fits", get=lambda r: "error" not in r["full"]),
            Col(head="p", get="full.groups"),
            Col(head="A:F", get=lambda r: f"{r['full']['attn_gpus']}:{r['full']['ffn_gpus']}"),
            Col(head="NICs", get=lambda r: f"{r['full']['attn_nics']}:{r['full']['ffn_nics']}"),
            Col(head="binding", get="full.binding"),
            Col(head="recompute", get="full.recompute"),
            Col(
                head="roofline-only A:F",
                get=lambda r: f"{r['paper']['attn_gpus']}:{r['paper']['ffn_gpus']}",
            ),
        ),
    ),
    "plan_solve_times": Table(
        title="Planner solve times",
        about="Stages 1-2 (MILP) per model and cluster size at 8K, with the plan found.",
        cols=(
            Col(head="model", get="model"),
            Col(head="GPUs", get="gpus"),
            Col(head="p", get="groups"),
            Col(head="A:F", get=lambda r: f"{r['attn_gpus']}:{r['ffn_gpus']}"),
            Col(head="NICs", get=lambda r: f"{r['attn_nics']}:{r['ffn_nics']}"),
            Col(head="stage s", get="t_stage_s", fmt="{:.4g}"),
            Col(head="status", get="status"),
            Col(head="solve s", get="solve_s", fmt=S3),
        ),
    ),
    "af_levers": Table(
        title="Where AF-Pipe's step goes: the LM head against a group's attention",
        about="Nominal H800, 8 nodes, 8K, full recompute: per p, the LM head's seconds per "
        "sequence (forward + backward) against a group's L / p layers of attention, and the "
        "compute bound were every GPU equally busy; the JSON's `fill` holds the forward fill "
        "of DeepSeek-MoE's plan with one exchange chunk and whole backwards (docs/paper.md).",
        rows=lambda p: list(p["heads"]),
        cols=(
            Col(head="model", get="model"),
            Col(head="p", get="groups"),
            Col(head="head s", get="head_s", fmt="{:.4f}"),
            Col(head="group attention s", get="group_attn_s", fmt="{:.4f}"),
            Col(head="head / group", get="head_over_group", fmt="{:.2f}"),
            Col(head="balanced bound s", get="balanced_bound_s", fmt="{:.2f}"),
        ),
    ),
    "planner_vs_sweep": Table(
        title="The planner's plan against an exhaustive simulator sweep",
        about="Nominal H800; tokens/s of the planner's plan and of the best swept plan, both "
        "simulated, and the seconds each took (docs/planner.md).",
        cols=(
            Col(head="model", get="model"),
            Col(head="seq", get="seq_len"),
            Col(head="GPUs", get="gpus"),
            Col(head="planner", get="planner_plan"),
            Col(head="planner tokens/s", get="planner_tokens_s", fmt="{:.0f}"),
            Col(head="best swept", get="best_plan"),
            Col(head="best tokens/s", get="best_tokens_s", fmt="{:.0f}"),
            Col(head="gap", get="gap_pct", fmt="{:+.1f}%"),
            Col(head="plan s", get="plan_s", fmt="{:.1f}"),
            Col(head="sweep s", get="sweep_s", fmt="{:.1f}"),
            Col(head="points", get="swept_points"),
            Col(head="infeasible", get="error"),
        ),
    ),
    "uneven_splits": Table(
        title="The planner's split (uneven where it picks one) against the splits with n | E",
        about="Simulated on nominal H800 at 8K; `fits`: the planner's memory model admits "
        'the split (docs/design-notes.md, "Uneven splits").',
        cols=(
            Col(head="model", get="model"),
            Col(head="GPUs", get="gpus"),
            Col(
                head="split", get=lambda r: f"{r['kind']} {r['attn_workers']}:{r['expert_workers']}"
            ),
            Col(head="experts/shard", get="experts_per_shard"),
            Col(head="slots/replica", get="slots_per_replica"),
            Col(head="fits", get="fits"),
            Col(head="in flight", get="in_flight"),
            Col(head="step ms", get=lambda r: 1e3 * r["step_time_s"], fmt="{:.1f}"),
            Col(head="k tokens/s", get=lambda r: r["tokens_per_s"] / 1e3, fmt="{:.1f}"),
        ),
    ),
    "scale_table": Table(
        title="AF-Pipe against the best EP runtime at cluster scale (simulated)",
        about="Nominal H800 nodes, each side as `disagmoe simulate` runs it by default (the "
        "planner's plan; the fastest EP layout that fits), one global batch of 8 sequences "
        "per GPU; memory per GPU by the runtime's model, of 80 GiB (docs/paper.md).",
        cols=(
            Col(head="model", get="model"),
            Col(head="nodes", get="nodes"),
            Col(head="seq", get="seq_len"),
            Col(head="AF-Pipe tokens/s", get="disagg.tokens_per_s", fmt="{:.0f}"),
            Col(head="AF step/bound", get="disagg.step_over_bound", fmt="{:.2f}"),
            Col(head="AF GiB", get="disagg.memory_gib", fmt="{:.1f}"),
            Col(head="AF exposed s", get="disagg.exposed_comm_s", fmt="{:.2f}"),
            Col(head="AF-Pipe plan", get="disagg.layout"),
            Col(head="best EP", get="best_ep.runtime"),
            Col(head="EP tokens/s", get="best_ep.tokens_per_s", fmt="{:.0f}"),
            Col(head="EP step/bound", get="best_ep.step_over_bound", fmt="{:.2f}"),
            Col(head="EP GiB", get="best_ep.memory_gib", fmt="{:.1f}"),
            Col(head="EP exposed s", get="best_ep.exposed_comm_s", fmt="{:.2f}"),
            Col(head="EP layout", get="best_ep.layout"),
            Col(head="AF / EP", get="vs_best_ep", fmt="{:.2f}"),
            Col(head="EP bound / AF bound", get="bound_ratio", fmt="{:.2f}"),
            Col(head="verdict", get="verdict"),
        ),
    ),
    "scale_groups": Table(
        title="AF-Pipe against its virtual stages (simulated)",
        about="Nominal H800 nodes at 8K: AF-Pipe at every group count p (v = L / p virtual "
        "stages), the planner's split for each p, in flight and recompute held to memory.",
        cols=(
            Col(head="model", get="model"),
            Col(head="nodes", get="nodes"),
            Col(head="p", get="groups"),
            Col(head="v", get="virtual_stages"),
            Col(head="tokens/s", get="tokens_per_s", fmt="{:.0f}"),
            Col(head="step/bound", get="step_over_bound", fmt="{:.2f}"),
            Col(head="GiB", get="memory_gib", fmt="{:.1f}"),
            Col(head="plan", get="layout"),
            Col(head="error", get="error"),
        ),
    ),
    "paper_figures": Table(
        title="The paper's Figures 10, 11 and 14 beside ours (simulated)",
        about="Derived from scale_table.json and scale_groups.json by "
        "benchmarks/paper_figures.py; the verdict rules are in its docstring (docs/paper.md).",
        cols=(
            Col(head="paper", get="figure"),
            Col(head="its claim", get="claim"),
            Col(head="ours (simulated, nominal H800, runtime memory model)", get="ours"),
            Col(head="verdict", get="verdict"),
        ),
    ),
}
SIMULATED["schedule_chain_head025"] = dataclasses.replace(
    SIMULATED["schedule_chain"],
    title="The same with the LM head priced at a quarter (a what-if)",
    about="`schedule_chain` with `--head-scale 0.25`: the analytic costs with the LM head and "
    "loss at a quarter of their seconds, to see how much of the gap the head's block holds "
    "(not a mechanism).",
)
