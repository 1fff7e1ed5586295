"""Ablations in the simulator: AF-Pipe against EP 1F1B as the A:F split, the sequence length,
top-k, the EP size and the number of virtual stages change; each with the planner's choice
marked and the step-time bound. Figures and JSON in docs/figures/ (docs/simulator.md).

    .venv/bin/python benchmarks/ablations.py [--out docs/figures] [--quick]

Cluster: the h800 preset, nominal (datasheet peaks x the preset's mfu and bw_efficiency,
analytic per-op costs; no GPU measurement). One sequence per micro-batch.

* **The planner's choice** is what `disagmoe plan` prints at these sizes: stages 1-3
  scored by the simulator profile (`plan_for(..., profile="simulator")`), simulated as
  planned (p, m, n, NIC split M_a : M_f, in-flight cap, recompute, micro-batches).
* **A split m : n** at a given p is the planner's plan with m replaced: the NIC split in
  proportion m : n, the most micro-batches in flight its memory model admits, the
  planner's recompute and micro-batch count (`Planner.evaluate`, scored by the same
  `SimulatorProfile`). Splits the memory model rules out are left out.
* **EP 1F1B** (`simulator.simulate_ep`, "ep-1f1b") runs on the same GPUs with about the
  same global batch as the planner's plan; pp = the largest divisor of L <= nodes that
  divides the GPUs, ep = the largest divisor of dp and E (as benchmarks/simulate_sweeps.py);
  `memory_gib` is its fullest rank's peak by the runtime's memory model (`simulate_ep`),
  and `fits` whether that is within the GPU's memory (the point is simulated either way).
* Throughput is tokens/s per GPU; "vs EP" divides by EP 1F1B's. The bound of a point is
  `tokens / bound_s` (`simulator.bound`): what its hardware allows for that layout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from disagmoe.config import ModelConfig
from disagmoe.planner import Plan, Planner, PlanOptions, plan_for
from disagmoe.planner.sim_profile import SimulatorProfile
from disagmoe.planner.split import memory_in_flight
from disagmoe.presets import CLUSTER_PRESETS, MODEL_PRESETS
from disagmoe.simulator import SimResult, simulate_ep

H800 = CLUSTER_PRESETS["h800"]
MODEL = "qwen3-30b-a3b"


@dataclasses.dataclass
class Case:
    """One model at one size: its planner, profile and the planner's plan."""

    model: ModelConfig
    nodes: int
    seq_len: int

    def __post_init__(self) -> None:
        self.gpus = self.nodes * H800.gpus_per_node
        kw: dict[str, Any] = dict(gpus=self.gpus, seq_len=self.seq_len, micro_batch_size=1)
        # stages 1-3 only: every point at the ring formula's micro-batches (no stage 4)
        # stages 1-3 (the points below vary whole recompute modes only)
        self.plan = plan_for(
            self.model, H800, profile="simulator", batch_stage=False, layers_stage=False, **kw
        )
        self.planner = Planner(
            model=self.model, cluster=H800, options=PlanOptions(profile="simulator"), **kw
        )
        self.profile = SimulatorProfile(self.planner)

    def point(self, plan: Plan, **extra: Any) -> dict[str, Any]:
        """A plan's simulated throughput and bound, per GPU."""
        result = self.profile.result(plan)
        assert result is not None, "a plan the validator rejects"
        return {**extra, **_per_gpu(result, self.gpus), **_layout(plan)}

    def split(self, groups: int, m: int) -> Plan | None:
        """The planner's plan at p = `groups` with m replicas (module doc), or None."""
        if groups != self.plan.groups:
            try:
                base = plan_for(self.model, H800, gpus=self.gpus, seq_len=self.seq_len,
                                micro_batch_size=1, profile="analytic", groups=groups,
                                search_moves=0)  # fmt: skip
            except ValueError:  # no split at this p fits the GPU's memory
                return None
        else:
            base = self.plan
        prob = self.planner.problem(groups, 1, base.recompute)
        ma = max(1, min(prob.nics - 1, round(prob.nics * m / prob.gpus)))
        k = memory_in_flight(self.planner, groups, m, base.recompute)
        return self.planner.evaluate(
            groups=groups, m=m, attn_nics=ma, in_flight=min(k, base.micro_batches),
            recompute=base.recompute, profile=self.profile, stage="sweep",
        )  # fmt: skip

    def ep(self, runtime: str = "ep-1f1b", *, pp: int = 0, ep: int = 0) -> dict[str, Any]:
        """An EP runtime on the same GPUs, about the planner's global batch."""
        pp = pp or max(d for d in range(1, self.nodes + 1)
                       if self.model.num_layers % d == 0 and self.gpus % d == 0)  # fmt: skip
        dp = self.gpus // pp
        ep = ep or max(
            d for d in range(1, dp + 1) if dp % d == 0 and self.model.num_experts % d == 0
        )
        micro = max(dp, round(self.plan.sequences_per_step / dp) * dp)
        result = simulate_ep(
            runtime, self.model, H800, gpus=self.gpus, pp=pp, ep=ep, seq_len=self.seq_len,
            micro_batch_size=1, num_micro_batches=micro, chunks=2,
        )  # fmt: skip
        gib = result.config["memory_gib_per_gpu"]
        return {
            "runtime": runtime, "pp": pp, "ep": ep, "memory_gib": gib,
            "fits": gib <= self.planner.cap_bytes / 1024**3, **_per_gpu(result, self.gpus),
        }  # fmt: skip


def _per_gpu(result: SimResult, gpus: int) -> dict[str, Any]:
    bound = result.bound
    assert bound is not None
    return {
        "step_time_s": result.step_time_s,
        "tokens_per_s_per_gpu": result.tokens_per_s / gpus,
        "bound_s": bound.seconds,
        "bound_tokens_per_s_per_gpu": result.tokens_per_step / bound.seconds / gpus,
        "binding": bound.binding,
        "comm_exposed": result.share("comm_exposed"),
    }


def _layout(plan: Plan) -> dict[str, Any]:
    return {
        "groups": plan.groups,
        "attn_workers": plan.attn_gpus_per_group,
        "expert_workers": plan.ffn_gpus_per_group,
        "attn_nics": plan.attn_nics_per_group,
        "ffn_nics": plan.ffn_nics_per_group,
        "in_flight": plan.in_flight,
        "recompute": plan.recompute,
        "micro_batches": plan.micro_batches,
    }


def m_grid(gpus: int, points: int) -> list[int]:
    """About `points` replica counts over 1..gpus-1, powers of two and the middle included."""
    every = sorted({max(1, min(gpus - 1, round(i * gpus / points))) for i in range(1, points)})
    return sorted(set(every) | {d for d in (1, 2, 4, 8, 16, 32, 64) if d < gpus} | {gpus // 2})


def sweep_split(seqs: list[int], groups: list[int], points: int) -> list[dict[str, Any]]:
    """Per sequence length: every m : n on the grid per p, the planner's plan, EP 1F1B."""
    out = []
    for seq in seqs:
        case = Case(MODEL_PRESETS[MODEL], 8, seq)
        ep = case.ep()
        chosen = case.point(case.plan, kind="planner")
        rows = [chosen]
        for p in sorted(set(groups) | {case.plan.groups}):
            for m in m_grid(case.gpus // p, points):
                plan = case.split(p, m)
                if plan is not None:
                    rows.append(case.point(plan, kind="split"))
        for r in rows:
            r["vs_ep"] = r["tokens_per_s_per_gpu"] / ep["tokens_per_s_per_gpu"]
            r["bound_vs_ep"] = r["bound_tokens_per_s_per_gpu"] / ep["tokens_per_s_per_gpu"]
        out.append({"seq_len": seq, "ep": ep, "points": rows})
        print(
            f"  {seq:6d}: planner p={chosen['groups']} {chosen['attn_workers']}:"
            f"{chosen['expert_workers']} {chosen['vs_ep']:.2f}x EP 1F1B "
            f"(bound {chosen['bound_vs_ep']:.2f}x); best split "
            f"{max(r['vs_ep'] for r in rows):.2f}x"
        )
    return out


def sweep_top_k(ks: list[int], seq: int) -> list[dict[str, Any]]:
    out = []
    for k in ks:
        case = Case(dataclasses.replace(MODEL_PRESETS[MODEL], top_k=k), 8, seq)
        rows = {"top_k": k, "disagg": case.point(case.plan, kind="planner"),
                "ep-1f1b": case.ep(), "ep-1f1b-wide": case.ep(pp=1)}  # fmt: skip
        out.append(rows)
        print(_line(f"top-k {k}", rows))
    return out


def sweep_ep_size(nodes: list[int], seq: int) -> list[dict[str, Any]]:
    """EP over every GPU (pp = 1, ep = GPUs) as the cluster grows, against AF-Pipe there."""
    out = []
    for n in nodes:
        case = Case(MODEL_PRESETS[MODEL], n, seq)
        rows = {"nodes": n, "disagg": case.point(case.plan, kind="planner"),
                "ep-1f1b": case.ep(), "ep-1f1b-wide": case.ep(pp=1)}  # fmt: skip
        out.append(rows)
        print(_line(f"{n} nodes (EP {rows['ep-1f1b-wide']['ep']})", rows))
    return out


def sweep_virtual(seq: int) -> list[dict[str, Any]]:
    """v = L/p: per p the planner's best plan at that p (stages 1-2 scored by the
    simulator; stage 3 only for the planner's own p)."""
    case = Case(MODEL_PRESETS[MODEL], 8, seq)
    ep = case.ep()
    out = []
    for p in case.planner.group_candidates():
        if p == case.plan.groups:
            plan = case.plan
        else:
            try:
                seed = plan_for(case.model, H800, gpus=case.gpus, seq_len=seq,
                                micro_batch_size=1, profile="analytic", groups=p,
                                search_moves=0)  # fmt: skip
            except ValueError:  # no split at this p fits the GPU's memory
                print(f"  p={p:2d}: no feasible plan")
                continue
            plan = dataclasses.replace(seed, step_time_s=case.profile(seed))
        r = case.point(plan, kind="planner" if plan is case.plan else "p",
                       virtual_stages=case.model.num_layers // p)  # fmt: skip
        r["vs_ep"] = r["tokens_per_s_per_gpu"] / ep["tokens_per_s_per_gpu"]
        out.append(r)
        print(
            f"  v={r['virtual_stages']:2d} p={p:2d} {r['attn_workers']}:{r['expert_workers']} "
            f"K{r['in_flight']} {r['recompute']}: {r['vs_ep']:.2f}x EP 1F1B, "
            f"step/bound {r['step_time_s'] / r['bound_s']:.2f}"
        )
    return out


def _line(label: str, rows: dict[str, Any]) -> str:
    d, e, w = rows["disagg"], rows["ep-1f1b"], rows["ep-1f1b-wide"]
    return (
        f"  {label:18s} disagg {d['tokens_per_s_per_gpu']:7.0f} tok/s/GPU "
        f"(step/bound {d['step_time_s'] / d['bound_s']:.2f}, p={d['groups']} "
        f"{d['attn_workers']}:{d['expert_workers']})  ep-1f1b pp{e['pp']} ep{e['ep']} "
        f"{e['tokens_per_s_per_gpu']:7.0f} ({e['memory_gib']:.0f} GiB)  pp1 ep{w['ep']} "
        f"{w['tokens_per_s_per_gpu']:7.0f} ({w['memory_gib']:.0f} GiB)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="docs/figures")
    parser.add_argument("--quick", action="store_true", help="fewer points (smoke test)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    q = args.quick
    print(f"A:F split vs sequence length ({MODEL}, 8 nodes)")
    seqs = [4096, 32768] if q else [4096, 8192, 16384, 32768]
    data: dict[str, Any] = {"split": sweep_split(seqs, [1] if q else [1, 2], 4 if q else 8)}
    print(f"top-k ({MODEL} 8K, 8 nodes)")
    data["top_k"] = sweep_top_k([1, 8] if q else [1, 2, 4, 8], 8192)
    print(f"EP size ({MODEL} 8K)")
    data["ep_size"] = sweep_ep_size([1, 8] if q else [1, 2, 4, 8], 8192)
    print(f"virtual stages ({MODEL} 8K, 8 nodes)")
    data["virtual"] = [] if q else sweep_virtual(8192)
    data["meta"] = {
        "model": MODEL,
        "cluster": dataclasses.asdict(H800),
        "seconds": time.perf_counter() - t0,
        "note": "simulated, nominal h800 preset; planner = plan_for(profile='simulator')",
    }
    (out / "ablations.json").write_text(json.dumps(data, indent=1))
    from ablation_plots import plot_ablations  # matplotlib only here

    plot_ablations(out, data)
    print(f"wrote {out}/ablation_*.png and ablations.json in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
