"""Command-line entry point: parses arguments, sets up logging, maps errors to exit codes.

Without a subcommand, `watchdog [--config FILE] [--dry-run] [--once] [--record FILE]` runs the
daemon; every other action is a subcommand module under watchdog.commands.

Exit codes: 0 ok, 1 unhealthy (`check`, `--once`, a failed `restart`), 2 bad config or usage,
3 startup failure, refusal or internal error. No exception reaches the interpreter: an unexpected
one is a single `watchdog: internal error: ...` line (its traceback is logged at debug level), so
an operator never has to read a traceback and systemd sees an ordinary failure.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

import structlog

from watchdog import __version__
from watchdog.config import DEFAULT_CONFIG_PATH, load_config
from watchdog.errors import EXIT_INTERNAL, EXIT_INTERRUPTED, ConfigError, WatchdogError
from watchdog.logs import LEVELS, configure_logging
from watchdog.redact import redact_text

# Subcommand modules under watchdog.commands; each has register(subparsers).
COMMANDS: tuple[str, ...] = (
    "validate",
    "check",
    "polkit_rule",
    "incidents",
    "status",
    "plan",
    "restart",
    "reset",
    "pause",
    "replay",
)


def build_parser() -> argparse.ArgumentParser:
    """The full parser: global and daemon flags plus every registered subcommand."""
    parser = argparse.ArgumentParser(
        prog="watchdog",
        description="Self-healing liveness watchdog for SGLang prefill-decode serving. "
        "Without a COMMAND, runs the daemon.",
    )
    parser.add_argument("--version", action="version", version=f"sglang-watchdog {__version__}")
    parser.add_argument(
        "--log-format",
        choices=("auto", "json", "console"),
        default="auto",
        help="auto: console on a TTY, JSON lines otherwise",
    )
    parser.add_argument("--log-level", choices=LEVELS, default="info")
    parser.add_argument(
        "--config",
        type=Path,
        default=DEFAULT_CONFIG_PATH,
        help=f"config file (default: {DEFAULT_CONFIG_PATH})",
    )
    daemon = parser.add_argument_group("daemon (no COMMAND)")
    daemon.add_argument(
        "--dry-run",
        action="store_true",
        help="rehearse: observe, decide, capture evidence, log the plan; restart nothing",
    )
    daemon.add_argument(
        "--once",
        action="store_true",
        help="run one cycle per group and exit 0 (all probes passed) or 1",
    )
    daemon.add_argument(
        "--record",
        type=Path,
        metavar="FILE",
        help="append every observation to FILE (JSON Lines) for `watchdog replay`",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(f"watchdog.commands.{name}")
        module.register(subparsers)
    return parser


def run_daemon(args: argparse.Namespace) -> int:
    """Load the config and run the daemon until SIGTERM/SIGINT (or one cycle with --once)."""
    # Imported here: subcommands such as `validate` must not pay for the daemon's imports.
    from watchdog.run.daemon import Daemon  # noqa: PLC0415
    from watchdog.run.daemon import run_daemon as run  # noqa: PLC0415

    config = load_config(args.config)
    daemon = Daemon(config, dry_run=args.dry_run, once=args.once, record_path=args.record)
    return asyncio.run(run(daemon))


# An exception message is shown on one line, and never a whole payload.
_MAX_MESSAGE_CHARS = 300


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit code (argparse exits 2 on bad usage)."""
    try:
        code = _main(argv)
        sys.stdout.flush()  # here, where a reader that left (EPIPE) is handled, not at exit
    except KeyboardInterrupt:
        print("watchdog: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader of stdout went away (`watchdog incidents | head -1`): nothing more to say,
        # and Python's own flush at exit must not fail a second time.
        _silence_stdout()
        return EXIT_INTERNAL
    except Exception as exc:  # the last line of defence: no traceback for the operator
        if structlog.is_configured():  # before configure_logging, structlog would print it all
            structlog.get_logger().debug("internal_error", traceback=traceback.format_exc())
        print(f"watchdog: internal error: {describe_exception(exc)}", file=sys.stderr)
        print(
            "watchdog: this is a bug; please report it with the command line "
            "(--log-level debug logs the traceback)",
            file=sys.stderr,
        )
        return EXIT_INTERNAL
    return code


def describe_exception(exc: BaseException) -> str:
    """`Class: first line of the message`, cut to a readable length."""
    lines = str(exc).strip().splitlines()
    message = lines[0] if lines else ""
    if len(message) > _MAX_MESSAGE_CHARS:
        message = message[: _MAX_MESSAGE_CHARS - 3] + "..."
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no real stdout (replaced in-process): nothing to flush
        pass


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_format, args.log_level)
    func = getattr(args, "func", run_daemon)
    try:
        code: int = func(args)
    except ConfigError as exc:
        for issue in exc.issues:
            print(redact_text(f"error: {issue}"), file=sys.stderr)
        return exc.exit_code
    except WatchdogError as exc:
        structlog.get_logger().error("command_failed", command=args.command, error=str(exc))
        print(redact_text(f"error: {exc}"), file=sys.stderr)
        return exc.exit_code
    return code
