"""Simulator sweeps for docs/simulator.md: figures (matplotlib Agg) and JSON in docs/figures/.

    .venv/bin/python benchmarks/simulate_sweeps.py [--out docs/figures] [--quick]
        [--link-model fair|fifo]

Cluster presets are nominal (datasheet peaks scaled by the preset's mfu and
bw_efficiency); no GPU measurement backs them. Every runtime of one sweep point
gets the same GPUs and about the same global batch (micro-batch size 1; disagg
rounds it to a multiple of its m replicas). disagg uses the planner's p, m, n and
NIC split and the node-aware placement (`simulator.placement`) unless a sweep
says otherwise. `--link-model` sets how messages share a port in the sequence-length
and placement sweeps (default fair; `fifo` for the comparison in docs/simulator.md, "Link
model").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import matplotlib.ticker

from disagmoe.config import MULTI_WORKER_RUNTIMES, ModelConfig
from disagmoe.planner.split import (
    default_disagg_split,
    planned_split,
    runnable_in_flight,
    split_planner,
)
from disagmoe.presets import CLUSTER_PRESETS, MODEL_PRESETS
from disagmoe.simulator import SimResult, simulate_disagg, simulate_ep
from disagmoe.simulator.links import LINK_MODELS, LinkModel

PRESETS = ("deepseek-moe-16b", "qwen3-30b-a3b", "gpt-oss-20b")
H800 = CLUSTER_PRESETS["h800"]
GIB = 1024**3


def pp_for(model: ModelConfig, nodes: int, gpus: int) -> int:
    return max(d for d in range(1, nodes + 1) if model.num_layers % d == 0 and gpus % d == 0)


def disagg_micro(target: int, m: int) -> int:
    """The global batch nearest `target` that m replicas can share evenly."""
    return max(m, round(target / m) * m)


def peak_memory_gib(
    model: ModelConfig, groups: int, m: int, n: int, seq_len: int, peak: int, recompute: str
) -> float:
    """Worst worker's memory (the runtime's model, as the planner and `train` price it) with
    `peak` micro-batches in flight."""
    planner = split_planner(
        model, H800, gpus=groups * (m + n), seq_len=seq_len, micro_batch_size=1, groups=groups
    )
    return max(mem.total for mem in planner.worker_memory(groups, m, peak, recompute)) / GIB


def run(
    runtime: str,
    model: ModelConfig,
    nodes: int,
    seq_len: int,
    per_replica: int,
    groups: int = 0,
    split: tuple[int, int] | None = None,
    pp: int = 0,
    ep: int = 0,
    placement: str = "node-aware",
    nic: str = "planner",
    cap: bool = True,
    link_model: LinkModel = "fair",
) -> SimResult:
    """One step; the global batch is about `per_replica` micro-batches per pair of GPUs.

    disagg: `split` (m, n) with `groups`, else the planner's (p, m, n); `nic` "planner"
    (its M_a : M_f, node-aware placement only) or "even" (one NIC share per GPU);
    `cap`: hold at most the planner's in-flight micro-batches (its memory limit).
    """
    gpus = nodes * H800.gpus_per_node
    micro = per_replica * gpus // 2
    if runtime == "disagg":
        plan = planned_split(model, H800, gpus=gpus, seq_len=seq_len, micro_batch_size=1,
                             groups=groups)  # fmt: skip
        p, (m, n), k = plan.groups, (plan.attn_workers, plan.expert_workers), plan.in_flight
        if split:  # another split: its own memory limit
            p, (m, n) = groups or p, split
            k = runnable_in_flight(model, H800, gpus=gpus, seq_len=seq_len, micro_batch_size=1,
                                   groups=p, attn_workers=m, recompute=plan.recompute)  # fmt: skip
        use_nic = nic == "planner" and placement == "node-aware" and not split
        result = simulate_disagg(
            model,
            H800,
            groups=p,
            attn_workers=m,
            expert_workers=n,
            seq_len=seq_len,
            micro_batch_size=1,
            num_micro_batches=disagg_micro(micro, m),
            placement=placement,
            nic_split=(plan.attn_nics, plan.ffn_nics) if use_nic else None,
            max_in_flight=k if cap else 0,
            recompute=plan.recompute,
            link_model=link_model,
        )
        result.config["split_note"] = plan.note if not split else "given"
        peak = int(result.config["peak_in_flight"])
        result.config["memory_gib"] = peak_memory_gib(model, p, m, n, seq_len, peak, plan.recompute)
        return result
    pp = pp or pp_for(model, nodes, gpus)
    dp = gpus // pp
    ep = ep or max(d for d in range(1, dp + 1) if dp % d == 0 and model.num_experts % d == 0)
    return simulate_ep(
        runtime,
        model,
        H800,
        gpus=gpus,
        pp=pp,
        ep=ep,
        seq_len=seq_len,
        micro_batch_size=1,
        num_micro_batches=micro,
        chunks=2,
        link_model=link_model,
    )


def row(result: SimResult, **extra: Any) -> dict[str, Any]:
    return {
        **extra,
        "step_time_s": result.step_time_s,
        "tokens_per_s": result.tokens_per_s,
        "shares": {k: result.share(k) for k in result.breakdown},
        "comm_share": result.comm_share,
        "config": result.config,
        **(result.bound.to_dict() if result.bound else {}),
    }


def sweep_seq_len(
    nodes: int, lens: list[int], per_replica: int, link_model: LinkModel = "fair"
) -> list[dict[str, Any]]:
    rows = []
    for name in PRESETS:
        for seq in lens:
            for runtime in MULTI_WORKER_RUNTIMES:
                try:
                    r = run(runtime, MODEL_PRESETS[name], nodes, seq, per_replica,
                            link_model=link_model)  # fmt: skip
                except ValueError as err:  # no plan fits the GPU's memory: no point
                    print(f"  {name:17s} {seq:6d} {runtime:15s} infeasible: {str(err)[:80]}")
                    continue
                rows.append(row(r, model=name, runtime=runtime, seq_len=seq, nodes=nodes))
                b = r.bound
                over = f"{r.step_time_s / b.seconds:5.2f}x bound ({b.describe()})" if b else ""
                print(f"  {name:17s} {seq:6d} {runtime:15s} {r.tokens_per_s:12.0f} tok/s  {over}")
    return rows


def sweep_placement(
    nodes: int, seq_len: int, per_replica: int, link_model: LinkModel = "fair"
) -> list[dict[str, Any]]:
    """disagg variants (split x placement x NIC split) against EP 1F1B with growing ep."""
    rows = []
    for name in PRESETS:
        model = MODEL_PRESETS[name]
        gpus = nodes * 8
        p2 = default_disagg_split(model, H800, gpus, seq_len, 2)
        variants = [
            ("flop split p=2, packed", dict(groups=2, split=p2, placement="packed")),
            ("flop split p=2, node-aware", dict(groups=2, split=p2)),
            ("planner, packed", dict(placement="packed")),
            ("planner, node-aware, even NICs", dict(nic="even")),
            ("planner, node-aware, planner NICs", {}),
            ("same, no in-flight cap (memory!)", dict(cap=False)),
        ]
        for label, kw in variants:
            r = run("disagg", model, nodes, seq_len, per_replica, link_model=link_model,
                    **kw)  # type: ignore[arg-type]  # fmt: skip
            rows.append(row(r, model=name, runtime="disagg", variant=label))
        for pp in (8, 4, 2, 1):
            dp = gpus // pp
            ep = max(d for d in range(1, dp + 1) if dp % d == 0 and model.num_experts % d == 0)
            if model.num_layers % pp:
                continue
            r = run("ep-1f1b", model, nodes, seq_len, per_replica, pp=pp, ep=ep,
                    link_model=link_model)  # fmt: skip
            rows.append(row(r, model=name, runtime="ep-1f1b", variant=f"pp={pp} ep={ep}"))
        for r in (r for r in rows if r["model"] == name):
            c = r["config"]
            print(
                f"  {name:17s} {r['variant']:34s} {r['tokens_per_s']:10.0f} tok/s "
                f"comm {100 * r['comm_share']:4.1f}% exposed "
                f"{100 * r['shares']['comm_exposed']:4.1f}% "
                + (f"p={c['groups']} m={c['attn_workers']} n={c['expert_workers']} in flight "
                   f"{c['peak_in_flight']} {c['memory_gib']:.0f} GiB"
                   if r["runtime"] == "disagg" else "")
            )  # fmt: skip
    return rows


def sweep_a2a(per_replica: int) -> list[dict[str, Any]]:
    """Megatron-style EP across all GPUs (pp = 1, ep = GPUs): all-to-all share of step time."""
    model = MODEL_PRESETS["deepseek-moe-16b"]
    rows = []
    for nodes in (1, 2, 4, 8):
        r = run("ep-1f1b", model, nodes, 8192, per_replica, pp=1, ep=8 * nodes)
        rows.append(row(r, sweep="nodes", nodes=nodes, top_k=model.top_k))
    for k in (1, 2, 4, 6, 8):
        mk = dataclasses.replace(model, top_k=k)
        r = run("ep-1f1b", mk, 8, 8192, per_replica, pp=1, ep=64)
        rows.append(row(r, sweep="top_k", nodes=8, top_k=k))
    return rows


def sweep_split(nodes: int, seq_len: int, slots: int) -> list[dict[str, Any]]:
    """Every runnable m : n per p, node-aware, even NICs, each at its memory's in-flight limit
    (the planner's recompute choice for that p); `planner` marks the planner's split."""
    model = MODEL_PRESETS["qwen3-30b-a3b"]
    gpus = nodes * 8
    rows = []
    for p in (1, 2, 4):
        plan = planned_split(model, H800, gpus=gpus, seq_len=seq_len, micro_batch_size=1, groups=p)
        per = gpus // p
        for n in (d for d in range(1, per) if model.num_experts % d == 0):
            m = per - n
            k = runnable_in_flight(model, H800, gpus=gpus, seq_len=seq_len, micro_batch_size=1,
                                   groups=p, attn_workers=m, recompute=plan.recompute)  # fmt: skip
            r = simulate_disagg(
                model,
                H800,
                groups=p,
                attn_workers=m,
                expert_workers=n,
                seq_len=seq_len,
                micro_batch_size=1,
                num_micro_batches=slots * m,
                max_in_flight=k,
                recompute=plan.recompute,
            )
            rows.append(
                row(
                    r,
                    groups=p,
                    attn_workers=m,
                    expert_workers=n,
                    ffn_fraction=n / per,
                    in_flight=k,
                    planner=m == plan.attn_workers,
                )
            )
    return rows


def sweep_virtual(nodes: int, seq_len: int, slots: int) -> list[dict[str, Any]]:
    model = MODEL_PRESETS["qwen3-30b-a3b"]
    gpus = nodes * 8
    rows = []
    for p in (d for d in range(1, 49) if model.num_layers % d == 0 and gpus % d == 0):
        plan = planned_split(model, H800, gpus=gpus, seq_len=seq_len, micro_batch_size=1, groups=p)
        m, n = plan.attn_workers, plan.expert_workers
        r = simulate_disagg(
            model,
            H800,
            groups=p,
            attn_workers=m,
            expert_workers=n,
            seq_len=seq_len,
            micro_batch_size=1,
            num_micro_batches=slots * m,
            nic_split=(plan.attn_nics, plan.ffn_nics),
            max_in_flight=plan.in_flight,
            recompute=plan.recompute,
        )
        peak = int(r.config["peak_in_flight"])
        worst = peak_memory_gib(model, p, m, n, seq_len, peak, plan.recompute)
        rows.append(
            row(
                r,
                groups=p,
                virtual_stages=model.num_layers // p,
                attn_workers=m,
                expert_workers=n,
                peak_in_flight=peak,
                memory_gib=worst,
                fits=worst <= H800.gpu_mem_gib,
            )
        )
    return rows


def plot(out: Path, data: dict[str, Any]) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, name in zip(axes, PRESETS, strict=True):
        for runtime in MULTI_WORKER_RUNTIMES:
            pts = [r for r in data["seq_len"] if r["model"] == name and r["runtime"] == runtime]
            ax.plot(
                [r["seq_len"] for r in pts],
                [r["tokens_per_s"] / 1e3 for r in pts],
                "o-",
                label=runtime,
            )
        ax.set(
            title=f"{name}, 8 x H800 nodes (nominal)",
            xlabel="sequence length",
            ylabel="k tokens/s",
            xscale="log",
            xticks=[4096, 8192, 16384, 32768],
        )
        ax.set_xticklabels(["4K", "8K", "16K", "32K"])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out / "sim_throughput_vs_seq.png", dpi=110)

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    nodes = [r for r in data["a2a"] if r["sweep"] == "nodes"]
    a1.plot([r["nodes"] for r in nodes], [100 * r["comm_share"] for r in nodes], "o-")
    a1.axhline(22, ls=":", c="gray")
    a1.axhline(78, ls=":", c="gray")
    a1.set(
        title="DeepSeek-MoE 8K, EP all-to-all + 1F1B",
        xlabel="nodes",
        ylabel="all-to-all share of step (%)",
    )
    ks = [r for r in data["a2a"] if r["sweep"] == "top_k"]
    a2.plot([r["top_k"] for r in ks], [100 * r["comm_share"] for r in ks], "o-")
    a2.set(title="8 nodes", xlabel="top-k", ylabel="all-to-all share of step (%)")
    fig.tight_layout()
    fig.savefig(out / "sim_a2a_share.png", dpi=110)

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, runtime in zip(axes, ("ep-1f1b", "disagg"), strict=True):
        pts = [
            r for r in data["seq_len"] if r["model"] == "qwen3-30b-a3b" and r["runtime"] == runtime
        ]
        for key in ("attn", "ffn", "comm_exposed", "bubble"):
            ax.plot(
                [r["seq_len"] for r in pts], [100 * r["shares"][key] for r in pts], "o-", label=key
            )
        ax.set(
            title=f"Qwen3-30B-A3B, 8 nodes, {runtime}",
            xlabel="sequence length",
            ylabel="share of step time (%)",
            xscale="log",
        )
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "sim_shares_vs_seq.png", dpi=110)

    fig, ax = plt.subplots(figsize=(6, 4))
    for p in sorted({r["groups"] for r in data["split"]}):
        pts = [r for r in data["split"] if r["groups"] == p]
        ax.plot(
            [r["ffn_fraction"] for r in pts],
            [r["tokens_per_s"] / 1e3 for r in pts],
            "o-",
            label=f"p = {p}",
        )
        for r in (r for r in pts if r["planner"]):
            ax.plot(r["ffn_fraction"], r["tokens_per_s"] / 1e3, "k*", ms=12)
    ax.set(
        title="Qwen3-30B-A3B 8K, 8 nodes: A:F split (*: planner)",
        xlabel="FFN share n/(m+n) of GPUs",
        ylabel="k tokens/s",
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "sim_throughput_vs_split.png", dpi=110)

    fig, ax = plt.subplots(figsize=(6, 4))
    pts = sorted(data["virtual"], key=lambda r: r["virtual_stages"])
    ax.plot([r["virtual_stages"] for r in pts], [r["tokens_per_s"] / 1e3 for r in pts], "o-")
    for r in pts:
        if not r["fits"]:
            ax.plot(r["virtual_stages"], r["tokens_per_s"] / 1e3, "rx", ms=12)
    ax.set(
        title="Qwen3-30B-A3B 8K, 8 nodes (x: over 80 GiB)",
        xlabel="virtual stages v = L/p",
        ylabel="k tokens/s",
        xscale="log",
    )
    fig.tight_layout()
    fig.savefig(out / "sim_throughput_vs_virtual_stages.png", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="docs/figures")
    parser.add_argument("--quick", action="store_true", help="fewer points (smoke test)")
    parser.add_argument("--link-model", choices=LINK_MODELS, default="fair",
                        help="port sharing of the sequence-length and placement sweeps")  # fmt: skip
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    lens = [4096, 32768] if args.quick else [4096, 8192, 16384, 32768]
    print("throughput vs sequence length (8 nodes)")
    data: dict[str, Any] = {"seq_len": sweep_seq_len(8, lens, 16, args.link_model)}
    print("all-to-all share")
    data["a2a"] = sweep_a2a(16)
    for r in data["a2a"]:
        print(
            f"  {r['sweep']:6s} nodes {r['nodes']} top-k {r['top_k']}: "
            f"{100 * r['comm_share']:5.1f}% of step in all-to-all"
        )
    print("placement and NIC split (8K, 8 nodes) against EP 1F1B with growing ep")
    data["placement"] = sweep_placement(8, 8192, 16, args.link_model)
    print("A:F split and virtual stages")
    data["split"] = sweep_split(8, 8192, 32)
    data["virtual"] = sweep_virtual(8, 8192, 32)
    for r in data["virtual"]:
        print(
            f"  v={r['virtual_stages']:2d} p={r['groups']:2d} m={r['attn_workers']} "
            f"n={r['expert_workers']}: {r['tokens_per_s']:10.0f} tok/s, "
            f"{r['memory_gib']:6.1f} GiB peak (in flight {r['peak_in_flight']})"
        )
    data["meta"] = {
        "cluster": dataclasses.asdict(H800),
        "seconds": time.perf_counter() - t0,
        "link_model": args.link_model,
        "note": "nominal cluster preset, no measured calibration; disagg: planner split, "
        "node-aware placement, planner NIC split unless the row says otherwise",
    }
    (out / "simulator_sweeps.json").write_text(json.dumps(data, indent=1))
    plot(out, data)
    print(f"wrote {out}/sim_*.png and simulator_sweeps.json in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
