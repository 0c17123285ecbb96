"""Optional file I/O (the recording, incident files, the audit log, CLI refusal counts): a
failure is counted every time, logged once per episode, and tried again next time; never raised.

None of these files is needed to detect a stall or to heal it. A full disk or a read-only state
directory must not fail the cycle that writes them (the decision comes after the recording), nor
flood the journal with one error per cycle while it lasts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog

log = structlog.get_logger("watchdog.optional_io")


class OptionalIO:
    """Per optional file (`key`, by default its kind `what`), how often it failed since it last
    worked: an episode of failures."""

    def __init__(self, count: Callable[[str], None] | None = None) -> None:
        self._count = count  # e.g. WatchdogMetrics.count_file_error
        self._failures: dict[str, int] = {}  # key -> failures in the current episode

    def failing(self, key: str) -> bool:
        """Whether the last attempt for `key` failed."""
        return key in self._failures

    def failed(
        self,
        what: str,
        event: str,
        error: BaseException | str,
        *,
        key: str | None = None,
        **fields: Any,
    ) -> None:
        """Count a failure of `what`; log `event` only when it starts an episode of `key`."""
        if self._count is not None:
            self._count(what)
        key = key or what
        seen = self._failures.get(key, 0)
        self._failures[key] = seen + 1
        if seen == 0:
            log.error(
                event,
                what=what,
                error=str(error),
                **fields,
                repeats="counted in sglang_watchdog_file_errors_total, logged again only after "
                "it has worked in between",
            )

    def succeeded(self, what: str, *, key: str | None = None) -> None:
        """`key` (by default `what`) worked: an episode of failures, if one was going on, ended."""
        failures = self._failures.pop(key or what, 0)
        if failures:
            log.info("file_io_recovered", what=what, key=key or what, failures=failures)
