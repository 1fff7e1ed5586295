"""The planner's AF-Pipe split (uneven where it picks one) against every even split, simulated.

    .venv/bin/python benchmarks/uneven_splits.py [--json benchmarks/results/uneven_splits.json]

Before uneven splits the runtime needed n | E and m | M, so the planner's split moved to
the best split with n | E. Per case (model, H800 nodes, sequence length) this replays one
step of the planner's split (`simulator.placement.planned_split`: n need not divide E, m
need not divide the global batch of M micro-batches) and of every split with n | E, all
with the same p, global batch, recomputation and node-aware placement, one fair NIC
share per GPU (so the split alone differs), each holding the micro-batches its memory
admits in flight (`runnable_in_flight`, at least 1). `fits`: whether the planner's memory
model admits the split at all (one micro-batch in flight, some NIC split); a split that
does not fit is simulated anyway, as if memory were no limit. Cluster presets are
nominal (no GPU measurement). Prints a table; writes JSON with a `rows` list.
"""

from __future__ import annotations

import argparse

from results_io import write_json

from disagmoe.planner import Planner, PlanOptions
from disagmoe.planner.split import planned_split, runnable_in_flight
from disagmoe.presets import CLUSTER_PRESETS, model_preset
from disagmoe.simulator import simulate_disagg

H800 = CLUSTER_PRESETS["h800"]
CASES = [("gpt-oss-20b", 1, 8192), ("qwen3-30b-a3b", 2, 8192)]  # (model, nodes, seq_len)
MICRO_PER_GPU = 8  # global batch: 8 micro-batches (of one sequence) per GPU


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", default="", help="write the rows here")
    args = parser.parse_args()
    rows = []
    print(f"{'model':15s} {'GPUs':>4s} {'split':16s} {'experts/shard':>13s} "
          f"{'slots/replica':>13s} {'fits':>5s} {'in flight':>9s} {'step ms':>9s} "
          f"{'k tok/s':>8s}")  # fmt: skip
    for name, nodes, seq_len in CASES:
        model = model_preset(name)
        gpus = nodes * H800.gpus_per_node
        micro = MICRO_PER_GPU * gpus
        kw = dict(gpus=gpus, seq_len=seq_len, micro_batch_size=1)
        plan = planned_split(model, H800, **kw)  # type: ignore[arg-type]
        p, per = plan.groups, gpus // plan.groups
        planner = Planner(model=model, cluster=H800, options=PlanOptions(groups=p), **kw)  # type: ignore[arg-type]
        rc = "full" if plan.recompute else "none"
        nics = planner.problem(p, 1, rc).nics
        splits = [(plan.attn_workers, plan.expert_workers, "planner")]
        splits += [(per - n, n, "n | E") for n in range(1, per) if model.num_experts % n == 0]
        for m, n, label in splits:
            fits = any(
                planner.evaluate(groups=p, m=m, attn_nics=ma, in_flight=1, recompute=rc)
                for ma in range(1, nics)
            )
            k = runnable_in_flight(model, H800, groups=p, attn_workers=m,
                                   recompute=plan.recompute, **kw)  # type: ignore[arg-type]  # fmt: skip
            r = simulate_disagg(
                model, H800, groups=p, attn_workers=m, expert_workers=n, seq_len=seq_len,
                micro_batch_size=1, num_micro_batches=micro, max_in_flight=k,
                recompute=plan.recompute,
            )  # fmt: skip
            experts = sorted({-(-model.num_experts // n), model.num_experts // n}, reverse=True)
            slots = sorted({-(-micro // m), micro // m}, reverse=True)
            row = {
                "model": name, "gpus": gpus, "seq_len": seq_len, "groups": p,
                "attn_workers": m, "expert_workers": n, "kind": label,
                "experts_per_shard": experts, "slots_per_replica": slots,
                "micro_batches": micro, "fits": fits, "in_flight": k, "recompute": plan.recompute,
                "step_time_s": r.step_time_s, "tokens_per_s": r.tokens_per_s,
            }  # fmt: skip
            rows.append(row)
            print(
                f"{name:15s} {gpus:4d} {f'{label} {m}:{n}':16s} "
                f"{'/'.join(map(str, experts)):>13s} {'/'.join(map(str, slots)):>13s} "
                f"{'yes' if fits else 'no':>5s} {k:9d} {1e3 * r.step_time_s:9.1f} {r.tokens_per_s / 1e3:8.1f}"
            )
    if args.json:
        write_json(args.json, {"cluster": H800.name, "rows": rows})


if __name__ == "__main__":
    main()
