"""Project-wide test setup."""

from __future__ import annotations

import os
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
import structlog
from hypothesis import HealthCheck, settings

from pdsim import stack as pdsim_stack
from tests import skipped_tools
from watchdog import redact

# Hypothesis times each example against the wall clock (a 200 ms deadline, the too_slow health
# check): on a machine whose cores are busy with other work that fails correct tests, and a rerun
# passes them. Off for every property test here; a test's own @settings keeps the rest.
settings.register_profile(
    "busy-machine-safe", deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("busy-machine-safe")


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, each worker process chooses free ports from a block of its own.

    Four workers start stacks side by side; a port one of them chose and released could be chosen
    by another before its server binds it. Blocks of pdsim's range, one per worker, rule that out
    (pdsim.stack.free_ports reads PDSIM_PORT_RANGE; its child processes inherit it harmlessly).
    """
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:
        return
    index = int(str(workerinput["workerid"]).removeprefix("gw"))
    count = int(workerinput["workercount"])
    low, high = pdsim_stack.port_block(index, count)
    os.environ[pdsim_stack.PORT_RANGE_ENV] = f"{low}-{high}"


@pytest.fixture(autouse=True)
def _reset_structlog() -> Iterator[None]:
    """Each test starts and ends with structlog's defaults, whatever a CLI call configured."""
    structlog.reset_defaults()
    yield
    structlog.reset_defaults()


@pytest.fixture(autouse=True)
def _forget_secrets() -> Iterator[None]:
    """Each test starts with no known secret values, whatever an earlier one read from a key file."""
    redact.forget_secrets()
    yield
    redact.forget_secrets()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> Generator[None]:
    """At the end: the tests skipped for a missing system tool and the apt-get line for them.

    A wrapper around pytest's own summary, so it comes after the short test summary, just before
    the final counts. Prints nothing when no such skip happened (tests/skipped_tools.py says what
    counts).
    """
    try:
        return (yield)
    finally:
        _print_tool_skips(terminalreporter)


def _print_tool_skips(terminalreporter: pytest.TerminalReporter) -> None:
    skips = []
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = getattr(report, "longrepr", None)
        if isinstance(longrepr, tuple) and len(longrepr) == 3:
            skip = skipped_tools.tool_skip(report.nodeid, str(longrepr[2]))
            if skip is not None:
                skips.append(skip)
    lines = skipped_tools.summary_lines(skips)
    if not lines:
        return
    terminalreporter.write_sep("=", "skipped for a missing system tool", yellow=True)
    for line in lines:
        terminalreporter.write_line(line)
    if record := os.environ.get(skipped_tools.ENV):
        skipped_tools.write(Path(record), skips)
