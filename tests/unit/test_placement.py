"""Placement: which rank is which worker (`distributed.placement`, carried by `Layout`),
one rule for the runtime and the simulator."""

from __future__ import annotations

import dataclasses
import math

import pytest

from disagmoe.cli import main
from disagmoe.config import ParallelConfig, RunConfig, TrainConfig
from disagmoe.distributed.layout import Layout, Role, run_layout
from disagmoe.distributed.placement import block_roles, node_mix, resolve_ranks_per_node
from disagmoe.presets import CLUSTER_PRESETS, MODEL_PRESETS
from disagmoe.simulator.disagg import simulate_disagg
from disagmoe.simulator.network import Network


def _layout(p: int, m: int, n: int, placement: str = "node-aware", R: int = 0) -> Layout:
    model = dataclasses.replace(MODEL_PRESETS["tiny"], num_layers=2 * p, num_experts=2 * n)
    parallel = ParallelConfig(groups=p, attn_workers=m, expert_workers=n, placement=placement)
    return Layout.build(model, parallel, ranks_per_node=R)


def _bounds(w: int, m: int, n: int) -> tuple[int, int]:
    return math.floor(w * m / (m + n)), math.ceil(w * m / (m + n))


def test_packed_is_rank_order() -> None:
    lay = _layout(3, 2, 4, "packed")
    for g in range(3):
        assert lay.attn_replicas(g) == [g * 6 + r for r in range(2)]
        assert lay.expert_shards(g) == [g * 6 + 2 + j for j in range(4)]


@pytest.mark.parametrize("p,m,n", [(1, 3, 5), (2, 2, 1), (3, 7, 9), (2, 8, 8), (1, 1, 6)])
def test_node_aware_is_a_permutation_of_each_group_block(p: int, m: int, n: int) -> None:
    lay, packed = _layout(p, m, n), _layout(p, m, n, "packed")
    assert lay.world_size == packed.world_size == p * (m + n)
    for g in range(p):
        block = range(g * (m + n), (g + 1) * (m + n))
        assert {lay.role(r) for r in block} == {packed.role(r) for r in block}
    for r in range(lay.world_size):  # role and rank lookups are inverse
        role = lay.role(r)
        back = lay.attn_rank if role.comp == "A" else lay.expert_rank
        assert back(role.group, role.index) == r
    # replicas and shards keep their order inside the block
    for g in range(p):
        assert lay.attn_replicas(g) == sorted(lay.attn_replicas(g))
        assert lay.expert_shards(g) == sorted(lay.expert_shards(g))


def test_every_run_of_a_block_is_as_close_to_m_to_n_as_integers_allow() -> None:
    """The property that makes the rule right for every ranks-per-node at once."""
    for m in range(1, 20):
        for n in range(1, 20):
            comps = [c for c, _ in block_roles(m, n, "node-aware")]
            for w in range(1, m + n + 1):
                lo, hi = _bounds(w, m, n)
                for start in range(m + n - w + 1):
                    assert lo <= comps[start : start + w].count("A") <= hi, (m, n, start, w)


@pytest.mark.parametrize(
    "p,m,n,R",
    [
        (1, 3, 5, 4),  # R divides m + n
        (2, 3, 3, 4),  # group blocks not aligned to nodes: node 1 holds both groups
        (3, 7, 9, 8),  # the planner's 16-worker split, p > 1
        (2, 5, 1, 3),  # R not dividing m + n
        (1, 8, 8, 8),  # m = n = one node: packed would put all A on node 0
    ],
)
def test_every_node_holds_each_group_in_proportion(p: int, m: int, n: int, R: int) -> None:
    lay = _layout(p, m, n, R=R)
    for node in range(lay.world_size // R):
        ranks = range(node * R, (node + 1) * R)
        assert all(lay.node_of(r) == node for r in ranks)
        for g in range(p):
            mine = [lay.role(r) for r in ranks if lay.role(r).group == g]
            a = sum(1 for role in mine if role.comp == "A")
            lo, hi = _bounds(len(mine), m, n)
            assert lo <= a <= hi, (node, g, a, len(mine))


def test_example_table_of_the_docs() -> None:
    lay = _layout(1, 3, 5, R=4)
    assert [str(lay.role(r)) for r in range(8)] == [
        "F(g0,j0)", "A(g0,r0)", "F(g0,j1)", "A(g0,r1)",
        "F(g0,j2)", "F(g0,j3)", "A(g0,r2)", "F(g0,j4)",
    ]  # fmt: skip
    assert node_mix([lay.role(r).comp for r in range(8)], 4) == [(2, 2), (1, 3)]
    assert node_mix([_layout(1, 3, 5, "packed").role(r).comp for r in range(8)], 4) == [
        (3, 1),
        (0, 4),
    ]


def test_reduced_layout_is_rank_order_whatever_the_placement() -> None:
    """m = n = 1 (the reduced schedule of `build_afpipe_rank` and the simulator): A, F."""
    for placement in ("node-aware", "packed"):
        lay = _layout(3, 1, 1, placement)
        assert [lay.role(r) for r in range(6)] == [
            Role(c, g, 0) for g in range(3) for c in ("A", "F")
        ]


def test_ranks_per_node_resolution() -> None:
    assert resolve_ranks_per_node(2, 8, "8") == 2  # the config wins
    assert resolve_ranks_per_node(0, 8, "4") == 4  # torchrun's LOCAL_WORLD_SIZE
    assert resolve_ranks_per_node(0, 8, None) == 8  # no torchrun: one node
    with pytest.raises(ValueError, match=r"parallel.ranks_per_node \(3\) must divide"):
        resolve_ranks_per_node(3, 8, None)
    with pytest.raises(ValueError, match=r"LOCAL_WORLD_SIZE \(3\) must divide"):
        resolve_ranks_per_node(0, 8, "3")


def test_runtime_layout_resolves_local_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = RunConfig(parallel=ParallelConfig(attn_workers=3, expert_workers=1), train=TrainConfig())
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    lay = run_layout(cfg)
    assert lay.ranks_per_node == 2 and lay.placement == "node-aware"
    assert [lay.node_of(r) for r in range(4)] == [0, 0, 1, 1]
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, ranks_per_node=4))
    assert run_layout(cfg).ranks_per_node == 4


@pytest.mark.parametrize("placement", ["node-aware", "packed"])
def test_simulator_places_ranks_as_the_runtime_does(
    placement: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The simulator's rank -> role map is the runtime's, and its nodes are the runtime's."""
    model = MODEL_PRESETS["small"]
    cluster = dataclasses.replace(CLUSTER_PRESETS["h800"], gpus_per_node=4, nics_per_node=4)
    p, m, n = 2, 2, 4
    sim = simulate_disagg(
        model, cluster, groups=p, attn_workers=m, expert_workers=n, seq_len=256,
        micro_batch_size=1, num_micro_batches=4, placement=placement, reduce=False,
    )  # fmt: skip
    cfg = RunConfig(
        model=model,
        parallel=ParallelConfig(
            groups=p, attn_workers=m, expert_workers=n, placement=placement, ranks_per_node=4
        ),
    )
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    runtime = run_layout(cfg)
    assert [w["role"] for w in sim.workers] == [
        str(runtime.role(r)) for r in range(runtime.world_size)
    ]
    net = Network.from_cluster(cluster)
    assert [net.node_of(r) for r in range(12)] == [runtime.node_of(r) for r in range(12)]


def test_node_aware_beats_packed_in_the_simulator() -> None:
    """p = 1, m = n = 4 on two 4-GPU nodes: packed sends every dispatch over IB."""
    model = MODEL_PRESETS["small"]
    cluster = dataclasses.replace(CLUSTER_PRESETS["h800"], gpus_per_node=4, nics_per_node=4)
    kw = dict(groups=1, attn_workers=4, expert_workers=4, seq_len=2048, micro_batch_size=1,
              num_micro_batches=8)  # fmt: skip
    aware = simulate_disagg(model, cluster, placement="node-aware", **kw)  # type: ignore[arg-type]
    packed = simulate_disagg(model, cluster, placement="packed", **kw)  # type: ignore[arg-type]
    assert aware.step_time_s < packed.step_time_s


def test_placement_command_prints_the_nodes(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["placement", "--attn-workers", "3", "--expert-workers", "5", "--ranks-per-node", "4",
            "--set", "model.num_experts=10"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "# placement node-aware: p=1 m=3 n=5, 8 ranks, 4 per node"
    assert out[2].split() == ["0", "0-3", "2:2", "F(g0,j0)", "A(g0,r0)", "F(g0,j1)", "A(g0,r1)"]
    assert out[3].split()[:3] == ["1", "4-7", "1:3"]
    assert main([*argv, "--placement", "packed"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[2] for line in out[2:]] == ["3:1", "0:4"]
