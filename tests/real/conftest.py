"""The real-SGLang tier: one sandbox with the real PD pair and both real routers per module.

Skipped, with the reason, where the sandbox cannot run or `make real-setup` has not been run;
`make test-real` runs the tier (and .ci/run, after the set-up).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from realsglang.stack import RealSandbox, skip_reason


@pytest.fixture(scope="session")
def real_available() -> None:
    """Skip (with the reason) where real SGLang cannot run here."""
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)


def real_sandbox(real_available: None, **kwargs: object) -> Iterator[RealSandbox]:
    """A started real stack, stopped (every process with it) when the module ends."""
    real = RealSandbox.start(**kwargs)  # type: ignore[arg-type]
    try:
        yield real
    finally:
        real.stop()
