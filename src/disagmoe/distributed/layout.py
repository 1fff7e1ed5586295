"""Who is who in a disaggregated run (pure: no process groups).

Ranks are numbered group by group: group g owns ranks `g*(m+n) .. (g+1)*(m+n)-1`,
its m attention replicas and n expert shards in the order `placement` gives
(`distributed.placement`: `packed` puts the replicas first, `node-aware` interleaves
them m : n so that every node holds both). Everything that needs a rank asks the
layout (`attn_rank`, `expert_rank`, `role`, `attn_replicas`, `expert_shards`), never
rank arithmetic, so the schedule, the process groups, the executor, the checkpoints,
the traces and the simulator all follow the placement.

Layer l lives on group `l mod p`; the "layer" L (after the last block: final
norm, LM head, loss) lives on A-group `L mod p`, which is group 0 because we
require `L mod p == 0`. Embedding lives with layer 0, also on group 0, so tied
embeddings stay on one worker.

Splits need not be even: expert shard j holds the contiguous experts
`expert_range(j)` (ceil(E/n) or floor(E/n) of them), and replica r runs
`slots_of_replica(r, M)` of the step's M micro-batches (micro-batch i is replica
i mod m's slot i // m), so only the last slot may be run by fewer than m replicas.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from ..config import ModelConfig, ParallelConfig, RunConfig
from ..models.moe import split_experts
from .placement import block_roles, resolve_ranks_per_node


@dataclass(frozen=True, slots=True)
class Role:
    comp: str  # "A" (attention replica) or "F" (expert shard)
    group: int
    index: int  # replica r for A, shard j for F

    def __str__(self) -> str:
        return f"{self.comp}(g{self.group},{'r' if self.comp == 'A' else 'j'}{self.index})"


@dataclass(frozen=True, slots=True)
class Layout:
    groups: int  # p
    attn_workers: int  # m, per group
    expert_workers: int  # n, per group
    num_layers: int  # L
    num_experts: int
    moe_layers: frozenset[int]
    placement: str = "packed"  # "packed" | "node-aware" (distributed.placement)
    ranks_per_node: int = 0  # R: node k holds ranks kR .. kR+R-1 (0: one node for all)
    # a group's block in rank order, and each (component, index)'s position in it; derived
    # in __post_init__, so `dataclasses.replace` re-derives them
    _block: tuple[tuple[str, int], ...] = field(init=False, repr=False, compare=False)
    _position: dict[tuple[str, int], int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        block = block_roles(self.attn_workers, self.expert_workers, self.placement)
        object.__setattr__(self, "_block", block)
        object.__setattr__(self, "_position", {role: k for k, role in enumerate(block)})

    @classmethod
    def build(
        cls,
        model: ModelConfig,
        parallel: ParallelConfig,
        world_size: int | None = None,
        *,
        ranks_per_node: int = 0,
    ) -> Layout:
        """The layout of `parallel` for `model`; `ranks_per_node` is the resolved R (the
        runtime resolves torchrun's LOCAL_WORLD_SIZE: `placement.resolve_ranks_per_node`)."""
        p, m, n = parallel.groups, parallel.attn_workers, parallel.expert_workers
        if model.num_layers % p:
            raise ValueError(
                f"model.num_layers ({model.num_layers}) must be divisible by parallel.groups ({p})"
            )
        if n > model.num_experts:
            raise ValueError(
                f"parallel.expert_workers ({n}) is more than model.num_experts "
                f"({model.num_experts}): a shard would hold no expert; use at most "
                f"{model.num_experts} expert workers"
            )
        moe = [l for l in range(model.num_layers) if model.is_moe_layer(l)]
        idle = sorted({g for g in range(p)} - {l % p for l in moe})
        if idle:
            raise ValueError(
                f"expert group(s) {idle} would hold no MoE layer (MoE layers {moe[0]}..{moe[-1]}, "
                f"p={p}); use parallel.groups <= {len(moe)} or fewer dense layers"
            )
        if world_size is not None and world_size != p * (m + n):
            raise ValueError(
                f"world size is {world_size} but groups*(attn_workers+expert_workers) = "
                f"{p}*({m}+{n}) = {p * (m + n)}; start {p * (m + n)} workers or change the layout"
            )
        return cls(
            groups=p,
            attn_workers=m,
            expert_workers=n,
            num_layers=model.num_layers,
            num_experts=model.num_experts,
            moe_layers=frozenset(l for l in range(model.num_layers) if model.is_moe_layer(l)),
            placement=parallel.placement,
            ranks_per_node=ranks_per_node,
        )

    @property
    def world_size(self) -> int:
        return self.groups * (self.attn_workers + self.expert_workers)

    def expert_range(self, shard: int) -> range:
        """Global expert ids expert shard j holds (the same in every MoE layer): contiguous,
        ceil(E/n) experts for the first `E mod n` shards and floor(E/n) for the others
        (docs/design-notes.md, "Uneven splits")."""
        return split_experts(self.num_experts, self.expert_workers)[shard]

    def expert_ranges(self) -> tuple[range, ...]:
        """`expert_range` of every shard j = 0..n-1, in order (what a dispatch splits by)."""
        return split_experts(self.num_experts, self.expert_workers)

    def expert_owner(self, expert: int) -> int:
        """The shard j whose `expert_range` holds global expert `expert`."""
        base, extra = divmod(self.num_experts, self.expert_workers)
        big = extra * (base + 1)  # experts held by the ceil(E/n)-sized shards
        return expert // (base + 1) if expert < big else extra + (expert - big) // base

    def slots_of_replica(self, replica: int, num_micro_batches: int) -> int:
        """Slots replica r runs per step: micro-batch i of the global batch goes to replica
        i mod m as slot i // m, so r runs ceil((M - r) / m) of the M micro-batches."""
        return max(0, -(-(num_micro_batches - replica) // self.attn_workers))

    def replicas_of_slot(self, slot: int, num_micro_batches: int) -> int:
        """How many replicas run slot s (replicas 0 .. count-1; m for all but a last,
        partial slot when m does not divide M)."""
        return max(0, min(self.attn_workers, num_micro_batches - slot * self.attn_workers))

    def micro_batch(self, replica: int, slot: int) -> int:
        """Index in the global batch of replica r's slot s."""
        return slot * self.attn_workers + replica

    def group_of(self, layer: int) -> int:
        return layer % self.groups

    def attn_rank(self, group: int, replica: int) -> int:
        assert 0 <= group < self.groups, group
        return group * len(self._block) + self._position[("A", replica)]

    def expert_rank(self, group: int, shard: int) -> int:
        assert 0 <= group < self.groups, group
        return group * len(self._block) + self._position[("F", shard)]

    def role(self, rank: int) -> Role:
        group, pos = divmod(rank, len(self._block))
        assert 0 <= group < self.groups, rank
        comp, index = self._block[pos]
        return Role(comp, group, index)

    def node_of(self, rank: int) -> int:
        """The node of `rank` (torchrun numbers ranks node by node)."""
        return rank // self.ranks_per_node if self.ranks_per_node else 0

    def layers_of(self, rank: int) -> list[int]:
        """Layers whose A (0..L, L = head/loss) or F component this rank runs, ascending."""
        role = self.role(rank)
        if role.comp == "A":
            return [l for l in range(self.num_layers + 1) if l % self.groups == role.group]
        return [l for l in sorted(self.moe_layers) if l % self.groups == role.group]

    def attn_replicas(self, group: int) -> list[int]:
        return [self.attn_rank(group, r) for r in range(self.attn_workers)]

    def expert_shards(self, group: int) -> list[int]:
        return [self.expert_rank(group, j) for j in range(self.expert_workers)]


def run_layout(cfg: RunConfig, world_size: int | None = None) -> Layout:
    """The layout of a run, with its ranks per node resolved (`parallel.ranks_per_node`,
    else torchrun's LOCAL_WORLD_SIZE of this process, else one node)."""
    layout = Layout.build(cfg.model, cfg.parallel, world_size)
    ranks = resolve_ranks_per_node(
        cfg.parallel.ranks_per_node, layout.world_size, os.environ.get("LOCAL_WORLD_SIZE")
    )
    return dataclasses.replace(layout, ranks_per_node=ranks)


def num_slots(cfg: RunConfig, layout: Layout) -> int:
    """Slots of the busiest replica: ceil(M / m) for M micro-batches per step."""
    num_micro = cfg.train.num_micro_batches
    if num_micro < layout.attn_workers:
        raise ValueError(
            f"global_batch_size/micro_batch_size = {num_micro} micro-batches leave some of the "
            f"{layout.attn_workers} attention replicas (parallel.attn_workers) without one; "
            f"use at most {num_micro} attention workers or a larger global batch"
        )
    return layout.slots_of_replica(0, num_micro)
