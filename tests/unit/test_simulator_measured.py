"""Measured per-op costs (`simulator.measured`): how a costs file prices a layout, and the
`--costs-file` flags of `disagmoe simulate` and `disagmoe plan`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from disagmoe.costs import flops
from disagmoe.costs.compute import ComputeCosts, Linear
from disagmoe.planner.cli import add_plan_arguments, run_plan
from disagmoe.presets import CLUSTER_PRESETS, MODEL_PRESETS
from disagmoe.schedule.ir import Op
from disagmoe.simulate_cli import main as simulate_main
from disagmoe.simulator import Workload, simulate_disagg
from disagmoe.simulator.measured import MeasuredCosts

UNITS = ComputeCosts(
    attn_fwd=Linear(1e-3, 2e-6),
    attn_bwd=Linear(2e-3, 4e-6),
    expert_fwd=Linear(5e-4, 1e-6),
    expert_bwd=Linear(1e-3, 3e-6),
)


def _write(tmp_path: Path) -> str:
    path = tmp_path / "compute_costs.json"
    path.write_text(UNITS.to_json())
    return str(path)


def test_a_layout_is_priced_from_the_linear_units() -> None:
    model = MODEL_PRESETS["tiny-shared"]  # layer 0 dense, the others MoE
    w = Workload(model, seq_len=64, micro_batch_size=2)
    costs = MeasuredCosts(UNITS).bound_to(w, attn_workers=3, expert_workers=2, recompute="none")
    moe = next(l for l in range(model.num_layers) if model.is_moe_layer(l))
    assert costs.compute_s(Op.FWD, "A", moe) == pytest.approx(1e-3 + 2e-6 * 128)
    assert costs.compute_s(Op.BWD, "A", moe) == pytest.approx(2e-3 + 4e-6 * 128)
    pairs = round(3 * w.pairs_per_shard(2))  # three replicas' assignments on one shard
    assert costs.compute_s(Op.FWD, "F", moe) == pytest.approx(5e-4 + 1e-6 * pairs)
    assert costs.compute_s(Op.BWD, "F", moe) == pytest.approx(1e-3 + 3e-6 * pairs)
    # a dense layer and the LM head: the MoE block's time scaled by forward FLOPs
    ref = sum(flops.attn_flops(model, 64, 2, moe=1.0, dense=0.0))
    for layer in (0, model.num_layers):
        scale = sum(w.attn_flops(layer)) / ref
        assert costs.compute_s(Op.FWD, "A", layer) == pytest.approx((1e-3 + 2e-6 * 128) * scale)
    # full recompute: every backward reruns its forward; more shards: fewer assignments
    full = costs.bound_to(w, 3, 2, "full")
    assert full.compute_s(Op.BWD, "F", moe) == pytest.approx(
        costs.compute_s(Op.BWD, "F", moe) + costs.compute_s(Op.FWD, "F", moe)
    )
    assert costs.bound_to(w, 3, 4, "none").compute_s(Op.FWD, "F", moe) < costs.compute_s(
        Op.FWD, "F", moe
    )


def test_simulate_disagg_binds_a_costs_file_to_its_layout() -> None:
    model, cluster = MODEL_PRESETS["tiny"], CLUSTER_PRESETS["h800"]
    kw = dict(groups=1, attn_workers=2, expert_workers=2, seq_len=128, micro_batch_size=1,
              num_micro_batches=8)  # fmt: skip
    unbound = simulate_disagg(model, cluster, costs=MeasuredCosts(UNITS), **kw)  # type: ignore[arg-type]
    w = Workload(model, 128, 1)
    bound = simulate_disagg(
        model,
        cluster,
        costs=MeasuredCosts(UNITS).bound_to(w, 2, 2, "none"),
        **kw,  # type: ignore[arg-type]
    )
    analytic = simulate_disagg(model, cluster, **kw)  # type: ignore[arg-type]
    assert unbound.step_time_s == pytest.approx(bound.step_time_s)
    # milliseconds per op against H800 microseconds: the file, not the preset, prices it
    assert unbound.step_time_s > 10 * analytic.step_time_s


def test_simulate_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path)
    args = ["--model", "tiny", "--seq-len", "128", "--attn-workers", "4", "--expert-workers", "4",
            "--order", "breadth", "--exchange-chunks", "1", "--split-backward", "off"]  # fmt: skip
    assert simulate_main([*args, "--costs-file", path, "--json"]) == 0
    measured = json.loads(capsys.readouterr().out)
    assert simulate_main([*args, "--json"]) == 0
    analytic = json.loads(capsys.readouterr().out)
    assert measured["config"]["costs"] == path
    assert measured["step_time_s"] > 10 * analytic["step_time_s"]
    assert simulate_main(["--runtime", "ep-1f1b", "--costs-file", path]) == 2
    assert "disagg replay only" in capsys.readouterr().err
    assert simulate_main([*args, "--costs-file", str(tmp_path / "missing.json")]) == 2
    assert "does not exist" in capsys.readouterr().err


def _plan_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    return parser.parse_args(argv)


def test_plan_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path)
    base = (
        "--model",
        "qwen3-30b-a3b",
        "--gpus",
        "8",
        "--seq-len",
        "1024",
        "--micro-batch-size",
        "1",
    )
    quick = ("--groups", "1", "--micro-batches", "4", "--search-moves", "2")
    assert run_plan(_plan_args(*base, *quick, "--costs-file", path, "--json")) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["profile"] == "simulator" and out["costs"] == path
    with pytest.raises(ValueError, match="simulator profile"):
        run_plan(_plan_args(*base, "--costs-file", path, "--profile", "analytic"))
