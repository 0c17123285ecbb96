"""structlog setup: JSON lines when stderr is not a TTY, the console renderer on a TTY."""

from __future__ import annotations

import logging
import sys
from typing import Literal, TextIO

import structlog

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
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )
