"""`disagmoe plan` argument handling, JSON keys, table, plot and errors."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from disagmoe.planner.cli import add_plan_arguments, run_plan

JSON_KEYS = {"attn_gpus", "ffn_gpus", "attn_nics", "ffn_nics", "groups", "virtual_stages",
             "micro_batches", "t_attn_s", "t_ffn_s", "t_stage_s"}  # fmt: skip


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="disagmoe plan")
    add_plan_arguments(parser)
    return parser.parse_args(list(argv))


def test_json_output_has_the_documented_keys(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse("--model", "qwen3-30b-a3b", "--gpus", "64", "--seq-len", "8192", "--json",
                 "--search-moves", "8", "--profile", "analytic")  # fmt: skip
    assert run_plan(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= JSON_KEYS
    assert out["attn_gpus"] + out["ffn_gpus"] == 64
    assert out["t_stage_s"] == max(out["t_attn_s"], out["t_ffn_s"]) > 0


def test_flags_override_the_cluster_preset(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse("--model", "deepseek-moe-16b", "--gpus", "16", "--cluster", "h200",
                 "--nic-gbit", "200", "--peak-tflops", "500", "--gpus-per-node", "8",
                 "--nics-per-node", "4", "--roofline-only", "--json", "--top-k", "2")  # fmt: skip
    run_plan(args)
    out = json.loads(capsys.readouterr().out)
    assert out["cluster"] == "h200" and out["nics"] == 8
    assert out["attn_nics"] + out["ffn_nics"] == 4
    assert out["ridge"] == pytest.approx(500e12 / (25e9 * 0.5))
    assert out["i_ffn"] == pytest.approx(2 * 1408)  # I_ffn = 2 D_e whatever the top-k


def test_table_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "roof.png"
    args = parse("--model", "gpt-oss-20b", "--gpus", "64", "--plot", str(png), "--profile",
                 "analytic")  # fmt: skip
    assert run_plan(args) == 0
    text = capsys.readouterr().out
    assert "A:F GPUs" in text and "T_stage" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_infeasible_request_raises_value_error() -> None:
    args = parse("--model", "mixtral-8x7b", "--gpus", "8", "--seq-len", "32768")
    with pytest.raises(ValueError, match=r"no feasible plan: .*memory"):
        run_plan(args)
