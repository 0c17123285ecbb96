"""state_dir hardening: planted symlinks are never followed; odd files are set aside, not fatal."""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
from structlog.testing import capture_logs

from tests.unit import configs
from tests.unit.test_statefiles import outcome
from watchdog.cli import main
from watchdog.errors import EXIT_OK, EXIT_STARTUP, StateFileError
from watchdog.evidence.incident import IncidentStore, UnknownIncident
from watchdog.evidence.records import Evidence
from watchdog.statefiles import (
    InstanceLock,
    RestartHistory,
    RestartLock,
    history_path,
    lock_path,
    operator_path,
    read_lock_holder,
    read_operator_controls,
    write_json_atomic,
)
from watchdog.statefs import UnsafeStateFile

PRECIOUS = "precious content that must survive\n"


@pytest.fixture(autouse=True)
def _restore_structlog() -> Iterator[None]:
    """cli.main() points structlog at this test's captured stderr; undo that afterwards."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file outside state_dir that a planted link points to; it must stay untouched."""
    path = tmp_path / "outside" / "victim"
    path.parent.mkdir()
    path.write_text(PRECIOUS)
    return path


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    """An empty state directory."""
    path = tmp_path / "state"
    path.mkdir()
    return path


def plant(link: Path, target: Path) -> None:
    """A symlink at `link` pointing to `target`."""
    link.symlink_to(target)


def untouched(victim: Path) -> bool:
    """The victim still has its content."""
    return victim.read_text() == PRECIOUS


def config_for(tmp_path: Path, state_dir: Path) -> Path:
    """A one-group config (group g1) using `state_dir`."""
    overrides = {"watchdog": {"state_dir": str(state_dir)}, "group": [configs.group("g1")]}
    return configs.write_config(tmp_path / "watchdog.toml", overrides)


# --- locks ----------------------------------------------------------------------------------------


def test_symlinked_restart_lock_is_refused_and_its_target_untouched(
    state_dir: Path, victim: Path
) -> None:
    """A restart lock that is a link is refused with a clear error, never opened or truncated."""
    plant(lock_path(state_dir, "g1"), victim)
    with capture_logs() as logs, pytest.raises(UnsafeStateFile, match="symbolic link"):
        RestartLock(state_dir, "g1", purpose="manual").acquire()
    assert untouched(victim)
    assert [e["event"] for e in logs] == ["state_file_refused"]
    assert read_lock_holder(lock_path(state_dir, "g1")) is None  # reading does not follow either


def test_cli_restart_as_root_never_truncates_a_symlinked_lock_target(
    tmp_path: Path, state_dir: Path, victim: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The reported case: `watchdog restart` refuses (exit 3) instead of truncating the target."""
    plant(lock_path(state_dir, "g1"), victim)
    config = config_for(tmp_path, state_dir)
    assert main(["restart", "--config", str(config), "--yes", "--dry-run"]) == EXIT_STARTUP
    assert "symbolic link" in capsys.readouterr().err
    assert untouched(victim)


def test_symlinked_instance_lock_is_refused(state_dir: Path, victim: Path) -> None:
    """The daemon's single-instance lock is never taken through a link either."""
    plant(state_dir / "daemon.lock", victim)
    with pytest.raises(UnsafeStateFile):
        InstanceLock(state_dir).acquire()
    assert untouched(victim)


# --- JSON state files -----------------------------------------------------------------------------


def test_symlinked_history_is_set_aside_not_followed(state_dir: Path, victim: Path) -> None:
    """A history file that is a link is set aside (the link renamed) and a real file written."""
    victim.write_text(json.dumps({"version": 1, "group": "g1", "restarts": []}))
    before = victim.read_text()
    plant(history_path(state_dir, "g1"), victim)
    with capture_logs() as logs:
        history = RestartHistory.load(state_dir, "g1", now=0.0)
    assert history.records == []
    assert history.warning is not None
    assert "symbolic link" in history.warning
    assert [e["event"] for e in logs] == ["state_file_corrupt"]
    history.record(outcome(10.0))
    assert victim.read_text() == before
    assert not history_path(state_dir, "g1").is_symlink()
    assert len(RestartHistory.load(state_dir, "g1", now=20.0).records) == 1
    aside = [p for p in state_dir.iterdir() if ".corrupt-" in p.name]
    assert len(aside) == 1
    assert aside[0].is_symlink()


def test_cli_pause_over_a_symlinked_lease_leaves_the_target_alone(
    tmp_path: Path, state_dir: Path, victim: Path
) -> None:
    """`watchdog pause` with the lease file planted as a link: the target is neither read nor
    written; the lease ends up in a regular file."""
    plant(operator_path(state_dir, "g1"), victim)
    config = config_for(tmp_path, state_dir)
    assert main(["pause", "--config", str(config), "--for", "10m"]) == EXIT_OK
    assert untouched(victim)
    assert not operator_path(state_dir, "g1").is_symlink()
    controls = read_operator_controls(state_dir, "g1")
    assert controls.paused_until is not None
    assert controls.paused_until > time.time()


def test_planted_temp_file_name_is_never_written_through(
    state_dir: Path, victim: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Temp names are unpredictable; even a link planted under the exact name is refused
    (O_EXCL | O_NOFOLLOW), and the target stays intact."""
    monkeypatch.setattr(secrets, "token_hex", lambda n: "feedface")
    target = state_dir / "g1.operator.json"
    plant(state_dir / f".{target.name}.tmp-{os.getpid()}-feedface", victim)
    with pytest.raises(StateFileError, match="cannot write state file"):
        write_json_atomic(target, {"version": 1})
    assert untouched(victim)
    assert not target.exists()


@pytest.mark.parametrize(
    "content",
    [
        b"[" * 200_000 + b"]" * 200_000,  # RecursionError inside json
        b'{"version": 1, "restarts": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    ],
    ids=["nested-array", "nested-inside-object"],
)
def test_deeply_nested_json_is_set_aside_like_any_corrupt_file(
    state_dir: Path, content: bytes
) -> None:
    """Deeply nested JSON in a state file is corrupt (set aside), not a crash."""
    history_path(state_dir, "g1").write_bytes(content)
    operator_path(state_dir, "g1").write_bytes(content)
    lock_path(state_dir, "g1").write_bytes(content)
    history = RestartHistory.load(state_dir, "g1", now=0.0)
    assert history.records == []
    assert history.warning is not None
    assert read_operator_controls(state_dir, "g1").paused_until is None
    assert read_lock_holder(lock_path(state_dir, "g1")) is None
    assert len([p for p in state_dir.iterdir() if ".corrupt-" in p.name]) == 2


def test_a_fifo_planted_as_a_state_file_is_set_aside_without_blocking(state_dir: Path) -> None:
    """Opening a FIFO for reading would block forever; it is refused and set aside instead."""
    os.mkfifo(operator_path(state_dir, "g1"))
    assert read_operator_controls(state_dir, "g1").paused_until is None
    assert not operator_path(state_dir, "g1").exists()


def test_oversized_state_file_is_set_aside_unread(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A state file far larger than any real one is not read into memory."""
    monkeypatch.setattr("watchdog.statefiles.MAX_STATE_FILE_BYTES", 1000)
    history_path(state_dir, "g1").write_bytes(b" " * 2000)
    history = RestartHistory.load(state_dir, "g1", now=0.0)
    assert history.warning is not None
    assert "larger than 1000 bytes" in history.warning


# --- audit log and incidents ----------------------------------------------------------------------


def evidence() -> Evidence:
    """Empty evidence (no units, no items)."""
    return Evidence(group="g1", started_at=1.0, finished_at=2.0, total_timeout_seconds=5.0)


def test_symlinked_audit_log_is_refused_and_logged(state_dir: Path, victim: Path) -> None:
    """audit.jsonl planted as a link: nothing is appended to the target; audit_write_failed."""
    plant(state_dir / "audit.jsonl", victim)
    store = IncidentStore(state_dir, keep=5, max_mib=10)
    with capture_logs() as logs:
        store.audit("decision", group="g1")
    assert untouched(victim)
    failed = [e for e in logs if e["event"] == "audit_write_failed"]
    assert len(failed) == 1
    assert "symbolic link" in failed[0]["error"]


def test_retention_never_follows_a_symlinked_incident(state_dir: Path, tmp_path: Path) -> None:
    """A link named like an incident is neither listed nor pruned through; a stale temp link
    is unlinked, its target left alone; real incidents are pruned as before."""
    outside = tmp_path / "outside-dir"
    outside.mkdir()
    (outside / "summary.json").write_text(json.dumps({"group": "secret"}))
    (outside / "keep.txt").write_text(PRECIOUS)
    store = IncidentStore(state_dir, keep=1, max_mib=10, clock=lambda: 10_000.0)
    root = state_dir / "incidents"
    root.mkdir()
    plant(root / "20000101T000000Z-g1-planted", outside)
    plant(root / ".tmp-20000101T000000Z-g1-old", outside)
    os.utime(root / ".tmp-20000101T000000Z-g1-old", (0, 0), follow_symlinks=False)
    with capture_logs() as logs:
        first = store.open_incident(group="g1", evidence=evidence(), now=1000.0)
        second = store.open_incident(group="g1", evidence=evidence(), now=2000.0)
    assert first.written
    assert second.written
    assert [row.id for row in store.list_incidents()] == [second.id]  # first pruned, link unlisted
    assert (outside / "keep.txt").read_text() == PRECIOUS
    assert (outside / "summary.json").exists()
    assert (root / "20000101T000000Z-g1-planted").is_symlink()  # left alone
    assert not os.path.lexists(root / ".tmp-20000101T000000Z-g1-old")  # the link, not its target
    assert any(e["event"] == "state_file_refused" for e in logs)
    with pytest.raises(UnknownIncident):
        store.read_report("20000101T000000Z-g1-planted")


def test_symlinked_incidents_root_is_never_written_through(state_dir: Path, tmp_path: Path) -> None:
    """incidents/ planted as a link: no incident is written into its target (logged)."""
    outside = tmp_path / "outside-dir"
    outside.mkdir()
    plant(state_dir / "incidents", outside)
    store = IncidentStore(state_dir, keep=5, max_mib=10)
    with capture_logs() as logs:
        incident = store.open_incident(group="g1", evidence=evidence(), now=1000.0)
    assert not incident.written
    assert list(outside.iterdir()) == []
    assert any(e["event"] == "incident_write_failed" for e in logs)
    assert store.list_incidents() == ()


def test_hard_linked_state_files_are_never_written_or_chowned(
    tmp_path: Path, state_dir: Path, victim: Path
) -> None:
    """A hard link to an outside file (as a symlink would) is refused: the lock is not taken
    through it, the lease is set aside and rewritten, and the outside file keeps content, owner
    and mode."""
    before = victim.stat()
    os.link(victim, lock_path(state_dir, "g1"))
    os.link(victim, operator_path(state_dir, "g1"))
    with pytest.raises(UnsafeStateFile, match="hard-linked"):
        RestartLock(state_dir, "g1", purpose="manual").acquire()
    config = config_for(tmp_path, state_dir)
    assert main(["pause", "--config", str(config), "--for", "10m"]) == EXIT_OK
    assert untouched(victim)
    after = victim.stat()
    assert (after.st_uid, after.st_gid, after.st_mode) == (
        before.st_uid,
        before.st_gid,
        before.st_mode,
    )
    assert os.stat(operator_path(state_dir, "g1")).st_nlink == 1
