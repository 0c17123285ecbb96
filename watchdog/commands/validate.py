"""`watchdog validate`: check a config file and print the effective config."""

from __future__ import annotations

import argparse

from watchdog.commands.common import add_config_argument, config_from_args
from watchdog.configfile import effective_toml
from watchdog.errors import EXIT_OK


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `validate` subcommand."""
    parser = subparsers.add_parser(
        "validate",
        help="check a config file; print the effective config as TOML (defaults filled in, "
        "secrets masked)",
    )
    add_config_argument(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the effective config as TOML (itself a valid config) and exit 0; ConfigError
    propagates (exit 2)."""
    config = config_from_args(args)
    print(effective_toml(config), end="")
    return EXIT_OK
