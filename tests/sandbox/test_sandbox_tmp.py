"""A checkout under /tmp: its paths are bound back over the sandbox's private /tmp, nothing else is."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandbox.namespace import (
    PARK_DIR,
    SandboxError,
    SystemdSandbox,
    UnitSpec,
    mount_script,
    tmp_binds,
)

# Mount plumbing only: no router runs, so the smg pass of `make test` skips this module.
pytestmark = pytest.mark.router_agnostic


@pytest.fixture
def host_tmp_dir() -> Iterator[Path]:
    """A directory in the host's /tmp (pytest's tmp_path may live elsewhere)."""
    path = Path(tempfile.mkdtemp(prefix="watchdog-sandbox-checkout-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_only_paths_under_tmp_are_bound_outermost_first(host_tmp_dir: Path) -> None:
    """Only checkout paths under /tmp are bound back, outermost first, so no bind hides another."""
    inner = host_tmp_dir / "checkout" / ".venv"
    inner.mkdir(parents=True)
    other = Path(tempfile.mkdtemp(prefix="watchdog-sandbox-other-", dir="/tmp"))
    try:
        binds = tmp_binds([inner, host_tmp_dir / "checkout", Path("/usr"), other, Path("/")])
        assert binds == sorted([host_tmp_dir / "checkout", other])
    finally:
        other.rmdir()


def test_symlinks_are_resolved(host_tmp_dir: Path) -> None:
    """A symlinked checkout is bound at its real path, which the sandbox's /tmp must show."""
    (host_tmp_dir / "real").mkdir()
    (host_tmp_dir / "link").symlink_to(host_tmp_dir / "real")
    assert tmp_binds([host_tmp_dir / "link"]) == [host_tmp_dir / "real"]


def test_the_host_tmp_itself_is_refused() -> None:
    """Binding the host's /tmp itself, however spelled, is refused: it undoes the private /tmp."""
    with pytest.raises(SandboxError, match="/tmp itself"):
        tmp_binds([Path("/tmp")])
    with pytest.raises(SandboxError, match="/tmp itself"):
        tmp_binds([Path("/tmp/x/..")])


def test_a_missing_directory_is_refused_before_a_root_is_made(host_tmp_dir: Path) -> None:
    """A missing directory to bind is refused before the sandbox root is made."""
    base = host_tmp_dir / "base"
    with pytest.raises(SandboxError, match="must exist"):
        SystemdSandbox(base_dir=base, host_paths=[host_tmp_dir / "missing"])
    assert not base.exists()


def test_the_script_parks_mounts_the_private_tmp_then_binds_back() -> None:
    """The mount script parks each checkout, mounts the private /tmp, then binds them back."""
    checkout = Path("/tmp/it's a checkout")
    script = mount_script(Path("/var/tmp/root"), Path("/var/tmp/root/console.log"), [checkout], "S")
    steps = script.split("; ")
    quoted = "'/tmp/it'\"'\"'s a checkout'"
    park = f"{PARK_DIR}/0"
    assert steps == [
        "set -e",
        "mount --bind /var/tmp/root/run /run",
        "mount --bind /var/tmp/root/console.log /dev/console",
        # The host's persistent journal, where it exists, is covered (never written or read).
        "[ ! -d /var/log/journal ] || mount -t tmpfs -o mode=0755 sandbox-journal /var/log/journal",
        f"mkdir -p {park}",
        f"mount --bind {quoted} {park}",
        "mount -t tmpfs -o mode=1777 sandbox-tmp /tmp",
        f"mkdir -p {quoted}",
        f"mount --bind {park} {quoted}",
        f"umount {park}",
        f"rmdir {park}",
        f"rmdir {PARK_DIR}",
        "export container=watchdog-sandbox",
        "exec S",
    ]


def test_without_binds_the_script_is_the_plain_recipe() -> None:
    """With nothing under /tmp to bind, the script is the plain recipe with no parking step."""
    script = mount_script(Path("/r"), Path("/r/console.log"), [], "S")
    assert "sandbox-tmp /tmp" in script
    assert PARK_DIR not in script


def _wait_for(path: Path, sandbox: SystemdSandbox, timeout_seconds: float = 20.0) -> str:
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().endswith("\n"):
            return path.read_text()
        time.sleep(0.1)
    raise AssertionError(
        f"{path} was not written; unit log:\n{sandbox.unit_log('tmp-checkout.service')}\n"
        f"console:\n{sandbox.console_log()[-2000:]}"
    )


def test_a_unit_runs_from_a_checkout_under_tmp(
    host_tmp_sentinel: Path, host_tmp_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ExecStart, its output and the sandbox root all under the host's /tmp; the rest stays hidden."""
    checkout = host_tmp_dir / "checkout"
    checkout.mkdir()
    marker = checkout / "seen.txt"
    script = checkout / "run.sh"
    script.write_text(
        "#!/bin/sh\n"
        f'if [ -e "{host_tmp_sentinel}" ]; then s=visible; else s=hidden; fi\n'
        f'if [ -e "{host_tmp_dir}/not-shared" ]; then o=visible; else o=hidden; fi\n'
        f'echo "sentinel=$s other=$o" > "{marker}"\n'
        "exec /bin/sleep infinity\n"
    )
    script.chmod(0o755)
    (host_tmp_dir / "not-shared").touch()
    # The sandbox root under /tmp too (WATCHDOG_SANDBOX_DIR): its logs must reach the host.
    monkeypatch.setenv("WATCHDOG_SANDBOX_DIR", str(host_tmp_dir / "sandboxes"))
    unit = UnitSpec("tmp-checkout.service", [str(script)], working_directory=str(checkout))
    sandbox = SystemdSandbox([unit], host_paths=[checkout])
    assert host_tmp_dir in sandbox.root.parents
    with sandbox:
        assert _wait_for(marker, sandbox) == "sentinel=hidden other=hidden\n"
        assert sandbox.unit_property(unit.name, "ActiveState") == "active"
        assert sandbox.host_pid(unit.name) is not None
        assert (sandbox.logs_dir / f"{unit.name}.log").exists()
    assert host_tmp_sentinel.exists()
    assert (host_tmp_dir / "not-shared").exists()
    assert script.exists()
    assert not sandbox.root.exists()
