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
the in-flight cap and recomputation and uses them as they are: the runtime runs
any n <= E (uneven expert shards) and any m up to the micro-batch count (replicas
with different numbers of micro-batches), docs/design-notes.md "Uneven splits".
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
    recompute: str  # the planner's activation recompute: none | attn | full
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
    recompute: str,
) -> int:
    """`memory_in_flight` for a given split (one fair NIC share per GPU)."""
    from ..planner import Planner, PlanOptions

    planner = Planner(
        model=model, cluster=cluster, gpus=gpus, seq_len=seq_len,
        micro_batch_size=micro_batch_size, options=PlanOptions(groups=groups),
    )  # fmt: skip
    nics = planner.problem(groups, 1, recompute).nics
    ma = max(1, min(nics - 1, round(nics * attn_workers / (gpus // groups))))
    return memory_in_flight(planner, groups, attn_workers, ma, recompute)


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

    The split is the planner's own (its MILP keeps n <= E; the runtime runs uneven
    shards and replicas); `micro_batches`, when given, must leave every one of the m
    replicas at least one. In flight: the most micro-batches its memory model admits
    for that split. (The plan's own `in_flight` stops at its ring length 2p — enough to
    keep the 2p compute components busy, but AF-Pipe also has 2p exchange stages to
    overlap.)
    """
    from ..planner import Planner, PlanOptions, plan_for

    plan = plan_for(
        model, cluster, gpus=gpus, seq_len=seq_len, micro_batch_size=micro_batch_size,
        groups=groups,
    )  # fmt: skip
    p, m, ma = plan.groups, plan.attn_gpus_per_group, plan.attn_nics_per_group
    n = gpus // p - m
    if micro_batches and micro_batches < m:
        raise ValueError(
            f"the planner's split has m={m} attention replicas per group but there are only "
            f"{micro_batches} micro-batches; give at least {m} (--micro-batches)"
        )
    assert n <= model.num_experts, (n, model.num_experts)  # the MILP's constraint
    planner = Planner(
        model=model, cluster=cluster, gpus=gpus, seq_len=seq_len,
        micro_batch_size=micro_batch_size, options=PlanOptions(groups=p),
    )  # fmt: skip
    k = memory_in_flight(planner, p, m, ma, plan.recompute)
    return PlannedSplit(
        groups=p,
        attn_workers=m,
        expert_workers=n,
        attn_nics=ma,
        ffn_nics=plan.ffn_nics_per_group,
        in_flight=k,
        recompute=plan.recompute,
        note=f"planner m={m}, n={n}, M_a={ma}; memory allows {k} in flight",
    )
