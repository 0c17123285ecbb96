"""Project-wide test setup."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import structlog


@pytest.fixture(autouse=True)
def _reset_structlog() -> Iterator[None]:
    """Each test starts and ends with structlog's defaults, whatever a CLI call configured."""
    structlog.reset_defaults()
    yield
    structlog.reset_defaults()
