"""What each results file's table shows, for `benchmarks/report.py`: a title, a line on
what the file measures, and its columns (a header, how to get the value from a row, its
format). A `disagmoe bench` report's table is `bench_table.table`'s; a file with no entry
here gets every scalar field of its rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import bench_table

Getter = Callable[[dict[str, Any]], Any]


@dataclass(frozen=True, kw_only=True, slots=True)
class Col:
    """One column: its header, how to get the value from a row, and its format."""

    head: str
    get: str | Getter
    fmt: str = "{}"

    def cell(self, row: dict[str, Any]) -> str:
        try:
            value = self.get(row) if callable(self.get) else _path(row, self.get)
        except KeyError:  # a row without the field (an infeasible plan)
            value = None
        if value is None:
            return "-"
        if isinstance(value, bool):
            return "yes" if value else "no"
        if isinstance(value, list | tuple):
            return " ".join(self.fmt.format(v) for v in value)
        return self.fmt.format(value)


@dataclass(frozen=True, kw_only=True, slots=True)
class Table:
    """What one results file shows: a title, a line on what it measures, its columns."""

    title: str
    about: str
    cols: tuple[Col, ...] = ()
    rows: Callable[[Any], list[dict[str, Any]]] = field(default=lambda p: _rows(p))


def _path(row: dict[str, Any], key: str) -> Any:
    value: Any = row
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _rows(payload: Any) -> list[dict[str, Any]]:
    return list(payload if isinstance(payload, list) else payload.get("rows", []))


def _ratio(num: str, den: str) -> Getter:
    return lambda r: r[num] / r[den]


def _memory_rows(payload: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"config": name, **m} for name, m in payload["memory_mib"].items()]


def _both(side: str, measured: str, predicted: str) -> Getter:
    return lambda r: f"{r[side][measured]:.2f} / {r[side][predicted]:.2f}"


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


S3, S4, PCT = "{:.3f}", "{:.4f}", "{:.0%}"
TABLES: dict[str, Table] = {
    "exchange_overhead": Table(
        title="What a message costs: the runtime's exchange against raw gloo",
        about="Per-message time of the executor's message path, raw gloo isend/irecv and "
        "the message protocol alone, two local ranks; medians over the runs "
        '(docs/design-notes.md, "What a message costs").',
        rows=lambda p: p["over_runs"],
        cols=(
            Col(head="bytes", get="bytes"),
            Col(head="runtime / gloo (median)", get="ratio_median"),
            Col(head="min", get="ratio_min"),
            Col(head="max", get="ratio_max"),
            Col(head="protocol / gloo", get="protocol_ratio_median"),
            Col(head="runtime / protocol", get="runtime_over_protocol_median"),
            Col(head="CPU runtime / gloo", get="cpu_ratio_median"),
        ),
    ),
    "gloo_rendezvous": Table(
        title="When a gloo send moves its bytes",
        about="A large gloo send against a receive posted after a delay: the send completes "
        "only once the receive is posted.",
        cols=(
            Col(head="receiver delay s", get="delay_s"),
            Col(head="send wait ms", get="send_wait_ms", fmt="{:.1f}"),
            Col(head="receive after posting ms", get="recv_after_post_ms", fmt="{:.1f}"),
        ),
    ),
    "tbf_goodput": Table(
        title="TCP goodput through the emulated NICs",
        about="Goodput per sending NIC over the tbf rate of the bench's token buckets, per "
        "traffic pattern, and the packets they dropped.",
        cols=(
            Col(head="pattern", get="pattern"),
            Col(head="flows", get="flows"),
            Col(head="goodput / rate", get="goodput_ratio"),
            Col(head="drops", get="drops"),
        ),
    ),
    "memory_model": Table(
        title="Activation and state memory per rank: measured against the memory model",
        about="`disagmoe train` runs of a few steps per configuration; the largest rank of "
        'each role, MiB, measured / predicted (docs/design-notes.md, "Memory").',
        rows=_memory_rows,
        cols=(
            Col(head="config", get="config"),
            Col(head="cap", get=lambda r: f"{r['cap']['in_flight']}/{r['cap']['slots']}"),
            Col(head="A act", get=_both("A", "act_peak", "act_pred")),
            Col(head="A states", get=_both("A", "states", "states_pred")),
            Col(head="F act", get=_both("F", "act_peak", "act_pred")),
            Col(head="F states", get=_both("F", "states", "states_pred")),
        ),
    ),
    "rank_memory": Table(
        title="Host memory of one rank",
        about="Parameter bytes and peak RSS of a fresh process that builds one rank "
        "(qwen3-30b-a3b shapes, 2 of 48 layers, float32), and its parameters at 48 layers.",
        cols=(
            Col(head="rank", get="rank"),
            Col(head="param GB", get=lambda r: r["param_bytes"] / 1e9, fmt="{:.2f}"),
            Col(head="peak RSS GB", get=lambda r: r["peak_rss_bytes"] / 1e9, fmt="{:.2f}"),
            Col(head="build s", get="build_s", fmt="{:.2f}"),
            Col(
                head="param GB at 48 layers",
                get=lambda r: r.get("param_bytes_48_layers", 0) / 1e9 or None,
                fmt="{:.2f}",
            ),
        ),
    ),
    "recompute": Table(
        title="Activation recompute: throughput of the default run per mode",
        about="`disagmoe train` (the default run) per `train.recompute` mode; median step "
        "over the rounds after the warm-up steps.",
        cols=(
            Col(head="mode", get="mode"),
            Col(head="s/step", get="step_s", fmt=S4),
            Col(head="tokens/s", get="tokens_per_s", fmt="{:.0f}"),
            Col(head="vs none", get="ratio", fmt=S3),
        ),
    ),
    "gc_pauses": Table(
        title="Garbage collection: automatic against every N steps (default run)",
        about="`disagmoe train` with Python's automatic collector (`gc_every` 0) and with "
        "collections every N steps on every rank; medians over the rounds.",
        cols=(
            Col(head="gc_every", get="gc_every"),
            Col(head="step median s", get="step_median_s", fmt=S3),
            Col(head="step max s", get="step_max_s", fmt=S3),
            Col(head="wall per step s", get="wall_per_step_s", fmt=S3),
            Col(head="gc total s", get="gc_total_s", fmt=S3),
            Col(head="gc max s", get="gc_max_s", fmt=S3),
            Col(head="wall vs automatic", get="wall_ratio", fmt=S3),
        ),
    ),
    "link_faults": Table(
        title="A link that dies or stalls under a running step",
        about="Two emulated nodes of two ranks; per run the exit codes, when the first "
        "rank reported, when the job ended, and whether a restarted run's losses equal the "
        "undisturbed run's; `restart` once per try and per delay of the link's return after "
        "the reports, with when training resumed, each agent's last restart count and its "
        "restarts for a rejoining node (seconds after the fault; docs/operations.md).",
        cols=(
            Col(head="scenario", get="scenario"),
            Col(head="link back s", get="link_back_s", fmt="{:g}"),
            Col(head="exit codes", get="exit_codes"),
            Col(head="fault at step", get="fault_at_step"),
            Col(head="detected s", get="detected_s"),
            Col(head="resumed s", get="resumed_s"),
            Col(head="ended s", get="ended_s"),
            Col(head="reports", get=lambda r: len(r["reports"])),
            Col(
                head="agents' restart counts",
                get=lambda r: [c[-1] for c in r.get("agent_restarts", []) if c] or None,
            ),
            Col(head="membership restarts", get=lambda r: r.get("membership_restarts") or None),
            Col(head="resumed", get=lambda r: r["resumed"] or None),
            Col(head="losses equal clean", get="losses_equal_clean"),
            Col(head="ok", get="ok"),
        ),
    ),
    "schedule_build": Table(
        title="Building and validating schedules",
        about="Seconds to build one rank's instruction list, the whole world's, and to "
        "validate it (`-`: skipped at that size).",
        cols=(
            Col(head="model", get="model"),
            Col(head="p", get="p"),
            Col(head="m", get="m"),
            Col(head="n", get="n"),
            Col(head="slots", get="slots"),
            Col(head="instrs/rank", get="instrs_per_rank"),
            Col(head="rank s", get="rank_s", fmt=S3),
            Col(head="global s", get="global_s", fmt=S3),
            Col(head="validate s", get="validate_s", fmt=S3),
        ),
    ),
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
            Col(head="step/bound", get=_ratio("step_s", "bound_s"), fmt=S3),
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
            Col(head="step/bound", get=_ratio("step_s", "bound_s"), fmt=S3),
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
        title="The planner's uneven split against the splits with n | E",
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
TABLES["gc_pauses_8w"] = TABLES["gc_pauses"]
TABLES["schedule_chain_head025"] = dataclasses.replace(
    TABLES["schedule_chain"],
    title="The same with the LM head priced at a quarter (a what-if)",
    about="`schedule_chain` with `--head-scale 0.25`: the analytic costs with the LM head and "
    "loss at a quarter of their seconds, to see how much of the gap the head's block holds "
    "(not a mechanism).",
)
BENCH_TITLES = {
    "bench8_searched": "8 emulated workers, each EP runtime at its best layout",
    "bench8_pp1": "8 emulated workers, experts sharded over every worker (pp 1)",
    "bench8_nic01_searched": "8 emulated workers at 0.1 Gbit/s NICs, best layouts",
    "bench16_searched": "16 emulated workers, each EP runtime at its best layout",
    "bench8_tinyshared_searched": "8 emulated workers, tiny-shared (a dense first layer, a "
    "shared expert), best layouts",
    "bench8_tinyshared_nic01_searched": "8 emulated workers, tiny-shared at 0.1 Gbit/s NICs, "
    "best layouts",
}
BENCH_ABOUT = (
    "`disagmoe bench` on the emulated cluster: every runtime beside the bound of its own run, "
    "and against the fastest EP baseline (docs/bench.md)."
)
ORDER = (
    "bench8_searched", "bench8_pp1", "bench8_nic01_searched", "bench16_searched",
    "bench8_tinyshared_searched", "bench8_tinyshared_nic01_searched",
    "schedule_orders", "schedule_whatif", "schedule_chain", "schedule_chain_head025",
    "schedule_chain_plans",
    "schedule_build", "plan_split_vs_seqlen", "plan_solve_times", "planner_vs_sweep",
    "uneven_splits", "exchange_overhead", "gloo_rendezvous", "tbf_goodput", "memory_model",
    "rank_memory", "recompute", "gc_pauses", "gc_pauses_8w", "link_faults",
    "scale_table", "scale_groups", "paper_figures", "af_levers",
)  # fmt: skip


def is_bench_report(payload: Any) -> bool:
    return isinstance(payload, dict) and "spec" in payload and "results" in payload


def markdown_table(rows: list[dict[str, Any]], cols: tuple[Col, ...]) -> str:
    """`rows` as a Markdown table; without `cols`, every scalar field of the first row."""
    if not cols:
        keys = [k for k, v in (rows[0] if rows else {}).items() if not isinstance(v, dict | list)]
        cols = tuple(Col(head=k, get=k, fmt="{:.4g}" if isinstance(rows[0][k], float) else "{}")
                     for k in keys)  # fmt: skip
    lines = ["| " + " | ".join(c.head for c in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(c.cell(r) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def table(name: str, payload: Any) -> str:
    if is_bench_report(payload):
        return bench_table.table(payload)
    spec = TABLES.get(name)
    rows = spec.rows(payload) if spec else _rows(payload)
    return markdown_table(rows, spec.cols if spec else ())
