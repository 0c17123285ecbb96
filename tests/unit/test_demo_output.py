"""Where `make demo` writes: only its output folder; the README's picture only when asked."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from demo.backends import PlainBackend, SandboxBackend
from demo.run import (
    DEFAULT_OUTPUT,
    DOCS_IMAGE,
    OUTPUT_NAMES,
    parse_args,
    prepare_output,
    usage_problem,
)
from pdsim.stack import REPO_ROOT

MAKEFILE = REPO_ROOT / "Makefile"


def _recipe(target: str) -> list[str]:
    text = MAKEFILE.read_text()
    match = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)+)", text, re.MULTILINE)
    assert match, f"no `{target}` target in the Makefile"
    return [line.strip() for line in match.group(1).splitlines()]


def test_by_default_the_demo_writes_no_docs_picture() -> None:
    """By default the demo writes to its own ignored folder and leaves the docs picture alone."""
    args = parse_args([])
    assert args.docs_image is None
    assert args.output == DEFAULT_OUTPUT == REPO_ROOT / "demo-output"


def test_the_output_folder_is_git_ignored() -> None:
    """The demo's output folder is git-ignored, so a demo run leaves the checkout clean."""
    ignored = (REPO_ROOT / ".gitignore").read_text().splitlines()
    assert "demo-output/" in ignored


def test_make_demo_leaves_the_docs_alone_and_demo_picture_refreshes_them() -> None:
    """`make demo` never writes under docs/; only `make demo-picture` refreshes the picture."""
    demo = _recipe("demo")
    assert any(line.startswith("$(BIN)/python -m demo") for line in demo)
    assert not any("docs" in line for line in demo)
    (picture,) = _recipe("demo-picture")
    assert picture.split() == [
        "$(BIN)/python",
        "-m",
        "demo",
        "--docs-image",
        "docs/demo-timeline.png",
    ]
    assert REPO_ROOT / "docs/demo-timeline.png" == DOCS_IMAGE


def test_docs_picture_needs_the_sandbox() -> None:
    """The docs picture comes only from the sandbox demo, so it shows real systemd restarts."""
    args = parse_args(["--docs-image", "docs/demo-timeline.png"])
    assert args.docs_image == Path("docs/demo-timeline.png")
    problem = usage_problem(args, PlainBackend())
    assert problem is not None
    assert "sandbox" in problem
    assert usage_problem(args, SandboxBackend()) is None


@pytest.mark.parametrize("output", ["/tmp/demo-out", "/tmp/x/demo-output"])
def test_an_output_folder_under_tmp_is_accepted(output: str) -> None:
    """An output folder under /tmp is accepted by both demo backends."""
    args = parse_args(["--output", output])
    assert usage_problem(args, SandboxBackend()) is None
    assert usage_problem(args, PlainBackend()) is None


def test_prepare_output_empties_only_what_the_demo_wrote(tmp_path: Path) -> None:
    """Preparing the output folder removes only what a demo wrote and keeps the user's files."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "timeline.png").write_bytes(b"old")
    (out / "state").mkdir()
    (out / "state" / "budget.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    assert prepare_output(out) == out.resolve()
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert "timeline.png" in OUTPUT_NAMES
