"""Figures of benchmarks/ablations.py (matplotlib Agg): one PNG per ablation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

STYLE = {1: "o-", 2: "s-", 4: "^-", 8: "d-", 16: "v-"}


def plot_split(out: Path, data: list[dict[str, Any]], model: str) -> None:
    fig, axes = plt.subplots(1, len(data), figsize=(4.2 * len(data), 3.8), squeeze=False)
    for ax, case in zip(axes[0], data, strict=True):
        splits = [r for r in case["points"] if r["kind"] == "split"]
        for p in sorted({r["groups"] for r in splits}):
            pts = sorted(
                (r for r in splits if r["groups"] == p),
                key=lambda r: r["expert_workers"] / (r["attn_workers"] + r["expert_workers"]),
            )
            xs = [r["expert_workers"] / (r["attn_workers"] + r["expert_workers"]) for r in pts]
            line = ax.plot(xs, [r["vs_ep"] for r in pts], STYLE.get(p, "o-"), label=f"p = {p}")
            ax.plot(xs, [r["bound_vs_ep"] for r in pts], ":", c=line[0].get_color(), lw=1)
        chosen = next(r for r in case["points"] if r["kind"] == "planner")
        x = chosen["expert_workers"] / (chosen["attn_workers"] + chosen["expert_workers"])
        ax.plot(x, chosen["vs_ep"], "k*", ms=13, label="planner")
        ax.axhline(1.0, c="gray", lw=0.8)
        ax.set(
            title=f"{case['seq_len'] // 1024}K",
            xlabel="FFN share n / (m + n) of GPUs",
            ylabel="tokens/s per GPU vs EP 1F1B",
        )
        ax.legend(fontsize=8)
    fig.suptitle(f"{model}, 8 x H800 (nominal): A:F split (dotted: bound)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "ablation_split_vs_seq.png", dpi=110)
    plt.close(fig)


def _runtimes(ax: Any, rows: list[dict[str, Any]], x_key: str) -> None:
    xs = [r[x_key] for r in rows]
    for key, label, style in (
        ("disagg", "AF-Pipe (planner)", "k*-"),
        ("ep-1f1b", "EP 1F1B", "o-"),
        ("ep-1f1b-wide", "EP 1F1B, pp 1 (EP = all GPUs)", "s-"),
    ):
        line = ax.plot(xs, [r[key]["tokens_per_s_per_gpu"] / 1e3 for r in rows], style, label=label)
        for x, r in zip(xs, rows, strict=True):
            if not r[key].get("fits", True):  # EP: over the GPU's memory
                ax.plot(x, r[key]["tokens_per_s_per_gpu"] / 1e3, "rx", ms=12)
        ax.plot(
            xs,
            [r[key]["bound_tokens_per_s_per_gpu"] / 1e3 for r in rows],
            ":",
            c=line[0].get_color(),
            lw=1,
        )
    ax.set(ylabel="k tokens/s per GPU", xscale="log", xticks=xs)
    ax.set_xticklabels([str(x) for x in xs])
    ax.minorticks_off()


def plot_top_k_ep(
    out: Path, top_k: list[dict[str, Any]], ep: list[dict[str, Any]], model: str
) -> None:
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    _runtimes(a1, top_k, "top_k")
    a1.set(title=f"{model} 8K, 8 nodes", xlabel="top-k")
    _runtimes(a2, ep, "nodes")
    a2.set(title=f"{model} 8K", xlabel="nodes (8 GPUs each)")
    a1.legend(fontsize=8)
    fig.suptitle(
        "nominal H800; dotted: each layout's bound; x: EP states exceed memory", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(out / "ablation_top_k_ep_size.png", dpi=110)
    plt.close(fig)


def plot_virtual(out: Path, rows: list[dict[str, Any]], model: str) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    pts = sorted(rows, key=lambda r: r["virtual_stages"])
    xs = [r["virtual_stages"] for r in pts]
    ax.plot(xs, [r["vs_ep"] for r in pts], "o-", label="AF-Pipe, best plan per p")
    ax.plot(xs, [r["bound_tokens_per_s_per_gpu"] / r["tokens_per_s_per_gpu"] * r["vs_ep"]
                 for r in pts], ":", lw=1, label="its bound")  # fmt: skip
    for r in pts:
        if r["kind"] == "planner":
            ax.plot(r["virtual_stages"], r["vs_ep"], "k*", ms=13, label="planner")
    ax.axhline(1.0, c="gray", lw=0.8)
    ax.set(
        title=f"{model} 8K, 8 x H800 (nominal)",
        xlabel="virtual stages v = L / p",
        ylabel="tokens/s per GPU vs EP 1F1B",
        xscale="log",
        xticks=xs,
    )
    ax.set_xticklabels([str(x) for x in xs])
    ax.minorticks_off()
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "ablation_virtual_stages.png", dpi=110)
    plt.close(fig)


def plot_ablations(out: Path, data: dict[str, Any]) -> None:
    model = data["meta"]["model"]
    plot_split(out, data["split"], model)
    plot_top_k_ep(out, data["top_k"], data["ep_size"], model)
    if data["virtual"]:
        plot_virtual(out, data["virtual"], model)
