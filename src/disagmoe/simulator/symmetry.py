"""Symmetry reduction: which real workers each simulated rank stands for.

Workers that run identical lists with identical costs need not all be simulated:
one representative runs the list and stands for its class (`members`, the
representative first), each of its messages for the bundle its class exchanges.

* AF-Pipe (`Symmetry.replicas`): a schedule generated for one replica per class and
  one shard per group (`schedule.afpipe.reduced_layout`); a representative A of a
  group stands for the replicas of its class (all m when m divides the micro-batches,
  else those with the last slot and those without it: their lists differ), the
  representative F for its n shards. A message between different components
  (dispatch, combine and their gradients) stands for every pair of their members
  (A sends n, F receives one per replica of the class); between equal components
  (act, grad_act) for replica r to replica r.
* EP (`Symmetry.representatives`): pipeline rank r's data-parallel replica 0 stands
  for its dp replicas; replica d talks to replica d of the neighbouring stage.
* `Symmetry.identity`: every rank simulated.

A bundle's bytes are split between NIC and NVLink by the share of its real pairs that
sit on one node (`local_share`), averaged over the members; a representative standing
only for itself sends one plain message (`Ports.message`).
`tests/unit/test_simulator.py` checks the reduced AF-Pipe replay against the full one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..distributed.ep_layout import EPLayout
from ..distributed.layout import Layout
from ..schedule.ir import Msg
from .network import Network, Ports


@dataclass(frozen=True)
class Symmetry:
    members: tuple[tuple[int, ...], ...]  # per simulated rank: real ranks, representative first
    kinds: tuple[str, ...]  # per simulated rank: members of equal kinds pair one to one
    _local: dict[tuple[int, int], float] = field(default_factory=dict, repr=False)
    _rank_of: dict[int, int] = field(default_factory=dict, repr=False)

    @classmethod
    def identity(cls, num_ranks: int) -> Symmetry:
        return cls(tuple((r,) for r in range(num_ranks)), ("",) * num_ranks)

    @classmethod
    def replicas(cls, full: Layout, classes: tuple[range, ...] | None = None) -> Symmetry:
        """For a schedule of `Layout(m=len(classes), n=1)` with `full`'s groups (ranks
        A0.., F0, A1.., F1, ...): class c's representative stands for replicas `classes[c]`
        (None: one class of all m replicas)."""
        classes = classes or (range(full.attn_workers),)
        members, kinds = [], []
        for group in range(full.groups):
            members += [tuple(full.attn_rank(group, r) for r in c) for c in classes]
            members.append(tuple(full.expert_shards(group)))
            kinds += ["A"] * len(classes) + ["F"]
        return cls(tuple(members), tuple(kinds))

    @classmethod
    def representatives(cls, layout: EPLayout) -> Symmetry:
        """For a schedule of one list per pipeline rank (`representatives=True`)."""
        members = [tuple(layout.rank_of(p, d) for d in range(layout.dp)) for p in range(layout.pp)]
        return cls(tuple(members), ("EP",) * layout.pp)

    @property
    def num_ranks(self) -> int:
        return len(self.members)

    def real(self, rank: int) -> int:
        """The real rank a simulated rank is (its representative)."""
        return self.members[rank][0]

    def count(self, rank: int) -> int:
        """How many real workers a simulated rank stands for."""
        return len(self.members[rank])

    def simulated(self, real: int) -> int:
        """The simulated rank that is real rank `real` (-1 if none)."""
        if not self._rank_of:
            self._rank_of.update((members[0], rank) for rank, members in enumerate(self.members))
        return self._rank_of.get(real, -1)

    def local_share(self, net: Network, src: int, dst: int) -> float:
        """Share of the real (sender, receiver) pairs of a `src` -> `dst` bundle on one node."""
        key = (src, dst)
        if key not in self._local:
            a_side, b_side = self.members[src], self.members[dst]
            if self.kinds[src] == self.kinds[dst]:
                pairs = list(zip(a_side, b_side, strict=True))
            else:
                pairs = [(a, b) for a in a_side for b in b_side]
            nodes = [(net.node_of(a), net.node_of(b)) for a, b in pairs]
            self._local[key] = sum(1 for a, b in nodes if a == b) / len(nodes)
        return self._local[key]

    def loads(self, msg: Msg, nbytes: float, ports: Ports) -> list[tuple[int, float]]:
        """Port loads of a message of simulated ranks: one message, or the bundle it stands for."""
        a, b = self.members[msg.src], self.members[msg.dst]
        if len(a) == 1 and len(b) == 1:
            return ports.message(a[0], b[0], nbytes)
        paired = self.kinds[msg.src] == self.kinds[msg.dst]
        fan_out, fan_in = (1, 1) if paired else (len(b), len(a))
        local = self.local_share(ports.net, msg.src, msg.dst)
        back = self.local_share(ports.net, msg.dst, msg.src)
        return ports.bundle(a[0], b[0], nbytes * fan_out, nbytes * fan_in, local, back)
