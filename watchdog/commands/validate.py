"""`watchdog validate`: check a config file and print the effective config."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from watchdog.commands.common import add_config_argument, config_from_args
from watchdog.config import DEFAULT_CONFIG_PATH
from watchdog.configfile import effective_toml
from watchdog.errors import EXIT_OK
from watchdog.evidence.preflight import config_warnings
from watchdog.redact import redact_text


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `validate` subcommand."""
    parser = subparsers.add_parser(
        "validate",
        help="check a config file; print the effective config as TOML (defaults filled in, "
        "secrets masked); warnings go to stderr",
    )
    add_config_argument(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the effective config as TOML (itself a valid config) and exit 0, with a
    'warning: FILE: KEY: reason' line on stderr for each setting that works only with some
    deployments; ConfigError propagates (exit 2)."""
    config = config_from_args(args)
    path: Path = getattr(args, "config", DEFAULT_CONFIG_PATH)
    for index, group in enumerate(config.group):
        for warning in config_warnings(group.probe):
            key, _, reason = warning.partition(": ")
            where = f"group#{index + 1}.{key}"  # counted from 1, as config errors count
            print(redact_text(f"warning: {path}: {where}: {reason}"), file=sys.stderr)
    # effective_toml masks URL userinfo; the policy also catches a known key or a secret
    # expect_env value quoted anywhere in the file.
    print(redact_text(effective_toml(config)), end="")
    return EXIT_OK
