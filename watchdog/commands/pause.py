"""`watchdog pause` / `watchdog resume`: set or clear a group's maintenance lease (observe only)."""

from __future__ import annotations

import argparse
import re
import time

import structlog

from watchdog.commands.common import (
    add_config_argument,
    add_group_argument,
    config_from_args,
    selected_groups,
    single_group,
)
from watchdog.errors import EXIT_OK, UsageError
from watchdog.statefiles import clear_pause, utc_iso, write_pause

log = structlog.get_logger("watchdog.commands.pause")

# ASCII digits only (`\d` would take any script's digits), matched whole (`$` takes a newline).
_DURATION = re.compile(r"[ ]*([0-9]+(?:\.[0-9]+)?)[ ]*([smh]?)[ ]*", re.ASCII)
_UNIT_SECONDS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}
# A lease is for maintenance. Longer than a week, the watchdog is switched off, not paused:
# stop its service instead, so that the state is visible to everyone (systemctl status).
MAX_PAUSE_SECONDS = 7 * 86400.0


def parse_duration(text: str) -> float:
    """`90`, `90s`, `30m`, `1.5h` as seconds, at most a week; UsageError naming the value."""
    match = _DURATION.fullmatch(text)
    shown = repr(text) if len(text) <= 40 else repr(text[:37] + "...")
    if not match or float(match.group(1)) <= 0:
        raise UsageError(
            f"--for {shown} is not a positive duration (a number with s, m or h, e.g. 30m)"
        )
    seconds = float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    if seconds > MAX_PAUSE_SECONDS:
        raise UsageError(
            f"--for {shown} is longer than the maximum lease of 7 days (168h); to switch the "
            "watchdog off for longer, stop its service"
        )
    return seconds


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `pause` and `resume` subcommands."""
    pause = subparsers.add_parser(
        "pause", help="maintenance lease: observe a group but take no action for a while"
    )
    add_config_argument(pause)
    add_group_argument(pause)
    pause.add_argument(
        "--for",
        dest="duration",
        required=True,
        metavar="DURATION",
        help="e.g. 30m, 2h, 90s (a number with s, m or h; at most 168h, a week)",
    )
    pause.add_argument("--reason", default="", help="shown in logs and by `watchdog status`")
    pause.set_defaults(func=run_pause)

    resume = subparsers.add_parser("resume", help="end a maintenance lease early")
    add_config_argument(resume)
    add_group_argument(resume)
    resume.set_defaults(func=run_resume)


def run_pause(args: argparse.Namespace) -> int:
    """Write the lease into the group's operator file (the daemon reads it every cycle)."""
    seconds = parse_duration(args.duration)
    config = config_from_args(args)
    group = single_group(config, args.group)
    now = time.time()
    until = now + seconds
    write_pause(config.watchdog.state_dir, group.name, until=until, reason=args.reason, now=now)
    log.info("group_paused", group=group.name, paused_until=until, reason=args.reason)
    print(
        f"group {group.name} paused until {utc_iso(until)}: observed, never restarted; "
        f"end it early with: watchdog resume --config {args.config} --group {group.name}"
    )
    return EXIT_OK


def run_resume(args: argparse.Namespace) -> int:
    """Clear the lease of one group, or of every group when --group is not given."""
    config = config_from_args(args)
    now = time.time()
    for group in selected_groups(config, args.group):
        was_active = clear_pause(config.watchdog.state_dir, group.name, now=now)
        log.info("group_resumed", group=group.name, lease_was_active=was_active)
        state = "resumed" if was_active else "was not paused; nothing to resume"
        print(f"group {group.name} {state}")
    return EXIT_OK
