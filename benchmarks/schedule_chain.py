"""Where AF-Pipe's step leaves its bound at paper scale: step/bound against the micro-batches
per replica, and when in the step the binding worker is idle.

    .venv/bin/python benchmarks/schedule_chain.py [--model qwen3-30b-a3b] [--head-scale S]
        [--json PATH]
    .venv/bin/python benchmarks/schedule_chain.py --plans [--head-scale S] [--json PATH]

gpt-oss-20b, seq 8192, 64 nominal H800 (8 nodes), p=1, m=n=32 (the planner's layout of
`benchmarks/schedule_orders.py`), breadth order, fair links, simulated (no GPU run): the
64 micro-batches with an in-flight cap of 2 the planner picked before its stage 4, its
stage-4 plan's 256 with a cap of 3, then 256 and 512 uncapped, each with each
micro-batch's exchange in 1, 2 and 4 chunks (`schedule.exchange_chunks`). For each: the
step, its bound (`simulator.bound`), and the share of each tenth of the step in which
the expert shard `F(g0,j0)` (the binding worker) computes. Prints a table; `--json PATH`
writes `{"rows": [{head_scale, micro_batches, max_in_flight, exchange_chunks, step_s,
bound_s, busy_by_tenth}]}`.

`--head-scale S`: a what-if, not a mechanism — the analytic costs with the LM head and
loss (attention "layer" L) priced at S times their seconds (`ScaledHead`), to see how much
of the gap the head's block holds.

`--plans`: the three presets' plans of `benchmarks/schedule_orders.py` (8K, 8 H800 nodes,
its planner settings and global batch) replayed as `schedule.order = auto` with
`exchange_chunks = 0` picks, with the head as it is and at `--head-scale` (default 0.25
there: about what a head split into 4 token chunks would leave exposed if the shards
overlapped the other three quarters — a what-if, not built): step, bound, step/bound,
and auto's order and chunks for each. JSON: `{"rows": [{model, head_scale, micro_batches,
max_in_flight, step_s, bound_s, order, exchange_chunks}]}`.

`--model qwen3-30b-a3b`: the layout the planner picked for it when it planned unchunked
(p=4, m=n=8, cap 8, steady: the order auto picks there), 64 micro-batches only, and the
busy share of its binding worker, the attention replica `A(g0,r0)` of group 0 (which also
holds the LM head).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from results_io import write_json

from disagmoe.costs import costmodel as cm
from disagmoe.presets import CLUSTER_PRESETS, model_preset
from disagmoe.schedule.ir import Op
from disagmoe.simulator import SimResult, simulate_disagg
from disagmoe.simulator.costs import AnalyticCosts, InstrCosts, Workload
from disagmoe.simulator.engine import COMPUTE

CHUNKS = (1, 2, 4)  # exchange chunks (schedule.exchange_chunks)


@dataclass(frozen=True)
class Setting:
    """A preset's planner layout (`benchmarks/schedule_orders.py`), order and binding worker."""

    groups: int
    workers: int  # m = n
    order: str
    worker: str
    runs: tuple[tuple[int, int], ...]  # (micro-batches per step, in-flight cap; 0: none)


SETTINGS = {
    "gpt-oss-20b": Setting(1, 32, "breadth", "F(g0,j0)", ((64, 2), (256, 3), (256, 0), (512, 0))),
    "qwen3-30b-a3b": Setting(4, 8, "steady", "A(g0,r0)", ((64, 8),)),
}


@dataclass(frozen=True)
class ScaledHead:
    """What-if costs: `base`, with the LM head and loss (attention "layer" L) priced at
    `scale` times their seconds; F shards and the other layers as they are."""

    base: InstrCosts
    num_layers: int
    scale: float

    def compute_s(self, op: Op, comp: str, layer: int) -> float:
        seconds = self.base.compute_s(op, comp, layer)
        return seconds * self.scale if comp == "A" and layer == self.num_layers else seconds


def busy_by_tenth(result: SimResult, role: str) -> list[float]:
    """Share of each tenth of the step in which `role`'s rank computes (its lanes' union)."""
    prog, timeline = result.program, result.timeline
    assert prog is not None and timeline is not None
    rank = next(w["rank"] for w in result.workers if w["role"] == role)
    spans = sorted(
        (timeline.start[op], timeline.end[op])
        for op, kind in enumerate(prog.kind)
        if kind == COMPUTE and prog.rank[op] == rank
    )
    merged: list[tuple[float, float]] = []
    for s, e in spans:
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    tenth = result.step_time_s / 10
    return [
        sum(max(0.0, min(e, (k + 1) * tenth) - max(s, k * tenth)) for s, e in merged) / tenth
        for k in range(10)
    ]


def plans(head_scale: float) -> list[dict[str, Any]]:
    """`--plans`: the presets' planned steps with the head as it is and at `head_scale`."""
    from schedule_orders import settings  # the planner's presets, as that table has them

    rows = []
    print(f"{'model':18s} {'M':>4s} {'cap':>3s} {'head':>5s} {'step s':>7s} {'bound s':>7s} "
          f"{'st/bd':>6s} {'order':>9s} {'chunks':>6s}")  # fmt: skip
    for _label, model, cluster, kw in settings():
        if "nic_split" not in kw:  # the emulated bench settings: no LM head block there
            continue
        recomputed = cm.group_recomputed(  # each group's first layers only, where planned so
            model, kw["groups"], kw["recompute"], kw.get("recompute_layers", 0)
        )
        base = AnalyticCosts.for_cluster(
            Workload(model, kw["seq_len"], kw["micro_batch_size"]), cluster,
            kw["attn_workers"], kw["expert_workers"], kw["recompute"], recomputed,
        )  # fmt: skip
        for scale in (1.0, head_scale):
            r = simulate_disagg(model, cluster, order="auto", exchange_chunks=0, reduce=True,
                                costs=ScaledHead(base, model.num_layers, scale), **kw)  # fmt: skip
            assert r.bound is not None
            order = f"{r.config['order']}{'+c' if r.config['costed'] else ''}"
            print(f"{model.name:18s} {kw['num_micro_batches']:4d} {kw['max_in_flight']:3d} "
                  f"{scale:5.2f} {r.step_time_s:7.4f} {r.bound.seconds:7.4f} "
                  f"{r.step_time_s / r.bound.seconds:6.3f} {order:>9s} "
                  f"{r.config['exchange_chunks']:6d}", flush=True)  # fmt: skip
            rows.append({"model": model.name, "head_scale": scale,
                         "micro_batches": kw["num_micro_batches"],
                         "max_in_flight": kw["max_in_flight"], "step_s": r.step_time_s,
                         "bound_s": r.bound.seconds, "order": order,
                         "exchange_chunks": r.config["exchange_chunks"]})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt-oss-20b", choices=sorted(SETTINGS))
    parser.add_argument("--json", default="", help="write the rows here")
    parser.add_argument("--head-scale", type=float, default=None, metavar="S",
                        help="what-if: price the LM head and loss at S times their seconds "
                        "(default 1, with --plans 0.25)")  # fmt: skip
    parser.add_argument("--plans", action="store_true",
                        help="the three presets' plans, head as it is and at --head-scale")  # fmt: skip
    args = parser.parse_args()
    head_scale = args.head_scale if args.head_scale is not None else 0.25 if args.plans else 1.0
    if args.plans:
        rows = plans(head_scale)
        if args.json:
            write_json(args.json, {"rows": rows})
        return
    model, cluster = model_preset(args.model), CLUSTER_PRESETS["h800"]
    setting = SETTINGS[args.model]
    rows = []
    print(f"{'micro-batches':>13s} {'cap':>3s} {'chunks':>6s} {'step s':>7s} {'bound s':>7s} "
          f"{'st/bd':>6s}  {setting.worker} busy per tenth of the step")  # fmt: skip
    costs: InstrCosts | None = None
    if head_scale != 1.0:
        base = AnalyticCosts.for_cluster(Workload(model, 8192, 1), cluster, setting.workers,
                                         setting.workers, "none")  # fmt: skip
        costs = ScaledHead(base, model.num_layers, head_scale)
    for micro, cap in setting.runs:
        for chunks in CHUNKS:
            r = simulate_disagg(model, cluster, groups=setting.groups,
                                attn_workers=setting.workers, expert_workers=setting.workers,
                                seq_len=8192, micro_batch_size=1, num_micro_batches=micro,
                                max_in_flight=cap, order=setting.order,
                                exchange_chunks=chunks, reduce=True, costs=costs)  # fmt: skip
            assert r.bound is not None
            busy = busy_by_tenth(r, setting.worker)
            print(f"{micro:13d} {cap:3d} {chunks:6d} {r.step_time_s:7.3f} {r.bound.seconds:7.3f} "
                  f"{r.step_time_s / r.bound.seconds:6.3f}  {' '.join(f'{b:.2f}' for b in busy)}",
                  flush=True)  # fmt: skip
            rows.append({"head_scale": head_scale, "micro_batches": micro,
                         "max_in_flight": cap, "exchange_chunks": chunks,
                         "step_s": r.step_time_s, "bound_s": r.bound.seconds,
                         "busy_by_tenth": busy})  # fmt: skip
    if args.json:
        write_json(args.json, {"model": model.name, "worker": setting.worker, "rows": rows})


if __name__ == "__main__":
    main()
