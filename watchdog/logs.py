"""structlog setup: JSON lines when stderr is not a TTY, the console renderer on a TTY."""

from __future__ import annotations

import logging
import sys
from typing import Literal, TextIO

import structlog
from structlog.typing import EventDict, WrappedLogger

from watchdog.redact import redact_value

LogFormat = Literal["auto", "json", "console"]


class _CurrentStderr:
    """Writes to whatever sys.stderr is *now*, so replacing sys.stderr later (pytest's capture,
    a daemon redirect) never leaves structlog holding a closed file."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()


LEVELS = ("debug", "info", "warning", "error")


def redact_event(_logger: WrappedLogger, _method: str, event_dict: EventDict) -> EventDict:
    """Every field of an event through the redaction policy (watchdog/redact.py): error details,
    probe bodies and exception text may quote a URL with credentials or an echoed header. Objects
    the renderer would have shown by repr (an httpx.URL) become redacted text."""
    redacted: EventDict = redact_value(event_dict)
    return redacted


def configure_logging(
    log_format: LogFormat = "auto", level: str = "info", stream: TextIO | None = None
) -> None:
    """Route structlog to `stream` (stderr) with ISO timestamps, in JSON or console form."""
    out: TextIO = stream if stream is not None else _CurrentStderr()  # type: ignore[assignment]
    if log_format == "auto":
        log_format = "console" if out.isatty() else "json"
    renderer: structlog.typing.Processor
    if log_format == "json":
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=out.isatty())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            # Last before rendering, so the exception and stack text rendered above are covered.
            redact_event,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )
