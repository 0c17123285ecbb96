"""`<state_dir>/status.json`: what the daemon last knew of each group, for `watchdog status`.

One file for all groups, written by the daemon alone (atomically, for state_dir's owner, through
the redaction policy: watchdog/statefiles.py) at startup, after every cycle and on every state
change. It is the single source of `watchdog status`: the command reads it and never asks the
daemon, so it works the same whether the daemon is running, wedged or gone (the file's pid and
`written_at` say how current it is).

Reading never renames or rewrites anything (the command may run as any user, and the daemon's
next write replaces a bad file): a planted link or FIFO, an oversized or malformed file is
reported as unusable, with the reason.
"""

from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from watchdog.errors import StateFileError
from watchdog.model import State
from watchdog.statefiles import INSTANCE_LOCK_NAME, read_lock_holder, write_json_atomic
from watchdog.statefs import UnsafeStateFile, read_bounded

FORMAT = "sglang-watchdog-status"
VERSION = 1
STATUS_NAME = "status.json"
# A status of a few hundred groups is well under this; anything larger is not ours.
MAX_STATUS_BYTES = 4 * 1024 * 1024
# A verdict's reasons, as written: enough for a sentence or two, never a peer's whole payload.
MAX_REASON_CHARS = 500
PROC_LOCKS = Path("/proc/locks")
# The last second of year 9999: every time in the file must be one utc_iso() can name.
_MAX_TIME = 253402300799.0


@dataclass(frozen=True, slots=True)
class GroupStatus:
    """One group as the daemon last saw it."""

    group: str
    state: State
    since: float  # when `state` was entered
    verdict: str  # the last decision's verdict ("" before the first cycle)
    verdict_at: float | None  # when that decision was made
    reason: str  # the decision's reasons, joined and cut to MAX_REASON_CHARS
    restarts_used: int  # real co-restarts in the budget window ending at `written_at`
    max_restarts: int
    budget_window_seconds: float
    held: bool
    paused_until: float | None  # an active maintenance lease (`watchdog pause`), else None
    pause_reason: str
    last_incident: str | None  # the newest incident this daemon (or its predecessor) opened
    # Why the group is held (its budget, or a storm) or the fleet defers its co-restart; "" when
    # neither. Defaulted: a file written before the field existed still reads.
    hold_reason: str = ""


@dataclass(frozen=True, slots=True)
class DaemonStatus:
    """The whole file: who wrote it, when, and every group."""

    format: str
    version: int
    pid: int
    written_at: float
    dry_run: bool
    watchdog_version: str
    groups: tuple[GroupStatus, ...]


_ADAPTER = TypeAdapter(DaemonStatus)


@dataclass(frozen=True, slots=True)
class StatusRead:
    """The status file as read: its content, or None with `problem` (None, None: not written)."""

    status: DaemonStatus | None
    problem: str | None = None


def status_path(state_dir: Path) -> Path:
    """The daemon's status file in state_dir."""
    return state_dir / STATUS_NAME


def short_reason(messages: list[str]) -> str:
    """A decision's reason messages as one line of at most MAX_REASON_CHARS."""
    text = "; ".join(" ".join(m.split()) for m in messages if m)
    if len(text) > MAX_REASON_CHARS:
        text = text[: MAX_REASON_CHARS - 3] + "..."
    return text


def write_status(state_dir: Path, status: DaemonStatus) -> None:
    """Replace the status file (raises StateFileError: an optional write the caller counts)."""
    write_json_atomic(status_path(state_dir), _ADAPTER.dump_python(status, mode="json"))


def _times(status: DaemonStatus) -> list[float]:
    times = [status.written_at]
    for group in status.groups:
        times.append(group.since)
        times.extend(t for t in (group.verdict_at, group.paused_until) if t is not None)
    return times


def _validate(data: Any) -> DaemonStatus:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} file")
    if data.get("version") != VERSION:
        raise ValueError(f"version {data.get('version')!r}, this watchdog reads {VERSION}")
    status = _ADAPTER.validate_python(data)
    for at in _times(status):
        if not math.isfinite(at) or abs(at) > _MAX_TIME:
            raise ValueError(f"time {at!r} out of range")
    return status


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name} (not JSON)")


def _problem(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"]) or "(top level)"
        return f"{where}: {first['msg']}"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def read_status(state_dir: Path) -> StatusRead:
    """The status file, never through a link; an unusable one is reported, left in place."""
    path = status_path(state_dir)
    try:
        raw = read_bounded(path, MAX_STATUS_BYTES)
        if raw is None:
            return StatusRead(None)
        return StatusRead(_validate(json.loads(raw, parse_constant=_reject_constant)))
    except UnsafeStateFile as exc:
        return StatusRead(None, f"{path} is {exc.what}: refused, not read")
    except (OSError, StateFileError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        return StatusRead(None, f"cannot read {path}: {reason}")
    except (ValueError, TypeError, RecursionError) as exc:
        # UnicodeDecodeError and json's errors are ValueErrors; deep nesting exhausts the stack.
        return StatusRead(None, f"{path} is corrupt ({_problem(exc)}): not used")


# --- is a daemon running? -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DaemonPresence:
    """Whether a daemon holds state_dir's single-instance lock (daemon.lock), and its pid."""

    running: bool
    pid: int | None = None


def daemon_presence(state_dir: Path, *, proc_locks: Path = PROC_LOCKS) -> DaemonPresence:
    """Ask the kernel whether daemon.lock is flocked, without taking it.

    Trying the lock ourselves would, for an instant, make a daemon starting at that moment
    refuse to start (two daemons); /proc/locks lists every flock instead. Where it cannot be
    read, the pid the holder recorded in the file (cleared at a clean exit) is checked alive.
    """
    path = state_dir / INSTANCE_LOCK_NAME
    try:
        st = os.lstat(path)
    except OSError:
        return DaemonPresence(False)
    if not stat.S_ISREG(st.st_mode):
        return DaemonPresence(False)  # a planted link or FIFO: no daemon takes a lock there
    holder = read_lock_holder(path)
    pid = holder.pid if holder is not None else None
    held = _flocked(st, pid, proc_locks)
    if held is None:
        held = pid is not None and _alive(pid)
    return DaemonPresence(held, pid if held else None)


def _flocked(st: os.stat_result, pid: int | None, proc_locks: Path) -> bool | None:
    """Whether /proc/locks holds a granted flock on the file `st` (None: cannot tell)."""
    try:
        text = proc_locks.read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    device = (os.major(st.st_dev), os.minor(st.st_dev))
    for line in text.splitlines():
        # `1: FLOCK  ADVISORY  WRITE 1234 fe:00:5484709 0 EOF`; a waiter's line has `->` first.
        fields = line.split()
        if len(fields) < 6 or fields[1] != "FLOCK":
            continue
        try:
            major, minor, inode = fields[5].split(":")
            where = (int(major, 16), int(minor, 16))
            same = int(inode) == st.st_ino
            by_holder = pid is not None and int(fields[4]) == pid
        except ValueError:
            continue
        # An overlay file system may name another device than stat() does: then the inode and
        # the pid recorded in the lock file must agree instead.
        if same and (where == device or by_holder):
            return True
    return False


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False  # 0 and negatives name process groups, never one daemon
    try:
        os.kill(pid, 0)
    except PermissionError:
        return True  # someone else's process
    except (OSError, OverflowError):
        return False
    return True
