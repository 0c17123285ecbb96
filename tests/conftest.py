"""Project-wide test setup."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import structlog

from watchdog import redact


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
