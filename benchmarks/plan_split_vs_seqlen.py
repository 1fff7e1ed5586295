"""How the planner's best A:F split shifts with sequence length (figure for docs/planner.md).

For each model preset, 8 and 16 H800 nodes (64 / 128 GPUs) and S = 2K..32K, runs the full
planner (stages 1-3, memory) and the paper's roofline-only problem, prints a table, writes
JSON and the figure.

    .venv/bin/python benchmarks/plan_split_vs_seqlen.py
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from results_io import write_json

from disagmoe.planner import plan_for
from disagmoe.presets import CLUSTER_PRESETS, MODEL_PRESETS

MODELS = ("deepseek-moe-16b", "qwen3-30b-a3b", "gpt-oss-20b")
SEQS = (2048, 4096, 8192, 16384, 32768)
GPUS = (64, 128)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--figure", default="docs/figures/plan_split_vs_seqlen.png")
    parser.add_argument("--out", default="benchmarks/results/plan_split_vs_seqlen.json")
    args = parser.parse_args()
    cluster = CLUSTER_PRESETS["h800"]
    rows: list[dict[str, object]] = []
    print(f"{'model':18s} {'GPUs':>4s} {'seq':>6s} | {'full: p':>7s} {'A:F':>7s} {'NICs':>7s} "
          f"{'binding':>17s} {'rc':>4s} | {'paper A:F':>9s} {'NICs':>7s}")  # fmt: skip
    for name in MODELS:
        for gpus in GPUS:
            for seq in SEQS:
                model = MODEL_PRESETS[name]
                paper = plan_for(model, cluster, gpus=gpus, seq_len=seq, micro_batch_size=1,
                                 roofline_only=True)  # fmt: skip
                try:
                    full = plan_for(model, cluster, gpus=gpus, seq_len=seq, micro_batch_size=1)
                except ValueError as err:  # no split fits the GPU's memory: the row says so
                    rows.append({"model": name, "gpus": gpus, "seq_len": seq,
                                 "full": {"error": str(err)}, "paper": paper.to_dict(),
                                 "full_attn_frac": None,
                                 "paper_attn_frac": paper.attn_gpus / gpus})  # fmt: skip
                    print(f"{name:18s} {gpus:4d} {seq:6d} | no feasible plan")
                    continue
                rows.append({
                    "model": name, "gpus": gpus, "seq_len": seq,
                    "full": full.to_dict(), "paper": paper.to_dict(),
                    "full_attn_frac": full.attn_gpus / gpus,
                    "paper_attn_frac": paper.attn_gpus / gpus,
                })  # fmt: skip
                print(f"{name:18s} {gpus:4d} {seq:6d} | {full.groups:7d} "
                      f"{full.attn_gpus:>3d}:{full.ffn_gpus:<3d} {full.attn_nics:>3d}:{full.ffn_nics:<3d} "
                      f"{full.binding:>17s} {full.recompute:>4s} | "
                      f"{paper.attn_gpus:>4d}:{paper.ffn_gpus:<4d} {paper.attn_nics:>3d}:{paper.ffn_nics:<3d}")  # fmt: skip
    write_json(args.out, {"rows": rows})
    fig, axes = plt.subplots(1, len(MODELS), figsize=(12, 3.8), sharey=True)
    for ax, name in zip(axes, MODELS, strict=True):
        for gpus, style in zip(GPUS, ("o-", "s-"), strict=True):
            sel = [r for r in rows if r["model"] == name and r["gpus"] == gpus]
            seqs = [int(r["seq_len"]) for r in sel]  # type: ignore[call-overload]
            fits = [r for r in sel if r["full_attn_frac"] is not None]
            ax.plot([int(r["seq_len"]) for r in fits], [r["full_attn_frac"] for r in fits],  # type: ignore[call-overload]
                    style, label=f"full, {gpus} GPUs")  # fmt: skip
            ax.plot(seqs, [r["paper_attn_frac"] for r in sel], style.replace("-", "--"),
                    alpha=0.6, label=f"roofline only, {gpus} GPUs")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(SEQS), [f"{s // 1024}K" for s in SEQS])
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("sequence length")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("attention GPUs / all GPUs")
    axes[0].set_ylim(0, 1)
    axes[-1].legend(fontsize=7, loc="lower right")
    fig.suptitle(
        "Best A:F split vs sequence length (8 / 16 H800 nodes, micro-batch 1)", fontsize=10
    )
    fig.tight_layout()
    figure = Path(args.figure)
    figure.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(figure, dpi=120)
    print(f"wrote {figure}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
