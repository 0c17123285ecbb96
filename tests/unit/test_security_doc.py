"""SECURITY.md makes no claim without a test: every claim row names tests, and each one exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
REFERENCE = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")


def _claim_rows(text: str) -> list[str]:
    """The rows of the claims table (after its header, up to the first blank line)."""
    start = text.index("| claim | proved by |")
    rows = text[start:].split("\n\n", 1)[0].splitlines()[2:]
    return [row for row in rows if row.startswith("|")]


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.name.startswith("test_")
    }


def test_security_md_is_at_the_repository_root() -> None:
    """Where people look for it; the old copy under systemd/ is gone."""
    assert (REPO / "SECURITY.md").is_file()
    assert not (REPO / "systemd" / "SECURITY.md").exists()


def test_every_claim_names_a_test_and_every_named_test_exists() -> None:
    """A renamed or deleted test makes its claim fail here, not silently go stale."""
    rows = _claim_rows((REPO / "SECURITY.md").read_text())
    assert len(rows) >= 15, rows
    missing = []
    for row in rows:
        references = REFERENCE.findall(row)
        assert references, f"a claim without a test: {row[:100]}"
        for file, name in references:
            path = REPO / file
            if not path.is_file() or name not in _test_names(path):
                missing.append(f"{file}::{name}")
    assert not missing, missing
