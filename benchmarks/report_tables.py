"""What each results file's table shows, for `benchmarks/report.py`: a title, a line on
what the file measures, and its columns (`report_columns.Col`). The measured files' tables
are here, the simulated and planned ones' in `tables_simulated.py`. A `disagmoe bench`
report's table is `bench_table.table`'s; a file with no entry gets every scalar field of
its rows.
"""

from __future__ import annotations

from typing import Any

import bench_table
from report_columns import S3, S4, Col, Getter, Table, markdown_table, payload_rows
from tables_simulated import SIMULATED


def _memory_rows(payload: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"config": name, **m} for name, m in payload["memory_mib"].items()]


def _both(side: str, measured: str, predicted: str) -> Getter:
    return lambda r: f"{r[side][measured]:.2f} / {r[side][predicted]:.2f}"


MEASURED: dict[str, Table] = {
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
        "rate (wall clock), queue and traffic pattern, and the packets they dropped.",
        cols=(
            Col(head="Mbit/s per node", get="mbit", fmt="{:g}"),
            Col(head="queue kB", get="queue_kb", fmt="{:g}"),
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
}
MEASURED["gc_pauses_8w"] = MEASURED["gc_pauses"]
TABLES: dict[str, Table] = {**MEASURED, **SIMULATED}
BENCH_TITLES = {
    "bench2_default": "2 workers, real compute: `disagmoe bench` with its defaults",
    "bench8_searched": "8 emulated workers, each EP runtime at its best layout",
    "bench8_pp1": "8 emulated workers, experts sharded over every worker (pp 1)",
    "bench8_nic01_searched": "8 emulated workers at 0.1 Gbit/s NICs, best layouts",
    "bench16_searched": "16 emulated workers, each EP runtime at its best layout",
    "bench8_tinyshared_searched": "8 emulated workers, tiny-shared (a dense first layer, a "
    "shared expert), best layouts",
    "bench8_tinyshared_nic01_searched": "8 emulated workers, tiny-shared at 0.1 Gbit/s NICs, "
    "best layouts",
    "bench8_tiny_searched": "8 emulated workers, tiny (the default model), best layouts",
    "bench8_tiny_nic01_searched": "8 emulated workers, tiny at 0.1 Gbit/s NICs, best layouts",
    "bench8_tiny_nic01_q125": "8 emulated workers, tiny at 0.1 Gbit/s NICs, the NICs' queue "
    "a quarter of the default (125 kB)",
}
BENCH_ABOUT = (
    "`disagmoe bench` on the emulated cluster: every runtime beside the bound of its own run, "
    "and against the fastest EP baseline (docs/bench.md)."
)
ORDER = (
    "bench2_default", "bench8_searched", "bench8_pp1", "bench8_nic01_searched", "bench16_searched",
    "bench8_tinyshared_searched", "bench8_tinyshared_nic01_searched",
    "bench8_tiny_searched", "bench8_tiny_nic01_searched", "bench8_tiny_nic01_q125",
    "schedule_orders", "schedule_whatif", "schedule_chain", "schedule_chain_head025",
    "schedule_chain_plans",
    "schedule_build", "plan_split_vs_seqlen", "plan_solve_times", "planner_vs_sweep",
    "uneven_splits", "exchange_overhead", "gloo_rendezvous", "tbf_goodput", "memory_model",
    "rank_memory", "recompute", "gc_pauses", "gc_pauses_8w", "link_faults",
    "scale_table", "scale_groups",
    "paper_figures", "af_levers",
)  # fmt: skip


def is_bench_report(payload: Any) -> bool:
    return isinstance(payload, dict) and "spec" in payload and "results" in payload


def table(name: str, payload: Any) -> str:
    if is_bench_report(payload):
        return bench_table.table(payload)
    spec = TABLES.get(name)
    rows = spec.rows(payload) if spec else payload_rows(payload)
    return markdown_table(rows, spec.cols if spec else ())
