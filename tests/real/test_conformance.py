"""The conformance checks (tests/conformance/checks.py) against the released sglang 0.5.23 on
CPU: the same checks tests/pdsim/test_conformance.py runs against pdsim. One sandbox for the
module (the real pair behind sglang-router 0.3.2 only); the tests run in file order (the first
needs servers that failed nothing, the last restarts prefill).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from realsglang.stack import RealSandbox
from tests.conformance import checks
from tests.conformance.backend import RealBackend

pytestmark = [pytest.mark.real]


@pytest.fixture(scope="module")
def backend(real_available: None) -> Iterator[RealBackend]:
    start = time.monotonic()
    real = RealSandbox.start("conformance", routers=("sglang-router",))
    try:
        yield RealBackend(real, boot_seconds=time.monotonic() - start)
    finally:
        real.stop()


def test_fresh_server(backend: RealBackend) -> None:
    checks.check_fresh_server(backend)


def test_health_latency(backend: RealBackend) -> None:
    checks.check_health_latency(backend)


def test_metric_names_and_labels(backend: RealBackend) -> None:
    checks.check_metric_names_and_labels(backend)


def test_health_adds_no_decode_tokens(backend: RealBackend) -> None:
    checks.check_health_adds_no_decode_tokens(backend)


def test_loads_fields(backend: RealBackend) -> None:
    checks.check_loads_fields(backend)


def test_transfer_stall(backend: RealBackend) -> None:
    checks.check_transfer_stall(backend)


def test_abort_accounting(backend: RealBackend) -> None:
    checks.check_abort_accounting(backend)


def test_unknown_rid_abort(backend: RealBackend) -> None:
    checks.check_unknown_rid_abort(backend)


def test_stream_error_shape(backend: RealBackend) -> None:
    checks.check_stream_error_shape(backend)


def test_startup(backend: RealBackend) -> None:
    """Real servers take tens of seconds (model load, warm-up); pdsim ~1 s (a kept difference,
    docs/sglang.md §8): the shape is checked on both, the duration only here."""
    elapsed = checks.check_startup(backend, ready_timeout_seconds=240.0)
    assert elapsed >= 10.0, elapsed
    assert backend.boot_seconds >= 10.0, backend.boot_seconds
