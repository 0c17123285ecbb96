"""Command-line entry point: parses arguments, sets up logging, maps errors to exit codes."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

import structlog

from watchdog import __version__
from watchdog.errors import EXIT_USAGE, ConfigError, WatchdogError
from watchdog.logs import LEVELS, configure_logging

# Subcommand modules under watchdog.commands; each has register(subparsers).
COMMANDS: tuple[str, ...] = ("validate", "polkit_rule", "plan", "restart", "reset", "pause", "replay", "check")


def build_parser() -> argparse.ArgumentParser:
    """The full parser: global flags plus every registered subcommand."""
    parser = argparse.ArgumentParser(
        prog="watchdog",
        description="Self-healing liveness watchdog for SGLang prefill-decode serving.",
    )
    parser.add_argument("--version", action="version", version=f"sglang-watchdog {__version__}")
    parser.add_argument(
        "--log-format",
        choices=("auto", "json", "console"),
        default="auto",
        help="auto: console on a TTY, JSON lines otherwise",
    )
    parser.add_argument("--log-level", choices=LEVELS, default="info")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(f"watchdog.commands.{name}")
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_format, args.log_level)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        code: int = func(args)
    except ConfigError as exc:
        for issue in exc.issues:
            print(f"error: {issue}", file=sys.stderr)
        return exc.exit_code
    except WatchdogError as exc:
        structlog.get_logger().error("command_failed", command=args.command, error=str(exc))
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    return code
