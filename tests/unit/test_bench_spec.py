"""The bench's NIC split: which rank gets which rate, and the same total as the EP runs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from disagmoe.bench.cli import nic_split
from disagmoe.bench.spec import BenchSpec, Entry
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
    kw = dict(gpus=8, seq_len=4096, micro_batch_size=1)
    plan = plan_for(model, h800, **kw)  # type: ignore[arg-type]
    split = planned_split(model, h800, **kw)  # type: ignore[arg-type]
    assert (split.attn_workers, split.expert_workers) == (
        plan.attn_gpus_per_group,
        plan.ffn_gpus_per_group,
    )
    assert model.num_experts % split.expert_workers  # 32 experts on 5 shards (uneven)
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
    accepts (the same checks a run makes; refused ones say why), and runs it; with --pp,
    the best at that pipeline depth."""
    from disagmoe.bench.cli import emulated_cluster
    from disagmoe.bench.ep_layouts import search
    from disagmoe.costs.compute import ComputeCosts, Linear

    costs = ComputeCosts(
        Linear(1e-4, 1e-6), Linear(2e-4, 2e-6), Linear(1e-4, 1e-6), Linear(2e-4, 2e-6)
    )
    spec = dataclasses.replace(
        SPEC, runtimes=("ep-1f1b", "ep-interleaved", "ep-dualpipev"), global_batch_size=64, pp=0
    )
    for runtime in spec.runtimes:
        ranked = search(spec, runtime, costs, emulated_cluster(spec))
        fits = [c for c in ranked if not c.refused]
        assert fits and all(c.refused for c in ranked[len(fits) :])
        steps = [round(c.step_s, 9) for c in fits]  # equal to a ns: least memory first
        assert steps == sorted(steps)
        for c in ranked[len(fits) :]:  # e.g. DualPipeV with too few micro-batches per replica
            assert c.step_s == float("inf") and c.refused
        assert {c.pp for c in fits} > {1}  # pipelines are candidates, not only pp 1
    assert any(
        c.runtime == "ep-dualpipev" and c.refused
        for c in search(spec, "ep-dualpipev", costs, emulated_cluster(spec))
    )
    # with --pp given the search keeps it (and ep = W/pp) and chooses the rest
    given = search(dataclasses.replace(spec, pp=1), "ep-interleaved", costs, emulated_cluster(spec))
    assert {(c.pp, c.ep) for c in given} == {(1, 8)} and len({c.virtual_stages for c in given}) > 1
    chosen = dataclasses.replace(spec, pp=0, ep_layouts=(("ep-interleaved", 2, 2, 3),))
    flags = chosen.train_flags("ep-interleaved", Path("r"))
    assert flags[flags.index("--pp") + 1] == "2" and flags[flags.index("--ep") + 1] == "2"
    assert flags[flags.index("--virtual-stages") + 1] == "3"
    flags = chosen.train_flags("ep-1f1b", Path("r"))  # not searched: pp 1, ep = world
    assert flags[flags.index("--pp") + 1] == "1" and flags[flags.index("--ep") + 1] == "8"


def test_an_ep_rows_layout_names_what_a_set_override_changed(tmp_path: Path) -> None:
    """A `--set parallel.pipeline_warmup=8` on an `--pp 4 --ep 2` bench: the row's layout
    names the warm-up and virtual stages its run resolved (its config.toml), not only the
    bench's flags; what the label already names, a zero warm-up and a disagg run add
    nothing."""
    from disagmoe.bench.runner import _override_note
    from disagmoe.config import RunConfig
    from disagmoe.config_io import save_toml

    def run(runtime: str, **parallel: int) -> Path:
        cfg = RunConfig(parallel=ParallelConfig(runtime=runtime, pp=4, ep=2, **parallel))
        path = tmp_path / f"{runtime}-{len(list(tmp_path.iterdir()))}"
        path.mkdir()
        save_toml(cfg, path / "config.toml")
        return path

    label = "pp 4 ep 2 world-size 16"
    warmed = run("ep-interleaved", pipeline_warmup=8)
    assert _override_note(warmed, label) == " virtual-stages 2 pipeline-warmup 8"
    assert _override_note(warmed, "pp 4 ep 2 virtual-stages 2 pipeline-warmup 8") == ""
    assert _override_note(run("ep-interleaved"), label) == " virtual-stages 2"
    assert _override_note(run("ep-overlap", overlap_chunks=4), label) == " overlap-chunks 4"
    # DualPipeV has no warm-up to lengthen; its expert chunks (the config's 2) are named
    assert _override_note(run("ep-dualpipev", pipeline_warmup=3), label) == " overlap-chunks 2"
    assert _override_note(run("ep-1f1b", overlap_chunks=4), label) == ""  # does not chunk
    assert _override_note(run("disagg"), "groups 1") == ""
    assert _override_note(tmp_path / "missing", label) == ""


def test_an_emulated_reports_compute_label_carries_its_calibration(tmp_path: Path) -> None:
    """The report says what the ranks waited: the calibration per micro-batch and layer,
    before the time scale (the costs file holds it scaled)."""
    from disagmoe.bench.cli import compute_label
    from disagmoe.costs.compute import ComputeCosts, Linear

    costs = ComputeCosts(Linear(0.0, 1e-5), Linear(0.0, 2e-5), Linear(0.0, 1e-6), Linear(0, 3e-6))
    path = tmp_path / "compute_costs.json"
    path.write_text(costs.scaled(10.0).to_json())
    spec = dataclasses.replace(SPEC, compute="emulated", time_scale=10.0)
    assert "calibration" not in compute_label(spec)  # no costs file yet
    label = compute_label(dataclasses.replace(spec, costs_path=str(path)))
    tokens, pairs = 64 * 2, 64 * 2 * model_preset("small").top_k
    want = (f"attention {1e-2 * tokens:.2f} / {2e-2 * tokens:.2f} ms fwd/bwd, "
            f"experts {1e-3 * pairs:.2f} / {3e-3 * pairs:.2f} ms")  # fmt: skip
    assert label.endswith(f"; calibration per micro-batch and layer: {want}")
    assert compute_label(dataclasses.replace(SPEC, compute="real")) == "real compute"
