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

`planner.split.planned_split` asks the planner (`planner.plan_for`) for p, m, n, M_a, M_f,
the in-flight cap and recomputation and uses them as they are: the runtime runs
any n <= E (uneven expert shards) and any m up to the micro-batch count (replicas
with different numbers of micro-batches), docs/design-notes.md "Uneven splits".
"""

from __future__ import annotations

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
