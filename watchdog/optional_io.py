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
    """Per kind of optional file (`what`), whether its last attempt failed, and since when."""

    def __init__(self, count: Callable[[str], None] | None = None) -> None:
        self._count = count  # e.g. WatchdogMetrics.count_file_error
        self._failures: dict[str, int] = {}  # what -> failures in the current episode

    def failing(self, what: str) -> bool:
        """Whether the last attempt for `what` failed."""
        return what in self._failures

    def failed(self, what: str, event: str, error: BaseException | str, **fields: Any) -> None:
        """Count a failure of `what`; log `event` only when it starts an episode."""
        if self._count is not None:
            self._count(what)
        seen = self._failures.get(what, 0)
        self._failures[what] = seen + 1
        if seen == 0:
            log.error(
                event,
                what=what,
                error=str(error),
                **fields,
                repeats="counted in sglang_watchdog_file_errors_total, logged again only after "
                "it has worked in between",
            )

    def succeeded(self, what: str) -> None:
        """`what` worked: an episode of failures, if one was going on, has ended."""
        failures = self._failures.pop(what, 0)
        if failures:
            log.info("file_io_recovered", what=what, failures=failures)
