"""Persisted state in state_dir: atomic JSON, restart lock, restart history, operator controls.

Files per group (the group name is validated to be safe in a file name):

    <group>.restart.lock    flock held for a whole restart sequence; holder pid/since/purpose inside
    <group>.history.json    restart records (time, trigger, result per step), newest last; a
                            sequence is recorded when it starts and completed when it ends
    <group>.operator.json   maintenance lease (pause) and re-arm time written by the CLI
    <group>.refusals.json   refused restart requests per reason (so CLI refusals reach metrics)

and once per state_dir `daemon.lock`, the daemon's single-instance flock.

Every file is opened without following symlinks and written for state_dir's owner, whoever runs
the writer (watchdog/statefs.py). Every write goes through write_json_atomic, so a crash leaves
either the old or the new file, and through the redaction policy, so no credential lands on
disk. A file that cannot be parsed (or is a symlink, is deeply nested, holds NaN or Infinity, or
a history time beyond year 9999) is renamed to `<name>.corrupt-<UTC time>` and reported; it is
never fatal, not even when the rename fails, because a watchdog that refuses to start over its
own bookkeeping is worse than one that forgets.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import structlog
from pydantic import TypeAdapter, ValidationError

from watchdog.clock import Clock
from watchdog.errors import LockHeld, StateFileError
from watchdog.model import OperatorControls, RestartOutcome, RestartPlan, Role
from watchdog.redact import redact_value
from watchdog.statefs import (
    NEW_FILE_MODE,
    UnsafeStateFile,
    adopt,
    check_writer,
    open_nofollow,
    read_bounded,
    write_atomic,
)

HISTORY_KEEP = 500  # records kept per group; budget windows need only the last few hours
# A full history is well under 2 MiB; anything far larger is not ours and is set aside unread.
MAX_STATE_FILE_BYTES = 16 * 1024 * 1024
_FORMAT_VERSION = 1

log = structlog.get_logger("watchdog.statefiles")


def utc_iso(at: float) -> str:
    """A unix time as an ISO 8601 UTC string with second precision (for messages and file names)."""
    return datetime.fromtimestamp(at, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def write_json_atomic(path: Path, data: Any) -> None:
    """Replace `path` with `data` as JSON: temp file, fsync, rename, fsync of the directory.

    Never through a symlink, and owned by state_dir's owner (see watchdog/statefs.py); raises
    StateFileError (WrongUser and UnsafeStateFile are kinds of it).

    Every string value goes through the redaction policy (watchdog/redact.py) on the way: a
    restart step's detail quotes its readiness URL, userinfo included, and an error body may
    echo a header; keys are kept, so the file still parses as what it was.
    """
    payload = (json.dumps(redact_value(data), indent=2, sort_keys=True) + "\n").encode()
    try:
        write_atomic(path, payload)
    except OSError as exc:
        raise StateFileError(f"cannot write state file {path}: {exc.strerror or exc}") from None


def set_aside(path: Path, now: float) -> Path:
    """Rename a corrupt state file out of the way (kept for inspection); returns the new path."""
    target = path.with_name(f"{path.name}.corrupt-{utc_iso(now)}")
    try:
        os.replace(path, target)
    except OSError as exc:
        raise StateFileError(
            f"state file {path} is corrupt and cannot be set aside: {exc.strerror or exc}"
        ) from None
    return target


@dataclass(frozen=True, slots=True)
class LoadResult:
    """A JSON state file's content (None when absent or corrupt), with a warning if corrupt."""

    data: Any
    warning: str | None = None


def read_json(path: Path, now: float, validate: Callable[[Any], Any] | None = None) -> LoadResult:
    """Read a JSON state file; a corrupt one (bad JSON or rejected by `validate`) is set aside.

    `validate` converts the parsed JSON into the caller's type and raises ValueError (pydantic's
    ValidationError is one) when the content does not fit.
    """
    try:
        raw = read_bounded(path, MAX_STATE_FILE_BYTES)
        if raw is None:
            return LoadResult(None)
        data = json.loads(raw, parse_constant=_reject_constant)
        if validate is not None:
            data = validate(data)
    except UnsafeStateFile as exc:
        problem = f"{exc.what}, not used"
    except OSError as exc:
        raise StateFileError(f"cannot read state file {path}: {exc.strerror or exc}") from None
    except (ValueError, TypeError, RecursionError) as exc:
        # RecursionError: deeply nested JSON exhausts the parser's stack; corrupt like any other.
        problem = _short_error(exc)
    else:
        return LoadResult(data)
    try:
        target = set_aside(path, now)
    except StateFileError as exc:
        # Unusable either way: a rename that fails (a read-only or full file system) must not
        # turn corrupt bookkeeping into a daemon that cannot start or cycle. The next read tries
        # again; the next atomic write replaces the file.
        warning = f"state file {path} is corrupt ({problem}) and stays in place: {exc}"
        log.error("state_file_corrupt", path=str(path), set_aside_as=None, error=problem)
        return LoadResult(None, warning)
    warning = f"state file {path} is corrupt ({problem}); set aside as {target.name}"
    log.warning("state_file_corrupt", path=str(path), set_aside_as=str(target), error=problem)
    return LoadResult(None, warning)


def _reject_constant(name: str) -> Any:
    # Python's json reads NaN and Infinity, which no JSON writer may produce: a time that is not
    # a number crashes every later use of it (a log line's UTC time, budget arithmetic).
    raise ValueError(f"non-finite number {name} (not JSON)")


def _short_error(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"]) or "(top level)"
        return f"{where}: {first['msg']}"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


# --- restart lock ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LockHolder:
    """Who holds a restart lock, as written into the lock file by the holder."""

    pid: int
    since: float
    purpose: str  # "daemon", "manual restart", ...

    def describe(self) -> str:
        """`pid 123 (manual restart) since 2026-01-01T00:00:00Z`."""
        return f"pid {self.pid} ({self.purpose}) since {utc_iso(self.since)}"


def lock_path(state_dir: Path, group: str) -> Path:
    """The restart lock file of a group."""
    return state_dir / f"{group}.restart.lock"


class _FlockFile:
    """An exclusive, non-blocking flock on a file in state_dir, with its holder written inside.

    flock belongs to the open file description, so it is released by the kernel when the holder
    dies (no stale locks) and two opens in one process contend like two processes do. The file is
    never deleted: unlinking a lock file races with a contender that has it open. Every error
    after the flock is taken closes the descriptor, so no failure leaves the lock held.
    """

    def __init__(self, path: Path, *, purpose: str, clock: Clock) -> None:
        self.path = path
        self.purpose = purpose
        self._clock = clock
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """True while this object holds the lock."""
        return self._fd is not None

    def _busy(self, holder: LockHolder | None) -> LockHeld:
        raise NotImplementedError

    def acquire(self) -> LockHolder:
        """Take the lock or fail fast with LockHeld naming the holder."""
        if self._fd is not None:
            raise RuntimeError(f"{self.path} is already held by this {type(self).__name__}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            owner = check_writer(self.path.parent)
            fd = open_nofollow(self.path, os.O_RDWR | os.O_CREAT, NEW_FILE_MODE)
        except UnsafeStateFile as exc:
            log.error("state_file_refused", path=str(self.path), error=str(exc))
            raise
        except OSError as exc:
            raise StateFileError(f"cannot open lock {self.path}: {exc.strerror or exc}") from None
        try:
            adopt(fd, owner)  # a lock file root created for the daemon stays openable by it
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise self._busy(read_lock_holder(self.path)) from None
        except BaseException as exc:
            os.close(fd)
            if isinstance(exc, OSError):
                raise StateFileError(f"cannot lock {self.path}: {exc.strerror or exc}") from None
            raise
        holder = LockHolder(pid=os.getpid(), since=self._clock(), purpose=self.purpose)
        self._fd = fd
        payload = json.dumps({"pid": holder.pid, "since": holder.since, "purpose": holder.purpose})
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, payload.encode() + b"\n", 0)
        except OSError as exc:
            # The record only names the holder for a contender's message; a full disk must not
            # stop a restart, and the lock itself (the flock) is held either way.
            log.warning("lock_holder_not_written", path=str(self.path), error=str(exc))
        return holder

    def release(self) -> None:
        """Clear the holder record and drop the lock (no-op when not held)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
        finally:
            os.close(fd)  # closing the last descriptor drops the flock

    def __enter__(self) -> Self:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


class RestartLock(_FlockFile):
    """The flock on `<group>.restart.lock`, held for a whole restart sequence.

    One lock per group, not per state_dir: groups are independent deployments, and one group's
    15-minute co-restart must not delay another's.
    """

    def __init__(
        self, state_dir: Path, group: str, *, purpose: str, clock: Clock = time.time
    ) -> None:
        super().__init__(lock_path(state_dir, group), purpose=purpose, clock=clock)
        self.group = group

    def _busy(self, holder: LockHolder | None) -> LockHeld:
        who = holder.describe() if holder else "a process that has not written its pid yet"
        return LockHeld(
            f"another restart of group {self.group!r} is in progress: {self.path} is held "
            f"by {who}; wait for it to finish (the lock is released when that process exits)"
        )


INSTANCE_LOCK_NAME = "daemon.lock"


class InstanceLock(_FlockFile):
    """The flock on `<state_dir>/daemon.lock`, held by the daemon for its whole life.

    Two daemons on one state_dir would both act on the same groups (double co-restarts); the
    second one refuses to start instead. `--once` and the CLI commands do not take it: they
    coordinate with the daemon through the per-group restart locks.
    """

    def __init__(self, state_dir: Path, *, clock: Clock = time.time) -> None:
        super().__init__(state_dir / INSTANCE_LOCK_NAME, purpose="daemon", clock=clock)
        self.state_dir = state_dir

    def _busy(self, holder: LockHolder | None) -> LockHeld:
        who = f"pid {holder.pid}" if holder else "a process that has not written its pid yet"
        since = f" since {utc_iso(holder.since)}" if holder else ""
        return LockHeld(
            f"another watchdog daemon ({who}{since}) already runs on state_dir {self.state_dir} "
            f"({self.path} is locked); two daemons on one state_dir would both restart the same "
            "groups. Stop that one first, or give this one its own state_dir"
        )


def read_lock_holder(path: Path) -> LockHolder | None:
    """The holder recorded in a lock file, or None when empty, unreadable, garbled or a link."""
    try:
        raw = read_bounded(path, 4096)
        data = json.loads(raw or b"", parse_constant=_reject_constant)
        holder = LockHolder(
            pid=int(data["pid"]), since=float(data["since"]), purpose=data["purpose"]
        )
    except (OSError, StateFileError, ValueError, KeyError, TypeError, RecursionError):
        return None
    # describe() prints the time: one no date can name is as garbled as bad JSON.
    return holder if abs(holder.since) <= _MAX_TIME else None


# --- restart history ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One step of a recorded restart."""

    role: Role
    unit: str
    ok: bool
    phase: str
    detail: str = ""
    started_at: float = 0.0
    finished_at: float = 0.0


@dataclass(frozen=True, slots=True)
class RestartRecord:
    """One executed (or rehearsed) restart sequence.

    A sequence is recorded when it starts (`finished` False, no steps yet) and the record is
    completed when it ends. A record still unfinished when another process holds the group's lock
    belongs to a process that died mid-sequence (SIGKILL, OOM): it stays unfinished (and charged
    to the budget) and gets `abandoned_at`, the time it was found and reported.
    """

    started_at: float
    finished_at: float
    trigger: str
    dry_run: bool
    ok: bool
    interrupted: bool = False
    steps: tuple[StepRecord, ...] = ()
    finished: bool = True  # files from before the start record have only finished records
    pid: int = 0  # the process that ran the sequence
    abandoned_at: float | None = None
    refused: str = ""  # RestartOutcome.refused: no step was started (e.g. host_unreachable)

    @property
    def restarted_nothing(self) -> bool:
        """Refused before its first step: not charged to the budget, not a failed attempt.

        Records written before `refused` existed are recognised by their steps: every one
        not_started without a shutdown is the pre-restart host check's refusal.
        """
        if self.refused:
            return True
        return (
            self.finished
            and not self.interrupted
            and bool(self.steps)
            and all(s.phase == "not_started" for s in self.steps)
        )

    @classmethod
    def begun(cls, plan: RestartPlan, *, dry_run: bool, now: float) -> RestartRecord:
        """The record of a sequence that starts now."""
        return cls(
            started_at=now,
            finished_at=0.0,
            trigger=plan.trigger,
            dry_run=dry_run,
            ok=False,
            finished=False,
            pid=os.getpid(),
        )

    @classmethod
    def from_outcome(cls, outcome: RestartOutcome) -> RestartRecord:
        """The record of an executed plan."""
        return cls(
            started_at=outcome.started_at,
            finished_at=outcome.finished_at,
            trigger=outcome.plan.trigger,
            dry_run=outcome.dry_run,
            ok=outcome.ok,
            interrupted=outcome.interrupted,
            refused=outcome.refused,
            pid=os.getpid(),
            steps=tuple(
                StepRecord(
                    role=s.role,
                    unit=s.unit,
                    ok=s.ok,
                    phase=s.phase,
                    detail=s.detail,
                    started_at=s.started_at,
                    finished_at=s.finished_at,
                )
                for s in outcome.steps
            ),
        )


@dataclass(frozen=True, slots=True)
class _HistoryFile:
    version: int
    group: str
    restarts: tuple[RestartRecord, ...] = ()


_HISTORY_ADAPTER = TypeAdapter(_HistoryFile)
# The last second of year 9999: every time in a history must be one utc_iso() can name.
_MAX_TIME = 253402300799.0


def _record_times(record: RestartRecord) -> Iterator[float]:
    yield record.started_at
    yield record.finished_at
    if record.abandoned_at is not None:
        yield record.abandoned_at
    for step in record.steps:
        yield step.started_at
        yield step.finished_at


def _validate_history(data: Any) -> _HistoryFile:
    """The history file's content; ValueError (set aside) for a time that is no time at all."""
    content = _HISTORY_ADAPTER.validate_python(data)
    for index, record in enumerate(content.restarts):
        for at in _record_times(record):
            if not math.isfinite(at) or abs(at) > _MAX_TIME:
                raise ValueError(f"restarts.{index}: time {at!r} out of range")
    return content


def history_path(state_dir: Path, group: str) -> Path:
    """The restart history file of a group."""
    return state_dir / f"{group}.history.json"


@dataclass(slots=True)
class RestartHistory:
    """A group's restart records, loaded from and saved to `<group>.history.json`.

    Persisted so that restarting the watchdog does not reset its restart budget.
    """

    path: Path
    group: str
    records: list[RestartRecord] = field(default_factory=list)
    warning: str | None = None  # set when the file on disk was corrupt and has been set aside
    keep: int = HISTORY_KEEP

    @classmethod
    def load(cls, state_dir: Path, group: str, *, now: float) -> RestartHistory:
        """Read the history; a missing file is empty, a corrupt one is set aside (see .warning)."""
        path = history_path(state_dir, group)
        result = read_json(path, now, _validate_history)
        if result.data is None:
            return cls(path=path, group=group, warning=result.warning)
        data: _HistoryFile = result.data
        return cls(path=path, group=group, records=list(data.restarts))

    def record(
        self, outcome: RestartOutcome, *, begun: RestartRecord | None = None
    ) -> RestartRecord:
        """Store an outcome (in place of its start record `begun`, if given) and save the file
        atomically; returns the stored record."""
        entry = RestartRecord.from_outcome(outcome)
        index = next((i for i, r in enumerate(self.records) if r is begun), None)
        if index is None:
            self.records.append(entry)
        else:
            self.records[index] = entry
        del self.records[: -self.keep]
        self.save()
        return entry

    def begin(self, plan: RestartPlan, *, dry_run: bool, now: float) -> RestartRecord:
        """Add the start record of a sequence (in memory: save() it before restarting anything,
        so a sequence cut by SIGKILL is still charged); complete it with record(begun=...).

        Only while holding the group's lock. Unfinished records already there belong to dead
        processes: they are marked abandoned (and logged) first, not mistaken for this one.
        """
        self.mark_abandoned(now, save=False)
        entry = RestartRecord.begun(plan, dry_run=dry_run, now=now)
        self.records.append(entry)
        del self.records[: -self.keep]
        return entry

    def unreported_abandoned(self) -> tuple[RestartRecord, ...]:
        """Unfinished records not yet reported; call only while holding the group's lock (then
        no live process is running them)."""
        return tuple(r for r in self.records if not r.finished and r.abandoned_at is None)

    def mark_abandoned(self, now: float, *, save: bool = True) -> tuple[RestartRecord, ...]:
        """Log `restart_sequence_interrupted` for each unreported unfinished record and mark it
        reported (and save, unless told not to); returns them. Only while holding the group's
        lock."""
        found = self.unreported_abandoned()
        if not found:
            return ()
        for record in found:
            log.error(
                "restart_sequence_interrupted",
                group=self.group,
                started_at=record.started_at,
                started_at_utc=utc_iso(record.started_at),
                trigger=record.trigger,
                dry_run=record.dry_run,
                pid=record.pid,
                effect="the process running it died without recording an outcome; it counts "
                "against the restart budget",
            )
        self.records = [
            dataclasses.replace(r, abandoned_at=now) if r in found else r for r in self.records
        ]
        if save:
            self.save()
        return found

    def save(self) -> None:
        """Write the whole history atomically."""
        content = _HistoryFile(
            version=_FORMAT_VERSION, group=self.group, restarts=tuple(self.records)
        )
        write_json_atomic(self.path, _HISTORY_ADAPTER.dump_python(content, mode="json"))

    def _real(self, since: float | None) -> Iterator[RestartRecord]:
        # Refusals restarted nothing: neither the budget nor the failure streak counts them.
        for r in self.records:
            if (
                not r.dry_run
                and not r.restarted_nothing
                and (since is None or r.started_at >= since)
            ):
                yield r

    def restart_times(
        self, window_seconds: float, now: float, *, since: float | None = None
    ) -> tuple[float, ...]:
        """Start times of real (not dry-run) restarts in the window and after `since` (a re-arm),
        unfinished ones included: a sequence cut by a kill still restarted something."""
        start = now - window_seconds if since is None else max(now - window_seconds, since)
        return tuple(r.started_at for r in self._real(None) if r.started_at >= start)

    def consecutive_failures(self, *, since: float | None = None) -> int:
        """Failed real restarts at the end of the history, after `since` (a re-arm).

        Interrupted sequences (watchdog shut down mid-way) and unfinished ones (running, or cut
        by a kill) are skipped, neither failure nor success: they say nothing about whether a
        restart helps. Both still count in restart_times (the budget).
        """
        count = 0
        for r in reversed(list(self._real(since))):
            if r.interrupted or not r.finished:
                continue
            if r.ok:
                break
            count += 1
        return count

    def last_restart_at(self) -> float | None:
        """Start time of the newest real restart, if any."""
        times = [r.started_at for r in self._real(None)]
        return max(times) if times else None


def report_abandoned(
    state_dir: Path, group: str, *, clock: Clock = time.time
) -> tuple[RestartRecord, ...]:
    """At daemon start: report sequences whose process died mid-way (see mark_abandoned).

    Needs the group's restart lock; when someone holds it (a `watchdog restart` in progress),
    the unfinished record may be theirs, and the next sequence under the lock reports it instead.
    """
    try:
        with RestartLock(state_dir, group, purpose="daemon start: history check", clock=clock):
            history = RestartHistory.load(state_dir, group, now=clock())
            return history.mark_abandoned(clock())
    except LockHeld:
        return ()


# --- operator controls ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _OperatorFile:
    version: int
    paused_until: float | None = None
    pause_reason: str = ""
    paused_at: float | None = None
    rearmed_at: float | None = None


_OPERATOR_ADAPTER = TypeAdapter(_OperatorFile)


def operator_path(state_dir: Path, group: str) -> Path:
    """The operator controls file of a group."""
    return state_dir / f"{group}.operator.json"


def _read_operator_file(
    state_dir: Path, group: str, now: float
) -> tuple[_OperatorFile, str | None]:
    result = read_json(operator_path(state_dir, group), now, _OPERATOR_ADAPTER.validate_python)
    if result.data is None:
        return _OperatorFile(version=_FORMAT_VERSION), result.warning
    data: _OperatorFile = result.data
    return data, None


def _write_operator_file(state_dir: Path, group: str, content: _OperatorFile) -> None:
    write_json_atomic(
        operator_path(state_dir, group), _OPERATOR_ADAPTER.dump_python(content, mode="json")
    )


def read_operator_controls(
    state_dir: Path, group: str, *, now: float | None = None
) -> OperatorControls:
    """What operators asked for (pause lease, re-arm); a corrupt file is set aside and ignored."""
    data, _ = _read_operator_file(state_dir, group, time.time() if now is None else now)
    return OperatorControls(
        paused_until=data.paused_until, pause_reason=data.pause_reason, rearmed_at=data.rearmed_at
    )


def write_pause(
    state_dir: Path, group: str, *, until: float, reason: str, now: float
) -> OperatorControls:
    """Set a maintenance lease: the daemon observes the group but does not act until `until`."""
    data, _ = _read_operator_file(state_dir, group, now)
    content = _OperatorFile(
        version=_FORMAT_VERSION,
        paused_until=until,
        pause_reason=reason,
        paused_at=now,
        rearmed_at=data.rearmed_at,
    )
    _write_operator_file(state_dir, group, content)
    return read_operator_controls(state_dir, group, now=now)


def clear_pause(state_dir: Path, group: str, *, now: float) -> bool:
    """Drop the maintenance lease; returns whether one was active."""
    data, _ = _read_operator_file(state_dir, group, now)
    was_active = data.paused_until is not None and data.paused_until > now
    content = _OperatorFile(version=_FORMAT_VERSION, rearmed_at=data.rearmed_at)
    _write_operator_file(state_dir, group, content)
    return was_active


def write_rearm(state_dir: Path, group: str, *, now: float) -> OperatorControls:
    """Re-arm a held group: failures and restarts before `now` no longer count against it."""
    data, _ = _read_operator_file(state_dir, group, now)
    content = _OperatorFile(
        version=_FORMAT_VERSION,
        paused_until=data.paused_until,
        pause_reason=data.pause_reason,
        paused_at=data.paused_at,
        rearmed_at=now,
    )
    _write_operator_file(state_dir, group, content)
    return read_operator_controls(state_dir, group, now=now)


# --- refused restart requests ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _RefusalsFile:
    version: int
    counts: dict[str, int] = field(default_factory=dict)
    last_at: float | None = None


_REFUSALS_ADAPTER = TypeAdapter(_RefusalsFile)


def refusals_path(state_dir: Path, group: str) -> Path:
    """The refused-requests counter file of a group."""
    return state_dir / f"{group}.refusals.json"


def read_refusal_counts(state_dir: Path, group: str, *, now: float) -> dict[str, int]:
    """Refused restart requests per reason, as recorded by CLI invocations (monotonic counts)."""
    result = read_json(refusals_path(state_dir, group), now, _REFUSALS_ADAPTER.validate_python)
    if result.data is None:
        return {}
    data: _RefusalsFile = result.data
    return dict(data.counts)


def record_refusal(state_dir: Path, group: str, reason: str, *, now: float) -> dict[str, int]:
    """Count one refused request; a short-lived CLI cannot export metrics, the daemon reads this."""
    counts = read_refusal_counts(state_dir, group, now=now)
    counts[reason] = counts.get(reason, 0) + 1
    content = _RefusalsFile(version=_FORMAT_VERSION, counts=counts, last_at=now)
    write_json_atomic(
        refusals_path(state_dir, group), _REFUSALS_ADAPTER.dump_python(content, mode="json")
    )
    return counts
