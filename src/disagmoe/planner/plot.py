"""The compute-communication roofline figure of a plan (`disagmoe plan --plot FILE.png`).

Per GPU, attainable FLOP/s = min(peak, I * bytes/s of the NICs that GPU can use):
* aggregated (every GPU holds attention and experts and its own r NICs): slope r*B;
* disaggregated attention: an attention GPU's share of the M_a NICs, slope B*M_a/m;
* disaggregated FFN: slope B*M_f/n.
Points mark the attention and FFN intensities (FLOP per exchanged byte, as the plan's stage
times count them) on the aggregated and on their own disaggregated roof.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from disagmoe.config import ClusterConfig
from disagmoe.planner.plan import Plan


def plot_roofline(plan: Plan, cluster: ClusterConfig, path: str | Path) -> Path:
    """Write the roofline PNG for `plan` on `cluster`; returns the path written."""
    achievable = not plan.roofline_only
    peak = cluster.peak_tflops * 1e12 * (cluster.mfu if achievable else 1.0)
    nic = cluster.nic_gbps * 1e9 * (cluster.bw_efficiency if achievable else 1.0)
    per_gpu = cluster.nics_per_node / cluster.gpus_per_node
    roofs = {
        "aggregated (own NICs)": nic * per_gpu,
        f"attention: {plan.attn_nics} NICs / {plan.attn_gpus} GPUs": nic
        * plan.attn_nics_per_group
        / plan.attn_gpus_per_group,
        f"FFN: {plan.ffn_nics} NICs / {plan.ffn_gpus} GPUs": nic
        * plan.ffn_nics_per_group
        / plan.ffn_gpus_per_group,
    }
    # FLOP per wire byte as the plan's stage times count them (forward + backward in the full
    # model, so it differs from the forward-only I_attn / I_ffn of the design's formulas)
    i_attn = (plan.t_attn_compute_s * plan.attn_gpus_per_group * peak) / (
        plan.t_attn_comm_s * plan.attn_nics_per_group * nic
    )
    i_ffn = (plan.t_ffn_compute_s * plan.ffn_gpus_per_group * peak) / (
        plan.t_ffn_comm_s * plan.ffn_nics_per_group * nic
    )
    lo = min(i_attn, i_ffn, plan.ridge) / 10
    hi = max(i_attn, i_ffn, plan.ridge) * 10
    x = np.geomspace(lo, hi, 256)
    fig, ax = plt.subplots(figsize=(7.0, 4.5))
    styles = ("k-", "C0--", "C1--")
    for (label, bw), style in zip(roofs.items(), styles, strict=True):
        ax.plot(x, np.minimum(peak, x * bw) / 1e12, style, label=label)
    points = (
        ("attention", i_attn, list(roofs.values())[1], "C0"),
        ("FFN", i_ffn, list(roofs.values())[2], "C1"),
    )
    for name, inten, bw, color in points:
        agg = min(peak, inten * roofs["aggregated (own NICs)"]) / 1e12
        dis = min(peak, inten * bw) / 1e12
        ax.plot([inten], [agg], "o", color=color, mfc="white")
        ax.plot([inten], [dis], "o", color=color)
        ax.annotate(f"{name} I={inten:,.0f}", (inten, dis), textcoords="offset points",
                    xytext=(5, -12), fontsize=8, color=color)  # fmt: skip
    ax.axvline(plan.ridge, color="grey", lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per exchanged byte)")
    ax.set_ylabel("attainable TFLOP/s per GPU")
    kind = "nominal peaks" if plan.roofline_only else "achievable (mfu, bw_efficiency)"
    ax.set_title(
        f"{plan.model}, S={plan.seq_len}, {plan.gpus} GPUs ({kind}); hollow: aggregated",
        fontsize=9,
    )
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
