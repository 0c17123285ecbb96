"""The docs the code relies on are in the repository: comments cite only files that exist here."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PY_DIRS = ("watchdog", "tests", "bench", "demo", "pdsim", "sandbox")
MARKDOWN = (ROOT / "README.md", ROOT / "pdsim" / "README.md", *sorted((ROOT / "docs").glob("*.md")))

DOCS_CITE = re.compile(r"\bdocs/([\w.-]+\.md)\b")
SGLANG_SECTIONS = re.compile(r"\bdocs/sglang\.md((?:(?:\s+|,\s*|\s+and\s+)§\d+(?:\.\d+)?)+)")
# Files that were never in the repository: the design notes, the SGLang reference and the sandbox
# recipe now live in docs/; an absolute path on the build machine and a bare "issue N" (the
# project's tracker, not SGLang's "issue #N") point outside it too.
OUTSIDE = re.compile(
    r"\b(?:design|sglang-pd|systemd-sandbox|style)\.md\b|/work/|\bissue \d+\b", re.IGNORECASE
)


# Another branch (the decide/ package split) rewrites these two docstrings; until it lands they
# may still cite the old notes. Delete an entry once its file is clean (a test below says when).
def _python_files() -> list[Path]:
    return sorted(p for d in PY_DIRS for p in (ROOT / d).rglob("*.py") if ".venv" not in p.parts)


def _comments_and_docstrings(path: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of every comment and every module, class and function docstring."""
    source = path.read_text(encoding="utf-8")
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None and node.body:
                yield node.body[0].lineno, doc


def _sglang_sections() -> set[str]:
    """Section numbers of docs/sglang.md: "7" for "## 7. ...", "7.2" for "### 7.2 ..."."""
    text = (ROOT / "docs" / "sglang.md").read_text(encoding="utf-8")
    return set(re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", text, re.MULTILINE))


def _bad_citations(path: Path, sections: set[str]) -> list[str]:
    found = []
    for line, text in _comments_and_docstrings(path):
        where = f"{path.relative_to(ROOT)}:{line}"
        found += [
            f"{where}: {m.group(0)!r} is not in the repository" for m in OUTSIDE.finditer(text)
        ]
        for name in DOCS_CITE.findall(text):
            if not (ROOT / "docs" / name).is_file():
                found.append(f"{where}: docs/{name} does not exist")
        for match in SGLANG_SECTIONS.finditer(text):
            for section in re.findall(r"§(\d+(?:\.\d+)?)", match.group(1)):
                if section not in sections:
                    found.append(f"{where}: docs/sglang.md has no §{section}")
    return found


def test_comments_cite_only_files_in_the_repository() -> None:
    """No comment or docstring cites a docs/ page or section that is missing, or a file outside."""
    sections = _sglang_sections()
    bad = [problem for path in _python_files() for problem in _bad_citations(path, sections)]
    assert not bad, "\n".join(bad)


def test_sglang_doc_keeps_its_section_numbers() -> None:
    """docs/sglang.md keeps §1–§7 and §7.1–§7.9, which the code cites by number."""
    expected = {str(n) for n in range(1, 8)} | {f"7.{n}" for n in range(1, 10)}
    assert expected <= _sglang_sections()


def _layout_block() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    return section.split("```", 2)[1].strip("\n").splitlines()


def test_readme_layout_matches_the_tree() -> None:
    """Every directory the README's Layout names exists, and it names every watchdog/ package."""
    named: set[str] = set()
    parent = ""
    for line in _layout_block():
        entry = line.split()[0]
        if not entry.endswith("/"):
            continue
        if line.startswith(" "):
            named.add(parent + entry.rstrip("/"))
        else:
            parent = entry
            named.add(entry.rstrip("/"))
    missing = sorted(n for n in named if not (ROOT / n).is_dir())
    assert not missing, f"README Layout names directories that do not exist: {missing}"
    packages = {f"watchdog/{p.parent.name}" for p in (ROOT / "watchdog").glob("*/__init__.py")}
    unnamed = sorted(packages - named)
    assert not unnamed, f"README Layout does not name: {unnamed}"


def test_markdown_links_resolve() -> None:
    """Relative links in the README, pdsim/README.md and docs/ point to files that exist."""
    broken = []
    for page in MARKDOWN:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            if not (page.parent / target.split("#", 1)[0]).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, "\n".join(broken)
