"""Simulator sweeps for docs/simulator.md: figures (matplotlib Agg) and JSON in docs/figures/.

    .venv/bin/python benchmarks/simulate_sweeps.py [--out docs/figures] [--quick]

Cluster presets are nominal (datasheet peaks scaled by the preset's mfu and
bw_efficiency); no GPU measurement backs them. Every runtime of one sweep point
gets the same GPUs and the same global batch (micro-batch size 1).
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

from disagmoe.config import CLUSTER_PRESETS, MODEL_PRESETS, ModelConfig
from disagmoe.simulator import EP_RUNTIMES, SimResult, simulate_disagg, simulate_ep
from disagmoe.simulator.cli import default_disagg_split

PRESETS = ("deepseek-moe-16b", "qwen3-30b-a3b", "gpt-oss-20b")
H800 = CLUSTER_PRESETS["h800"]
GIB = 1024**3


def pp_for(model: ModelConfig, nodes: int, gpus: int) -> int:
    return max(d for d in range(1, nodes + 1) if model.num_layers % d == 0 and gpus % d == 0)


def run(
    runtime: str,
    model: ModelConfig,
    nodes: int,
    seq_len: int,
    per_replica: int,
    groups: int = 2,
    split: tuple[int, int] | None = None,
    pp: int = 0,
    ep: int = 0,
) -> SimResult:
    """One step; the global batch is `per_replica` micro-batches per GPU-pair of work."""
    gpus = nodes * H800.gpus_per_node
    micro = per_replica * gpus // 2
    if runtime == "disagg":
        m, n = split or default_disagg_split(model, H800, gpus, seq_len, groups, micro)
        return simulate_disagg(
            model,
            H800,
            groups=groups,
            attn_workers=m,
            expert_workers=n,
            seq_len=seq_len,
            micro_batch_size=1,
            num_micro_batches=micro,
        )
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
    )


def row(result: SimResult, **extra: Any) -> dict[str, Any]:
    return {
        **extra,
        "step_time_s": result.step_time_s,
        "tokens_per_s": result.tokens_per_s,
        "shares": {k: result.share(k) for k in result.breakdown},
        "comm_share": result.comm_share,
        "config": result.config,
    }


def sweep_seq_len(nodes: int, lens: list[int], per_replica: int) -> list[dict[str, Any]]:
    rows = []
    for name in PRESETS:
        for seq in lens:
            for runtime in ("disagg", *EP_RUNTIMES):
                r = run(runtime, MODEL_PRESETS[name], nodes, seq, per_replica)
                rows.append(row(r, model=name, runtime=runtime, seq_len=seq, nodes=nodes))
                print(f"  {name:17s} {seq:6d} {runtime:15s} {r.tokens_per_s:12.0f} tok/s")
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
    model = MODEL_PRESETS["qwen3-30b-a3b"]
    gpus = nodes * 8
    rows = []
    for p in (1, 2, 4):
        per = gpus // p
        for n in (d for d in range(1, per) if model.num_experts % d == 0):
            m = per - n
            r = simulate_disagg(
                model,
                H800,
                groups=p,
                attn_workers=m,
                expert_workers=n,
                seq_len=seq_len,
                micro_batch_size=1,
                num_micro_batches=slots * m,
            )
            rows.append(row(r, groups=p, attn_workers=m, expert_workers=n, ffn_fraction=n / per))
    return rows


def sweep_virtual(nodes: int, seq_len: int, slots: int) -> list[dict[str, Any]]:
    from disagmoe.planner import costmodel as cm

    model = MODEL_PRESETS["qwen3-30b-a3b"]
    gpus = nodes * 8
    rows = []
    for p in (d for d in range(1, 49) if model.num_layers % d == 0 and gpus % d == 0):
        m, n = default_disagg_split(model, H800, gpus, seq_len, p)
        r = simulate_disagg(
            model,
            H800,
            groups=p,
            attn_workers=m,
            expert_workers=n,
            seq_len=seq_len,
            micro_batch_size=1,
            num_micro_batches=slots * m,
        )
        peak = int(r.config["peak_in_flight"])
        attn = cm.attn_worker_memory(
            model, groups=p, seq_len=seq_len, micro_batch_size=1, in_flight=peak, recompute="none"
        ).total
        a, b = cm.ffn_memory_terms(
            model, groups=p, seq_len=seq_len, micro_batch_size=1, in_flight=peak, recompute="none"
        )
        worst = max(attn, (a + b * m) / n) / GIB
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
        for runtime in ("disagg", *EP_RUNTIMES):
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
    ax.set(
        title="Qwen3-30B-A3B 8K, 8 nodes: A:F split",
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
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    lens = [4096, 32768] if args.quick else [4096, 8192, 16384, 32768]
    print("throughput vs sequence length (8 nodes)")
    data = {"seq_len": sweep_seq_len(8, lens, 16)}
    print("all-to-all share")
    data["a2a"] = sweep_a2a(16)
    for r in data["a2a"]:
        print(
            f"  {r['sweep']:6s} nodes {r['nodes']} top-k {r['top_k']}: "
            f"{100 * r['comm_share']:5.1f}% of step in all-to-all"
        )
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
        "note": "nominal cluster preset, no measured calibration",
    }
    (out / "simulator_sweeps.json").write_text(json.dumps(data, indent=1))
    plot(out, data)
    print(f"wrote {out}/sim_*.png and simulator_sweeps.json in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
