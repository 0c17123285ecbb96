"""Pytest fixtures for the systemd sandbox; import them in a conftest (`from ... import *`-free).

`pd_sandbox` is one sandboxed PD stack per test module. Every test using it should also request
`pd_serving`, which waits until the stack serves again (a test may leave it restarting). The
`host_tmp_sentinel` fixture proves after teardown that the host's /tmp was not touched.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdsim.stack import StackError, http_json
from sandbox.namespace import UnitSpec, skip_reason
from sandbox.pdsandbox import PdSandbox

# A unit whose restart job finishes at once (for the JobRemoved-before-reply race).
INSTANT_UNIT = UnitSpec("sandbox-instant.service", ["/bin/sleep", "infinity"])


@pytest.fixture(scope="session")
def sandbox_available() -> None:
    """Skip (with the reason) where a private systemd cannot run: not root, no unshare, ..."""
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def host_tmp_sentinel(sandbox_available: None) -> Iterator[Path]:
    """A file in the host's /tmp that must survive every sandbox of the module."""
    fd, name = tempfile.mkstemp(prefix="watchdog-sandbox-sentinel-", dir="/tmp")
    os.close(fd)
    path = Path(name)
    yield path
    assert path.exists(), "the host's /tmp was modified by the sandboxed systemd"
    path.unlink()


@pytest.fixture(scope="module")
def pd_sandbox(host_tmp_sentinel: Path) -> Iterator[PdSandbox]:
    """A sandboxed systemd running the simulated prefill, decode and the real router as units."""
    pd = PdSandbox.start("sbx", ready_timeout_seconds=30.0, extra_units=[INSTANT_UNIT])
    try:
        yield pd
    finally:
        pd.stop()


@pytest.fixture
def pd_serving(pd_sandbox: PdSandbox) -> PdSandbox:
    """The module's sandboxed stack, waited on until it serves, with no start faults left."""
    for role in ("prefill", "decode"):
        pd_sandbox.stack.set_start_faults(role, [])
    pd_sandbox.wait_until_serving(timeout_seconds=30.0)
    return pd_sandbox


def clear_runtime_faults(pd: PdSandbox) -> None:
    """Clear run-time faults and let stuck transfers complete (best effort: a worker may be down)."""
    for role in ("prefill", "decode"):
        for method, path in (("DELETE", "/_sim/fault"), ("POST", "/_sim/release")):
            with contextlib.suppress(OSError, StackError):
                http_json(method, pd.stack.url(role) + path, timeout_s=2.0)
