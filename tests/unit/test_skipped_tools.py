"""The end-of-run summary of tests skipped for a missing system tool (tests/skipped_tools.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import skipped_tools
from tests.alertmanager_support import MISSING_ALERTMANAGER
from tests.skipped_tools import ToolSkip, summary_lines, tool_skip

PROMTOOL = "Skipped: promtool is not installed (apt-get install prometheus; .ci/run installs it)"
ROOT = Path(__file__).resolve().parents[2]
SSHD = "Skipped: the multi-host sandbox tests need openssh-server (apt-get install openssh-server)"


def test_reasons_that_name_a_package_are_tool_skips() -> None:
    """Both wordings name the package; a skip for anything else (root, real SGLang) is not one."""
    skip = tool_skip("tests/unit/test_prometheus_rules.py::test_rules", PROMTOOL)
    assert skip == ToolSkip(
        "prometheus",
        "tests/unit/test_prometheus_rules.py::test_rules",
        PROMTOOL.removeprefix("Skipped: "),
    )
    assert skip.suite == "tests/unit/test_prometheus_rules.py"
    nft = tool_skip(
        "tests/real/test_real_pd.py", "the real stack needs `nft` (Debian package: nftables)"
    )
    assert nft is not None
    assert nft.package == "nftables"
    assert tool_skip("tests/e2e/test_x.py::t", "Skipped: the systemd sandbox needs root") is None
    alertmanager = tool_skip("tests/integration/test_alertmanager_real.py::t", MISSING_ALERTMANAGER)
    assert alertmanager is not None
    assert alertmanager.package == "prometheus-alertmanager"
    assert tool_skip("t.py::t", "real SGLang is not installed in /x: run `make real-setup`") is None


def test_summary_names_suites_counts_and_one_apt_line() -> None:
    """Per package its suites and counts and one reason; one apt-get line with every package."""
    skips = [
        tool_skip(f"tests/unit/test_prometheus_rules.py::t{i}", PROMTOOL) for i in range(3)
    ] + [tool_skip("tests/sandbox/test_multihost_sandbox.py::t", SSHD)]
    lines = summary_lines(s for s in skips if s is not None)
    assert lines == [
        "openssh-server: tests/sandbox/test_multihost_sandbox.py (1)",
        "    " + SSHD.removeprefix("Skipped: "),
        "prometheus: tests/unit/test_prometheus_rules.py (3)",
        "    " + PROMTOOL.removeprefix("Skipped: "),
        "To run them: sudo apt-get install -y openssh-server prometheus",
    ]
    assert summary_lines([]) == []


def test_runs_append_and_the_final_summary_reads_them_all(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """make test's three runs append to one file; the summary at the end covers them all."""
    record = tmp_path / "skips.jsonl"
    assert skipped_tools.main([str(record)]) == 0
    assert capsys.readouterr().out == ""  # nothing skipped, nothing printed
    first = tool_skip("tests/unit/test_prometheus_rules.py::t", PROMTOOL)
    second = tool_skip("tests/sandbox/test_multihost_sandbox.py::t", SSHD)
    assert first is not None
    assert second is not None
    skipped_tools.write(record, [first])
    skipped_tools.write(record, [second])
    assert skipped_tools.read(record) == [first, second]
    assert skipped_tools.main([str(record)]) == 0
    out = capsys.readouterr().out
    assert "skipped for a missing system tool" in out
    assert out.splitlines()[-1] == "To run them: sudo apt-get install -y openssh-server prometheus"


PLUGINS_OFF = ("-p", "no:randomly", "-p", "no:cacheprovider")


def run_pytest(directory: Path, record: Path) -> subprocess.CompletedProcess[str]:
    """pytest in `directory` with this project's conftest hook, recording to `record`."""
    env = {**os.environ, skipped_tools.ENV: str(record), "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-ra", *PLUGINS_OFF],
        cwd=directory,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_a_pytest_run_ends_with_the_summary(tmp_path: Path) -> None:
    """The hook itself: a run with a tool skip ends with the apt line (and records the skip)."""
    (tmp_path / "conftest.py").write_text(
        "from tests.conftest import pytest_terminal_summary  # noqa: F401\n"
    )
    (tmp_path / "test_tools.py").write_text(
        "import pytest\n\n"
        "def test_ok():\n    pass\n\n"
        "def test_needs_root():\n    pytest.skip('needs root')\n\n"
        f"def test_needs_promtool():\n    pytest.skip({PROMTOOL.removeprefix('Skipped: ')!r})\n"
    )
    record = tmp_path / "skips.jsonl"
    run = run_pytest(tmp_path, record)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed, 2 skipped" in run.stdout
    lines = run.stdout.splitlines()
    assert "1 passed, 2 skipped" in lines[-1]
    assert "skipped for a missing system tool" in lines[-5]
    assert "short test summary info" in lines[-8]  # after it, with its two SKIPPED lines
    assert lines[-4:-1] == [  # just above pytest's own last line: the end of the output
        "prometheus: test_tools.py (1)",
        "    " + PROMTOOL.removeprefix("Skipped: "),
        "To run them: sudo apt-get install -y prometheus",
    ]
    assert [s.package for s in skipped_tools.read(record)] == ["prometheus"]
