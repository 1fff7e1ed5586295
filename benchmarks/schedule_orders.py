"""AF-Pipe orders and exchange chunks against their bound: every candidate, simulated, and
`auto`'s pick.

    .venv/bin/python benchmarks/schedule_orders.py [--json benchmarks/results/schedule_orders.json]

Per setting this replays one optimizer step (`simulate_disagg`, fair links) of each
candidate of `schedule.order = auto` with `schedule.exchange_chunks = 0` and
`schedule.split_backward = auto` — breadth, depth and steady, each ordered with the nominal
costs and with the run's costs and links, each with its exchange in 1, 2, 4 and 8 chunks,
each with whole backwards and with deferred weight gradients (`simulator.choose`) — and
prints the unchunked whole-backward candidates' steps, the best step with 2, 4 and 8
chunks (whole backwards), the best with deferred weight gradients (`best +W`), and auto's
pick (order, `+c` ordered with the run's costs, `+W` weight gradients deferred; chunks),
its step, its bound (`simulator.bound`), their ratio and the unchunked whole-backward
best's ratio (`c1 st/bd`).
Every replay is the symmetry-reduced one (`reduce=True`: one replica per class, one shard
per group, bundled messages, as `run_choice` replays for `schedule.order = auto`), which
keeps 48 candidates per setting affordable.
`one-slot` is the step of the same layout (auto, chunks too) when every replica runs one
micro-batch: about
what the dependency chain of a single micro-batch (every layer forward and backward, each
with its m-way exchange) costs there — not a strict bound (a schedule could stagger the
replicas' first slots), but where it is near the step, the step is the chain's, and
the order has little left to move.

Settings: the default `disagmoe bench` (small model, 2 workers p=1 m=n=1, 0.2 Gbit/s,
global batch 16 x 128, micro-batch 2); the 8- and 16-worker emulated settings of
docs/bench.md (4 x 2 and 8 x 2 ranks, 0.4 Gbit/s, global batch 64, m=n=4 with micro-batch
4, m=n=8 with micro-batch 2; each also with an in-flight cap of 3 slots), all on the
emulated cluster as the planner sees it
(`bench.cli.emulated_cluster_of`, analytic compute at 0.02 TFLOP/s); and the three presets
at 8K on 8 H800 nodes with p, m, n, in-flight cap, recompute and NIC split from the
planner (`disagmoe plan --gpus 64 --seq-len 8192 --exchange-chunks 4`: `planner.plan_for`, profile
auto, each plan scored by a replay of breadth with 4 exchange chunks), the global batch the
planner's stage 4 picks (micro-batches per replica doubled while the replay is more than 1.1x
its bound and doubling pays).
Nominal clusters, no GPU measurement. Prints a table; writes JSON with a `rows` list.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from results_io import write_json

from disagmoe.bench.cli import emulated_cluster_of
from disagmoe.config import ClusterConfig, ModelConfig
from disagmoe.planner import plan_for
from disagmoe.presets import CLUSTER_PRESETS, model_preset
from disagmoe.simulator import simulate_disagg
from disagmoe.simulator.choose import CANDIDATES, CHUNK_CANDIDATES

# The planner's simulator profile replays breadth with 4 exchange chunks, auto's usual pick.
PLAN_EXCHANGE_CHUNKS = 4


def settings() -> list[tuple[str, ModelConfig, ClusterConfig, dict[str, Any]]]:
    small = model_preset("small")
    out = [
        ("bench default (2 workers)", small, emulated_cluster_of(1, 0.2),
         dict(groups=1, attn_workers=1, expert_workers=1, seq_len=128, micro_batch_size=2,
              num_micro_batches=8)),
        ("bench 8 workers (4x2)", small, emulated_cluster_of(2, 0.4),
         dict(groups=1, attn_workers=4, expert_workers=4, seq_len=128, micro_batch_size=4,
              num_micro_batches=16)),
        ("bench 16 workers (8x2)", small, emulated_cluster_of(2, 0.4),
         dict(groups=1, attn_workers=8, expert_workers=8, seq_len=128, micro_batch_size=2,
              num_micro_batches=32)),
        # the same two with an in-flight cap of 3 slots (memory-bound runs): where steady wins
        ("bench 8 workers, cap 3", small, emulated_cluster_of(2, 0.4),
         dict(groups=1, attn_workers=4, expert_workers=4, seq_len=128, micro_batch_size=4,
              num_micro_batches=16, max_in_flight=3)),
        ("bench 16 workers, cap 3", small, emulated_cluster_of(2, 0.4),
         dict(groups=1, attn_workers=8, expert_workers=8, seq_len=128, micro_batch_size=2,
              num_micro_batches=32, max_in_flight=3)),
    ]  # fmt: skip
    h800 = CLUSTER_PRESETS["h800"]
    for name in ("deepseek-moe-16b", "qwen3-30b-a3b", "gpt-oss-20b"):
        model = model_preset(name)
        plan = plan_for(model, h800, gpus=64, seq_len=8192, micro_batch_size=1, profile="auto",
                        exchange_chunks=PLAN_EXCHANGE_CHUNKS)  # fmt: skip
        kw = dict(
            groups=plan.groups,
            attn_workers=plan.attn_gpus_per_group,
            expert_workers=plan.ffn_gpus_per_group,
            seq_len=8192,
            micro_batch_size=1,
            num_micro_batches=plan.sequences_per_step,
            max_in_flight=plan.in_flight,
            recompute=plan.recompute,
            recompute_layers=plan.recompute_layers,
            nic_split=(plan.attn_nics_per_group, plan.ffn_nics_per_group),
        )
        out.append((f"{name} 8K, 8 H800 nodes", model, h800, kw))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", default="", help="write the rows here")
    args = parser.parse_args()
    rows = []
    names = [f"{o}{'+c' if c else ''}" for o, c in CANDIDATES]
    more = [f"best c{k}" for k in CHUNK_CANDIDATES if k > 1] + ["best +W"]
    print(f"{'setting':34s} {'p/m/n':>8s} {'M':>3s} {'cap':>3s} "
          + " ".join(f"{n:>9s}" for n in names + more)
          + f" {'chosen':>11s} {'chunks':>6s} {'step s':>8s} {'bound s':>8s} {'st/bd':>6s}"
          f" {'c1 st/bd':>8s} {'one-slot':>8s}  binding")  # fmt: skip
    for label, model, cluster, kw in settings():
        t0 = time.perf_counter()
        # one auto replay tries every (order, costs, chunks) candidate (simulator.choose)
        auto = simulate_disagg(model, cluster, order="auto", exchange_chunks=0, reduce=True,
                               split_backward=None, **kw)  # fmt: skip
        steps: dict[str, dict[int, float]] = {}
        split_steps = []
        for order, costed, chunks, step, split in auto.config["auto_steps"]:
            if split:
                split_steps.append(step)
            else:
                steps.setdefault(f"{order}{'+c' if costed else ''}", {})[chunks] = step
        best = {k: min(v[k] for v in steps.values()) for k in CHUNK_CANDIDATES}
        # none where the plan recomputes: a recomputing run keeps whole backwards
        best_split = min(split_steps, default=None)
        one = simulate_disagg(
            model, cluster, order="auto", exchange_chunks=0, reduce=True, split_backward=None,
            **{**kw, "num_micro_batches": kw["attn_workers"]},
        )  # fmt: skip
        bound = auto.bound.seconds if auto.bound else 0.0
        chosen = (
            f"{auto.config['order']}{'+c' if auto.config['costed'] else ''}"
            f"{'+W' if auto.config['split_backward'] else ''}"
        )
        chunks = auto.config["exchange_chunks"]
        layout = f"{kw['groups']}/{kw['attn_workers']}/{kw['expert_workers']}"
        cap = kw.get("max_in_flight", 0)
        print(f"{label:34s} {layout:>8s} {kw['num_micro_batches']:3d} {cap:3d} "
              + " ".join(f"{steps[n][1]:9.4f}" for n in names)
              + " " + " ".join(f"{best[k]:9.4f}" for k in CHUNK_CANDIDATES if k > 1)
              + (f" {best_split:9.4f}" if best_split is not None else f" {'-':>9s}")
              + f" {chosen:>11s} {chunks:6d} {auto.step_time_s:8.4f} {bound:8.4f} "
              f"{auto.step_time_s / bound:6.3f} {best[1] / bound:8.3f} {one.step_time_s:8.4f}  "
              f"{auto.bound.describe() if auto.bound else '-'}", flush=True)  # fmt: skip
        rows.append(
            {
                "setting": label,
                "model": model.name,
                "cluster": cluster.name,
                **{k: (list(v) if isinstance(v, tuple) else v) for k, v in kw.items()},
                "candidate_steps_s": {n: steps[n][1] for n in names},
                "candidate_steps_by_chunks_s": {n: {str(k): t for k, t in v.items()}
                                                for n, v in steps.items()},
                "best_step_by_chunks_s": {str(k): t for k, t in best.items()},
                "best_split_backward_step_s": best_split,
                "split_backward": auto.config["split_backward"],
                "chosen": chosen,
                "exchange_chunks": chunks,
                "step_s": auto.step_time_s,
                "bound_s": bound,
                "step_over_bound": auto.step_time_s / bound,
                "unchunked_step_over_bound": best[1] / bound,
                "binding": auto.bound.describe() if auto.bound else "",
                "one_slot_step_s": one.step_time_s,
                "one_slot_exchange_chunks": one.config["exchange_chunks"],
                "seconds": time.perf_counter() - t0,
            }
        )  # fmt: skip
    if args.json:
        write_json(args.json, {"link_model": "fair", "rows": rows})


if __name__ == "__main__":
    main()
