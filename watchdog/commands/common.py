"""Helpers shared by subcommands: loading the config named on the command line, picking groups."""

from __future__ import annotations

import argparse
from pathlib import Path

from watchdog.config import DEFAULT_CONFIG_PATH, Config, GroupSection, load_config
from watchdog.errors import UsageError


def add_config_argument(parser: argparse.ArgumentParser) -> None:
    """The --config option every subcommand takes."""
    # SUPPRESS: when absent here, the top-level `watchdog --config FILE` value (or its default)
    # stays in effect, so both `watchdog --config F check` and `watchdog check --config F` work.
    parser.add_argument(
        "--config",
        type=Path,
        default=argparse.SUPPRESS,
        help=f"config file (default: {DEFAULT_CONFIG_PATH})",
    )


def add_group_argument(parser: argparse.ArgumentParser) -> None:
    """The --group option: restrict a subcommand to one group (default: all)."""
    parser.add_argument("--group", help="only this group (default: every group)")


def config_from_args(args: argparse.Namespace) -> Config:
    """Load and validate the config named by --config (raises ConfigError)."""
    path: Path = getattr(args, "config", DEFAULT_CONFIG_PATH)
    return load_config(path)


def selected_groups(config: Config, name: str | None) -> tuple[GroupSection, ...]:
    """All groups, or only the one called `name` (UsageError naming the known groups)."""
    if name is None:
        return config.group
    try:
        return (config.group_named(name),)
    except KeyError as exc:
        raise UsageError(exc.args[0]) from None


def single_group(config: Config, name: str | None) -> GroupSection:
    """The group called `name`, or the only group when `name` is None and there is exactly one."""
    if name is None:
        if len(config.group) != 1:
            known = ", ".join(g.name for g in config.group)
            raise UsageError(f"the config has several groups ({known}); pick one with --group")
        return config.group[0]
    return selected_groups(config, name)[0]
