"""The decision and classification code is pure: importing it loads no I/O or logging library."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

IMPURE = ("httpx", "asyncio", "structlog", "prometheus_client")


@pytest.mark.parametrize("module", ["watchdog.decide", "watchdog.evidence.classify"])
def test_import_loads_no_io_library(module: str) -> None:
    """A fresh interpreter importing `module` has none of the I/O libraries in sys.modules."""
    code = (
        f"import json, sys, {module}; "
        f"print(json.dumps(sorted(m for m in {IMPURE!r} if m in sys.modules)))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert json.loads(result.stdout) == []
