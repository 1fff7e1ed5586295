"""`disagmoe checkpoint verify PATH`: check checkpoints against their manifests, for operators.

PATH is a run dir, its `checkpoints/` or one `step-N/`. Every step dir is read whole and
compared with its manifest (`training.manifest`: sizes and CRC-32), newest first, one line
each; for a run dir also the unfinished saves left behind (`*.tmp-*`, which `--resume`
never reads) and the checkpoint `--resume` would continue from. Exit code 0 when every
checkpoint verifies, 1 when one does not, 2 when PATH holds no checkpoint.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .training.checkpoint import checkpoint_root, choose_checkpoint, require_step_dir
from .training.manifest import CHECKSUM, CheckpointError, Verified, verify


def add_checkpoint_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True)
    p_verify = sub.add_parser(
        "verify", help="check every file of a run's checkpoints against their manifests"
    )
    p_verify.add_argument("path", metavar="PATH", help="a run dir, its checkpoints/ or a step dir")


def run_checkpoint(args: argparse.Namespace) -> int:
    assert args.action == "verify", args.action
    path = Path(args.path)
    root = checkpoint_root(path)
    if root is None:
        steps = [require_step_dir(path)]
    else:
        steps = sorted(
            (d for d in root.iterdir() if d.is_dir() and d.name.startswith("step-")),
            key=lambda d: d.name,
            reverse=True,
        )
    results: dict[Path, Verified | CheckpointError] = {}
    for step_dir in steps:
        if ".tmp-" in step_dir.name:
            print(f"unfinished save {step_dir}: never resumed from; the next save removes it")
            continue
        try:
            ok = results[step_dir] = verify(step_dir)
            mib = ok.num_bytes / 2**20
            print(f"ok     {step_dir}: {ok.num_files} files, {mib:.2f} MiB, {CHECKSUM} match")
        except CheckpointError as err:
            results[step_dir] = err
            print(f"FAILED {err}")
    all_good = all(isinstance(r, Verified) for r in results.values())
    if root is None:
        return 0 if all_good else 1

    def known(step_dir: Path) -> Verified:
        result = results.get(step_dir) or verify(step_dir)
        if isinstance(result, CheckpointError):
            raise result
        return result

    latest = (root / "latest").read_text().strip()
    try:
        chosen = choose_checkpoint(root, check=known).step_dir
        print(f"latest names {latest}; --resume would continue from {chosen}")
    except CheckpointError:
        print(f"latest names {latest}; --resume would refuse: no checkpoint verifies")
        all_good = False
    return 0 if all_good else 1
