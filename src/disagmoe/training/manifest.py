"""A checkpoint's manifest: what every file of a step dir must be, and the check that it is.

A save (`checkpoint.save_checkpoint`) writes `manifest.json` last, before the step dir is
renamed into place and before `latest` moves: every other file's size in bytes and CRC-32
(`zlib.crc32`, about 4 GB/s on one core of the development host). The manifest goes to a
temp file that is fsynced and renamed, and the directory is fsynced, so a manifest is
either whole and durable or absent. Each rank checksums the shards it wrote itself
(`__<rank>_*.distcp`, still in its page cache); rank 0 the rest and writes the manifest.

`verify` reads every listed file and compares; the first mismatch is one line that names
the file, what the manifest expects and what was found (`CheckpointError`, a ValueError:
exit code 2 at the command line). A step dir without a manifest (a save that did not
finish, or a checkpoint of a version without manifests) does not verify.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
CHECKSUM = "crc32"  # zlib.crc32 of the whole file, 8 hex digits
FORMAT = 1
_CHUNK = 8 << 20
_RANK_FILE = re.compile(r"^__(\d+)_")


class CheckpointError(ValueError):
    """A checkpoint does not verify: one line naming the file, expected vs found."""


def file_digest(path: Path) -> dict[str, Any]:
    """{"bytes": size, "crc32": 8 hex digits} of one file, read in 8 MiB chunks."""
    crc, size = 0, 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return {"bytes": size, CHECKSUM: f"{crc:08x}"}


def files_of_rank(step_dir: Path, rank: int, world: int) -> list[str]:
    """The files of `step_dir` that `rank` checksums: the shards DCP named after it
    (`__<rank>_<i>.distcp`); rank 0 also every file no rank of `world` claims."""

    def owner(name: str) -> int:
        match = _RANK_FILE.match(name)
        return int(match.group(1)) if match and int(match.group(1)) < world else 0

    return sorted(p.name for p in step_dir.iterdir() if p.is_file() and owner(p.name) == rank)


def digest_files(step_dir: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    return {name: file_digest(step_dir / name) for name in names}


def write_durable(path: Path, text: str) -> None:
    """Write `text` to `path` and fsync it."""
    with path.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Make the directory's entries (created, renamed files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(step_dir: Path, files: dict[str, dict[str, Any]]) -> None:
    """`step_dir/manifest.json`, atomically (temp file, fsync, rename, fsync of the dir)."""
    body = {"format": FORMAT, "checksum": CHECKSUM, "files": dict(sorted(files.items()))}
    tmp = step_dir / f"{MANIFEST}.tmp"
    write_durable(tmp, json.dumps(body, indent=1) + "\n")
    os.replace(tmp, step_dir / MANIFEST)
    fsync_dir(step_dir)


@dataclass(frozen=True)
class Verified:
    """A step dir whose every file matched its manifest."""

    step_dir: Path
    num_files: int
    num_bytes: int


def _read_manifest(step_dir: Path) -> dict[str, dict[str, Any]]:
    path = step_dir / MANIFEST
    if not path.is_file():
        raise CheckpointError(
            f"{path}: expected the checkpoint's manifest, found no file (a save writes it "
            "last: this save did not finish, or the checkpoint predates manifests)"
        )
    try:
        body = json.loads(path.read_text())
        files = body["files"]
        assert body["checksum"] == CHECKSUM and isinstance(files, dict)
        assert all(
            isinstance(e["bytes"], int) and isinstance(e[CHECKSUM], str) for e in files.values()
        )
    except (ValueError, KeyError, TypeError, AssertionError, UnicodeDecodeError) as err:
        raise CheckpointError(
            f"{path}: expected a JSON manifest of {CHECKSUM} checksums, found unreadable "
            f"content ({type(err).__name__})"
        ) from None
    return files


def verify(step_dir: Path) -> Verified:
    """Check every file the manifest lists (size, then checksum); raise `CheckpointError`
    naming the first bad or missing one (and how many more there are)."""
    files = _read_manifest(step_dir)
    problems = []
    total = 0
    for name, want in files.items():
        path = step_dir / name
        if not path.is_file():
            problems.append(f"{path}: expected {want['bytes']} bytes, found no file")
            continue
        size = path.stat().st_size
        if size != want["bytes"]:
            problems.append(f"{path}: expected {want['bytes']} bytes, found {size}")
            continue
        got = file_digest(path)
        if got[CHECKSUM] != want[CHECKSUM]:
            problems.append(
                f"{path}: expected {CHECKSUM} {want[CHECKSUM]}, found {got[CHECKSUM]} "
                f"({size} bytes, as expected)"
            )
            continue
        total += size
    if problems:
        more = f" (and {len(problems) - 1} more bad files)" if len(problems) > 1 else ""
        raise CheckpointError(problems[0] + more)
    return Verified(step_dir, len(files), total)
