"""The watchdog's JSON log lines as timed events (structlog's `timestamp` in unix seconds)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class LogEvent:
    """One structured log line: its event name, when it was logged, and every other field."""

    name: str
    at: float
    fields: Mapping[str, Any] = field(default_factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        """A field's value (`default` when absent)."""
        return self.fields.get(key, default)


def parse_timestamp(stamp: object) -> float | None:
    """structlog's ISO-8601 UTC stamp (`2026-11-29T08:21:52.890466Z`) as unix seconds."""
    if not isinstance(stamp, str) or not stamp:
        return None
    try:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def parse_log_line(line: str, received_at: float | None = None) -> LogEvent | None:
    """A JSON log line as a LogEvent; None for anything else (a traceback, a blank line).

    The time is the line's own stamp; `received_at` stands in when it has none.
    """
    try:
        data = json.loads(line)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("event"), str):
        return None
    at = parse_timestamp(data.get("timestamp"))
    if at is None:
        if received_at is None:
            return None
        at = received_at
    fields = {k: v for k, v in data.items() if k not in ("event", "timestamp")}
    return LogEvent(name=data["event"], at=at, fields=fields)


def parse_log_lines(lines: Iterable[str]) -> list[LogEvent]:
    """Every parseable event of `lines`, in order."""
    events = (parse_log_line(line) for line in lines)
    return [e for e in events if e is not None]


def read_log(path: Path) -> list[LogEvent]:
    """Every event of a JSON log file."""
    with path.open(encoding="utf-8", errors="replace") as handle:
        return parse_log_lines(handle)
