"""Where the simulated disaggregated workers sit, and how the NICs are split between them.

Placement is the runtime's (`parallel.placement`, `distributed.placement`): the
`Layout` says which worker each rank is, and rank r runs on GPU r. With `packed` and
m, n >= one node, a group's A and F workers sit on different nodes and every M2N / N2M
byte crosses InfiniBand; `node-aware` (default) puts A and F of a group on every node in
proportion m : n, so the share of a replica's dispatch that goes to shards on its own
node (about GPUs per node / (m + n)) moves over NVLink. The N2M combine goes to the
*next* group's replicas (p > 1), on other nodes.

NIC split (`nic_shares`): the planner (docs/design.md §2.4) gives each group's
attention and FFN workers M_a and M_f NICs. Physically a node's NICs form one
pool that its GPUs reach over NVLink (PXN), so the simulator gives the group's
attention workers the fraction M_a / (M_a + M_f) of the NIC bandwidth of the
group's GPUs and the FFN workers the rest. The design's M_a + M_f = M_tot / 2
counts each byte once although it leaves one NIC and enters another; the
simulator charges the sender's egress and the receiver's ingress separately,
so it splits all NICs in the planner's proportion rather than idling half.
The split needs A and F on the same nodes: it is applied with `node-aware`.

`planned_split` asks the planner (`planner.plan_for`) for p, m, n, M_a, M_f,
the in-flight cap and recomputation, then moves to the nearest split the runtime
can run (n | E) that the planner's own checks (memory, NIC locality) accept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config import ClusterConfig, ModelConfig
from ..distributed.layout import Layout
from .network import Network


def nic_shares(layout: Layout, net: Network, attn_nics: int, ffn_nics: int) -> tuple[float, ...]:
    """Per rank NIC bytes/s: the planner's M_a : M_f of the group's NIC bandwidth."""
    if attn_nics < 1 or ffn_nics < 1:
        raise ValueError("the NIC split needs at least one NIC for each side")
    m, n = layout.attn_workers, layout.expert_workers
    pool = (m + n) * net.nic_bytes_per_gpu
    frac = attn_nics / (attn_nics + ffn_nics)
    return tuple(
        pool * frac / m if layout.role(r).comp == "A" else pool * (1.0 - frac) / n
        for r in range(layout.world_size)
    )


@dataclass(frozen=True, slots=True)
class PlannedSplit:
    groups: int
    attn_workers: int
    expert_workers: int
    attn_nics: int  # per group, the planner's M_a
    ffn_nics: int  # per group, the planner's M_f
    in_flight: int  # micro-batches a worker may hold: the planner's memory limit
    recompute: bool  # the planner chose full activation recomputation
    note: str  # how the planner's answer was adapted


def memory_in_flight(planner: Any, groups: int, m: int, attn_nics: int, recompute: str) -> int:
    """Most micro-batches in flight the planner's memory model admits (at least 1)."""
    k = max(1, planner.max_in_flight_attn(groups, recompute))
    while k > 1 and (
        planner.evaluate(groups=groups, m=m, attn_nics=attn_nics, in_flight=k, recompute=recompute)
        is None
    ):
        k -= 1
    return k


def runnable_in_flight(
    model: ModelConfig,
    cluster: ClusterConfig,
    *,
    gpus: int,
    seq_len: int,
    micro_batch_size: int,
    groups: int,
    attn_workers: int,
    recompute: bool,
) -> int:
    """`memory_in_flight` for a given split (one fair NIC share per GPU)."""
    from ..planner import Planner, PlanOptions

    planner = Planner(
        model=model, cluster=cluster, gpus=gpus, seq_len=seq_len,
        micro_batch_size=micro_batch_size, options=PlanOptions(groups=groups),
    )  # fmt: skip
    rc = "full" if recompute else "none"
    nics = planner.problem(groups, 1, rc).nics
    ma = max(1, min(nics - 1, round(nics * attn_workers / (gpus // groups))))
    return memory_in_flight(planner, groups, attn_workers, ma, rc)


def planned_split(
    model: ModelConfig,
    cluster: ClusterConfig,
    *,
    gpus: int,
    seq_len: int,
    micro_batch_size: int,
    groups: int = 0,
    micro_batches: int = 0,
) -> PlannedSplit:
    """The planner's (p, m, n, M_a, M_f), in-flight cap and recompute choice.

    The runtime needs n | E (and m | `micro_batches` when that is given), which the
    planner's MILP does not impose; among the runnable splits the planner accepts
    (`Planner.evaluate`: memory, NIC locality) the one its own profile scores best is
    used. In flight: the most micro-batches its memory model admits for that split.
    (The plan's own `in_flight` stops at its ring length 2p — enough to keep the 2p
    compute components busy, but AF-Pipe also has 2p exchange stages to overlap.)
    """
    from ..planner import Planner, PlanOptions, plan_for

    plan = plan_for(
        model, cluster, gpus=gpus, seq_len=seq_len, micro_batch_size=micro_batch_size,
        groups=groups,
    )  # fmt: skip
    p = plan.groups
    per = gpus // p
    m0, ma0 = plan.attn_gpus_per_group, plan.attn_nics_per_group
    planner = Planner(
        model=model, cluster=cluster, gpus=gpus, seq_len=seq_len,
        micro_batch_size=micro_batch_size, options=PlanOptions(groups=p),
    )  # fmt: skip
    nics = planner.problem(p, 1, plan.recompute).nics
    candidates = [
        m
        for m in range(1, per)
        if model.num_experts % (per - m) == 0 and (not micro_batches or micro_batches % m == 0)
    ]
    best: tuple[float, PlannedSplit] | None = None
    for m in candidates:
        feasible = [
            ma
            for ma in range(1, nics)
            if planner.evaluate(groups=p, m=m, attn_nics=ma, in_flight=1, recompute=plan.recompute)
        ]
        if not feasible:
            continue  # NIC locality, or memory with one micro-batch
        k = memory_in_flight(planner, p, m, feasible[0], plan.recompute)
        for ma in feasible:
            got = planner.evaluate(
                groups=p, m=m, attn_nics=ma, in_flight=min(k, plan.in_flight),
                recompute=plan.recompute,
            )  # fmt: skip
            assert got is not None
            score = got.step_time_s / got.sequences_per_step
            if best is None or score < best[0] - 1e-12:
                note = f"planner m={m0}, n={per - m0}, M_a={ma0}"
                if (m, ma) != (m0, ma0):
                    note += f"; runnable: m={m}, n={per - m}, M_a={ma}"
                split = PlannedSplit(
                    groups=p,
                    attn_workers=m,
                    expert_workers=per - m,
                    attn_nics=ma,
                    ffn_nics=nics - ma,
                    in_flight=k,
                    recompute=plan.recompute == "full",
                    note=f"{note}; memory allows {k} in flight",
                )
                best = (score, split)
    if best is not None:
        return best[1]
    raise ValueError(
        f"no runnable split of {per} GPUs per group that the planner accepts: n must divide "
        f"{model.num_experts} experts"
        + (f" and m the {micro_batches} micro-batches" if micro_batches else "")
    )
