"""The daemon's side of `watchdog status`: each group's runtime as `<state_dir>/status.json`.

Written at startup, after every cycle and on every state change (a co-restart lasts minutes and
`restarting` must be visible while it runs). An optional write (watchdog/optional_io.py): a full
disk or a planted file is counted and logged once per episode, never the end of a cycle.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from watchdog import __version__
from watchdog.decide.state import in_window
from watchdog.errors import StateFileError
from watchdog.model import State
from watchdog.optional_io import OptionalIO
from watchdog.run.cycle import GroupRuntime
from watchdog.statusfile import (
    FORMAT,
    VERSION,
    DaemonStatus,
    GroupStatus,
    read_status,
    short_reason,
    write_status,
)


def group_status(runtime: GroupRuntime, now: float) -> GroupStatus:
    """One group's line of the status file, as of `now`."""
    group = runtime.config
    state = runtime.state
    decision = runtime.last_decision
    window = group.restart.budget_window_seconds
    lease = runtime.operator
    paused = lease.paused_until is not None and lease.paused_until > now
    return GroupStatus(
        group=group.name,
        state=state.state,
        since=state.since,
        verdict=str(decision.verdict) if decision is not None else "",
        verdict_at=runtime.decided_at,
        reason=short_reason([r.message for r in decision.reasons]) if decision else "",
        restarts_used=len(in_window(state.budget.restart_times, window, now)),
        max_restarts=group.restart.max_restarts,
        budget_window_seconds=window,
        # A storm holds a group the fleet refuses while decide() keeps it stalled (run/fleet.py).
        held=state.state is State.HELD or runtime.fleet_hold.startswith("storm"),
        paused_until=lease.paused_until if paused else None,
        pause_reason=lease.pause_reason if paused else "",
        last_incident=runtime.last_incident,
        hold_reason=runtime.fleet_hold
        or (state.budget.held_reason if state.state is State.HELD else ""),
    )


class StatusWriter:
    """Writes status.json for the daemon's groups; failures go through OptionalIO."""

    def __init__(self, state_dir: Path, *, dry_run: bool, optional_io: OptionalIO) -> None:
        self.state_dir = state_dir
        self.dry_run = dry_run
        self.optional_io = optional_io

    def previous_incidents(self) -> dict[str, str]:
        """The last incident per group from the file an earlier daemon left (empty if none):
        a restart of the watchdog does not make the group's last incident unknown."""
        read = read_status(self.state_dir)
        if read.status is None:
            return {}
        return {g.group: g.last_incident for g in read.status.groups if g.last_incident}

    def write(self, runtimes: Iterable[GroupRuntime], now: float) -> None:
        """Replace the file with every group's status as of `now`."""
        status = DaemonStatus(
            format=FORMAT,
            version=VERSION,
            pid=os.getpid(),
            written_at=now,
            dry_run=self.dry_run,
            watchdog_version=__version__,
            groups=tuple(group_status(runtime, now) for runtime in runtimes),
        )
        try:
            write_status(self.state_dir, status)
        except StateFileError as exc:
            self.optional_io.failed(
                "status",
                "status_write_failed",
                exc,
                effect="`watchdog status` shows the last status written; detection and healing "
                "go on",
            )
        else:
            self.optional_io.succeeded("status")
