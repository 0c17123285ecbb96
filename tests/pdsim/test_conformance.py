"""The conformance checks (tests/conformance/checks.py) against pdsim: what real sglang 0.5.23
does, pdsim must do too. tests/real/test_conformance.py runs the same checks against the real
servers. The tests run in file order on one stack (the first needs servers that failed nothing).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator

import pytest

from pdsim.stack import start_stack
from tests.conformance import checks
from tests.conformance.backend import PdsimBackend
from tests.pdsim.fixtures import real_config


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdsimBackend]:
    """One real-mode pdsim stack shared by the module's checks, stopped when they are done."""
    config = dataclasses.replace(real_config(), log_dir=tmp_path_factory.mktemp("conformance"))
    start = time.monotonic()
    stack = start_stack(config)
    try:
        yield PdsimBackend(stack, boot_seconds=time.monotonic() - start)
    finally:
        stack.stop()


def test_fresh_server(backend: PdsimBackend) -> None:
    """pdsim's fresh servers, like real SGLang's, have no failure-counter series yet."""
    checks.check_fresh_server(backend)


def test_health_latency(backend: PdsimBackend) -> None:
    """pdsim's /health, like real SGLang's, is 200 and never answers in under about one second."""
    checks.check_health_latency(backend)


def test_metric_names_and_labels(backend: PdsimBackend) -> None:
    """pdsim exports the series the watchdog reads with real SGLang's names and label keys."""
    checks.check_metric_names_and_labels(backend)


def test_health_adds_no_decode_tokens(backend: PdsimBackend) -> None:
    """pdsim's decode /health, like real SGLang's, adds no decode tokens to the realtime counter."""
    checks.check_health_adds_no_decode_tokens(backend)


def test_loads_fields(backend: PdsimBackend) -> None:
    """pdsim's /v1/loads has real SGLang's keys: a row per DP rank, the side in its mode."""
    checks.check_loads_fields(backend)


def test_transfer_stall(backend: PdsimBackend) -> None:
    """A stalled transfer on pdsim as on real SGLang: prefill inflight > 0, decode queues 0."""
    checks.check_transfer_stall(backend)


def test_abort_accounting(backend: PdsimBackend) -> None:
    """An abort of a request stuck in transfer counts on pdsim exactly as on real SGLang."""
    checks.check_abort_accounting(backend)


def test_unknown_rid_abort(backend: PdsimBackend) -> None:
    """An abort of a rid nobody holds is 200 and changes nothing on pdsim, as on real SGLang."""
    checks.check_unknown_rid_abort(backend)


def test_stream_error_shape(backend: PdsimBackend) -> None:
    """A failed streamed request is HTTP 200 with one error event, on pdsim as on real SGLang."""
    checks.check_stream_error_shape(backend)


def test_startup(backend: PdsimBackend) -> None:
    """A restarted pdsim server starts up as real SGLang does: 503, silence, 503, then 200."""
    checks.check_startup(backend, ready_timeout_seconds=30.0)


# The checks tell real behaviour from pdsim's old one: each compat opt-in (pdsim/stack.py
# COMPAT_OPTIONS) brings back a behaviour real 0.5.23 does not have, and its check fails on it.
LEGACY_CASES: list[tuple[str, Callable[[PdsimBackend], None]]] = [
    ("fast-health", checks.check_health_latency),
    ("legacy-streams", checks.check_stream_error_shape),
]  # legacy-aborts fails check_abort_accounting too, but only after its 10 s wait: left out


@pytest.mark.parametrize(("compat", "check"), LEGACY_CASES, ids=[c for c, _ in LEGACY_CASES])
def test_checks_fail_on_the_old_behaviours(
    compat: str, check: Callable[[PdsimBackend], None], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Each check fails on pdsim's old behaviour, so its passing proves the real behaviour."""
    config = real_config(compat=frozenset({compat}), log_dir=tmp_path_factory.mktemp(compat))
    stack = start_stack(config)
    try:
        with pytest.raises(AssertionError):
            check(PdsimBackend(stack, boot_seconds=0.0))
    finally:
        stack.stop()
