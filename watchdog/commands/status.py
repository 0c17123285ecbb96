"""`watchdog status`: one line per group, as the daemon last wrote it (`<state_dir>/status.json`).

The daemon's status file is the single source (watchdog/statusfile.py); the command never
observes the groups itself (that is `watchdog check`). It says whether a daemon holds the
state_dir's instance lock; with none running it still shows the last status written, and how old
it is. Exit 0 when a daemon runs, its status is current and every group is healthy or warming;
1 otherwise (a group in any other state, a group the status does not list, no daemon, no usable
or a stale status); 2 on a bad config or usage.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter

from watchdog.commands.common import add_config_argument, config_from_args
from watchdog.errors import EXIT_OK, EXIT_UNHEALTHY
from watchdog.model import State
from watchdog.statefiles import utc_iso
from watchdog.statusfile import (
    DaemonPresence,
    GroupStatus,
    StatusRead,
    daemon_presence,
    read_status,
    status_path,
)
from watchdog.text import printable

OK_STATES = frozenset({State.HEALTHY, State.WARMING})
_COLUMNS = ("GROUP", "STATE", "SINCE (UTC)", "VERDICT", "AT (UTC)", "RESTARTS", "HOLD", "INCIDENT")
# The reason is the last column, cut to this in the table (--json carries it whole).
_REASON_CHARS = 100
_GROUP_ADAPTER = TypeAdapter(GroupStatus)
# A running daemon rewrites the file after every cycle; one that has not for this long (and is
# not inside a co-restart, which holds its cycle for minutes) is wedged, or cannot write.
STALE_CYCLES = 3
STALE_MARGIN_SECONDS = 60.0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `status` subcommand."""
    parser = subparsers.add_parser(
        "status",
        help="one line per group as the daemon last wrote it (state, verdict, budget, hold, "
        "incident); exit 0 when every group is healthy or warming",
    )
    add_config_argument(parser)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=run)


def age(seconds: float) -> str:
    """`42s`, `5m`, `3h`, `2d`: how long ago, coarsely."""
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


def _window(seconds: float) -> str:
    return age(seconds) if seconds % 60 == 0 or seconds < 60 else f"{int(seconds)}s"


def _hold(group: GroupStatus) -> str:
    parts = ["held"] if group.held else []
    if group.hold_reason.startswith("storm"):
        parts = ["held (storm)"]
    elif group.hold_reason.startswith("fleet budget"):
        parts = ["waiting (fleet budget)"]
    if group.paused_until is not None:
        reason = f" ({group.pause_reason})" if group.pause_reason else ""
        parts.append(f"paused until {utc_iso(group.paused_until)}{reason}")
    return ", ".join(parts) or "-"


def _row(group: GroupStatus) -> tuple[str, ...]:
    budget = f"{group.restarts_used}/{group.max_restarts} in {_window(group.budget_window_seconds)}"
    return (
        group.group,
        str(group.state),
        utc_iso(group.since),
        group.verdict or "-",
        utc_iso(group.verdict_at) if group.verdict_at is not None else "-",
        budget,
        _hold(group),
        group.last_incident or "-",
    )


def _reason(group: GroupStatus) -> str:
    # A hold says why the group is not acted on; the verdict's reasons follow it.
    text = f"{group.hold_reason}; {group.reason}" if group.hold_reason else group.reason
    return text if len(text) <= _REASON_CHARS else text[: _REASON_CHARS - 3] + "..."


def format_table(groups: Sequence[GroupStatus], missing: Sequence[str]) -> str:
    """The groups as aligned columns, the verdict's reason last; `missing` as unknown."""
    cells: list[tuple[str, ...]] = [(*_COLUMNS, "REASON")]
    cells += [(*_row(g), _reason(g)) for g in groups]
    cells += [
        (name, "unknown", *["-"] * (len(_COLUMNS) - 2), "not in the daemon's status")
        for name in missing
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(_COLUMNS) + 1)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in cells
    )


def _selected(read: StatusRead, names: Sequence[str]) -> tuple[list[GroupStatus], list[str]]:
    """The status of each configured group, and the configured groups it does not list."""
    listed = {g.group: g for g in read.status.groups} if read.status is not None else {}
    return [listed[n] for n in names if n in listed], [n for n in names if n not in listed]


@dataclass(frozen=True, slots=True)
class StatusView:
    """What the command found: the daemon's presence, the file, the configured groups in it."""

    state_dir: Path
    presence: DaemonPresence
    read: StatusRead
    groups: tuple[GroupStatus, ...]
    missing: tuple[str, ...]  # configured groups the file does not list
    now: float
    stale_after_seconds: float  # a running daemon writes at least this often, but mid-restart

    @property
    def age_seconds(self) -> float | None:
        """How long ago the status was written (None: no usable status)."""
        status = self.read.status
        return None if status is None else max(0.0, self.now - status.written_at)

    @property
    def stale(self) -> str:
        """Why a running daemon's status cannot be trusted as current ("" when it can)."""
        status, age_seconds = self.read.status, self.age_seconds
        if not self.presence.running or status is None or age_seconds is None:
            return ""
        if self.presence.pid is not None and status.pid != self.presence.pid:
            return f"written by pid {status.pid}, not by the running daemon"
        restarting = any(g.state is State.RESTARTING for g in self.groups)
        if age_seconds > self.stale_after_seconds and not restarting:
            return f"no cycle has finished for {age(age_seconds)}"
        return ""

    @property
    def healthy(self) -> bool:
        """A running daemon, its current status, every configured group healthy or warming."""
        return (
            self.presence.running
            and self.read.status is not None
            and not self.stale
            and not self.missing
            and all(g.state in OK_STATES for g in self.groups)
        )


def daemon_line(view: StatusView) -> str:
    """The first line: is a daemon running, and how current is its status."""
    presence, read = view.presence, view.read
    if presence.running:
        who = f"pid {presence.pid}" if presence.pid is not None else "pid not recorded"
        head = f"daemon running on state_dir {view.state_dir} ({who})"
    else:
        head = f"no daemon running on state_dir {view.state_dir}"
    if read.problem is not None:
        return f"{head}; status unusable: {read.problem}"
    if read.status is None or view.age_seconds is None:
        return f"{head}; no status written yet ({status_path(view.state_dir)} does not exist)"
    status = read.status
    dry = ", dry run" if status.dry_run else ""
    stale = f"; STALE: {view.stale}" if view.stale else ""
    return (
        f"{head}; status written {utc_iso(status.written_at)} "
        f"({age(view.age_seconds)} ago) by pid {status.pid}{dry}{stale}"
    )


def as_json(view: StatusView) -> dict[str, Any]:
    """The --json document."""
    status = view.read.status
    age_seconds = view.age_seconds
    return {
        "state_dir": str(view.state_dir),
        "daemon": {"running": view.presence.running, "pid": view.presence.pid},
        "status_file": str(status_path(view.state_dir)),
        "problem": view.read.problem,
        "written_at": status.written_at if status is not None else None,
        "age_seconds": round(age_seconds, 3) if age_seconds is not None else None,
        "written_by_pid": status.pid if status is not None else None,
        "dry_run": status.dry_run if status is not None else None,
        "stale": view.stale or None,
        "groups": [_GROUP_ADAPTER.dump_python(g, mode="json") for g in view.groups],
        "missing_groups": list(view.missing),
        "healthy": view.healthy,
    }


def run(args: argparse.Namespace) -> int:
    """Print the daemon's status of every configured group; exit 0 only when all are fine."""
    config = config_from_args(args)
    state_dir = config.watchdog.state_dir
    read = read_status(state_dir)
    groups, missing = _selected(read, [g.name for g in config.group])
    view = StatusView(
        state_dir=state_dir,
        presence=daemon_presence(state_dir),
        read=read,
        groups=tuple(groups),
        missing=tuple(missing),
        now=time.time(),
        stale_after_seconds=STALE_CYCLES * config.watchdog.cycle_seconds + STALE_MARGIN_SECONDS,
    )
    if args.json:
        # json.dumps escapes every control character: nothing a peer wrote reaches the terminal.
        print(json.dumps(as_json(view), indent=2))
    else:
        # Group names, reasons and pause reasons can quote what peers and operators wrote.
        print(printable(daemon_line(view)))
        if read.status is not None:
            print(printable(format_table(groups, missing)))
    return EXIT_OK if view.healthy else EXIT_UNHEALTHY
