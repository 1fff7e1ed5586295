"""Process groups of a disaggregated run: a fixed set, whatever m and n are (no process group
is created here: a fake factory records what `Topology.build` asks for)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence

import pytest

from disagmoe.config import ParallelConfig
from disagmoe.distributed.layout import Layout
from disagmoe.distributed.topology import Topology
from disagmoe.presets import MODEL_PRESETS


def _layout(p: int, m: int, n: int, placement: str = "node-aware") -> Layout:
    model = dataclasses.replace(MODEL_PRESETS["tiny"], num_layers=4 * p, num_experts=384)
    parallel = ParallelConfig(groups=p, attn_workers=m, expert_workers=n, placement=placement)
    return Layout.build(model, parallel)


@pytest.mark.parametrize("placement", ["node-aware", "packed"])
@pytest.mark.parametrize("p,m,n", [(1, 32, 32), (2, 128, 128), (4, 8, 24)])
def test_group_count_does_not_grow_with_m_or_n(p: int, m: int, n: int, placement: str) -> None:
    layout = _layout(p, m, n, placement)
    created: list[tuple[int, ...]] = []

    backends: list[str] = []

    def fake(ranks: Sequence[int], *, backend: str) -> tuple[int, ...]:
        created.append(tuple(ranks))
        backends.append(backend)
        return tuple(ranks)

    topo = Topology.build(
        layout, rank=layout.expert_rank(p - 1, n - 1), new_group=fake, payload_backend="nccl"
    )
    # headers (host tensors) always on gloo; payloads and replica groups on the device's
    assert backends.count("gloo") == 4 and backends.count("nccl") == 4 + p
    assert all(backends[i] == "gloo" for i in range(0, 8, 2))
    # header + payload per channel and direction, and the replica groups
    assert topo.process_groups == len(created) == 8 + p
    membership = Counter(r for ranks in created for r in ranks)
    assert set(membership) == set(range(layout.world_size))
    assert max(membership.values()) <= 9  # no rank is in more than a constant number
    # the groups are shared by every stream of a channel and direction (to a higher rank
    # or to a lower one, whatever the roles of the two ranks are)
    a, f = layout.attn_rank(0, m - 1), layout.expert_rank(0, n - 1)
    up = (a, f) if a < f else (f, a)
    assert topo.stream(*up, "fwd") is topo.stream(0, layout.world_size - 1, "fwd")
    assert topo.stream(a, f, "fwd") is not topo.stream(f, a, "fwd")  # the two directions
    assert topo.stream(0, 1, "fwd") is not topo.stream(0, 1, "bwd")
    assert topo.replica_group is None  # an expert shard has no replica group


def test_attention_rank_gets_its_replica_group() -> None:
    layout = _layout(2, 3, 2)
    topo = Topology.build(
        layout, rank=layout.attn_rank(1, 2), new_group=lambda ranks, backend: tuple(ranks)
    )
    assert topo.replica_group == tuple(layout.attn_replicas(1))


def test_directions_follow_rank_numbers_under_a_permuted_placement() -> None:
    """node-aware interleaves A and F, so a group's dispatches travel both up and down; every
    (sender, receiver) pair still uses one group per direction, the reverse stream the other."""
    layout = _layout(1, 2, 2)
    assert [str(layout.role(r)) for r in range(4)] == [
        "A(g0,r0)",
        "F(g0,j0)",
        "A(g0,r1)",
        "F(g0,j1)",
    ]
    topo = Topology.build(layout, rank=0, new_group=lambda ranks, backend: object())
    a1, f0 = layout.attn_rank(0, 1), layout.expert_rank(0, 0)
    assert a1 > f0  # a dispatch to a lower rank
    assert topo.stream(a1, f0, "fwd") is topo.channels[("fwd", "down")]
    assert topo.stream(f0, a1, "fwd") is topo.channels[("fwd", "up")]
    assert topo.stream(layout.attn_rank(0, 0), f0, "fwd") is topo.channels[("fwd", "up")]
