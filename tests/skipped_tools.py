"""Which tests were skipped for a missing system tool, and the one apt-get line that enables them.

A skip for a missing tool names its Debian package in its reason, as "(Debian package: NAME)" or
"apt-get install NAME"; every other skip (needs root, no real SGLang installed) is left to pytest's
own lines. tests/conftest.py prints the summary at the end of each pytest run (nothing when no
such skip happened) and, when SGLANG_WATCHDOG_SKIPS names a file, appends them there as JSON
lines, so `make test` can print one summary of its three runs at the very end:
`python -m tests.skipped_tools FILE`.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

ENV = "SGLANG_WATCHDOG_SKIPS"
_PACKAGE = re.compile(r"(?:Debian package: |apt-get install (?:-y )?)([a-z0-9][a-z0-9.+-]*)")


@dataclass(frozen=True)
class ToolSkip:
    """One skipped test (or module) and the Debian package whose tool it missed."""

    package: str
    nodeid: str
    reason: str

    @property
    def suite(self) -> str:
        """The test file the skip belongs to."""
        return self.nodeid.split("::", 1)[0]


def tool_skip(nodeid: str, reason: str) -> ToolSkip | None:
    """The skip as a missing-tool skip, or None when its reason names no Debian package."""
    match = _PACKAGE.search(reason)
    if match is None:
        return None
    return ToolSkip(match.group(1), nodeid, reason.removeprefix("Skipped: "))


def summary_lines(skips: Iterable[ToolSkip]) -> list[str]:
    """Per package: the suites it would enable, how many tests, one reason; then the apt line."""
    by_package: dict[str, list[ToolSkip]] = {}
    for skip in skips:
        by_package.setdefault(skip.package, []).append(skip)
    if not by_package:
        return []
    lines = []
    for package, group in sorted(by_package.items()):
        suites: dict[str, int] = {}
        for skip in group:
            suites[skip.suite] = suites.get(skip.suite, 0) + 1
        where = ", ".join(f"{suite} ({n})" for suite, n in sorted(suites.items()))
        lines.append(f"{package}: {where}")
        lines.append(f"    {group[0].reason}")
    lines.append("To run them: sudo apt-get install -y " + " ".join(sorted(by_package)))
    return lines


def write(path: Path, skips: Iterable[ToolSkip]) -> None:
    """Append the skips to `path` as JSON lines."""
    with path.open("a", encoding="utf-8") as out:
        for skip in skips:
            out.write(json.dumps(skip.__dict__) + "\n")


def read(path: Path) -> list[ToolSkip]:
    """The skips that runs appended to `path` (none when it does not exist)."""
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    return [ToolSkip(**json.loads(line)) for line in lines if line.strip()]


def main(argv: Sequence[str]) -> int:
    """Print the summary of the skips recorded in argv[0]; print nothing when there are none."""
    (path,) = argv
    lines = summary_lines(read(Path(path)))
    if lines:
        print("=" * 24 + " skipped for a missing system tool (all runs) " + "=" * 24)
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
