"""Where AF-Pipe's step goes at 8 H800 nodes, 8K (docs/paper.md, the scale table's reading).

    .venv/bin/python benchmarks/af_levers.py [--json PATH]

Two measurements, both on the nominal h800 preset (analytic per-op costs):

* **The LM head at p groups.** Group 0's attention replicas also compute the embedding and
  the LM head (layer L). Per preset and each p that divides the layers and the 64 GPUs:
  the head's forward + backward seconds per sequence (chunked loss head, full recompute,
  `simulator.costs.AnalyticCosts`) against the attention seconds of the L / p layers a
  group holds, and the compute bound of a perfectly balanced step: every A and F second of
  the batch (8 sequences per GPU) spread over the GPUs.
* **The forward fill at p = 1.** DeepSeek-MoE's plan with one exchange chunk and whole
  backwards (p 1, 32:32, 14 slots in flight, full recompute, breadth order) simulated with its trace: on attention replica
  0, when its first backward starts, how much of the time before it the replica
  computed, and the median seconds of its forward computes and of its dispatch sends.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from results_io import write_json

from disagmoe.presets import CLUSTER_PRESETS, model_preset
from disagmoe.schedule.ir import Op
from disagmoe.simulator import simulate_disagg
from disagmoe.simulator.costs import AnalyticCosts, Workload

H800 = CLUSTER_PRESETS["h800"]
MODELS = ("deepseek-moe-16b", "qwen3-30b-a3b", "gpt-oss-20b")
NODES, SEQ = 8, 8192


def head_rows(model_name: str) -> list[dict[str, Any]]:
    """The head against a group's attention, per p (module doc)."""
    model = model_preset(model_name)
    costs = AnalyticCosts.for_cluster(Workload(model, SEQ, 1), H800, recompute="full")

    def a_s(layer: int) -> float:
        return costs.compute_s(Op.FWD, "A", layer) + costs.compute_s(Op.BWD, "A", layer)

    layers = model.num_layers
    attn = [a_s(l) for l in range(layers)]
    experts = sum(
        costs.compute_s(Op.FWD, "F", l) + costs.compute_s(Op.BWD, "F", l)
        for l in range(layers)
        if model.is_moe_layer(l)
    )
    head = a_s(layers)
    gpus = NODES * H800.gpus_per_node
    per_sequence = sum(attn) + head + experts  # GPU-seconds of one sequence's A and F
    balanced = per_sequence * 8  # 8 sequences per GPU, every GPU equally busy
    rows = []
    for p in (d for d in range(1, layers + 1) if layers % d == 0 and gpus % d == 0):
        group = sum(attn) / p  # a group's L / p layers, on average
        rows.append({"model": model_name, "groups": p, "head_s": head, "group_attn_s": group,
                     "head_over_group": head / group, "balanced_bound_s": balanced})  # fmt: skip
    return rows


def fill_row() -> dict[str, Any]:
    """DeepSeek-MoE's plan at 8 nodes, 8K with one exchange chunk and whole backwards
    (`simulate --exchange-chunks 1 --split-backward off`): attention replica 0 before its
    first backward (module doc)."""
    model = model_preset("deepseek-moe-16b")
    result = simulate_disagg(
        model, H800, groups=1, attn_workers=32, expert_workers=32, seq_len=SEQ,
        micro_batch_size=1, num_micro_batches=8 * NODES * 8, max_in_flight=14,
        recompute="full",
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        result.write_trace(str(path))
        events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    mine = [e for e in events if e["pid"] == 0]
    fwd = [e for e in mine if e["name"].startswith("FA ")]
    bwd = [e for e in mine if e["name"].startswith("BA ")]
    first_bwd = min(e["ts"] for e in bwd) / 1e6
    busy = sum(min(e["ts"] + e["dur"], first_bwd * 1e6) - e["ts"] for e in fwd
               if e["ts"] < first_bwd * 1e6) / 1e6  # fmt: skip
    dispatch = [e["dur"] / 1e6 for e in mine if e["name"].startswith("send dispatch")]
    return {
        "model": model.name, "step_s": result.step_time_s,
        "bound_s": result.bound.seconds if result.bound else None,
        "first_backward_s": first_bwd, "computed_before_s": busy,
        "idle_before_s": first_bwd - busy,
        "forward_median_s": statistics.median(e["dur"] / 1e6 for e in fwd),
        "dispatch_median_s": statistics.median(dispatch),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args()
    heads = [row for name in MODELS for row in head_rows(name)]
    print(f"LM head against a group's attention ({NODES} nodes, {SEQ} tokens, full recompute)")
    for r in heads:
        print(f"  {r['model']:17s} p {r['groups']:2d}: head {r['head_s']:.4f} s, group's "
              f"attention {r['group_attn_s']:.4f} s ({r['head_over_group']:.2f}x); balanced "
              f"compute bound {r['balanced_bound_s']:.2f} s")  # fmt: skip
    fill = fill_row()
    print(f"forward fill, {fill['model']} one-chunk plan: step {fill['step_s']:.3f} s, bound "
          f"{fill['bound_s']:.3f} s; first backward at {fill['first_backward_s']:.3f} s, "
          f"computed {fill['computed_before_s']:.3f} s before it (idle "
          f"{fill['idle_before_s']:.3f} s); forward {fill['forward_median_s'] * 1e3:.2f} ms, "
          f"dispatch {fill['dispatch_median_s'] * 1e3:.2f} ms (medians)")  # fmt: skip
    if args.json:
        write_json(args.json, {"heads": heads, "fill": fill})


if __name__ == "__main__":
    main()
