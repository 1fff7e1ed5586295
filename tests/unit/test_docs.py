"""The docs say where things stand, not how they got there.

History belongs in git: README.md and docs/*.md cite no run directory as evidence (a
`runs/...` path appears only in commands and their transcripts, where a run writes or reads
it), and carry no work-log phrases. The README stays a first screen.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^[ \t]*(```|~~~).*?^[ \t]*\1[ \t]*$", re.S | re.M)
INLINE = re.compile(r"(`+)(.+?)\1", re.S)
RUN_DIR = re.compile(r"\bruns/[\w.-]+")
COMMAND = re.compile(
    r"^\s*(\$ )?(sudo |PYTHONPATH=\S+ )*(disagmoe|python\S*|\.venv/\S+|torchrun|tensorboard|-)"
)
WORK_LOG = [
    r"\bsession \d+",
    r"\bround \d+\b",
    r"\bnot kept\b",
    r"\bthrow-away\b",
    r"\btried\b",
    r"\bre-?measured\b",
    r"\bre-ran\b",
    r"\bsince (replaced|superseded)\b",
    r"\bearlier (run|measurement|table|session|version)s?\b",
    r"\bthe previous (measurement|run|table)\b",
    r"\b\d{1,2} (Nov|Dec) 20\d\d\b",
]


def prose(text: str) -> str:
    """The page without its fenced blocks (commands, transcripts, program output)."""
    return FENCE.sub("", text)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_run_directory_is_cited_as_evidence(page: Path) -> None:
    text = prose(page.read_text())
    for match in INLINE.finditer(text):
        code = match.group(2)
        if RUN_DIR.search(code):
            assert COMMAND.match(code), f"{page.name}: `{code}` names a run dir outside a command"
    outside = INLINE.sub("", text)
    found = RUN_DIR.findall(outside)
    assert not found, f"{page.name} names run dirs in its prose: {found}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_work_log_phrases(page: Path) -> None:
    text = prose(page.read_text())
    found = [m.group(0) for pat in WORK_LOG for m in re.finditer(pat, text, re.I)]
    assert not found, f"{page.name} reads as a work log: {found}"


def test_the_readme_is_a_first_screen() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 160, f"README.md has {len(lines)} lines"


def test_the_readme_shows_the_generated_baselines_table() -> None:
    """AF-Pipe against the baselines with bounds, from benchmarks/results/bench8_pp1.json
    (`benchmarks/report.py --check` keeps the block equal to the file)."""
    assert "<!-- report:bench8_pp1 -->" in (ROOT / "README.md").read_text()


def test_the_readme_keeps_the_ci_test_command() -> None:
    """`.ci/run` runs the README's test command verbatim."""
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    command = ci.split(" && ", 1)[1]  # after `python3 -m venv .venv`
    assert command in (ROOT / "README.md").read_text()
