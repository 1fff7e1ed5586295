"""No function in src/disagmoe is longer than MAX_LINES lines without a stated reason.

A function's length runs from its `def` line to its last line, docstring included. A
longer one either splits into named steps or says why it stays whole: its docstring
contains "Long because" and the reason (a hot loop whose locals matter, a flat list of
argparse flags).
"""

from __future__ import annotations

import ast
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parents[2] / "src" / "disagmoe"
MAX_LINES = 80
REASON = "Long because"


def long_functions(root: Path, max_lines: int = MAX_LINES) -> list[str]:
    """`path:line name (N lines)` of every function or method under `root` longer than
    `max_lines` whose docstring gives no reason."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            assert node.end_lineno is not None
            lines = node.end_lineno - node.lineno + 1
            if lines > max_lines and REASON not in (ast.get_docstring(node) or ""):
                where = path.relative_to(root.parent)
                found.append(f"{where}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_the_source_folder_is_found() -> None:
    assert (SOURCE_DIR / "__init__.py").is_file()


def test_no_long_function_without_a_reason() -> None:
    found = long_functions(SOURCE_DIR)
    assert not found, (
        f"functions over {MAX_LINES} lines: split them into named steps, or give the reason "
        f"in the docstring ('{REASON} ...'):\n  " + "\n  ".join(found)
    )


def test_a_long_function_is_found_and_a_reason_excuses_it(tmp_path: Path) -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_LINES))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "bare.py").write_text(f"def bare() -> None:\n{body}")
    (tmp_path / "pkg" / "told.py").write_text(
        f'def told() -> None:\n    """{REASON} it is a test."""\n{body}'
    )
    (tmp_path / "pkg" / "short.py").write_text("def short() -> None:\n    pass\n")
    found = long_functions(tmp_path / "pkg")
    assert found == [f"pkg/bare.py:1 bare ({MAX_LINES + 1} lines)"]
