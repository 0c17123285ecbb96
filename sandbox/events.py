"""A daemon's JSON log read back as events, and waiting on a condition with a deadline (tests, the
demos and the benchmark drive the real daemon through these)."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from typing import Any

Event = dict[str, Any]


def parse_events(text: str) -> list[Event]:
    """The JSON log lines of a daemon's output (other lines are skipped)."""
    events = []
    for line in text.splitlines():
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                events.append(json.loads(line))
    return events


def matching_events(text: str, name: str | None = None, **match: Any) -> list[Event]:
    """The JSON log events in `text`, only those called `name` (if given) with the given fields."""
    return [
        e
        for e in parse_events(text)
        if (name is None or e.get("event") == name) and all(e.get(k) == v for k, v in match.items())
    ]


def wait_until(
    condition: Callable[[], Any], *, timeout_seconds: float, what: str, poll: float = 0.1
) -> Any:
    """Poll `condition` until it returns something truthy; AssertionError naming `what` if not."""
    deadline = time.monotonic() + timeout_seconds
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_seconds:g} s waiting for {what}")
        time.sleep(poll)
