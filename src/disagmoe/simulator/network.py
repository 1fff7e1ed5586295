"""Where workers sit and how fast their links are: NICs across nodes, NVLink inside one.

Every GPU has an NVLink port pair (out, in) and uses a NIC port pair; when a
node has fewer NICs than GPUs, neighbouring GPUs share one NIC (its ports are
shared objects, so their messages share them, `simulator.links`); with more NICs
than GPUs a GPU's ports aggregate its NICs. Out and in are separate ports: full
duplex. Bandwidths are achievable ones (`nic_gbps * bw_efficiency`).

Placement: rank r runs on GPU r, node `r // gpus_per_node` (as torchrun numbers
ranks); which worker a rank is, is the layout's business (`distributed.placement`,
one rule for the runtime and the simulator). NIC split (`nic_share`): with
one or more NICs per GPU, rank r's NIC ports run at `nic_share[r]` bytes/s per
direction instead of the fair share — a node's NICs used as one pool (NCCL
routes a GPU's inter-node traffic through another GPU's NIC over NVLink, "PXN"),
split unevenly between the workers on the node (`simulator.placement`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ClusterConfig
from .engine import Program


@dataclass(frozen=True, slots=True)
class Network:
    gpus_per_node: int
    nics_per_node: int
    nic_bytes_per_s: float  # one NIC, one direction
    nvlink_bytes_per_s: float  # one GPU, one direction
    latency_s: float
    nic_share: tuple[float, ...] = ()  # per rank NIC bytes/s per direction (empty: fair share)

    @classmethod
    def from_cluster(cls, cluster: ClusterConfig) -> Network:
        eff = cluster.bw_efficiency
        return cls(
            gpus_per_node=cluster.gpus_per_node,
            nics_per_node=cluster.nics_per_node,
            nic_bytes_per_s=cluster.nic_gbps * 1e9 * eff,
            nvlink_bytes_per_s=cluster.nvlink_gbps * 1e9 * eff,
            latency_s=cluster.latency_us * 1e-6,
        )

    @classmethod
    def single_node(cls, bytes_per_s: float, latency_s: float, gpus: int) -> Network:
        """All workers on one host linked at `bytes_per_s` each (e.g. gloo over loopback)."""
        return cls(gpus, gpus, bytes_per_s, bytes_per_s, latency_s)

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def same_node(self, a: int, b: int) -> bool:
        return self.node_of(a) == self.node_of(b)

    @property
    def nic_bytes_per_gpu(self) -> float:
        """A GPU's fair share of its node's NIC bandwidth."""
        return self.nic_bytes_per_s * self.nics_per_node / self.gpus_per_node

    def nic_bw(self, rank: int) -> float:
        """Rank's NIC bandwidth per direction (its share of the node's NICs)."""
        return self.nic_share[rank] if self.nic_share else self.nic_bytes_per_gpu

    def nic_of(self, rank: int) -> int:
        local = rank % self.gpus_per_node
        if self.nics_per_node >= self.gpus_per_node:
            return rank
        return (
            self.node_of(rank) * self.nics_per_node
            + local * self.nics_per_node // self.gpus_per_node
        )

    def allreduce_s(self, ranks: list[int], nbytes: float) -> float:
        """Ring all-reduce of `nbytes` over `ranks`: 2(k-1)/k of the bytes over the slowest
        hop, latency per hop.

        The ring visits `ranks` in order (gloo's ring and NCCL's follow the group's rank
        order), so node-mates that are neighbours in it talk over NVLink and only the
        hops that leave a node load NICs. Those hops are spread over the NICs of the
        group's members on the node (`ring_nic_fraction`). A NIC is shared with the groups
        its other GPUs are in, assumed shaped alike and run at the same time: a group that
        holds every GPU of a node spreads its one hop over all the node's NICs, one that
        holds one GPU per node puts it on that GPU's NIC, shared with the other GPUs'
        groups. With a NIC split (`nic_share`) a node's hops run at the sum of its
        members' rates."""
        k = len(ranks)
        if k <= 1 or nbytes <= 0:
            return 0.0
        nodes = {self.node_of(r) for r in ranks}
        if len(nodes) == 1:
            bw = self.nvlink_bytes_per_s
        elif self.nic_share:
            bw = min(
                sum(self.nic_bw(r) for r in ranks if self.node_of(r) == node)
                / self._ring_leaving(ranks, node)
                for node in nodes
            )
        else:
            gpus_per_nic = max(self.gpus_per_node // self.nics_per_node, 1)
            per_nic = self.nic_bytes_per_s * max(self.nics_per_node // self.gpus_per_node, 1)
            one_per_node = {self.node_of(r): r for r in ranks}.values()
            load = max(self.ring_nic_fraction(ranks, r) for r in one_per_node) * gpus_per_nic
            bw = per_nic / load
        return 2.0 * (k - 1) / k * nbytes / bw + 2.0 * (k - 1) * self.latency_s

    def _ring_leaving(self, ranks: list[int] | tuple[int, ...], node: int) -> int:
        """Hops of the ring over `ranks` that leave `node` (as many enter it)."""
        k = len(ranks)
        return sum(
            1
            for i, r in enumerate(ranks)
            if self.node_of(r) == node and not self.same_node(r, ranks[(i + 1) % k])
        )

    def ring_nic_fraction(self, ranks: list[int] | tuple[int, ...], rank: int) -> float:
        """Fraction of `rank`'s ring hop (2(k-1)/k of the bytes out, as many in) that
        crosses its NIC in a ring all-reduce over `ranks`; the rest moves over NVLink.

        The hops leaving its node are spread evenly over the group's members there: NCCL
        runs a ring per channel and routes the channels' inter-node hops through different
        NICs, the data split over NVLink first (github.com/NVIDIA/nccl/issues/601), so a
        group with g GPUs on a node crosses the node's boundary through g NICs at 1/g of
        the data each. Members sharing one NIC add up to the one hop (the emulated
        cluster's node, one NIC for its two ranks, as gloo's single ring loads it)."""
        node = self.node_of(rank)
        here = sum(1 for r in ranks if self.node_of(r) == node)
        return self._ring_leaving(ranks, node) / here

    def a2a_s(self, ranks: list[int], me: int, bytes_per_peer: float) -> float:
        """All-to-all of `bytes_per_peer` to every other rank of `ranks`, seen from `me`."""
        peers = [r for r in ranks if r != me]
        if not peers:
            return 0.0
        local = sum(1 for r in peers if self.same_node(r, me))
        remote = len(peers) - local
        return self.latency_s + max(
            local * bytes_per_peer / self.nvlink_bytes_per_s,
            remote * bytes_per_peer / self.nic_bw(me),
        )


class Ports:
    """Port ids in a `Program` for real ranks (created on first use)."""

    def __init__(self, program: Program, net: Network) -> None:
        self.program = program
        self.net = net
        self._ids: dict[tuple[str, int], int] = {}

    def _get(self, kind: str, key: int, bw: float) -> int:
        if (kind, key) not in self._ids:
            self._ids[(kind, key)] = self.program.add_port(f"{kind}{key}", bw)
        return self._ids[(kind, key)]

    def nic(self, rank: int, direction: str) -> int:
        net = self.net
        if net.nics_per_node >= net.gpus_per_node:
            return self._get(f"nic_{direction}", rank, net.nic_bw(rank))
        return self._get(f"nic_{direction}", net.nic_of(rank), net.nic_bytes_per_s)

    def nvlink(self, rank: int, direction: str) -> int:
        return self._get(f"nvl_{direction}", rank, self.net.nvlink_bytes_per_s)

    def message(self, src: int, dst: int, nbytes: float) -> list[tuple[int, float]]:
        """Port loads of one message between two real ranks."""
        if src == dst:
            return []
        if self.net.same_node(src, dst):
            return [(self.nvlink(src, "out"), nbytes), (self.nvlink(dst, "in"), nbytes)]
        return [(self.nic(src, "out"), nbytes), (self.nic(dst, "in"), nbytes)]

    def ring_hop(
        self, rank: int, nbytes: float, out_local: float, in_local: float, *, own: bool = False
    ) -> list[tuple[int, float]]:
        """Port loads of a rank's share of a ring all-reduce: `nbytes` out to the next member
        and `nbytes` in from the previous one, `out_local` / `in_local` of them on its node
        (over NVLink). `own`: the rank's NIC ports are its own, at its share of the node's
        NICs (`bundle`'s, a representative's); else the node's shared ones (`message`'s)."""
        net = self.net
        if own:
            nic_out = self._get("nic_out", rank, net.nic_bw(rank))
            nic_in = self._get("nic_in", rank, net.nic_bw(rank))
        else:
            nic_out, nic_in = self.nic(rank, "out"), self.nic(rank, "in")
        return [
            (nic_out, nbytes * (1.0 - out_local)),
            (self.nvlink(rank, "out"), nbytes * out_local),
            (nic_in, nbytes * (1.0 - in_local)),
            (self.nvlink(rank, "in"), nbytes * in_local),
        ]

    def bundle(
        self,
        src: int,
        dst: int,
        out_bytes: float,
        in_bytes: float,
        out_local: float,
        in_local: float,
    ) -> list[tuple[int, float]]:
        """Port loads of a bundle of messages between two representatives.

        `out_bytes` leave the sender (to all its peers), `in_bytes` reach the receiver
        (from all its peers); `*_local` is the fraction of them that stays on the node.
        Each representative has its own NIC ports (`Network.nic_bw`).
        """
        net = self.net
        return [
            (self._get("nic_out", src, net.nic_bw(src)), out_bytes * (1.0 - out_local)),
            (self.nvlink(src, "out"), out_bytes * out_local),
            (self._get("nic_in", dst, net.nic_bw(dst)), in_bytes * (1.0 - in_local)),
            (self.nvlink(dst, "in"), in_bytes * in_local),
        ]
