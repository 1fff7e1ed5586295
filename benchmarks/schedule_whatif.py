"""What a token-chunked LM head would buy AF-Pipe's schedule: a what-if on the generator's own
timeline, not a simulation of anything the runtime runs.

    .venv/bin/python benchmarks/schedule_whatif.py [--json benchmarks/results/schedule_whatif.json]

For each setting of `benchmarks/schedule_orders.py` (the three bench settings, the two
capped ones, the three presets' plans at 8K on 8 H800 nodes) this builds AF-Pipe's task
graph (`schedule.afpipe.build_afpipe_graph`, the reduced layout, ordered with the run's
costs and links as `simulator.choose` prices them) at 4 and 8 exchange chunks, breadth and
steady, rewrites it, and list-schedules it (`schedule.graph.list_schedule`, a rank's lanes
sharing its compute, one compute at a time by priority) — the makespan of the generator's timeline, which has neither the
gradient all-reduce nor the optimizer step, so compare the columns with each other, and
with the bound (`simulator.bound`, of the unmodified run), not with the simulated steps of
docs/simulator.md:

* `head/c` — the LM head and loss (attention "layer" L) split by tokens into as many pieces
  as exchange chunks: piece k consumes combine chunk k of every shard and its backward
  produces grad_combine chunk k (exchange chunks cut by token ranges), so the shards begin
  a slot's backward while the rest of its head runs;
* `+W` — the lists with deferred weight gradients (`schedule.split_backward`, a mechanism
  the runtime has: `runtime.wgrad`), as generated, for comparison on the same timeline;
* `+W head/c` — both.

Prints a table (seconds; `st/bd` columns: the timeline over the bound) and with `--json` a
`rows` list.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import replace
from typing import Any

from results_io import write_json
from schedule_orders import settings

from disagmoe.config import ClusterConfig, ModelConfig, ParallelConfig
from disagmoe.costs import costmodel as cm
from disagmoe.distributed.layout import Layout
from disagmoe.schedule.afpipe import build_afpipe_graph, reduced_layout
from disagmoe.schedule.graph import Task, TaskGraph, list_schedule
from disagmoe.schedule.ir import Op
from disagmoe.simulator import simulate_disagg
from disagmoe.simulator.choose import schedule_costs
from disagmoe.simulator.costs import AnalyticCosts, Workload
from disagmoe.simulator.network import Network
from disagmoe.simulator.placement import nic_shares

CHUNKS = (4, 8)
ORDERS = ("breadth", "steady")
VARIANTS = ("as is", "head/c", "+W", "+W head/c")


def split_head(g: TaskGraph, num_layers: int, pieces: int) -> TaskGraph:
    """`g` with each LM-head compute (A, layer L) as `pieces` token pieces (module doc)."""
    out = TaskGraph(ports=g.ports)
    split: dict[Task, list[Task]] = {}
    for t in g.tasks:
        if t.comp == "A" and t.layer == num_layers:
            split[t] = [replace(t, chunk=k) for k in range(pieces)]
            for k, piece in enumerate(split[t]):
                out.add(piece, g.cost[t] / pieces, (*g.priority[t], k))
        else:
            out.add(t, g.cost[t], g.priority[t])

    def last(t: Task) -> Task:
        return split[t][-1] if t in split else t

    for t, msgs in g.inputs.items():
        for m in msgs:  # a chunked message goes to its token piece, the others to piece 0
            out.inputs[split[t][max(m.chunk, 0)] if t in split else t].append(m)
    for t, msgs in g.outputs.items():
        for m in msgs:
            out.outputs[split[t][m.chunk] if t in split and m.chunk >= 0 else last(t)].append(m)
    for t, deps in g.local_deps.items():
        if t in split and t.op == Op.BWD:  # backward piece k after forward piece k
            fwd = split[replace(t, op=Op.FWD)]
            for k, piece in enumerate(split[t]):
                out.local_deps[piece].append(fwd[k])
            for d in deps:
                if d != replace(t, op=Op.FWD):
                    out.local_deps[split[t][0]].append(last(d))
        else:
            for piece in split.get(t, [t]):
                out.local_deps[piece] += [last(d) for d in deps]
    return out


def whatif(
    label: str, model: ModelConfig, cluster: ClusterConfig, kw: dict[str, Any]
) -> dict[str, Any]:
    parallel = ParallelConfig(
        groups=kw["groups"], attn_workers=kw["attn_workers"],
        expert_workers=kw["expert_workers"], placement="node-aware",
    )  # fmt: skip
    layout = Layout.build(model, parallel, ranks_per_node=cluster.gpus_per_node)
    micro = kw["num_micro_batches"]
    slots = layout.slots_of_replica(0, micro)
    workload = Workload(model, kw["seq_len"], kw["micro_batch_size"])
    recompute = kw.get("recompute", "none")
    # each group's first `recompute_layers` layers only, where the plan says so (as the replay)
    recomputed = cm.group_recomputed(model, kw["groups"], recompute, kw.get("recompute_layers", 0))
    costs = AnalyticCosts.for_cluster(
        workload, cluster, kw["attn_workers"], kw["expert_workers"], recompute, recomputed
    )
    net = Network.from_cluster(cluster)
    if "nic_split" in kw:
        net = dataclasses.replace(net, nic_share=nic_shares(layout, net, *kw["nic_split"]))
    priced = schedule_costs(layout, micro, costs, workload, net)
    reduced, reduced_micro = reduced_layout(layout, micro)
    L = model.num_layers
    bound = simulate_disagg(model, cluster, order="breadth", costed=True, exchange_chunks=4,
                            reduce=True, **kw).bound  # fmt: skip
    assert bound is not None
    row: dict[str, Any] = {"setting": label, "bound_s": bound.seconds, "timeline_s": {}}
    for chunks in CHUNKS:
        for order in ORDERS:
            g, w = (
                build_afpipe_graph(
                    reduced, slots, kw.get("max_in_flight", 0), order,
                    num_micro_batches=reduced_micro, costs=priced, exchange_chunks=chunks,
                    split_backward=split,
                )
                for split in (False, True)
            )  # fmt: skip
            graphs = {
                "as is": g,
                "head/c": split_head(g, L, chunks),
                "+W": w,
                "+W head/c": split_head(w, L, chunks),
            }
            for name, graph in graphs.items():
                timeline = list_schedule(graph, priced.latency_s, shared_compute=True)
                row["timeline_s"][f"{order} c{chunks} {name}"] = max(timeline.end.values())
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", default="", help="write the rows here")
    args = parser.parse_args()
    rows = []
    print(f"{'setting':34s} {'bound s':>7s} {'order':>10s} "
          + " ".join(f"{v:>7s} {'st/bd':>5s}" for v in VARIANTS))  # fmt: skip
    for label, model, cluster, kw in settings():
        row = whatif(label, model, cluster, kw)
        rows.append(row)
        for chunks in CHUNKS:
            for order in ORDERS:
                cells = [row["timeline_s"][f"{order} c{chunks} {v}"] for v in VARIANTS]
                print(f"{label:34s} {row['bound_s']:7.4f} {f'{order} c{chunks}':>10s} "
                      + " ".join(f"{c:7.4f} {c / row['bound_s']:5.3f}" for c in cells),
                      flush=True)  # fmt: skip
    if args.json:
        write_json(args.json, {"rows": rows})


if __name__ == "__main__":
    main()
