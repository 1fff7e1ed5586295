"""The bench's NIC split: which rank gets which rate, and the same total as the EP runs."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from disagmoe.bench.cli import nic_split
from disagmoe.bench.spec import BenchSpec, Entry
from disagmoe.config import ParallelConfig, TrainConfig
from disagmoe.distributed.layout import Layout
from disagmoe.presets import model_preset
from disagmoe.simulator.network import Network

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
    # packed rows keep even NICs: the split pools a node's NICs for its A and F workers
    assert spec.worker_gbps("disagg (packed)") == [0.2] * 8


def test_each_placement_is_a_row_with_its_own_flags() -> None:
    spec = dataclasses.replace(SPEC, placements=("node-aware", "packed"))
    assert spec.entries == ("disagg", "disagg (packed)", "ep-1f1b")
    assert Entry.parse("disagg (packed)") == Entry("disagg", "packed")
    assert Entry.parse("disagg") == Entry("disagg", "node-aware")
    assert Entry.parse("ep-1f1b").runtime == "ep-1f1b"
    assert Entry.parse("disagg (packed)").slug == "disagg-packed"
    flags = spec.train_flags("disagg (packed)", Path("r"))
    assert flags[flags.index("--runtime") + 1] == "disagg"
    assert flags[flags.index("--placement") + 1] == "packed"
    assert flags[flags.index("--ranks-per-node") + 1] == "2"
    assert flags[flags.index("--device") + 1] == "cpu"  # the emulated cluster is CPUs
    # 4 nodes x 2 ranks, p = 2, m = n = 2: node-aware mixes A and F on every node
    aware, packed = spec.layout("disagg"), spec.layout("disagg (packed)")
    assert [[aware.role(r).comp for r in (2 * k, 2 * k + 1)] for k in range(4)] == [["A", "F"]] * 4
    assert [packed.role(r).comp for r in range(8)] == ["A", "A", "F", "F"] * 2


def test_planner_follows_the_planner_or_stays_even() -> None:
    assert nic_split("planner", 3, 1, None) == (1.0, 1.0)
    a, f = nic_split("planner", 3, 1, (2, 2))  # 2 NICs for 3 attention workers, 2 for 1 shard
    assert 3 * a + f == pytest.approx(4) and f / a == pytest.approx(3.0)
    assert nic_split("even", 3, 1, (2, 2)) == (1.0, 1.0)
    with pytest.raises(ValueError, match="--nic-split auto was renamed planner"):
        nic_split("auto", 3, 1, None)
    for bad in ("2", "1:0", "a:b", "1:2:3"):
        with pytest.raises(ValueError, match="--nic-split"):
            nic_split(bad, 1, 1, None)


def test_emulated_time_scale_grows_with_the_ranks_sharing_the_cores() -> None:
    from disagmoe.bench.cli import default_time_scale

    assert default_time_scale(2) == 10.0 and default_time_scale(16) == 64.0


@pytest.mark.parametrize(("nodes", "analytic"), [(4, (3, 5)), (8, (7, 9))])
def test_bench_runs_the_planners_split(nodes: int, analytic: tuple[int, int]) -> None:
    """The 8- and 16-worker emulated clusters of docs/bench.md get what `disagmoe plan`
    prints for them (simulator profile), with no fallback to m = n; the analytic stage-2
    split (3:5 and 7:9, measured in docs/bench.md) is uneven and runs as well."""
    from disagmoe.bench.cli import emulated_cluster, planner_split
    from disagmoe.planner import plan_for

    spec = dataclasses.replace(
        SPEC, nodes=nodes, nic_gbps=0.4, seq_len=128, groups=0, attn_workers=0, expert_workers=0
    )
    p, m, n, note, nics = planner_split(spec)
    assert note.startswith("planner (simulator profile)") and nics is not None
    model = model_preset("small")
    Layout.build(model, ParallelConfig(groups=p, attn_workers=m, expert_workers=n), spec.world)
    cluster_kw = dict(gpus=spec.world, seq_len=128, micro_batch_size=2)
    cluster = emulated_cluster(spec)
    quick = plan_for(model, cluster, search_moves=0, **cluster_kw)  # type: ignore[arg-type]
    assert (quick.attn_gpus_per_group, quick.ffn_gpus_per_group) == analytic
    assert model.num_experts % analytic[1] and 8 % analytic[0]  # neither divides
    Layout.build(
        model, ParallelConfig(attn_workers=analytic[0], expert_workers=analytic[1]), spec.world
    )


def test_simulator_uses_the_planners_split_as_is() -> None:
    from disagmoe.planner import plan_for
    from disagmoe.planner.split import planned_split
    from disagmoe.presets import CLUSTER_PRESETS

    model, h800 = model_preset("gpt-oss-20b"), CLUSTER_PRESETS["h800"]
    kw = dict(gpus=8, seq_len=8192, micro_batch_size=1)
    plan = plan_for(model, h800, **kw)  # type: ignore[arg-type]
    split = planned_split(model, h800, **kw)  # type: ignore[arg-type]
    assert (split.attn_workers, split.expert_workers) == (
        plan.attn_gpus_per_group,
        plan.ffn_gpus_per_group,
    )
    assert model.num_experts % split.expert_workers  # 32 experts on 5 shards
    # a recompute given is planned for (simulate --recompute, --split-backward on: none)
    assert planned_split(model, h800, recompute="none", **kw).recompute == "none"  # type: ignore[arg-type]
    # the run's batch is planned for: 2 micro-batches leave room for 2 replicas at most
    small = planned_split(model, h800, micro_batches=2, **kw)  # type: ignore[arg-type]
    assert 1 <= small.attn_workers <= 2


def test_emulated_network_pools_a_node_nic_like_its_token_bucket() -> None:
    """The simulator's view of the emulated cluster: one NIC per node at R x the worker
    rate (the node's tbf), shared by its ranks; per rank only for the NIC split."""
    from disagmoe.bench.analysis import emulated_network

    pooled = emulated_network(0.4, 2, False)
    per_rank = emulated_network(0.4, 2, False, per_rank=True)
    assert pooled.nics_per_node == 1 and per_rank.nics_per_node == 2
    assert pooled.nic_bytes_per_s == pytest.approx(2 * per_rank.nic_bytes_per_s)
    assert pooled.nic_bytes_per_gpu == pytest.approx(per_rank.nic_bytes_per_gpu)
    assert pooled.nic_of(0) == pooled.nic_of(1) != pooled.nic_of(2)


def test_splits_and_recompute_modes_are_rows_of_one_run() -> None:
    """`--splits planner,even` x `--placements` x `--recomputes`: every combination is a
    row with its own layout flags and recompute override; labels read back exactly."""
    spec = dataclasses.replace(
        SPEC, groups=1, attn_workers=3, expert_workers=5, nic_split=(1.2, 0.88),
        splits=("planner", "even"), placements=("node-aware", "packed"),
        recomputes=("none", "full"), overrides=("train.recompute=attn",),
    )  # fmt: skip
    rows = spec.entries
    assert rows[:3] == ("disagg (recompute none)", "disagg (recompute full)",
                        "disagg (packed, recompute none)")  # fmt: skip
    assert "disagg (even, packed, recompute full)" in rows and len(rows) == 4 * 2 + 2
    assert rows[-1] == "ep-1f1b (recompute full)"
    for row in rows:
        assert Entry.parse(row).label == row
    flags = spec.train_flags("disagg (even, packed, recompute full)", Path("r"))
    assert flags[flags.index("--attn-workers") + 1] == "4"
    assert flags[flags.index("--expert-workers") + 1] == "4"
    assert flags[flags.index("--placement") + 1] == "packed"
    sets = [flags[i + 1] for i, f in enumerate(flags) if f == "--set"]
    assert sets[-1] == "train.recompute=full"  # the row's mode after the global override
    planned = spec.train_flags("disagg (recompute none)", Path("r"))
    assert planned[planned.index("--attn-workers") + 1] == "3"
    # the NIC split belongs to the planner's node-aware row only
    assert len(set(spec.worker_gbps("disagg (recompute none)"))) == 2
    assert spec.worker_gbps("disagg (even, recompute none)") == [0.2] * 8
    assert Entry.parse("disagg (even, packed)").slug == "disagg-even-packed"
    with pytest.raises(ValueError, match="unknown qualifier"):
        Entry.parse("disagg (sideways)")


def test_bench_flags_for_splits_and_recomputes_are_checked() -> None:
    import argparse

    from disagmoe.bench.cli import add_bench_arguments, spec_from_args

    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)

    def spec(*argv: str) -> BenchSpec:
        return spec_from_args(parser.parse_args(["--loopback", *argv]))

    # 2 workers: the planner's split is the even one, so it is one row
    two = spec("--runtimes", "disagg,ep-1f1b", "--splits", "planner,even")
    assert two.splits == ("planner",) and "even split" in two.split_note
    eight = spec("--compute", "emulated", "--nodes", "4", "--ranks-per-node", "2",
                 "--nic-gbit", "0.4", "--runtimes", "disagg", "--splits", "planner,even")  # fmt: skip
    assert eight.split_of("disagg (even)") == (1, 4, 4)
    if eight.split_of("disagg") != (1, 4, 4):
        assert eight.entries == ("disagg", "disagg (even)")
    for bad in (("--splits", "uneven"), ("--recomputes", "full,full"), ("--splits", "")):
        with pytest.raises(ValueError, match=bad[0]):
            spec("--runtimes", "disagg", *bad)


def test_exchange_chunk_counts_are_disagg_rows_of_one_run() -> None:
    """`--exchange-chunks 1,2`: one disagg row per count, with its schedule override after
    the global ones; EP rows are not multiplied; bad lists are one-line errors."""
    import argparse

    from disagmoe.bench.cli import add_bench_arguments, spec_from_args

    spec = dataclasses.replace(
        SPEC, groups=1, attn_workers=4, expert_workers=4, exchange_chunks=(1, 3, 0),
        overrides=("schedule.exchange_chunks=2",),
    )  # fmt: skip
    rows = spec.entries
    assert rows == ("disagg (chunks 1)", "disagg (chunks 3)", "disagg (chunks auto)", "ep-1f1b")
    for row in rows:
        assert Entry.parse(row).label == row
    flags = spec.train_flags(rows[1], Path("r"))
    sets = [flags[i + 1] for i, f in enumerate(flags) if f == "--set"]
    assert sets[-1] == "schedule.exchange_chunks=3"  # after the global override
    assert "schedule.exchange_chunks=3" not in spec.train_flags("ep-1f1b", Path("r"))
    auto = spec.train_flags("disagg (chunks auto)", Path("r"))
    assert auto[-1] == "schedule.exchange_chunks=0"
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    parsed = spec_from_args(
        parser.parse_args(["--loopback", "--runtimes", "disagg", "--exchange-chunks", "1,4,auto"])
    )
    assert parsed.exchange_chunks == (1, 4, 0)
    zero = ["--loopback", "--runtimes", "disagg", "--exchange-chunks", "0,2"]
    assert spec_from_args(parser.parse_args(zero)).exchange_chunks == (0, 2)  # 0: auto
    for bad in ("auto,0", "2,2", "17", "x"):
        with pytest.raises(ValueError, match="--exchange-chunks"):
            spec_from_args(
                parser.parse_args(["--loopback", "--runtimes", "disagg", "--exchange-chunks", bad])
            )


def test_each_ep_runtime_runs_the_fastest_layout_it_accepts() -> None:
    """Without --pp, every EP row gets the simulator's best of the layouts its runtime
    accepts (the same checks a run makes; refused ones say why), and runs it."""
    from disagmoe.bench.cli import emulated_cluster
    from disagmoe.bench.ep_layouts import search
    from disagmoe.costs.compute import ComputeCosts, Linear

    costs = ComputeCosts(
        Linear(1e-4, 1e-6), Linear(2e-4, 2e-6), Linear(1e-4, 1e-6), Linear(2e-4, 2e-6)
    )
    spec = dataclasses.replace(
        SPEC, runtimes=("ep-1f1b", "ep-interleaved", "ep-dualpipev"), global_batch_size=64
    )
    for runtime in spec.runtimes:
        ranked = search(spec, runtime, costs, emulated_cluster(spec))
        fits = [c for c in ranked if not c.refused]
        assert fits and all(c.refused for c in ranked[len(fits) :])
        assert [c.step_s for c in fits] == sorted(c.step_s for c in fits)
        for c in ranked[len(fits) :]:  # e.g. DualPipeV with too few micro-batches per replica
            assert c.step_s == float("inf") and c.refused
        assert {c.pp for c in fits} > {1}  # pipelines are candidates, not only pp 1
    assert any(
        c.runtime == "ep-dualpipev" and c.refused
        for c in search(spec, "ep-dualpipev", costs, emulated_cluster(spec))
    )
    chosen = dataclasses.replace(spec, pp=0, ep_layouts=(("ep-interleaved", 2, 2, 3),))
    flags = chosen.train_flags("ep-interleaved", Path("r"))
    assert flags[flags.index("--pp") + 1] == "2" and flags[flags.index("--ep") + 1] == "2"
    assert flags[flags.index("--virtual-stages") + 1] == "3"
    flags = chosen.train_flags("ep-1f1b", Path("r"))  # not searched: pp 1, ep = world
    assert flags[flags.index("--pp") + 1] == "1" and flags[flags.index("--ep") + 1] == "8"


def _ep_search_setting(a2a_s: float) -> tuple[Any, Any, TrainConfig, dict[str, Any]]:
    """The bench's 8-worker setting at a batch of 64 for `search_ep_layouts`: (spec, model,
    train, keyword arguments) with linear compute costs and `a2a_s` per all-to-all."""
    from disagmoe.bench.cli import emulated_cluster
    from disagmoe.bench.ep_layouts import EmulatedEPCosts
    from disagmoe.costs.compute import ComputeCosts, Linear
    from disagmoe.distributed.ep_layout import EPLayout
    from disagmoe.simulator import Workload

    costs = ComputeCosts(
        Linear(1e-4, 1e-6), Linear(2e-4, 2e-6), Linear(1e-4, 1e-6), Linear(2e-4, 2e-6)
    )
    spec = dataclasses.replace(SPEC, global_batch_size=64)
    model, cluster = model_preset(spec.model), emulated_cluster(spec)
    workload = Workload(model, spec.seq_len, spec.micro_batch_size)

    def costs_for(lay: EPLayout, recompute: str) -> EmulatedEPCosts:
        return EmulatedEPCosts(costs, workload, [a2a_s] * lay.pp, recompute)

    train = TrainConfig(seq_len=spec.seq_len, global_batch_size=64,
                        micro_batch_size=spec.micro_batch_size)  # fmt: skip
    kw = {"costs_for": costs_for, "net": Network.from_cluster(cluster), "cluster": cluster}
    return spec, model, train, kw


def test_ep_layout_search_skips_what_does_not_fit_and_searches_recompute() -> None:
    """A budget below some layouts' peak refuses them (not simulated, counted); recompute
    is a dimension of its own, full priced slower and smaller."""
    from disagmoe.simulator.ep_search import search_ep_layouts, skipped_for_memory

    spec, model, train, kw = _ep_search_setting(a2a_s=1e-3)
    every = search_ep_layouts("ep-1f1b", model, train, spec.world, recomputes=("none", "full"),
                              **kw)  # type: ignore[arg-type]  # fmt: skip
    fit = [c for c in every if not c.refused]
    assert {c.recompute for c in fit} == {"none", "full"} and skipped_for_memory(every) == 0
    by = {(c.pp, c.ep, c.warmup, c.recompute): c for c in fit}
    for (pp, ep, w, r), c in by.items():
        if r == "full":
            assert c.memory_gib < by[pp, ep, w, "none"].memory_gib
            assert c.step_s > by[pp, ep, w, "none"].step_s
    budget = sorted(c.memory_gib for c in fit)[len(fit) // 2]
    some = search_ep_layouts("ep-1f1b", model, train, spec.world, memory_gib=budget,
                             recomputes=("none", "full"), **kw)  # type: ignore[arg-type]  # fmt: skip
    over = [c for c in some if c.over_memory]
    assert over and skipped_for_memory(some) == len(over)
    assert all(c.memory_gib > budget and "needs" in c.refused for c in over)
    assert all(c.memory_gib <= budget for c in some if not c.refused)


def test_the_ep_search_tries_longer_pipeline_warm_ups_held_to_their_memory() -> None:
    """With pp > 1, the 1F1B runtimes are searched at warm-ups 0, pp and every forward
    first (`pipeline_warmups`); a longer warm-up holds more micro-batches (more memory) and,
    where the hand-overs are slow against the compute (here), runs faster. A warm-up given
    is the only one; pp 1 and the runtimes without one have none."""
    from disagmoe.simulator.ep_search import search_ep_layouts

    spec, model, train, kw = _ep_search_setting(a2a_s=1e-3)
    every = [c for c in search_ep_layouts("ep-1f1b", model, train, spec.world, **kw)
             if not c.refused]  # type: ignore[arg-type]  # fmt: skip
    by: dict[tuple[int, int], dict[int, Any]] = {}
    for c in every:
        by.setdefault((c.pp, c.ep), {})[c.warmup] = c
        assert ("pipeline-warmup" in c.label) == (c.warmup > 0)
    assert any(pp == 1 for pp, _ in by) and any(pp > 1 for pp, _ in by)
    for (pp, _), warmed in by.items():
        local = train.num_micro_batches // (spec.world // pp)
        assert set(warmed) == ({0} if pp == 1 else {0, min(pp, local), local})
        gib = [warmed[w].memory_gib for w in sorted(warmed)]
        assert gib == sorted(set(gib))  # each longer warm-up holds more
    assert any(c.step_s < ws[0].step_s for ws in by.values() for w, c in ws.items() if w)
    assert every[0].warmup > 0
    given = search_ep_layouts("ep-combined", model, train, spec.world, warmup=0, **kw)  # type: ignore[arg-type]
    assert {c.warmup for c in given} == {0}
    other = search_ep_layouts("ep-interleaved", model, train, spec.world, **kw)  # type: ignore[arg-type]
    assert {c.warmup for c in other} == {0}


def test_a_pruned_ep_search_finds_the_same_fastest_and_skips_only_slower_layouts() -> None:
    """`prune`: a candidate whose bound is above the fastest step so far is not run; the
    fastest is the full search's, each one skipped is slower in the full search, fits the
    memory and says its bound; a layout's bound is the same at every warm-up."""
    from disagmoe.simulator.ep import simulate_ep
    from disagmoe.simulator.ep_search import search_ep_layouts, skipped_for_bound

    spec, model, train, kw = _ep_search_setting(a2a_s=1e-3)
    for runtime in ("ep-1f1b", "ep-overlap"):
        full = search_ep_layouts(runtime, model, train, spec.world, overlap_chunks=0, **kw)  # type: ignore[arg-type]
        fast = search_ep_layouts(runtime, model, train, spec.world, overlap_chunks=0,
                                 prune=True, **kw)  # type: ignore[arg-type]  # fmt: skip
        assert skipped_for_bound(full) == 0 and skipped_for_bound(fast) > 0
        assert fast[0] == full[0] and len(fast) == len(full)
        step = {(c.pp, c.ep, c.overlap_chunks, c.warmup, c.recompute): c.step_s for c in full}
        for c in fast:
            if c.refused:
                assert c.fits and "bound above the fastest step" in c.refused
                assert step[c.pp, c.ep, c.overlap_chunks, c.warmup, c.recompute] > fast[0].step_s
    lay = {"gpus": spec.world, "pp": 4, "ep": 2, "seq_len": train.seq_len,
           "micro_batch_size": train.micro_batch_size, "num_micro_batches": 16}  # fmt: skip
    bounds = {
        w: simulate_ep("ep-1f1b", model, kw["cluster"], net=kw["net"], warmup=w, **lay).bound
        for w in (0, 4, 8)
    }
    assert bounds[0] is not None and bounds[4] is not None and bounds[8] is not None
    assert bounds[0].seconds == pytest.approx(bounds[4].seconds, rel=1e-12)
    assert bounds[0].seconds == pytest.approx(bounds[8].seconds, rel=1e-12)


def test_ep_overlap_search_tries_each_chunk_count() -> None:
    """`overlap_chunks` 0: ep-overlap's search simulates every layout at each of
    `OVERLAP_CHUNKS` and names the count (the effort AF-Pipe's exchange chunks get), an
    `ep 1` layout (nothing exchanged, the runtime does not chunk) at one; a count given is
    the only one; the other runtimes have none to search."""
    from disagmoe.simulator.ep_search import OVERLAP_CHUNKS, search_ep_layouts

    spec, model, train, kw = _ep_search_setting(a2a_s=1e-2)
    every = [c for c in search_ep_layouts("ep-overlap", model, train, spec.world,
             overlap_chunks=0, **kw) if not c.refused]  # type: ignore[arg-type]  # fmt: skip
    by_layout: dict[tuple[int, int], dict[int, float]] = {}
    for c in every:
        by_layout.setdefault((c.pp, c.ep), {})[c.overlap_chunks] = c.step_s
        assert f"overlap-chunks {c.overlap_chunks}" in c.label
    assert any(ep > 1 for _, ep in by_layout) and any(ep == 1 for _, ep in by_layout)
    for (_, ep), steps in by_layout.items():  # at ep 1 every expert is local: no chunks
        assert set(steps) == (set(OVERLAP_CHUNKS) if ep > 1 else {1})
    assert every[0].step_s == min(c.step_s for c in every)
    # where the all-to-all costs something, chunking changes the step
    assert any(len(set(v.values())) > 1 for v in by_layout.values())
    given = search_ep_layouts("ep-overlap", model, train, spec.world, overlap_chunks=2, **kw)  # type: ignore[arg-type]
    assert {c.overlap_chunks for c in given if not c.refused} == {2}
    plain = search_ep_layouts("ep-1f1b", model, train, spec.world, overlap_chunks=0, **kw)  # type: ignore[arg-type]
    assert {c.overlap_chunks for c in plain} == {0}


def test_the_bench_runs_ep_overlap_at_its_searched_chunk_count() -> None:
    """The bench's search gives ep-overlap every chunk count of `OVERLAP_CHUNKS` (a
    `--set parallel.overlap_chunks=K` only K), and its row runs the chosen one."""
    from disagmoe.bench.cli import emulated_cluster
    from disagmoe.bench.ep_layouts import search
    from disagmoe.costs.compute import ComputeCosts, Linear
    from disagmoe.simulator.ep_search import OVERLAP_CHUNKS

    costs = ComputeCosts(
        Linear(1e-4, 1e-6), Linear(2e-4, 2e-6), Linear(1e-4, 1e-6), Linear(2e-4, 2e-6)
    )
    spec = dataclasses.replace(SPEC, runtimes=("ep-overlap",), global_batch_size=64)
    ranked = [c for c in search(spec, "ep-overlap", costs, emulated_cluster(spec)) if not c.refused]
    assert {c.overlap_chunks for c in ranked} == set(OVERLAP_CHUNKS)
    given = dataclasses.replace(spec, overrides=("parallel.overlap_chunks=4",))
    fixed = search(given, "ep-overlap", costs, emulated_cluster(given))
    assert {c.overlap_chunks for c in fixed if not c.refused} == {4}
    best = ranked[0]
    chosen = dataclasses.replace(
        spec, pp=0, ep_layouts=(("ep-overlap", best.pp, best.ep, 1),),
        ep_overlap_chunks=best.overlap_chunks,
    )  # fmt: skip
    flags = chosen.train_flags("ep-overlap", Path("r"))
    assert flags[flags.index("--overlap-chunks") + 1] == str(best.overlap_chunks)
    assert flags[flags.index("--pp") + 1] == str(best.pp)
    assert "--overlap-chunks" not in dataclasses.replace(chosen, ep_overlap_chunks=0).train_flags(
        "ep-overlap", Path("r")
    )


def test_the_bench_search_prices_each_expert_chunk_as_one_call() -> None:
    """ep-overlap's c chunks are c expert calls, each paying the calibrated call's fixed
    part (as each chunk's wait does in an emulated run): where that part is most of a
    call, more chunks simulate slower at every layout with an all-to-all, and the search
    does not pick 8."""
    from disagmoe.bench.cli import emulated_cluster
    from disagmoe.bench.ep_layouts import EmulatedEPCosts, search
    from disagmoe.costs.compute import ComputeCosts, Linear
    from disagmoe.simulator import Workload

    fixed = 5e-3
    costs = ComputeCosts(
        Linear(1e-4, 1e-6), Linear(2e-4, 2e-6), Linear(fixed, 1e-7), Linear(2 * fixed, 2e-7)
    )
    spec = dataclasses.replace(SPEC, runtimes=("ep-overlap",), global_batch_size=64)
    train = TrainConfig(seq_len=spec.seq_len, global_batch_size=64,
                        micro_batch_size=spec.micro_batch_size)  # fmt: skip
    priced = EmulatedEPCosts(costs, Workload.of_train(model_preset(spec.model), train), [0.0])
    for kind, call in (("F", fixed), ("B", 2 * fixed)):
        whole, quarter = priced.experts(kind), priced.experts_chunk(kind, 4)
        assert 4 * quarter - whole == pytest.approx(3 * call)
    ranked = [c for c in search(spec, "ep-overlap", costs, emulated_cluster(spec)) if not c.refused]
    steps: dict[tuple[int, int], dict[int, float]] = {}
    for c in ranked:
        steps.setdefault((c.pp, c.ep), {})[c.overlap_chunks] = c.step_s
    exchanged = [v for (pp, ep), v in steps.items() if ep > 1]
    assert exchanged and all(v[8] > v[4] > v[2] > v[1] for v in exchanged)
    assert ranked[0].overlap_chunks != 8 or ranked[0].ep == 1


def test_ep_layout_search_sends_the_runs_dtype() -> None:
    """The search prices a float32 run's pipeline activations at 4 bytes an element and a
    bf16 run's at 2 (`Workload.of_train`): on the bench's slow NIC the float32 steps of
    every pipelined layout are longer, the unpipelined ones (no activation on the NIC) not."""
    from disagmoe.simulator.ep_search import search_ep_layouts

    spec, model, train, kw = _ep_search_setting(a2a_s=1e-3)
    steps = {}
    for dtype in ("float32", "bfloat16"):
        run = dataclasses.replace(train, dtype=dtype)
        found = search_ep_layouts("ep-1f1b", model, run, spec.world, **kw)  # type: ignore[arg-type]
        steps[dtype] = {(c.pp, c.ep): c.step_s for c in found if not c.refused}
    assert steps["float32"].keys() == steps["bfloat16"].keys()
    for (pp, ep), step in steps["float32"].items():
        if pp > 1:
            assert step > steps["bfloat16"][pp, ep], (pp, ep)
        else:  # the all-to-all is priced by the costs given (`a2a_s`)
            assert step == pytest.approx(steps["bfloat16"][pp, ep]), (pp, ep)


def test_the_layout_search_prices_all_to_alls_in_the_runs_dtype() -> None:
    """The rows run in float32 (the bench's dtype): the search's all-to-alls carry 4-byte
    elements, as the runtime sends them, not the simulator's bf16 default."""
    from unittest import mock

    from disagmoe.bench import ep_layouts
    from disagmoe.bench.analysis import emulated_network
    from disagmoe.bench.cli import emulated_cluster
    from disagmoe.costs.compute import ComputeCosts, Linear
    from disagmoe.simulator import Workload

    costs = ComputeCosts(
        Linear(1e-4, 1e-6), Linear(2e-4, 2e-6), Linear(1e-4, 1e-6), Linear(2e-4, 2e-6)
    )
    spec = dataclasses.replace(SPEC, runtimes=("ep-1f1b",), global_batch_size=64)
    priced: list[ep_layouts.EmulatedEPCosts] = []
    real = ep_layouts.EmulatedEPCosts
    with mock.patch.object(ep_layouts, "EmulatedEPCosts", side_effect=lambda *a: priced.append(
            real(*a)) or priced[-1]):  # fmt: skip
        ep_layouts.search(spec, "ep-1f1b", costs, emulated_cluster(spec))
    assert TrainConfig().dtype == "float32" and priced
    workload = priced[0].workload
    assert workload.act_bytes == 4
    net = emulated_network(spec.nic_gbps, spec.ranks_per_node, spec.loopback)
    bf16 = Workload(workload.model, spec.seq_len, spec.micro_batch_size)
    group = list(range(spec.world))  # pp 1, ep 8 is a candidate
    assert net.a2a_s(group, 0, workload.a2a_bytes_per_peer(8)) > net.a2a_s(
        group, 0, bf16.a2a_bytes_per_peer(8)
    )
    assert any(c.a2a_s == [net.a2a_s(group, 0, workload.a2a_bytes_per_peer(8))] for c in priced)
