"""State files: atomic writes, the restart lock, restart history and operator controls."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from watchdog.errors import LockHeld, StateFileError
from watchdog.model import RestartOutcome, RestartPlan, RestartStep, Role, StepResult
from watchdog.statefiles import (
    RestartHistory,
    RestartLock,
    clear_pause,
    history_path,
    lock_path,
    operator_path,
    read_lock_holder,
    read_operator_controls,
    read_refusal_counts,
    record_refusal,
    report_abandoned,
    write_json_atomic,
    write_pause,
    write_rearm,
)

REPO = Path(__file__).resolve().parents[2]


def outcome(
    started: float, *, ok: bool = True, dry_run: bool = False, interrupted: bool = False
) -> RestartOutcome:
    """A one-step outcome starting at `started`."""
    step = RestartStep(Role.PREFILL, "p.service", "http://127.0.0.1:1/health", 10.0)
    plan = RestartPlan(group="g1", trigger="probe_failures", steps=(step,))
    result = StepResult(
        Role.PREFILL, "p.service", ok, "ready" if ok else "restart_job", "", started, started + 1
    )
    return RestartOutcome(
        plan=plan,
        ok=ok,
        dry_run=dry_run,
        steps=(result,),
        started_at=started,
        finished_at=started + 2,
        interrupted=interrupted,
    )


# --- atomic writes --------------------------------------------------------------------------------


def test_atomic_write_replaces_file_and_leaves_no_temp(tmp_path: Path) -> None:
    """write_json_atomic writes the JSON and leaves only the target file behind."""
    target = tmp_path / "state" / "x.json"
    write_json_atomic(target, {"a": 1})
    write_json_atomic(target, {"a": 2})
    assert json.loads(target.read_text()) == {"a": 2}
    assert sorted(p.name for p in target.parent.iterdir()) == ["x.json"]


def test_atomic_write_into_unwritable_place_raises_state_file_error(tmp_path: Path) -> None:
    """A write that cannot happen raises StateFileError naming the file."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(StateFileError) as info:
        write_json_atomic(blocker / "x.json", {})
    assert str(info.value).startswith(f"cannot write state file {blocker / 'x.json'}: ")


# --- restart lock ---------------------------------------------------------------------------------


def test_lock_contention_within_one_process_names_holder(tmp_path: Path) -> None:
    """A second open of the lock fails fast with the holder's pid, purpose and since-time."""
    first = RestartLock(tmp_path, "g1", purpose="daemon", clock=lambda: 0.0)
    first.acquire()
    holder = read_lock_holder(lock_path(tmp_path, "g1"))
    assert holder is not None
    assert (holder.pid, holder.purpose, holder.since) == (os.getpid(), "daemon", 0.0)
    with pytest.raises(LockHeld) as info:
        RestartLock(tmp_path, "g1", purpose="manual").acquire()
    assert str(info.value) == (
        f"another restart of group 'g1' is in progress: {tmp_path / 'g1.restart.lock'} is held by "
        f"pid {os.getpid()} (daemon) since 1970-01-01T00:00:00Z; wait for it to finish (the lock "
        "is released when that process exits)"
    )
    first.release()
    with RestartLock(tmp_path, "g1", purpose="manual") as again:
        assert again.held
    assert read_lock_holder(lock_path(tmp_path, "g1")) is None


def test_locks_of_different_groups_are_independent(tmp_path: Path) -> None:
    """One group's sequence does not block another group's."""
    with RestartLock(tmp_path, "g1", purpose="a"), RestartLock(tmp_path, "g2", purpose="b"):
        pass


def test_lock_contention_across_processes_and_release_on_exit(tmp_path: Path) -> None:
    """Another process holding the lock blocks us; when it dies, the kernel releases the lock."""
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from watchdog.statefiles import RestartLock\n"
        "lock = RestartLock(Path(sys.argv[1]), 'g1', purpose='daemon')\n"
        "lock.acquire()\n"
        "print('locked', flush=True)\n"
        "sys.stdin.read()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "locked"
        with pytest.raises(LockHeld) as info:
            RestartLock(tmp_path, "g1", purpose="manual").acquire()
        assert f"held by pid {child.pid} (daemon) since " in str(info.value)
    finally:
        child.kill()
        child.wait(timeout=10)
    with RestartLock(tmp_path, "g1", purpose="manual"):
        pass


# --- history --------------------------------------------------------------------------------------


def test_history_round_trip_survives_reload(tmp_path: Path) -> None:
    """Recorded outcomes (time, trigger, result per step) are there after a reload."""
    history = RestartHistory.load(tmp_path, "g1", now=0.0)
    assert history.records == []
    history.record(outcome(100.0))
    history.record(outcome(200.0, ok=False))
    again = RestartHistory.load(tmp_path, "g1", now=300.0)
    assert again.warning is None
    assert [(r.started_at, r.trigger, r.ok) for r in again.records] == [
        (100.0, "probe_failures", True),
        (200.0, "probe_failures", False),
    ]
    assert again.records[1].steps[0].phase == "restart_job"
    assert again.records[1].steps[0].role is Role.PREFILL


@pytest.mark.parametrize(
    "content",
    [b"{not json", b'{"version": 1, "group": "g1", "restarts": [{"trigger": 3}]}', b"[]"],
)
def test_corrupt_history_is_set_aside_not_fatal(tmp_path: Path, content: bytes) -> None:
    """A corrupt history is renamed *.corrupt-<time>, reported, and replaced by an empty one."""
    path = history_path(tmp_path, "g1")
    path.write_bytes(content)
    with capture_logs() as logs:
        history = RestartHistory.load(tmp_path, "g1", now=86400.0)
    assert history.records == []
    aside = tmp_path / "g1.history.json.corrupt-1970-01-02T00:00:00Z"
    assert aside.read_bytes() == content
    assert not path.exists()
    assert history.warning is not None
    assert history.warning.startswith(f"state file {path} is corrupt (")
    assert history.warning.endswith("); set aside as g1.history.json.corrupt-1970-01-02T00:00:00Z")
    assert [e["event"] for e in logs] == ["state_file_corrupt"]
    history.record(outcome(1.0))
    assert len(RestartHistory.load(tmp_path, "g1", now=2.0).records) == 1


def unfinished_record(started_at: str) -> bytes:
    """A history whose one unfinished record starts at `started_at` (JSON text, as planted)."""
    record = (
        f'{{"started_at": {started_at}, "finished_at": 0.0, "trigger": "probe_failures", '
        '"dry_run": false, "ok": false, "finished": false, "pid": 4242}'
    )
    return f'{{"version": 1, "group": "g1", "restarts": [{record}]}}'.encode()


@pytest.mark.parametrize("started_at", ["NaN", "Infinity", "-Infinity", "1e300"])
def test_history_with_a_time_that_is_no_time_is_set_aside(tmp_path: Path, started_at: str) -> None:
    """An unfinished record whose start is NaN, infinite or beyond year 9999 is corrupt state:
    set aside at load, and the start-up report of abandoned sequences does not crash on it."""
    path = history_path(tmp_path, "g1")
    content = unfinished_record(started_at)
    path.write_bytes(content)
    with capture_logs() as logs:
        assert report_abandoned(tmp_path, "g1", clock=lambda: 86400.0) == ()
        history = RestartHistory.load(tmp_path, "g1", now=86400.0)
    assert history.records == []
    aside = tmp_path / "g1.history.json.corrupt-1970-01-02T00:00:00Z"
    assert aside.read_bytes() == content
    assert [e["event"] for e in logs] == ["state_file_corrupt"]


def test_corrupt_file_that_cannot_be_set_aside_reads_as_absent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rename that fails (read-only file system) leaves the corrupt file in place, logged;
    the read returns nothing instead of raising, so start-up and cycles go on."""
    path = history_path(tmp_path, "g1")
    path.write_bytes(b"{not json")

    def read_only(src: object, dst: object) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(os, "replace", read_only)
    with capture_logs() as logs:
        history = RestartHistory.load(tmp_path, "g1", now=86400.0)
    assert history.records == []
    assert history.warning is not None
    assert "stays in place" in history.warning
    assert [(e["event"], e["set_aside_as"]) for e in logs] == [("state_file_corrupt", None)]
    assert path.read_bytes() == b"{not json"


def test_history_keeps_only_the_newest_records(tmp_path: Path) -> None:
    """The file is bounded: the oldest records are dropped beyond `keep`."""
    history = RestartHistory.load(tmp_path, "g1", now=0.0)
    history.keep = 3
    for t in range(5):
        history.record(outcome(float(t)))
    assert [r.started_at for r in RestartHistory.load(tmp_path, "g1", now=9).records] == [
        2.0,
        3.0,
        4.0,
    ]


def test_budget_seeds_from_history(tmp_path: Path) -> None:
    """restart_times and consecutive_failures skip dry runs and honour windows and re-arms."""
    history = RestartHistory.load(tmp_path, "g1", now=0.0)
    for record in [
        outcome(100.0),
        outcome(200.0, ok=False),
        outcome(250.0, dry_run=True, ok=True),
        outcome(300.0, ok=False),
        outcome(350.0, ok=False, interrupted=True),
        outcome(400.0, ok=False),
    ]:
        history.record(record)
    loaded = RestartHistory.load(tmp_path, "g1", now=500.0)
    assert loaded.restart_times(1000.0, now=500.0) == (100.0, 200.0, 300.0, 350.0, 400.0)
    assert loaded.restart_times(250.0, now=500.0) == (300.0, 350.0, 400.0)
    assert loaded.restart_times(1000.0, now=500.0, since=320.0) == (350.0, 400.0)
    assert loaded.consecutive_failures() == 3
    assert loaded.consecutive_failures(since=250.0) == 2
    assert loaded.consecutive_failures(since=450.0) == 0
    assert loaded.last_restart_at() == 400.0


# --- operator controls and refusals ---------------------------------------------------------------


def test_pause_resume_and_rearm(tmp_path: Path) -> None:
    """pause sets a lease with a reason, resume clears it, reset records the re-arm time."""
    assert read_operator_controls(tmp_path, "g1", now=0.0).paused_until is None
    write_pause(tmp_path, "g1", until=1800.0, reason="driver upgrade", now=0.0)
    controls = read_operator_controls(tmp_path, "g1", now=1.0)
    assert (controls.paused_until, controls.pause_reason) == (1800.0, "driver upgrade")
    write_rearm(tmp_path, "g1", now=5.0)
    controls = read_operator_controls(tmp_path, "g1", now=6.0)
    assert (controls.paused_until, controls.rearmed_at) == (1800.0, 5.0)
    assert clear_pause(tmp_path, "g1", now=10.0) is True
    assert clear_pause(tmp_path, "g1", now=11.0) is False
    controls = read_operator_controls(tmp_path, "g1", now=12.0)
    assert (controls.paused_until, controls.pause_reason, controls.rearmed_at) == (None, "", 5.0)


def test_corrupt_operator_file_reads_as_no_controls(tmp_path: Path) -> None:
    """A garbled operator file is set aside and means 'no lease, no re-arm'."""
    operator_path(tmp_path, "g1").write_text('{"version": 1, "paused_until": "soon"}')
    controls = read_operator_controls(tmp_path, "g1", now=0.0)
    assert controls.paused_until is None
    assert [p.name for p in tmp_path.iterdir()] == ["g1.operator.json.corrupt-1970-01-01T00:00:00Z"]


def test_refusals_are_counted_per_reason(tmp_path: Path) -> None:
    """CLI refusals accumulate per reason so the daemon can export them."""
    record_refusal(tmp_path, "g1", "decode_without_prefill", now=1.0)
    record_refusal(tmp_path, "g1", "decode_without_prefill", now=2.0)
    record_refusal(tmp_path, "g1", "partial_restart", now=3.0)
    assert read_refusal_counts(tmp_path, "g1", now=4.0) == {
        "decode_without_prefill": 2,
        "partial_restart": 1,
    }
    assert read_refusal_counts(tmp_path, "g2", now=4.0) == {}


@pytest.mark.parametrize("since", ["NaN", "Infinity", "1e300"])
def test_a_lock_holder_since_no_time_is_not_named(tmp_path: Path, since: str) -> None:
    """A lock file naming its holder `since` NaN reads as no holder: the contender's message
    (which prints the time) cannot crash on it."""
    path = lock_path(tmp_path, "g1")
    path.write_text(f'{{"pid": 1, "since": {since}, "purpose": "manual restart"}}\n')
    assert read_lock_holder(path) is None
