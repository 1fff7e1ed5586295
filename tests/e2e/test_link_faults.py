"""A worker's link taken down under a running step, on the emulated cluster (network
namespaces, `bench.netns`): the ranks report the missing message, its peer across the dead
link and the instruction within `--comm-timeout`, and the job exits non-zero. The stall and
the restart cases, with longer timeouts, are `benchmarks/link_faults.py`'s (its figures are
in docs/operations.md). Needs root; skipped otherwise."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest

from disagmoe.bench.netns import available, list_namespaces

pytestmark = pytest.mark.skipif(bool(available()), reason=available() or "")

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
TIMEOUT_S = 3.0


def test_a_link_down_mid_step_is_reported_within_the_timeout(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    link_faults = importlib.import_module("link_faults")
    [down] = link_faults.run(
        ["down"], steps=8, comm_timeout=TIMEOUT_S, stall_s=0.0, timeout_s=100.0,
        out=str(tmp_path), grace_s=2.0,
    )  # fmt: skip
    assert down.fault_at_step is not None and down.exit_codes[0] == 1, down
    # a rank whose local peer gave up first may see that peer's connection close before
    # its own wait times out: the hang reports are those of ranks waiting across the link
    hangs = [r for r in down.reports if r.error == "HangError"]
    assert hangs and all(r.across_link and r.names_instruction for r in hangs), down.reports
    first = min(hangs, key=lambda r: r.after_s)
    assert "nothing arrived within 3 s" in first.line
    assert down.detected_s is not None and down.detected_s <= TIMEOUT_S + 2.0, down
    for report in down.reports:  # the others: the same, or a local peer that failed first
        assert report.across_link or "Connection closed by peer" in report.line, report
    assert down.losses and len(down.losses) < 8  # nothing trained past the fault
    assert list_namespaces(f"dmoe-{os.getpid()}-") == []
