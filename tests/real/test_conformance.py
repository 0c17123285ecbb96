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
    """One released sglang 0.5.23 sandbox shared by the module's checks."""
    start = time.monotonic()
    real = RealSandbox.start("conformance", routers=("sglang-router",))
    try:
        yield RealBackend(real, boot_seconds=time.monotonic() - start)
    finally:
        real.stop()


def test_fresh_server(backend: RealBackend) -> None:
    """Real SGLang's fresh servers have no failure-counter series before any failure."""
    checks.check_fresh_server(backend)


def test_health_latency(backend: RealBackend) -> None:
    """Real SGLang's /health is 200 and never answers in under about one second."""
    checks.check_health_latency(backend)


def test_metric_names_and_labels(backend: RealBackend) -> None:
    """Real SGLang exports the series the watchdog reads, with the label keys it expects."""
    checks.check_metric_names_and_labels(backend)


def test_health_adds_no_decode_tokens(backend: RealBackend) -> None:
    """Real SGLang's decode /health adds no decode tokens to the realtime counter."""
    checks.check_health_adds_no_decode_tokens(backend)


def test_loads_fields(backend: RealBackend) -> None:
    """Real SGLang's /v1/loads has the keys the watchdog reads, one row per DP rank."""
    checks.check_loads_fields(backend)


def test_transfer_stall(backend: RealBackend) -> None:
    """A stalled transfer on real SGLang: prefill inflight > 0, decode's queue gauges 0."""
    checks.check_transfer_stall(backend)


def test_abort_accounting(backend: RealBackend) -> None:
    """Real SGLang counts an abort of a request stuck in transfer as one failure."""
    checks.check_abort_accounting(backend)


def test_unknown_rid_abort(backend: RealBackend) -> None:
    """Real SGLang answers an abort of an unknown rid with 200 and changes nothing."""
    checks.check_unknown_rid_abort(backend)


def test_stream_error_shape(backend: RealBackend) -> None:
    """Real SGLang streams a failed PD request as HTTP 200 with one error event."""
    checks.check_stream_error_shape(backend)


def test_startup(backend: RealBackend) -> None:
    """Real servers take tens of seconds (model load, warm-up); pdsim ~1 s (a kept difference,
    docs/sglang.md §8): the shape is checked on both, the duration only here."""
    elapsed = checks.check_startup(backend, ready_timeout_seconds=240.0)
    assert elapsed >= 10.0, elapsed
    assert backend.boot_seconds >= 10.0, backend.boot_seconds
