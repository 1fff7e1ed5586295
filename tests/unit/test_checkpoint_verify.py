"""Checkpoints that prove themselves: the manifest a save writes last, verification before
any rank loads, the fall-back to the newest checkpoint that verifies (or exit code 2 and one
line naming the file), `disagmoe checkpoint verify`, and a process killed at each point of
a save. Single process (reference runtime, float64); the resumed losses must equal those of
the undisturbed run to 1e-10 relative, as in tests/distributed/equivalence.py."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from disagmoe.testing.cli import run_cli_in_process
from disagmoe.train_config import SAVE_KILL_POINTS
from disagmoe.training.manifest import MANIFEST, CheckpointError, file_digest, verify

FLAGS = ["--runtime", "reference", "--dtype", "float64", "--no-progress", "--seq-len", "32"]
SHARD = "__0_0.distcp"


def _train(run_dir: Path, *extra: str, steps: int = 4, every: int = 2) -> tuple[int, str, str]:
    out = run_cli_in_process(
        "train", *FLAGS, "--steps", str(steps), "--checkpoint-every", str(every),
        "--run-dir", str(run_dir), *extra,
    )  # fmt: skip
    return out.returncode, out.stdout, out.stderr


def _losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def _same(got: dict[int, float], want: dict[int, float]) -> bool:
    return got.keys() == want.keys() and all(
        abs(got[s] - want[s]) <= 1e-10 * abs(want[s]) for s in want
    )


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An undisturbed run: 4 steps, checkpoints after steps 2 and 4."""
    run_dir = tmp_path_factory.mktemp("clean") / "run"
    code, _, err = _train(run_dir)
    assert code == 0, err
    return run_dir


def _copy(clean: Path, tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(clean, run_dir)
    return run_dir


def test_a_save_lists_every_file_with_its_size_and_crc32(clean: Path) -> None:
    step_dir = clean / "checkpoints" / "step-00000004"
    body = json.loads((step_dir / MANIFEST).read_text())
    assert body["checksum"] == "crc32"
    on_disk = {p.name for p in step_dir.iterdir()} - {MANIFEST}
    assert set(body["files"]) == on_disk and {SHARD, ".metadata", "meta.json"} <= on_disk
    for name, entry in body["files"].items():
        assert entry == file_digest(step_dir / name)
    ok = verify(step_dir)
    assert ok.num_files == len(on_disk) and ok.num_bytes == sum(
        (step_dir / n).stat().st_size for n in on_disk
    )


def _truncate(step_dir: Path) -> str:
    shard = step_dir / SHARD
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size // 2])
    return f"{shard}: expected {size} bytes, found {size // 2}"


def _flip(step_dir: Path) -> str:
    shard = step_dir / SHARD
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x01
    want = json.loads((step_dir / MANIFEST).read_text())["files"][SHARD]["crc32"]
    shard.write_bytes(bytes(data))
    return f"{shard}: expected crc32 {want}, found "


def _delete_metadata(step_dir: Path) -> str:
    (step_dir / ".metadata").unlink()
    return f"{step_dir / '.metadata'}: expected "


def _delete_manifest(step_dir: Path) -> str:
    (step_dir / MANIFEST).unlink()
    return f"{step_dir / MANIFEST}: expected the checkpoint's manifest, found no file"


DAMAGE: dict[str, Callable[[Path], str]] = {
    "truncated shard": _truncate,
    "flipped byte": _flip,
    "missing file": _delete_metadata,
    "missing manifest": _delete_manifest,
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_resume_falls_back_to_the_newest_checkpoint_that_verifies(
    clean: Path, tmp_path: Path, damage: str
) -> None:
    run_dir = _copy(clean, tmp_path)
    newest = run_dir / "checkpoints" / "step-00000004"
    named = DAMAGE[damage](newest)
    with pytest.raises(CheckpointError) as err:
        verify(newest)
    assert str(err.value).startswith(named) and "\n" not in str(err.value)
    code, out, err_text = _train(run_dir, "--resume")
    assert code == 0, err_text
    warning = err_text.strip().splitlines()
    assert len(warning) == 1 and warning[0].startswith("disagmoe: warning: checkpoint skipped")
    assert named in warning[0] and "resuming from" in warning[0] and "step-00000002" in warning[0]
    assert f"resumed from {run_dir / 'checkpoints' / 'step-00000002'} at step 2" in out
    assert _same(_losses(run_dir), _losses(clean))


def test_resume_refuses_with_one_line_when_no_checkpoint_verifies(
    clean: Path, tmp_path: Path
) -> None:
    run_dir = _copy(clean, tmp_path)
    root = run_dir / "checkpoints"
    named = [_truncate(root / "step-00000004"), _delete_manifest(root / "step-00000002")]
    code, out, err = _train(run_dir, "--resume")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"disagmoe: error: no checkpoint in {root}")
    assert all(n in err for n in named) and "Traceback" not in err
    # A step dir named explicitly is that one or none: no fall-back.
    code, _, err = _train(tmp_path / "other", "--resume", str(root / "step-00000004"))
    assert code == 2 and err == f"disagmoe: error: {named[0]}\n"


def test_checkpoint_verify_command(clean: Path, tmp_path: Path) -> None:
    good = run_cli_in_process("checkpoint", "verify", str(clean))
    root = clean / "checkpoints"
    assert good.returncode == 0, good.stderr
    assert good.stdout.splitlines() == [
        f"ok     {root / 'step-00000004'}: 3 files, 11.43 MiB, crc32 match",
        f"ok     {root / 'step-00000002'}: 3 files, 11.43 MiB, crc32 match",
        f"latest names step-00000004; --resume would continue from {root / 'step-00000004'}",
    ]
    run_dir = _copy(clean, tmp_path)
    root = run_dir / "checkpoints"
    named = _flip(root / "step-00000004")
    (root / "step-00000006.tmp-0a1b2c3d").mkdir()
    bad = run_cli_in_process("checkpoint", "verify", str(run_dir))
    assert bad.returncode == 1
    lines = bad.stdout.splitlines()
    assert lines[0].startswith(f"unfinished save {root / 'step-00000006.tmp-0a1b2c3d'}")
    assert lines[1].startswith(f"FAILED {named}")
    assert lines[2].startswith(f"ok     {root / 'step-00000002'}")
    assert (
        lines[3]
        == f"latest names step-00000004; --resume would continue from {root / 'step-00000002'}"
    )
    one = run_cli_in_process("checkpoint", "verify", str(root / "step-00000002"))
    assert one.returncode == 0 and len(one.stdout.splitlines()) == 1
    missing = run_cli_in_process("checkpoint", "verify", str(tmp_path / "nothing"))
    assert missing.returncode == 2 and missing.stderr.startswith(
        "disagmoe: error: no checkpoint at"
    )


@pytest.fixture(scope="module")
def short(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The undisturbed losses of the killed runs' flags (2 steps)."""
    run_dir = tmp_path_factory.mktemp("short") / "run"
    code, _, err = _train(run_dir, steps=2, every=1)
    assert code == 0, err
    return _losses(run_dir)


@pytest.mark.parametrize("point", SAVE_KILL_POINTS)
def test_a_process_killed_during_a_save_resumes_from_the_last_complete_checkpoint(
    short: dict[int, float], tmp_path: Path, point: str
) -> None:
    """Killed (SIGKILL) at `point` of the save after step 2: `latest` names the checkpoint of
    step 1 until the save moves it, and the resumed run's losses are the undisturbed ones."""
    run_dir = tmp_path / "run"
    killed = subprocess.run(  # `disagmoe train` without the other commands' imports
        [sys.executable, "-m", "disagmoe.train", *FLAGS, "--steps", "2", "--checkpoint-every",
         "1", "--run-dir", str(run_dir), "--set", f"train.fail_in_save={point}:2"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    resumed_at = 2 if point == "latest" else 1
    code, out, err = _train(run_dir, "--resume", steps=2, every=1)
    assert code == 0 and err == "", err
    assert f"resumed from {run_dir / 'checkpoints' / f'step-0000000{resumed_at}'}" in out
    assert _same(_losses(run_dir), short)
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-00000002"
    assert not list((run_dir / "checkpoints").glob("*.tmp-*"))  # the next save cleaned up
