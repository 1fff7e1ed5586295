"""The analytic pipeline profile of a plan (what stages 1-2 choose p and recompute with,
`planner.seed`, and stage 3's default score), the ring's length and the score every stage
minimises."""

from __future__ import annotations

from typing import TYPE_CHECKING

import disagmoe.costs.costmodel as cm

if TYPE_CHECKING:
    from disagmoe.planner.plan import Plan, Planner


def score(plan: Plan, seconds: float) -> float:
    """What stage 3 and the choice of p minimise: profile seconds per sequence trained."""
    return seconds / plan.sequences_per_step


class AnalyticProfile:
    """A stand-in for a measured run: the AF-Pipe pipeline model of docs/design.md §2.3.

    Beyond the MILP's roofline it models (so stage 3 has something to find):
    * optionally (`dedup=True`) dispatch de-duplication: a token goes once to each F-worker
      holding >= 1 of its top-k experts, so wire bytes scale by E[distinct workers]/k under
      uniform routing. Off by default: it rewards tiny FFN groups (n=2 -> 4x less traffic for
      k=8) whose traffic would really stay inside a node on NVLink, which this model omits;
      the design's V (k copies per token) is the conservative bound;
    * per-message latency: each stage an A-replica exchanges with n F-workers and an F-worker
      with m replicas, forward and backward (2 * peers * cluster.latency_us);
    * the ring A0 -> F0 -> A1 -> ... -> F(p-1) has R = 2p compute components (the exchanges
      overlap on their own lane); with K < R micro-batches in flight (memory) it runs R/K
      slower;
    * step = (R/K) * N * v * T + (2p - 1) * T + T_M2N  (fill/drain of 2p components; the
      design's (2L-1) * max(T_a, T_f) + T_M2N when v = 1).
    """

    def __init__(self, planner: Planner, *, dedup: bool = False) -> None:
        self.planner = planner
        self.dedup = dedup

    def __call__(self, plan: Plan) -> float:
        pl = self.planner
        model, cluster = pl.model, pl.cluster
        m, n = plan.attn_gpus_per_group, plan.ffn_gpus_per_group
        u = pl.units(plan.groups, plan.recompute)
        dedup = (
            cm.distinct_worker_fraction(model.num_experts, model.top_k, n) if self.dedup else 1.0
        )
        if pl.options.roofline_only:
            attn_nic, ffn_nic = u.attn_nic * dedup, u.ffn_nic * dedup
        else:
            c = cm.detailed_costs(model, pl.seq_len, plan.groups)
            attn_nic = 2.0 * (c.dispatch_bytes * dedup + c.hop_bytes) / u.bytes_per_s
            ffn_nic = 2.0 * c.dispatch_bytes * dedup / u.bytes_per_s
        seqs = m * pl.micro_batch_size
        lat = 2.0 * cluster.latency_us * 1e-6
        comm_a = seqs * attn_nic / plan.attn_nics_per_group
        t_a = max(seqs * u.attn_gpu / m, comm_a) + lat * n
        t_f = max(seqs * u.ffn_gpu / n, seqs * ffn_nic / plan.ffn_nics_per_group) + lat * m
        t = max(t_a, t_f)
        slow = max(1.0, ring_length(plan.groups) / plan.in_flight)
        return (
            slow * plan.micro_batches * plan.virtual_stages * t + (2 * plan.groups - 1) * t + comm_a
        )


def ring_length(groups: int) -> int:
    """Micro-batches in flight that keep all 2p compute components of the ring busy."""
    return 2 * groups
