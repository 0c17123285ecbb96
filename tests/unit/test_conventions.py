"""Conventions of the test suite that no linter checks on its own."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _undocumented_tests(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.name.startswith("test")
        and ast.get_docstring(node) is None
    ]


def test_every_test_function_has_a_docstring() -> None:
    """Every test says what it checks and why. ruff's D103 enforces it for public functions, but
    takes a module's functions left out of its __all__ for private, and skips methods; this
    reads every test function, wherever it is defined."""
    missing = [
        found
        for path in sorted((ROOT / "tests").rglob("*.py"))
        for found in _undocumented_tests(path)
    ]
    assert not missing, "\n".join(missing)
