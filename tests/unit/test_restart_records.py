"""Restart history recorded at the start of a sequence; one daemon per state_dir."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
from structlog.testing import capture_logs

from pdsim.stack import free_ports
from tests.unit import configs
from tests.unit.rawhttp import refused_url
from tests.unit.test_statefiles import outcome
from watchdog.act.restarters import DryRunRestarter, execute_locked
from watchdog.cli import main
from watchdog.config import load_config
from watchdog.errors import EXIT_STARTUP, StartupError
from watchdog.model import RestartOutcome, RestartPlan, RestartStep, Role
from watchdog.run.daemon import Daemon, run_daemon
from watchdog.statefiles import (
    InstanceLock,
    RestartHistory,
    RestartLock,
    report_abandoned,
)

REPO = Path(__file__).resolve().parents[2]
NO_BUS = "unix:path=/nonexistent/sglang-watchdog-test/bus"


@pytest.fixture(autouse=True)
def _no_systemd(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No real bus or notify socket; cli.main()'s structlog setup is undone afterwards."""
    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", NO_BUS)
    for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        monkeypatch.delenv(name, raising=False)
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def plan() -> RestartPlan:
    """A one-step plan of group g1."""
    step = RestartStep(Role.ROUTER, "r.service", "http://127.0.0.1:1/readiness", 10.0)
    return RestartPlan(group="g1", trigger="probe_failures", steps=(step,))


class RealLooking:
    """A restarter that is not a dry run; it checks what the history says mid-sequence."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.seen_mid_sequence: list[bool] = []

    async def execute(self, plan: RestartPlan) -> RestartOutcome:
        records = RestartHistory.load(self.state_dir, plan.group, now=0.0).records
        self.seen_mid_sequence = [r.finished for r in records]
        done = outcome(time.time())
        return RestartOutcome(
            plan=plan,
            ok=True,
            dry_run=False,
            steps=done.steps,
            started_at=done.started_at,
            finished_at=done.finished_at,
        )


# --- the start record -----------------------------------------------------------------------------


async def test_sequence_is_on_disk_before_anything_restarts_and_completed_after(
    tmp_path: Path,
) -> None:
    """The start record (finished False) is saved before the restarter runs; afterwards the
    same entry holds the outcome: one record, finished."""
    restarter = RealLooking(tmp_path)
    await execute_locked(plan(), restarter, state_dir=tmp_path, purpose="daemon")
    assert restarter.seen_mid_sequence == [False]
    records = RestartHistory.load(tmp_path, "g1", now=0.0).records
    assert [(r.finished, r.ok, r.dry_run, r.pid) for r in records] == [
        (True, True, False, os.getpid())
    ]


def test_unfinished_records_count_against_the_budget_but_not_as_failures(tmp_path: Path) -> None:
    """restart_times sees an unfinished (running or killed) sequence; consecutive_failures
    neither counts it nor stops at it."""
    history = RestartHistory.load(tmp_path, "g1", now=0.0)
    history.record(outcome(100.0, ok=False))
    history.begin(plan(), dry_run=False, now=200.0)
    history.save()
    loaded = RestartHistory.load(tmp_path, "g1", now=300.0)
    assert loaded.restart_times(3600.0, 300.0) == (100.0, 200.0)
    assert loaded.consecutive_failures() == 1
    assert loaded.last_restart_at() == 200.0


KILLED_MID_SEQUENCE = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    from watchdog.act.restarters import execute_locked
    from watchdog.model import RestartPlan, RestartStep, Role

    class Hangs:
        async def execute(self, plan):
            print("restarting", flush=True)
            await asyncio.sleep(3600)

    step = RestartStep(Role.ROUTER, "r.service", "http://127.0.0.1:1/readiness", 10.0)
    plan = RestartPlan(group="g1", trigger="probe_failures", steps=(step,))
    asyncio.run(execute_locked(plan, Hangs(), state_dir=Path(sys.argv[1]), purpose="daemon"))
    """
)


def test_sequence_cut_by_sigkill_is_charged_and_reported_once(tmp_path: Path) -> None:
    """SIGKILL mid-sequence: the record stays, unfinished; the next holder of the lock reports it
    (restart_sequence_interrupted) exactly once, and it keeps counting against the budget."""
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_MID_SEQUENCE, str(tmp_path)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        while "restarting" not in proc.stdout.readline():
            assert proc.poll() is None, "the sequence never started"
        with pytest.raises(Exception, match="in progress"):  # LockHeld while it runs
            RestartLock(tmp_path, "g1", purpose="manual").acquire()
        assert report_abandoned(tmp_path, "g1") == ()  # lock held: not ours to judge
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()
    (record,) = RestartHistory.load(tmp_path, "g1", now=0.0).records
    assert (record.finished, record.pid, record.abandoned_at) == (False, proc.pid, None)
    with capture_logs() as logs:
        found = report_abandoned(tmp_path, "g1", clock=lambda: 5e9)
        again = report_abandoned(tmp_path, "g1", clock=lambda: 5e9)
    assert [r.started_at for r in found] == [record.started_at]
    assert again == ()
    reported = [e for e in logs if e["event"] == "restart_sequence_interrupted"]
    assert len(reported) == 1
    assert (reported[0]["group"], reported[0]["started_at"]) == ("g1", record.started_at)
    history = RestartHistory.load(tmp_path, "g1", now=0.0)
    assert history.records[0].abandoned_at == 5e9
    assert history.restart_times(3600.0, record.started_at + 60) == (record.started_at,)


async def test_next_sequence_reports_an_abandoned_record_before_its_own(tmp_path: Path) -> None:
    """A manual restart finding a dead sequence's record reports it and does not mistake it for
    its own start record."""
    history = RestartHistory.load(tmp_path, "g1", now=0.0)
    history.begin(plan(), dry_run=False, now=100.0)
    history.save()
    with capture_logs() as logs:
        await execute_locked(plan(), DryRunRestarter(), state_dir=tmp_path, purpose="manual")
    assert [e["event"] for e in logs].count("restart_sequence_interrupted") == 1
    records = RestartHistory.load(tmp_path, "g1", now=0.0).records
    assert [(r.started_at, r.finished, r.abandoned_at is not None) for r in records[:1]] == [
        (100.0, False, True)
    ]
    assert [(r.finished, r.dry_run) for r in records[1:]] == [(True, True)]


# --- the daemon -----------------------------------------------------------------------------------


def write_config(tmp_path: Path) -> Path:
    """A one-group config against nothing, state in tmp_path/state, a 1 h budget of 3."""
    group = configs.group("g1", url=refused_url())
    group["restart"] = {"max_restarts": 3, "budget_window_seconds": 3600}
    return configs.write_config(
        tmp_path / "w.toml",
        {
            "watchdog": {
                "state_dir": str(tmp_path / "state"),
                "metrics_listen": f"127.0.0.1:{free_ports(1)[0]}",
            },
            "group": [group],
        },
    )


async def test_daemon_start_reports_a_killed_sequence_and_charges_it(tmp_path: Path) -> None:
    """An unfinished record from a killed daemon: logged and audited at the next start, and the
    budget the new daemon starts with is one lower."""
    config = load_config(write_config(tmp_path))
    state_dir = config.watchdog.state_dir
    state_dir.mkdir()
    now = time.time()
    history = RestartHistory.load(state_dir, "g1", now=now)
    history.begin(plan(), dry_run=False, now=now - 60)
    history.save()
    daemon = Daemon(config, dry_run=True, bus_address=NO_BUS)
    with capture_logs() as logs:
        try:
            await daemon.startup()
        finally:
            await daemon.shutdown()
    reported = [e for e in logs if e["event"] == "restart_sequence_interrupted"]
    assert [(e["group"], e["started_at"]) for e in reported] == [("g1", now - 60)]
    group = config.group[0]
    state = daemon.groups["g1"].state
    assert state.budget_remaining(group, now) == 2
    audit = [json.loads(line) for line in (state_dir / "audit.jsonl").read_text().splitlines()]
    assert [(a["event"], a["group"], a["started_at"]) for a in audit] == [
        ("restart_sequence_interrupted", "g1", now - 60)
    ]


async def test_second_daemon_on_one_state_dir_is_refused(tmp_path: Path) -> None:
    """While a daemon holds daemon.lock, another exits 3 naming the state_dir and the pid; the
    lock is free again after the first one stops."""
    config = load_config(write_config(tmp_path))
    first = Daemon(config, dry_run=True, bus_address=NO_BUS)
    await first.startup()
    try:
        second = Daemon(config, dry_run=True, bus_address=NO_BUS)
        with pytest.raises(StartupError) as refused:
            await run_daemon(second)
        message = str(refused.value)
        assert str(config.watchdog.state_dir) in message
        assert f"pid {os.getpid()}" in message
        assert second.metrics_server is None  # refused before binding the metrics port
    finally:
        await first.shutdown()
    with InstanceLock(config.watchdog.state_dir) as lock:
        assert lock.held


def test_second_daemon_exits_3_but_once_and_cli_commands_still_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Through the command line: the daemon exits 3; `--once` and `pause` are not blocked."""
    path = write_config(tmp_path)
    state_dir = tmp_path / "state"
    with InstanceLock(state_dir):
        assert main(["--config", str(path), "--dry-run"]) == EXIT_STARTUP
        err = capsys.readouterr().err
        assert f"already runs on state_dir {state_dir}" in err
        assert f"pid {os.getpid()}" in err
        assert main(["--config", str(path), "--once"]) == 1  # ran: nothing listens
        assert main(["pause", "--config", str(path), "--for", "5m"]) == 0
