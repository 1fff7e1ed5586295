"""A run's schedule choice priced with measured compute costs (`schedule.costs_file`, else
`train.emulate_compute`'s file), and the emulated bench describing its links to the run."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from disagmoe.bench.analysis import emulated_network
from disagmoe.bench.spec import BenchSpec
from disagmoe.config import (
    ClusterConfig,
    ParallelConfig,
    RunConfig,
    ScheduleConfig,
    TrainConfig,
)
from disagmoe.config_io import apply_overrides
from disagmoe.distributed.layout import Layout
from disagmoe.presets import MODEL_PRESETS
from disagmoe.simulator.choose import run_choice, run_compute_costs
from disagmoe.simulator.costs import AnalyticCosts, Workload
from disagmoe.simulator.measured import MeasuredCosts
from disagmoe.simulator.network import Network


def costs_file(tmp_path: Path, expert_fixed: float) -> str:
    """Compute costs with `expert_fixed` seconds per expert call (backward twice that)."""

    def unit(fixed: float, per_row: float) -> dict[str, float]:
        return {"fixed": fixed, "per_row": per_row}

    path = tmp_path / f"costs-{expert_fixed}.json"
    path.write_text(
        json.dumps(
            {
                "attn_fwd": unit(0.0, 2e-5),
                "attn_bwd": unit(0.0, 4e-5),
                "expert_fwd": unit(expert_fixed, 2e-5),
                "expert_bwd": unit(2 * expert_fixed, 4e-5),
            }
        )
    )
    return str(path)


def config(costs: str = "", emulate: str = "") -> RunConfig:
    """Small model, 2 + 2 workers one per node on 0.5 GB/s NICs, cap 3: comm-heavy enough
    that the analytic costs pick 4 exchange chunks."""
    return RunConfig(
        model=MODEL_PRESETS["small"],
        schedule=ScheduleConfig(
            order="breadth", exchange_chunks=0, max_in_flight=3, costs_file=costs
        ),
        parallel=ParallelConfig(groups=1, attn_workers=2, expert_workers=2),
        train=TrainConfig(
            seq_len=512, global_batch_size=8, micro_batch_size=1, emulate_compute=emulate
        ),
        cluster=ClusterConfig(nic_gbps=0.5, gpus_per_node=1, nics_per_node=1),
    )


def test_the_costs_file_decides_the_chunk_count(tmp_path: Path) -> None:
    cfg = config()
    layout = Layout.build(cfg.model, cfg.parallel)
    workload = Workload.of_run(cfg)
    assert isinstance(run_compute_costs(cfg, layout, workload), AnalyticCosts)
    run_choice.cache_clear()
    assert run_choice(cfg, layout, 4, 3)[0].exchange_chunks == 4
    # an expert call that costs 5 ms whatever its rows: every chunk pays it, so 1 chunk wins
    heavy = config(costs=costs_file(tmp_path, 0.005))
    assert isinstance(run_compute_costs(heavy, layout, workload), MeasuredCosts)
    choice = run_choice(heavy, layout, 4, 3)[0]
    assert choice.exchange_chunks == 1
    steps = {k: t for _, _, k, t, _ in choice.steps}
    assert steps[1] < steps[2] < steps[4]
    # the same costs without a fixed part: chunks win again
    assert run_choice(config(costs=costs_file(tmp_path, 0.0)), layout, 4, 3)[0].exchange_chunks > 1
    # an emulated run's own costs file is the default; schedule.costs_file wins over it
    emulated = config(emulate=costs_file(tmp_path, 0.005))
    assert run_choice(emulated, layout, 4, 3)[0].exchange_chunks == 1
    both = config(costs=costs_file(tmp_path, 0.0), emulate=costs_file(tmp_path, 0.005))
    assert run_choice(both, layout, 4, 3)[0].exchange_chunks > 1


def test_a_missing_costs_file_is_a_clear_error(tmp_path: Path) -> None:
    cfg = config(costs=str(tmp_path / "nope.json"))
    layout = Layout.build(cfg.model, cfg.parallel)
    with pytest.raises(ValueError, match="nope.json' does not exist"):
        run_choice(cfg, layout, 4, 3)


def test_emulated_disagg_runs_see_the_emulated_links() -> None:
    spec = BenchSpec(
        runtimes=("disagg", "ep-1f1b"), nodes=4, ranks_per_node=2, nic_gbps=0.4,
        model="small", seq_len=128, global_batch_size=64, micro_batch_size=4, steps=3,
        warmup=1, repeats=1, groups=1, attn_workers=4, expert_workers=4, pp=1, ep=8,
        out_dir=Path("out"), compute="emulated", time_scale=32.0, costs_path="costs.json",
    )  # fmt: skip
    flags = spec.train_flags("disagg", Path("r"))
    sets = [flags[i + 1] for i, f in enumerate(flags) if f == "--set"]
    cluster = [s for s in sets if s.startswith("cluster.")]
    assert cluster == spec.cluster_overrides() and "cluster.name=emulated" in cluster
    assert not any(s.startswith("cluster.") for s in spec.train_flags("ep-1f1b", Path("r")))
    cfg = apply_overrides(RunConfig(), cluster)
    seen, emulated = Network.from_cluster(cfg.cluster), emulated_network(0.4, 2, False)
    assert seen.gpus_per_node == 2 and seen.nics_per_node == 1
    assert seen.nic_bytes_per_s == pytest.approx(emulated.nic_bytes_per_s / 32)
    assert seen.latency_s == pytest.approx(emulated.latency_s)
    # real compute has no costs file: the run keeps its cluster
    real = dataclasses.replace(spec, compute="real", time_scale=1.0, costs_path="")
    assert not any(f.startswith("cluster.") for f in real.train_flags("disagg", Path("r")))


def test_bench_rows_say_what_the_schedule_resolved_to(tmp_path: Path) -> None:
    from disagmoe.bench.runner import _schedule_note

    (tmp_path / "run.json").write_text(
        json.dumps({"schedule": {"order": "steady", "exchange_chunks": 2}})
    )
    assert _schedule_note(tmp_path) == " order steady exchange-chunks 2"
    (tmp_path / "run.json").write_text(json.dumps({"runtime": "ep-1f1b"}))
    assert _schedule_note(tmp_path) == ""
    assert _schedule_note(tmp_path / "missing") == ""
