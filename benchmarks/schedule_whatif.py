"""What two mechanisms the runtime does not have would buy AF-Pipe's schedule: a what-if on the
generator's own timeline, not a simulation of anything the runtime runs.

    .venv/bin/python benchmarks/schedule_whatif.py [--json benchmarks/results/schedule_whatif.json]

For each setting of `benchmarks/schedule_orders.py` (the three bench settings, the two
capped ones, the three presets' plans at 8K on 8 H800 nodes) this builds AF-Pipe's task
graph (`schedule.afpipe.build_afpipe_graph`, the reduced layout, ordered with the run's
costs and links as `simulator.choose` prices them) at 4 and 8 exchange chunks, breadth and
steady, rewrites it, and list-schedules it (`schedule.graph.list_schedule`, a rank's lanes
sharing its compute) — the makespan of the generator's timeline, which has neither the
gradient all-reduce nor the optimizer step, so compare the columns with each other, and
with the bound (`simulator.bound`, of the unmodified run), not with the simulated steps of
docs/simulator.md:

* `head/c` — the LM head and loss (attention "layer" L) split by tokens into as many pieces
  as exchange chunks: piece k consumes combine chunk k of every shard and its backward
  produces grad_combine chunk k (exchange chunks cut by token ranges), so the shards begin
  a slot's backward while the rest of its head runs;
* `wgrad` — every backward split into its input-gradient part (what the next stage waits
  for) and its weight-gradient GEMMs (`W`: one forward's GEMM seconds — the attention
  projections or the LM head on A, the experts on F; the attention core has no weights),
  deferred: a `W` runs when its rank has nothing else ready, and the in-flight cap holds
  the slot until its `W` ran (its activations are kept until then);
* `both`.

Prints a table (seconds; `st/bd` columns: the timeline over the bound) and with `--json` a
`rows` list.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections import Counter
from dataclasses import replace
from typing import Any

from results_io import write_json
from schedule_orders import settings

from disagmoe.config import ClusterConfig, ModelConfig, ParallelConfig
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
VARIANTS = ("as is", "head/c", "wgrad", "both")


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


def split_weight_grads(g: TaskGraph, weight_s: dict[tuple[str, int], float]) -> TaskGraph:
    """`g` with every backward's weight-gradient GEMMs (`weight_s[(comp, layer)]` seconds of a
    whole, unchunked compute) as a deferred task `W` after it (module doc)."""
    out = TaskGraph(ports=g.ports)
    deferred: dict[Task, Task] = {}
    # exchange chunks of each backward: a chunk's share of its whole compute is 1/chunks
    chunks = Counter((t.comp, t.layer, t.slot, t.rank) for t in g.tasks if t.op == Op.BWD)
    for t in g.tasks:
        if t.op != Op.BWD:
            out.add(t, g.cost[t], g.priority[t])
            continue
        share = 1.0 / chunks[(t.comp, t.layer, t.slot, t.rank)]
        w = replace(t, comp=f"{t.comp}w")
        deferred[t] = w
        seconds = weight_s[(t.comp, t.layer)] * share
        out.add(t, g.cost[t] - seconds, g.priority[t])
        out.add(w, seconds, (9, *g.priority[t]))  # after anything else ready on the rank
        out.local_deps[w].append(t)
    for t, msgs in g.inputs.items():
        out.inputs[t] += msgs
    for t, msgs in g.outputs.items():
        out.outputs[t] += msgs
    for t, deps in g.local_deps.items():
        for d in deps:  # the cap: a first-stage forward waits for the old slot's W
            cap = t.op == Op.FWD and d.op == Op.BWD and d in deferred
            out.local_deps[t].append(deferred[d] if cap else d)
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
    costs = AnalyticCosts.for_cluster(
        workload, cluster, kw["attn_workers"], kw["expert_workers"], recompute
    )
    net = Network.from_cluster(cluster)
    if "nic_split" in kw:
        net = dataclasses.replace(net, nic_share=nic_shares(layout, net, *kw["nic_split"]))
    priced = schedule_costs(layout, micro, costs, workload, net)
    reduced, reduced_micro = reduced_layout(layout, micro)
    L = model.num_layers
    weight_s = {("A", layer): workload.attn_flops(layer)[0] / costs.flops_per_s
                for layer in range(L + 1)}  # fmt: skip
    weight_s |= {("F", layer): costs.compute_s(Op.FWD, "F", layer) for layer in range(L)}
    bound = simulate_disagg(model, cluster, order="breadth", costed=True, exchange_chunks=4,
                            reduce=True, **kw).bound  # fmt: skip
    assert bound is not None
    row: dict[str, Any] = {"setting": label, "bound_s": bound.seconds, "timeline_s": {}}
    for chunks in CHUNKS:
        for order in ORDERS:
            g = build_afpipe_graph(
                reduced, slots, kw.get("max_in_flight", 0), order,
                num_micro_batches=reduced_micro, costs=priced, exchange_chunks=chunks,
            )  # fmt: skip
            graphs = {
                "as is": g,
                "head/c": split_head(g, L, chunks),
                "wgrad": split_weight_grads(g, weight_s),
                "both": split_weight_grads(split_head(g, L, chunks), weight_s),
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
