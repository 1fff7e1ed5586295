"""Where a disaggregated run's workers sit: which rank is which A replica or F shard.

One rule for the runtime and the simulator (`Layout` applies it; docs/design-notes.md,
"Placement"). Group g owns the block of ranks `g*(m+n) .. (g+1)*(m+n)-1` either way;
`parallel.placement` orders the block:

* `packed` — rank order: the m attention replicas, then the n expert shards.
* `node-aware` (default) — A and F interleaved in proportion m : n. Replica i sits at
  (i + 1/2)/m and shard j at (j + 1/2)/n of the unit interval; the block lists them by
  that position, a replica before a shard on a tie. The result is a balanced word: every
  run of w consecutive ranks inside a block holds ⌊w·m/(m+n)⌋ or ⌈w·m/(m+n)⌉ replicas
  (`tests/unit/test_placement.py` checks every window for m, n < 20).

Why the rule does not depend on the ranks per node R: torchrun numbers ranks node by
node (node k holds ranks kR .. kR+R-1), so a node's share of a group is a run of
consecutive ranks of the group's block — and every such run is as close to m : n as
integers allow, whatever R is, whether R divides m + n or not, and whether the block
starts on a node boundary or not (p > 1). One mapping is thus optimal for every R at
once; a rank keeps its role when the same job runs on nodes of another size, and the
simulator's mapping is the runtime's. R is only needed to say which node a rank is on.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..config import PLACEMENTS


def block_roles(
    attn_workers: int, expert_workers: int, placement: str
) -> tuple[tuple[str, int], ...]:
    """(component, index) of each of a group's m + n ranks in rank order: ("A", replica) or
    ("F", shard)."""
    if placement not in PLACEMENTS:
        raise ValueError(
            f"parallel.placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}"
        )
    m, n = attn_workers, expert_workers
    if placement == "packed":
        return tuple([("A", i) for i in range(m)] + [("F", j) for j in range(n)])
    # (i + 1/2)/m < (j + 1/2)/n  <=>  (2i + 1)·n < (2j + 1)·m: exact in integers
    keyed = [((2 * i + 1) * n, 0, "A", i) for i in range(m)]
    keyed += [((2 * j + 1) * m, 1, "F", j) for j in range(n)]
    return tuple((comp, index) for _, _, comp, index in sorted(keyed))


def resolve_ranks_per_node(configured: int, world_size: int, local_world_size: str | None) -> int:
    """Ranks per node of a run: `parallel.ranks_per_node`, else torchrun's LOCAL_WORLD_SIZE
    (passed in by the caller), else the whole world on one node."""
    ranks = configured or int(local_world_size or 0) or world_size
    if ranks < 1 or world_size % ranks:
        source = "parallel.ranks_per_node" if configured else "LOCAL_WORLD_SIZE"
        raise ValueError(
            f"{source} ({ranks}) must divide the world size ({world_size}); "
            "set --ranks-per-node to the ranks each node runs"
        )
    return ranks


def node_mix(comps: Sequence[str], ranks_per_node: int) -> list[tuple[int, int]]:
    """(attention workers, expert workers) on each node of `ranks_per_node` consecutive ranks."""
    out = []
    for start in range(0, len(comps), ranks_per_node):
        node = comps[start : start + ranks_per_node]
        out.append((sum(1 for c in node if c == "A"), sum(1 for c in node if c == "F")))
    return out
