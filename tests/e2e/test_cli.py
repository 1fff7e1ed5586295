"""`disagmoe` as a user runs it: real subprocesses, real exit codes, real output files.

The tables of input mistakes call `disagmoe.cli.main` in this process (`run_cli_in_process`:
the same exit code and stderr, without a 3 s Python start-up each); a mistake of each
command family still goes through a real process here and in `test_workflows.py`,
`test_memory.py` and `test_reliability.py`."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from disagmoe.testing.cli import run_cli, run_cli_in_process


def disagmoe(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, timeout=timeout)


def losses(run_dir: Path) -> list[float]:
    return [
        json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]


def test_disagg_and_reference_print_the_same_losses(tmp_path: Path) -> None:
    common = ["--dtype", "float64", "--steps", "5", "--seed", "3", "--no-progress"]
    ref = run_cli_in_process(  # one process either way: this one
        "train", "--runtime", "reference", "--run-dir", str(tmp_path / "ref"), *common
    )
    assert ref.returncode == 0, ref.stderr
    dis = disagmoe("train", "--runtime", "disagg", "--run-dir", str(tmp_path / "dis"), *common)
    assert dis.returncode == 0, dis.stderr
    a, b = losses(tmp_path / "ref"), losses(tmp_path / "dis")
    assert len(a) == len(b) == 5
    for x, y in zip(a, b, strict=True):
        assert abs(x - y) <= 1e-10 * abs(x)
    assert "disagg: 5 steps" in dis.stdout
    run = tmp_path / "dis"
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert len(record["busy_s"]) == 4 and {"tokens_per_s", "elapsed_s", "lr"} <= record.keys()
    trace = json.loads((run / "trace.json").read_text())["traceEvents"]
    pids = {e["pid"] for e in trace if e.get("ph") == "X"}
    lanes = {e["cat"] for e in trace if e.get("ph") == "X"}
    assert pids == {0, 1, 2, 3} and {"fwd", "bwd", "send", "recv"} <= lanes
    assert all("slot" in e["args"] and "layer" in e["args"] for e in trace if e.get("cat") == "fwd")
    assert (run / "config.toml").exists() and (run / "schedule.txt").exists()
    info = json.loads((run / "run.json").read_text())
    assert info == {
        "runtime": "disagg",
        "world_size": 4,
        "process_groups": 9,  # 8 + p
        "placement": "node-aware",
        "ranks_per_node": 4,  # the local launch: every rank on this host
        "roles": ["A(g0,r0)", "F(g0,j0)", "A(g0,r1)", "F(g0,j1)"],
        "nodes": [{"A": 2, "F": 2}],
        "schedule": {  # what the schedule resolved to (the default chunks: auto, 1 here)
            "order": "breadth",
            "costs": "nominal",
            "exchange_chunks": 1,
            "split_backward": False,
            "compute_costs": "",
            "max_in_flight": info["schedule"]["max_in_flight"],
        },
    }
    assert info["schedule"]["max_in_flight"] >= 1
    assert json.loads((tmp_path / "ref" / "run.json").read_text())["process_groups"] == 0


@pytest.mark.parametrize(
    "args,match",
    [
        (["train", "--model", "gpt-9"], "unknown model preset 'gpt-9'"),
        (["train", "--set", "model.nope=3"], "unknown key model.nope"),
        (["train", "--set", "train.steps=x"], "train.steps must be an integer"),
        (["train", "--data", "/nonexistent/file.txt"], "does not exist"),
        (["train", "--groups", "3"], "divisible by parallel.groups"),
        (["train", "--attn-workers", "5"], "replicas (parallel.attn_workers) without one"),
        (["train", "--expert-workers", "9"], "a shard would hold no expert"),
        (["train", "--steps", "-1"], "train.steps must be >= 0"),
        (["train", "--runtime", "nope"], "invalid choice"),
        (["train", "--set", "train.emulate_compute=/nonexistent.json"], "does not exist"),
        (["train", "--set", "schedule.order=sideways"], "schedule.order must be"),
        (["train", "--ranks-per-node", "3"], "parallel.ranks_per_node (3) must divide"),
        (["train", "--placement", "random"], "invalid choice"),
    ],
)
def test_bad_input_one_line_exit_2(args: list[str], match: str, tmp_path: Path) -> None:
    result = run_cli_in_process(*args, "--run-dir", str(tmp_path / "r"))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and match in lines[0], result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("runtime", ["disagg", "reference"])
def test_device_cuda_without_cuda_one_line_exit_2(runtime: str, tmp_path: Path) -> None:
    result = run_cli_in_process(
        "train", "--runtime", runtime, "--device", "cuda", "--run-dir", str(tmp_path / "r")
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("disagmoe: error: --device cuda: CUDA is not")
    assert not (tmp_path / "r").exists()  # before any rank started, nothing written


@pytest.mark.parametrize(
    "args,match",
    [
        (["--time-scale", "5"], "--time-scale needs --compute emulated"),
        (["--compute", "emulated", "--nodes", "40", "--ranks-per-node", "2"], "at most 64"),
        (["--nodes", "99"], "would measure CPU contention"),
        (["--mtu", "100"], "--mtu must be in"),
        (["--queue-kb", "0"], "--queue-kb must be in"),
        (["--placements", "packed,random"], "--placements must list"),
        (["--set", "parallel.overlap_chunks=x"], "parallel.overlap_chunks must be an integer"),
        (["--set", "parallel.bogus=3"], "unknown key parallel.bogus"),
    ],
)
def test_bench_bad_input_one_line_exit_2(args: list[str], match: str, tmp_path: Path) -> None:
    result = run_cli_in_process("bench", *args, "--out", str(tmp_path / "b"))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and match in lines[0], result.stderr
    assert not (tmp_path / "b").exists()


def test_bench_refuses_an_out_dir_holding_runs(tmp_path: Path) -> None:
    """A second bench into the same --out is refused before any calibration or run (each
    row would fail on its run dir), and the first bench's runs stay as they were."""
    old = tmp_path / "b" / "disagg-even-r0"
    old.mkdir(parents=True)
    (old / "metrics.jsonl").write_text('{"step": 0}\n')
    result = run_cli_in_process("bench", "--loopback", "--out", str(tmp_path / "b"))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "already holds a bench's runs" in lines[0], result.stderr
    assert "disagg-even-r0" in lines[0]
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["disagg-even-r0"]
    assert (old / "metrics.jsonl").read_text() == '{"step": 0}\n'


def test_bench_bad_input_from_a_real_process(tmp_path: Path) -> None:
    """The table above as a shell meets it: exit code 2, one line, no traceback."""
    result = disagmoe("bench", "--mtu", "100", "--out", str(tmp_path / "b"), timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--mtu must be in" in lines[0], result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "b").exists()


def test_malformed_toml_and_unsupported_hf(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = 2\n")
    result = disagmoe("train", "--config", str(bad))
    assert result.returncode == 2 and "not valid TOML" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama"}))
    result = disagmoe("train", "--init-from-hf", str(hf))
    assert result.returncode == 2 and "llama" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_schedule_command(tmp_path: Path) -> None:
    result = disagmoe("schedule", "--groups", "2", "--attn-workers", "1", "--expert-workers", "1")
    assert result.returncode == 0
    assert "rank 1 F(g0,j0):" in result.stdout and "# valid" in result.stdout


def test_schedule_of_one_rank() -> None:
    """In this process (`test_schedule_command` runs `schedule` as a real process)."""
    layout = ("--groups", "2", "--attn-workers", "2", "--expert-workers", "2")
    whole = run_cli_in_process("schedule", *layout)
    one = run_cli_in_process("schedule", *layout, "--rank", "5", "--validate")
    assert whole.returncode == 0 and one.returncode == 0, one.stderr
    # node-aware: group 1's block is ranks 4..7 = A(g1,r0), F(g1,j0), A(g1,r1), F(g1,j1)
    section = whole.stdout.split("rank 5 F(g1,j0):\n")[1].split("rank 6")[0]
    assert one.stdout.split("rank 5 F(g1,j0):\n")[1].startswith(section)
    assert "rank 4" not in one.stdout and "this rank's list equals its slice" in one.stdout
    bad = run_cli_in_process("schedule", *layout, "--rank", "8")
    assert bad.returncode == 2 and "--rank must be in 0..7" in bad.stderr


def test_schedule_of_an_ep_runtime_is_its_own() -> None:
    """`--runtime ep-*` prints that runtime's lists (pipeline order and all-to-alls), the
    ones its run records in schedule.txt, not AF-Pipe's."""
    layout = ("--runtime", "ep-1f1b", "--pp", "2", "--ep", "2")
    whole = run_cli_in_process("schedule", *layout)
    assert whole.returncode == 0, whole.stderr
    assert whole.stdout.startswith("# schedule ep-1f1b: 4 ranks")
    assert "A2A dispatch l0 s0 [0, 1]" in whole.stdout and "SEND act[l1,s0] 0->2" in whole.stdout
    one = run_cli_in_process("schedule", *layout, "--rank", "2")
    section = whole.stdout.split("rank 2 S(pp1,dp0,ep0):\n")[1].split("rank 3")[0]
    assert one.returncode == 0 and one.stdout.split("rank 2 S(pp1,dp0,ep0):\n")[1] == section
    for extra, says in ((("--validate",), "AF-Pipe's"), (("--rank", "4"), "0..3")):
        bad = run_cli_in_process("schedule", *layout, *extra)
        assert bad.returncode == 2 and says in bad.stderr, bad.stderr
    ref = run_cli_in_process("schedule", "--runtime", "reference")
    assert ref.returncode == 2 and "no per-rank schedule" in ref.stderr
