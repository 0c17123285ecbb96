"""`watchdog reset`: re-arm a held group (restarts and failures before now stop counting)."""

from __future__ import annotations

import argparse
import time

import structlog

from watchdog.commands.common import (
    add_config_argument,
    add_group_argument,
    config_from_args,
    single_group,
)
from watchdog.errors import EXIT_OK
from watchdog.statefiles import utc_iso, write_rearm

log = structlog.get_logger("watchdog.commands.reset")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `reset` subcommand."""
    parser = subparsers.add_parser(
        "reset",
        help="re-arm a held group: earlier restarts and failures no longer count",
    )
    add_config_argument(parser)
    add_group_argument(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Write the re-arm time into the group's operator file (the daemon reads it every cycle)."""
    config = config_from_args(args)
    group = single_group(config, args.group)
    now = time.time()
    write_rearm(config.watchdog.state_dir, group.name, now=now)
    log.info("group_rearmed", group=group.name, rearmed_at=now)
    print(
        f"group {group.name} re-armed at {utc_iso(now)}: restarts and failed attempts before "
        "now no longer count against its budget"
    )
    return EXIT_OK
