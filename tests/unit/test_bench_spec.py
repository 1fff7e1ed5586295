"""The bench's NIC split: which rank gets which rate, and the same total as the EP runs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from disagmoe.bench.cli import nic_split
from disagmoe.bench.runner import BenchSpec
from disagmoe.config import ParallelConfig
from disagmoe.distributed.layout import Layout
from disagmoe.presets import model_preset

SPEC = BenchSpec(
    runtimes=("disagg", "ep-1f1b"), nodes=4, ranks_per_node=2, nic_gbps=0.2, model="small",
    seq_len=64, global_batch_size=16, micro_batch_size=2, steps=3, warmup=1, repeats=1,
    groups=2, attn_workers=2, expert_workers=2, pp=1, ep=0, out_dir=Path("unused"),
)  # fmt: skip


def test_split_keeps_the_total_and_gives_each_role_its_rate() -> None:
    a, f = nic_split("1:3", 2, 2, None)
    assert 2 * a + 2 * f == pytest.approx(4) and f == pytest.approx(3 * a)
    spec = dataclasses.replace(SPEC, nic_split=(a, f), time_scale=10.0)
    rates = spec.worker_gbps("disagg")
    layout = Layout.build(
        model_preset("small"), ParallelConfig(groups=2, attn_workers=2, expert_workers=2), 8
    )
    for rank, gbps in enumerate(rates):
        want = a if layout.role(rank).comp == "A" else f
        assert gbps == pytest.approx(0.2 * want)
    assert spec.worker_gbps("ep-1f1b") == [0.2] * 8
    nodes = spec.node_mbit("disagg")
    assert len(nodes) == 4 and sum(nodes) == pytest.approx(sum(spec.node_mbit("ep-1f1b")))
    assert sum(spec.node_mbit("ep-1f1b")) == pytest.approx(8 * 200 / 10)


def test_auto_follows_the_planner_or_stays_even() -> None:
    assert nic_split("auto", 3, 1, None) == (1.0, 1.0)
    a, f = nic_split("auto", 3, 1, (2, 2))  # 2 NICs for 3 attention workers, 2 for 1 shard
    assert 3 * a + f == pytest.approx(4) and f / a == pytest.approx(3.0)
    for bad in ("2", "1:0", "a:b", "1:2:3"):
        with pytest.raises(ValueError, match="--nic-split"):
            nic_split(bad, 1, 1, None)


def test_emulated_time_scale_grows_with_the_ranks_sharing_the_cores() -> None:
    from disagmoe.bench.cli import default_time_scale

    assert default_time_scale(2) == 10.0 and default_time_scale(16) == 64.0


@pytest.mark.parametrize(("nodes", "split"), [(4, (3, 5)), (8, (7, 9))])
def test_bench_runs_the_planners_uneven_split(nodes: int, split: tuple[int, int]) -> None:
    """The 8- and 16-worker emulated clusters of docs/bench.md get the planner's own m, n
    (no fallback to m = n): 3 replicas share 8 micro-batches and 5 shards hold 16 experts;
    7 and 9 likewise."""
    from disagmoe.bench.cli import planner_split

    spec = dataclasses.replace(
        SPEC, nodes=nodes, nic_gbps=0.4, seq_len=128, groups=0, attn_workers=0, expert_workers=0
    )
    p, m, n, note, nics = planner_split(spec)
    assert (p, m, n) == (1, *split) and note.startswith("planner:") and nics is not None
    assert model_preset("small").num_experts % n and 8 % m  # neither divides


def test_simulator_uses_the_planners_split_as_is() -> None:
    from disagmoe.planner import plan_for
    from disagmoe.presets import CLUSTER_PRESETS
    from disagmoe.simulator.placement import planned_split

    model, h800 = model_preset("qwen3-30b-a3b"), CLUSTER_PRESETS["h800"]
    kw = dict(gpus=16, seq_len=8192, micro_batch_size=1)
    plan = plan_for(model, h800, **kw)  # type: ignore[arg-type]
    split = planned_split(model, h800, **kw)  # type: ignore[arg-type]
    assert (split.attn_workers, split.expert_workers) == (
        plan.attn_gpus_per_group,
        plan.ffn_gpus_per_group,
    )
    assert model.num_experts % split.expert_workers  # 128 experts on 9 shards
    with pytest.raises(ValueError, match="only 3 micro-batches"):
        planned_split(model, h800, micro_batches=3, **kw)  # type: ignore[arg-type]
