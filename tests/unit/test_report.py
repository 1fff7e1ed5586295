"""`benchmarks/report.py`: the docs' benchmark tables are what `benchmarks/results/*.json` hold.

The check runs on the repository (so the README's test command runs it in CI) and on a
tampered copy, where it must fail and name the block that differs.
"""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"


@pytest.fixture
def report(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("report")


def _copy(root: Path) -> Path:
    """README.md, docs/ and benchmarks/results/ of the repository under `root`."""
    shutil.copy(ROOT / "README.md", root / "README.md")
    shutil.copytree(ROOT / "docs", root / "docs", ignore=shutil.ignore_patterns("*.png"))
    shutil.copytree(ROOT / "benchmarks" / "results", root / "benchmarks" / "results")
    return root


def test_the_pages_show_what_the_results_files_hold(report: ModuleType) -> None:
    assert report.differences(ROOT) == []


def test_every_results_file_says_how_it_was_made(report: ModuleType) -> None:
    for name, payload in report.load(ROOT).items():
        meta = payload.get("meta", {})
        assert {"command", "machine", "date"} <= set(meta), f"{name}.json lacks meta"


def test_check_names_a_tampered_block(
    report: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _copy(tmp_path)
    readme = root / "README.md"
    text = readme.read_text()
    start = text.index("<!-- report:bench8_pp1 -->")
    row = text.index("| ep-overlap |", start)
    readme.write_text(text[:row] + "| ep-overlap | 99999 |" + text[row + len("| ep-overlap |") :])
    assert report.main(["--check", "--root", str(root)]) == 1
    err = capsys.readouterr().err
    assert "README.md: block report:bench8_pp1 differs" in err
    assert "docs/benchmarks.md" not in err

    assert report.main(["--root", str(root)]) == 0  # rewriting repairs it
    assert report.main(["--check", "--root", str(root)]) == 0


def test_check_fails_when_a_results_file_changes(
    report: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _copy(tmp_path)
    path = root / "benchmarks" / "results" / "recompute.json"
    payload = json.loads(path.read_text())
    payload["rows"][0]["tokens_per_s"] += 1000
    path.write_text(json.dumps(payload))
    assert report.main(["--check", "--root", str(root)]) == 1
    assert "docs/benchmarks.md differs" in capsys.readouterr().err


def test_a_block_without_its_results_file_is_named(
    report: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _copy(tmp_path)
    page = root / "docs" / "bench.md"
    page.write_text(page.read_text() + "\n<!-- report:no_such_bench -->\n<!-- /report -->\n")
    assert report.main(["--check", "--root", str(root)]) == 1
    assert "docs/bench.md: block report:no_such_bench has no" in capsys.readouterr().err


def test_stamp_adds_meta_and_keeps_the_indent(report: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"rows": [{"a": 1.5}]}, indent=2))
    report.main(["--stamp", str(path), "--command", "disagmoe bench", "--date", "2030-01-02"])
    text = path.read_text()
    assert text.startswith('{\n  "rows"')
    meta = json.loads(text)["meta"]
    assert meta["command"] == "disagmoe bench" and meta["date"] == "2030-01-02"
    assert meta["machine"]


def test_a_file_without_a_table_spec_shows_its_scalar_fields(report: ModuleType) -> None:
    text = report.table("new_bench", {"rows": [{"size": 3, "s": 0.123456, "xs": [1]}]})
    assert text.splitlines() == ["| size | s |", "|---|---|", "| 3 | 0.1235 |"]


def test_a_pipe_inside_a_cell_stays_in_its_cell(report: ModuleType) -> None:
    text = report.table("new_bench", {"rows": [{"split": "n | E 7:1", "fits": "no"}]})
    row = text.splitlines()[2]
    assert row == "| n \\| E 7:1 | no |"
    assert row.replace("\\|", "").count("|") == 3  # two cells, as the header has
