"""`watchdog status`: the daemon writes status.json every cycle; the command reads only that."""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from tests.unit import configs
from tests.unit.rawhttp import refused_url
from tests.unit.test_app import NO_BUS, StopAfter, write_config
from watchdog.cli import main
from watchdog.config import load_config
from watchdog.errors import StateFileError
from watchdog.model import State
from watchdog.run import status as run_status
from watchdog.run.daemon import run_daemon
from watchdog.statefiles import InstanceLock, utc_iso
from watchdog.statusfile import (
    FORMAT,
    VERSION,
    DaemonPresence,
    DaemonStatus,
    GroupStatus,
    daemon_presence,
    read_status,
    status_path,
    write_status,
)


@pytest.fixture(autouse=True)
def _no_systemd(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test here talks to a real bus or to a notify socket of whoever runs pytest."""
    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", NO_BUS)
    for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        monkeypatch.delenv(name, raising=False)


# --- the daemon writes it -------------------------------------------------------------------------


async def test_the_daemon_writes_every_groups_status_after_its_cycles(tmp_path: Path) -> None:
    """After a dry-run daemon's cycles, status.json names its pid, a recent time and the group's
    state, last verdict with its time and reason, and its restart budget."""
    config = load_config(write_config(tmp_path, refused_url(), cycle_seconds=0.05))
    registry = CollectorRegistry()
    daemon = StopAfter(config, dry_run=True, registry=registry, bus_address=NO_BUS)
    before = time.time()
    assert await run_daemon(daemon) == 0
    read = read_status(config.watchdog.state_dir)
    assert read.problem is None
    status = read.status
    assert status is not None
    assert (status.pid, status.dry_run) == (os.getpid(), True)
    assert status.written_at >= before
    (group,) = status.groups
    assert group.group == "g1"
    assert group.state is daemon.groups["g1"].state.state
    assert group.verdict == str(daemon.groups["g1"].state.verdict)
    assert group.verdict_at is not None
    assert group.verdict_at >= before
    assert group.reason  # the decision's reasons, as one line
    restart = config.group[0].restart
    assert (group.restarts_used, group.max_restarts) == (0, restart.max_restarts)
    assert group.budget_window_seconds == restart.budget_window_seconds
    assert (group.held, group.paused_until, group.last_incident) == (False, None, None)
    errors = registry.get_sample_value("sglang_watchdog_file_errors_total", {"what": "status"})
    assert errors == 0.0


async def test_a_status_that_cannot_be_written_never_fails_a_cycle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A status write that fails every time (a full disk) is counted every time, logged once,
    and every cycle still runs to its decision."""
    attempts: list[DaemonStatus] = []

    def full_disk(state_dir: Path, status: DaemonStatus) -> None:
        attempts.append(status)
        raise StateFileError(f"cannot write state file {state_dir}/status.json: No space left")

    monkeypatch.setattr(run_status, "write_status", full_disk)
    config = load_config(write_config(tmp_path, refused_url(), cycle_seconds=0.05))
    registry = CollectorRegistry()
    daemon = StopAfter(config, dry_run=True, registry=registry, bus_address=NO_BUS)
    daemon.limit = 3
    with capture_logs() as logs:
        assert await run_daemon(daemon) == 0
    events = [e["event"] for e in logs]
    assert "cycle_failed" not in events
    assert events.count("status_write_failed") == 1
    assert len(attempts) > daemon.cycles  # at startup, then after every cycle
    errors = registry.get_sample_value("sglang_watchdog_file_errors_total", {"what": "status"})
    assert errors == float(len(attempts))


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
async def test_a_link_planted_as_the_status_file_is_replaced_never_written_through(
    tmp_path: Path, link: str
) -> None:
    """status.json planted as a symbolic or hard link to another file: the daemon's atomic write
    replaces the name; the file it pointed to is untouched."""
    config = load_config(write_config(tmp_path, refused_url(), cycle_seconds=0.05))
    state_dir = config.watchdog.state_dir
    state_dir.mkdir(parents=True)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    if link == "symlink":
        status_path(state_dir).symlink_to(victim)
    else:
        os.link(victim, status_path(state_dir))
    daemon = StopAfter(config, dry_run=True, registry=CollectorRegistry(), bus_address=NO_BUS)
    assert await run_daemon(daemon) == 0
    assert victim.read_text() == "keep me\n"
    assert not status_path(state_dir).is_symlink()
    assert read_status(state_dir).status is not None


async def test_the_last_incident_survives_a_restart_of_the_daemon(tmp_path: Path) -> None:
    """A new daemon takes each group's last incident id from the status its predecessor left."""
    config = load_config(write_config(tmp_path, refused_url(), cycle_seconds=0.05))
    state_dir = config.watchdog.state_dir
    write_status(state_dir, status_of(group_of("g1", last_incident="20261202T200000Z-g1-x")))
    daemon = StopAfter(config, dry_run=True, registry=CollectorRegistry(), bus_address=NO_BUS)
    assert await run_daemon(daemon) == 0
    status = read_status(state_dir).status
    assert status is not None
    assert status.groups[0].last_incident == "20261202T200000Z-g1-x"


# --- the command reads it -------------------------------------------------------------------------

NOW = time.time()


def group_of(name: str = "g1", **fields: object) -> GroupStatus:
    """A healthy group's status, with `fields` replaced."""
    base = GroupStatus(
        group=name,
        state=State.HEALTHY,
        since=NOW - 600,
        verdict="healthy",
        verdict_at=NOW - 2,
        reason="probes pass and tokens flow",
        restarts_used=0,
        max_restarts=3,
        budget_window_seconds=3600.0,
        held=False,
        paused_until=None,
        pause_reason="",
        last_incident=None,
    )
    return replace(base, **fields)  # type: ignore[arg-type]


def status_of(
    *groups: GroupStatus, pid: int | None = None, written_at: float = NOW - 3
) -> DaemonStatus:
    """A status file's content, written by `pid` (by default this process, the lock's holder
    in the tests where a daemon runs)."""
    return DaemonStatus(
        format=FORMAT,
        version=VERSION,
        pid=os.getpid() if pid is None else pid,
        written_at=written_at,
        dry_run=False,
        watchdog_version="test",
        groups=groups,
    )


@pytest.fixture
def config_path(tmp_path: Path) -> Path:
    """A one-group config (g1) with its state_dir in tmp_path (created)."""
    path = write_config(tmp_path, refused_url())
    load_config(path).watchdog.state_dir.mkdir(parents=True)
    return path


@pytest.fixture
def daemon_lock(config_path: Path) -> Iterator[InstanceLock]:
    """state_dir's instance lock, held by this process as a running daemon would hold it."""
    lock = InstanceLock(load_config(config_path).watchdog.state_dir)
    lock.acquire()
    yield lock
    lock.release()


def state_dir_of(config_path: Path) -> Path:
    """The config's state_dir."""
    return load_config(config_path).watchdog.state_dir


def run_status_command(
    config_path: Path, capsys: pytest.CaptureFixture[str], *more: str
) -> tuple[int, str, str]:
    """`watchdog status --config PATH [more]`: exit code, stdout, stderr."""
    code = main(["--log-level", "error", "status", "--config", str(config_path), *more])
    out, err = capsys.readouterr()
    return code, out, err


def line_of(out: str, group: str) -> str:
    """The table line of `group`."""
    (line,) = [row for row in out.splitlines() if row.split()[:1] == [group]]
    return line


@pytest.mark.usefixtures("daemon_lock")
def test_a_healthy_group_with_a_running_daemon_exits_0(
    config_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Text: the daemon's line (running, its pid, the status's age), then the group's line;
    --json says the same; both exit 0."""
    write_status(state_dir_of(config_path), status_of(group_of()))
    code, out, err = run_status_command(config_path, capsys)
    assert (code, err) == (0, "")
    head = out.splitlines()[0]
    assert f"daemon running on state_dir {state_dir_of(config_path)} (pid {os.getpid()})" in head
    assert f"ago) by pid {os.getpid()}" in head
    assert "STALE" not in head
    line = line_of(out, "g1")
    assert line.split()[1:2] == ["healthy"]
    assert "0/3 in 1h" in line
    assert "probes pass and tokens flow" in line

    code, out, _ = run_status_command(config_path, capsys, "--json")
    doc = json.loads(out)
    assert code == 0
    assert doc["daemon"] == {"running": True, "pid": os.getpid()}
    assert doc["healthy"] is True
    assert doc["groups"][0]["state"] == "healthy"
    assert doc["groups"][0]["restarts_used"] == 0
    assert 0 <= doc["age_seconds"] < 3600


@pytest.mark.usefixtures("daemon_lock")
def test_a_held_group_exits_1_and_shows_its_spent_budget(
    config_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A held group: state held, the budget used up, its last incident; exit 1."""
    held = group_of(
        state=State.HELD,
        verdict="silent_stall",
        restarts_used=3,
        held=True,
        last_incident="20261202T193000Z-g1-silent_stall",
        reason="restart budget exhausted",
    )
    write_status(state_dir_of(config_path), status_of(held))
    code, out, _ = run_status_command(config_path, capsys)
    assert code == 1
    line = line_of(out, "g1")
    assert line.split()[1] == "held"
    assert "3/3 in 1h" in line
    assert "20261202T193000Z-g1-silent_stall" in line
    code, out, _ = run_status_command(config_path, capsys, "--json")
    doc = json.loads(out)
    assert (code, doc["healthy"], doc["groups"][0]["held"]) == (1, False, True)


@pytest.mark.usefixtures("daemon_lock")
def test_a_paused_group_shows_its_lease_and_reason_escaped(
    config_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A paused group shows until when and why (an operator's text, its control characters
    escaped for the terminal); exit 1, it is not being healed."""
    until = NOW + 1800
    paused = group_of(state=State.PAUSED, paused_until=until, pause_reason="kernel\x1b[2J upgrade")
    write_status(state_dir_of(config_path), status_of(paused))
    code, out, _ = run_status_command(config_path, capsys)
    assert code == 1
    line = line_of(out, "g1")
    assert line.split()[1] == "paused"
    assert f"paused until {utc_iso(until)} (kernel\\x1b[2J upgrade)" in line
    assert "\x1b" not in out
    code, out, _ = run_status_command(config_path, capsys, "--json")
    doc = json.loads(out)
    assert doc["groups"][0]["paused_until"] == until
    assert doc["groups"][0]["pause_reason"] == "kernel\x1b[2J upgrade"
    assert "\x1b" not in out  # JSON escapes it


def test_no_daemon_running_still_shows_the_last_status_and_its_age(
    config_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With no daemon holding the lock (a stale lock file left behind included), the command says
    so, shows the last status written and how old it is, and exits 1."""
    state_dir = state_dir_of(config_path)
    lock = InstanceLock(state_dir)
    lock.acquire()
    lock.release()  # a daemon that ran and stopped
    write_status(state_dir, status_of(group_of(), pid=4242, written_at=NOW - 7200))
    code, out, err = run_status_command(config_path, capsys)
    assert (code, err) == (1, "")
    head = out.splitlines()[0]
    assert head.startswith(f"no daemon running on state_dir {state_dir}; status written ")
    assert "(2h ago) by pid 4242" in head
    assert line_of(out, "g1").split()[1] == "healthy"
    code, out, _ = run_status_command(config_path, capsys, "--json")
    doc = json.loads(out)
    assert (code, doc["daemon"], doc["healthy"]) == (1, {"running": False, "pid": None}, False)
    assert doc["age_seconds"] >= 7200


def test_no_status_file_says_none_was_written(
    config_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No daemon has ever written a status: one line says so; exit 1; no traceback."""
    code, out, err = run_status_command(config_path, capsys)
    assert (code, err) == (1, "")
    assert out.splitlines() == [
        f"no daemon running on state_dir {state_dir_of(config_path)}; no status written yet "
        f"({status_path(state_dir_of(config_path))} does not exist)"
    ]
    code, out, _ = run_status_command(config_path, capsys, "--json")
    doc = json.loads(out)
    assert (code, doc["written_at"], doc["groups"], doc["missing_groups"]) == (1, None, [], ["g1"])


def plant_garbage(path: Path) -> None:
    """Not JSON."""
    path.write_bytes(b"{not json")


def plant_other_format(path: Path) -> None:
    """JSON, but not a status file."""
    path.write_text(json.dumps({"format": "something-else", "version": 1}))


def plant_nan(path: Path) -> None:
    """A status whose time is NaN."""
    doc = {"format": FORMAT, "version": VERSION, "pid": 1, "written_at": "NaN"}
    path.write_text(json.dumps(doc).replace('"NaN"', "NaN"))


def plant_symlink(path: Path) -> None:
    """A link to a valid-looking file elsewhere."""
    target = path.parent.parent / "elsewhere.json"
    target.write_text("{}")
    path.symlink_to(target)


def plant_hardlink(path: Path) -> None:
    """A second name of a file elsewhere."""
    target = path.parent.parent / "elsewhere.json"
    target.write_text("{}")
    os.link(target, path)


def plant_fifo(path: Path) -> None:
    """A FIFO: opening it for reading must not block."""
    os.mkfifo(path)


@pytest.mark.parametrize(
    "plant",
    [plant_garbage, plant_other_format, plant_nan, plant_symlink, plant_hardlink, plant_fifo],
    ids=lambda f: f.__name__,
)
@pytest.mark.usefixtures("daemon_lock")
def test_a_corrupt_or_planted_status_file_is_refused_without_a_traceback(
    config_path: Path, capsys: pytest.CaptureFixture[str], plant: object
) -> None:
    """Garbage, another format, NaN, a symlink or a FIFO as status.json: one line names the
    problem, exit 1, no traceback; the file is left where it is for the daemon to replace."""
    path = status_path(state_dir_of(config_path))
    assert callable(plant)
    plant(path)
    code, out, err = run_status_command(config_path, capsys)
    assert (code, err) == (1, "")
    assert len(out.splitlines()) == 1
    assert "status unusable: " in out
    assert path.is_symlink() or path.exists()
    code, out, _ = run_status_command(config_path, capsys, "--json")
    assert json.loads(out)["problem"]


UNITS_2 = ("p2.service", "d2.service", "r2.service")


@pytest.mark.usefixtures("daemon_lock")
def test_a_configured_group_missing_from_the_status_is_unknown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A group of the config that the daemon's status does not list shows as unknown (exit 1)."""
    more = write_config(
        tmp_path, refused_url(), more_groups=[configs.group("g2", url=refused_url(), units=UNITS_2)]
    )
    # The fixture's daemon_lock holds the lock of this same state_dir (tmp_path/state).
    write_status(state_dir_of(more), status_of(group_of("g1")))
    code, out, _ = run_status_command(more, capsys)
    assert code == 1
    assert line_of(out, "g1").split()[1] == "healthy"
    assert line_of(out, "g2").split()[1] == "unknown"


# --- is a daemon running? -------------------------------------------------------------------------


def test_presence_follows_the_flock_not_the_file(tmp_path: Path) -> None:
    """Held: running, with the holder's pid; released (the file stays): not running; never
    created: not running. Asking never takes the lock."""
    assert daemon_presence(tmp_path).running is False
    lock = InstanceLock(tmp_path)
    lock.acquire()
    try:
        assert daemon_presence(tmp_path) == DaemonPresence(True, os.getpid())
        assert lock.held
    finally:
        lock.release()
    assert daemon_presence(tmp_path).running is False


def test_without_proc_locks_the_recorded_pid_must_be_alive(tmp_path: Path) -> None:
    """Where /proc/locks cannot be read, the pid the holder wrote decides: a live pid is a
    running daemon, a dead one (a killed daemon's record) or a garbled one is not."""
    nowhere = tmp_path / "no-proc-locks"
    lock_file = tmp_path / "daemon.lock"
    lock_file.write_text(json.dumps({"pid": os.getpid(), "since": NOW, "purpose": "daemon"}))
    assert daemon_presence(tmp_path, proc_locks=nowhere).running is True
    for pid in (0, -1, 2**22 + 1):  # above any pid_max: no such process
        lock_file.write_text(json.dumps({"pid": pid, "since": NOW, "purpose": "daemon"}))
        assert daemon_presence(tmp_path, proc_locks=nowhere).running is False


def test_asking_never_takes_the_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Taking daemon.lock, even shared and for an instant, would make a daemon starting at that
    moment refuse to start: presence is read from the kernel's lock table, never by flock."""
    lock = InstanceLock(tmp_path)
    lock.acquire()
    lock.release()  # the file exists, unlocked: a flock would succeed here

    def no_flock(*args: object) -> None:
        raise AssertionError("watchdog status must not flock daemon.lock")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    assert daemon_presence(tmp_path).running is False


def test_the_status_file_carries_no_credential(tmp_path: Path) -> None:
    """A reason quoting a URL with userinfo, or an API key, is masked on its way to the file."""
    leaky = group_of(
        reason="GET http://admin:hunter2@10.0.0.7:30000/health failed; --api-key sk-s3cr3t-value"
    )
    write_status(tmp_path, status_of(leaky))
    text = status_path(tmp_path).read_text()
    assert "hunter2" not in text
    assert "sk-s3cr3t-value" not in text
    read = read_status(tmp_path)
    assert read.status is not None
    assert "***" in read.status.groups[0].reason


# (written by: None for the running daemon, written how long ago, the group's state, STALE's why)
STALE_CASES = [
    (4242, 3.0, State.HEALTHY, "written by pid 4242, not by the running daemon"),
    (None, 3600.0, State.HEALTHY, "no cycle has finished for 1h"),
    (None, 3600.0, State.RESTARTING, ""),  # a co-restart holds its cycle for minutes
    (None, 3.0, State.HEALTHY, ""),
]


@pytest.mark.parametrize("case", STALE_CASES)
@pytest.mark.usefixtures("daemon_lock")
def test_a_running_daemons_status_that_is_not_current_is_called_stale(
    config_path: Path,
    capsys: pytest.CaptureFixture[str],
    case: tuple[int | None, float, State, str],
) -> None:
    """A status another process wrote, or one not rewritten for far longer than a cycle (but
    during a co-restart), is flagged STALE and never counts as healthy."""
    pid, written_ago, state, stale = case
    write_status(
        state_dir_of(config_path),
        status_of(group_of(state=state), pid=pid, written_at=time.time() - written_ago),
    )
    code, out, _ = run_status_command(config_path, capsys)
    head = out.splitlines()[0]
    assert head.endswith(f"; STALE: {stale}") if stale else "STALE" not in head
    assert code == (0 if not stale and state is State.HEALTHY else 1)
    code, out, _ = run_status_command(config_path, capsys, "--json")
    assert json.loads(out)["stale"] == (stale or None)
