"""state_dir hardening: a full disk never leaves the restart lock held; files stay the owner's."""

from __future__ import annotations

import errno
import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
from structlog.testing import capture_logs

from tests.unit import configs
from watchdog.act.restarters import DryRunRestarter, execute_locked
from watchdog.cli import main
from watchdog.errors import EXIT_OK, EXIT_STARTUP
from watchdog.model import RestartPlan, RestartStep, Role
from watchdog.statefiles import (
    RestartHistory,
    RestartLock,
    history_path,
    lock_path,
    operator_path,
    refusals_path,
)

REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534
IS_ROOT = os.geteuid() == 0


@pytest.fixture(autouse=True)
def _restore_structlog() -> Iterator[None]:
    """cli.main() points structlog at this test's captured stderr; undo that afterwards."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def plan() -> RestartPlan:
    """A one-step plan of group g1."""
    step = RestartStep(Role.ROUTER, "r.service", "http://127.0.0.1:1/readiness", 10.0)
    return RestartPlan(group="g1", trigger="probe_failures", steps=(step,))


def enospc(*args: object, **kwargs: object) -> None:
    """A write on a full disk."""
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


# --- a full disk (fake: any user) -----------------------------------------------------------------


async def test_full_disk_while_taking_the_lock_and_writing_history_never_leaves_it_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC on the holder record and on every history write: the sequence still runs, the
    errors are logged, and the lock is free again afterwards (in this process and others)."""
    monkeypatch.setattr("watchdog.statefiles.os.pwrite", enospc)
    monkeypatch.setattr("watchdog.statefs.write_all", enospc)
    with capture_logs() as logs:
        outcome = await execute_locked(
            plan(), DryRunRestarter(), state_dir=tmp_path, purpose="daemon"
        )
    assert outcome.ok
    events = [e["event"] for e in logs]
    assert "lock_holder_not_written" in events
    assert events.count("restart_history_not_written") == 2  # the start record and the result
    monkeypatch.undo()
    with RestartLock(tmp_path, "g1", purpose="manual") as again:  # not held by ourselves
        assert again.held
    assert not list(tmp_path.glob(".*.tmp-*"))
    # Space is back: the next sequence is recorded normally.
    await execute_locked(plan(), DryRunRestarter(), state_dir=tmp_path, purpose="daemon")
    assert [r.finished for r in RestartHistory.load(tmp_path, "g1", now=0.0).records] == [True]


def test_full_disk_under_a_file_size_limit_releases_the_lock(tmp_path: Path) -> None:
    """RLIMIT_FSIZE (EFBIG, any user) while taking the lock: a second process gets it."""
    script = textwrap.dedent(
        """
        import asyncio, resource, signal, sys
        from pathlib import Path
        from watchdog.act.restarters import DryRunRestarter, execute_locked
        from watchdog.model import RestartPlan, RestartStep, Role
        from watchdog.statefiles import RestartLock
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death
        state = Path(sys.argv[1])
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
        step = RestartStep(Role.ROUTER, "r.service", "http://127.0.0.1:1/readiness", 10.0)
        plan = RestartPlan(group="g1", trigger="t", steps=(step,))
        outcome = asyncio.run(
            execute_locked(plan, DryRunRestarter(), state_dir=state, purpose="daemon")
        )
        with RestartLock(state, "g1", purpose="again"):
            print("ok" if outcome.ok else "failed", flush=True)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "ok"  # structlog's default output goes to stdout
    assert "restart_history_not_written" in result.stdout
    assert not history_path(tmp_path, "g1").exists()


# --- a full disk (real: root, a 64 KiB tmpfs in a private mount namespace) ------------------------

TMPFS_SCRIPT = textwrap.dedent(
    """
    import asyncio, json, os, sys
    from pathlib import Path
    from watchdog.act.restarters import DryRunRestarter, execute_locked
    from watchdog.model import RestartPlan, RestartStep, Role
    from watchdog.statefiles import RestartHistory, RestartLock
    state = Path(sys.argv[1])
    step = RestartStep(Role.ROUTER, "r.service", "http://127.0.0.1:1/readiness", 10.0)
    plan = RestartPlan(group="g1", trigger="t", steps=(step,))
    filler = state / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"x" * 4096)
    except OSError as exc:
        full = exc.errno
    os.close(fd)
    result = {"full_errno": full}
    run = lambda: asyncio.run(
        execute_locked(plan, DryRunRestarter(), state_dir=state, purpose="daemon")
    )
    result["ok_while_full"] = run().ok
    lock = RestartLock(state, "g1", purpose="check")
    lock.acquire()
    result["lock_free_after_full"] = lock.held
    lock.release()
    result["records_while_full"] = len(RestartHistory.load(state, "g1", now=0).records)
    filler.unlink()
    result["ok_after"] = run().ok
    result["records_after"] = len(RestartHistory.load(state, "g1", now=0).records)
    print(json.dumps(result), flush=True)
    """
)


@pytest.mark.skipif(not IS_ROOT or shutil.which("unshare") is None, reason="needs root + unshare")
def test_real_full_tmpfs_never_leaves_the_lock_held(tmp_path: Path) -> None:
    """ENOSPC from a real full filesystem: the lock is free again, and recording resumes once
    there is space."""
    mount = tmp_path / "small"
    mount.mkdir()
    command = (
        f'mount -t tmpfs -o size=64k tmpfs {mount} && exec {sys.executable} -c "$SCRIPT" {mount}'
    )
    result = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", command],
        cwd=REPO,
        env={**os.environ, "SCRIPT": TMPFS_SCRIPT},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if result.returncode != 0 and "mount" in result.stderr and "permission" in result.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout.splitlines()[-1])  # after structlog's default output
    assert data == {
        "full_errno": errno.ENOSPC,
        "ok_while_full": True,
        "lock_free_after_full": True,
        "records_while_full": 0,
        "ok_after": True,
        "records_after": 1,
    }
    assert "lock_holder_not_written" in result.stdout
    assert "restart_history_not_written" in result.stdout


# --- ownership: the CLI as another user than the daemon -------------------------------------------


def test_cli_as_a_non_owner_is_refused_naming_the_user_to_run_as(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Neither root nor state_dir's owner: refused (exit 3) before writing, naming the owner."""
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    config = configs.write_config(
        tmp_path / "w.toml",
        {"watchdog": {"state_dir": str(state_dir)}, "group": [configs.group("g1")]},
    )
    owner = state_dir.stat().st_uid
    monkeypatch.setattr(os, "geteuid", lambda: owner + 4242)
    assert main(["pause", "--config", str(config), "--for", "10m"]) == EXIT_STARTUP
    assert main(["restart", "--config", str(config), "--yes", "--dry-run"]) == EXIT_STARTUP
    err = capsys.readouterr().err
    name = pwd.getpwuid(owner).pw_name
    assert f"Run as {name}: sudo -u {name} watchdog" in err
    assert list(state_dir.iterdir()) == []


@pytest.fixture
def service_state(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """(config, state_dir) with state_dir owned by uid/gid 65534, mode 0700 (as systemd makes
    it), under a directory that uid can traverse (pytest's own tmp dirs are root-only)."""
    base = Path(tempfile.mkdtemp(prefix="watchdog-owner-", dir="/tmp"))
    try:
        base.chmod(0o755)
        state_dir = base / "state"
        state_dir.mkdir(mode=0o700)
        os.chown(state_dir, NOBODY, NOBODY)
        config = configs.write_config(
            tmp_path / "w.toml",
            {"watchdog": {"state_dir": str(state_dir)}, "group": [configs.group("g1")]},
        )
        yield config, state_dir
    finally:
        shutil.rmtree(base, ignore_errors=True)


AS_SERVICE_USER = textwrap.dedent(
    """
    import fcntl, json, os, sys
    state = sys.argv[1]
    for name in sys.argv[2:]:
        path = os.path.join(state, name)
        with open(path, "rb") as f:
            f.read()
        fd = os.open(path, os.O_RDWR)  # what the daemon needs: read, write, flock the lock
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(fd)
        tmp = os.path.join(state, "." + name + ".tmp-x")
        with open(tmp, "w") as f:
            f.write("{}")
        os.replace(tmp, path)
    print("ok")
    """
)


@pytest.mark.skipif(not IS_ROOT, reason="needs root to act as two users")
def test_cli_as_root_leaves_every_file_to_the_service_user(
    service_state: tuple[Path, Path],
) -> None:
    """`sudo watchdog pause/reset/restart` on a state_dir owned by the service user: every file
    it creates or rewrites is owned by that user, who can then read, write and lock it."""
    config, state_dir = service_state
    operator_path(state_dir, "g1").write_text('{"version": 1}')  # as the daemon left it
    os.chown(operator_path(state_dir, "g1"), NOBODY, NOBODY)
    operator_path(state_dir, "g1").chmod(0o600)
    cfg = ["--config", str(config)]
    assert main(["pause", *cfg, "--for", "10m"]) == EXIT_OK
    assert main(["reset", *cfg]) == EXIT_OK
    assert main(["restart", *cfg, "--yes", "--dry-run"]) == EXIT_OK
    assert main(["restart", *cfg, "--yes", "--unit", "decode"]) == EXIT_STARTUP  # counted
    names = [
        p.name
        for p in (
            operator_path(state_dir, "g1"),
            history_path(state_dir, "g1"),
            lock_path(state_dir, "g1"),
            refusals_path(state_dir, "g1"),
        )
    ]
    for name in names:
        st = (state_dir / name).stat()
        assert (st.st_uid, st.st_gid) == (NOBODY, NOBODY), name
    # A rewrite keeps the mode the daemon gave the file.
    assert stat.S_IMODE(operator_path(state_dir, "g1").stat().st_mode) == 0o600
    assert sorted(p.name for p in state_dir.iterdir()) == sorted(names)  # no temp left
    python = shutil.which("python3", path="/usr/bin:/bin:/usr/local/bin")
    if python is None:
        pytest.skip("no system python3 that the service user can run")
    result = subprocess.run(
        [python, "-c", AS_SERVICE_USER, str(state_dir), *names],
        user=NOBODY,
        group=NOBODY,
        extra_groups=[],
        cwd="/",
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


@pytest.mark.skipif(not IS_ROOT, reason="needs root to act as two users")
def test_root_fixes_a_lock_file_an_older_version_left_root_owned(
    service_state: tuple[Path, Path],
) -> None:
    """A root-owned restart lock (left by an older CLI) is handed back when root next takes it."""
    _, state_dir = service_state
    lock_path(state_dir, "g1").write_text("")
    with RestartLock(state_dir, "g1", purpose="manual"):
        pass
    st = lock_path(state_dir, "g1").stat()
    assert (st.st_uid, st.st_gid) == (NOBODY, NOBODY)
