"""A private systemd as PID 1 of its own PID + mount namespace, with its own system bus, for tests.

Recipe and hazards: docs/architecture.md ("A real systemd for tests"). Two rules are enforced here
and nowhere optional: the namespace gets a private tmpfs on /tmp, and every unit carries
DefaultDependencies=no. Without them the sandboxed systemd pulled in sysinit.target, ran
`systemd-tmpfiles --remove`, and emptied the *host's* /tmp.

The units see the host's file system except /tmp. Host directories under /tmp that the units need
(a checkout cloned into /tmp, its .venv, an output folder; the sandbox root itself when
WATCHDOG_SANDBOX_DIR points there) are named in `host_paths`: each is bind-mounted back at its own
path on top of the private /tmp, so ExecStart= paths stay valid and nothing else of the host's /tmp
is reachable. Paths outside /tmp need nothing.

Layout of the sandbox root (by default under /var/tmp; the same paths inside and outside the
namespace):

    <root>/run/            bind-mounted on the namespace's /run; units in run/systemd/system/,
                           the bus socket at run/dbus/system_bus_socket, the journal (volatile)
                           in run/log/journal/
    <root>/logs/<unit>.log stdout+stderr of each unit that logs to a file (output="file")
    <root>/console.log     systemd's own log (bind-mounted over the namespace's /dev/console)
    <root>/share/          free for tests: state dirs, fault files, configs

Use it as a context manager (`with SystemdSandbox(units) as sandbox:`) or call start()/stop();
from async code use `await sandbox.astart()` / `await sandbox.astop()`. The root exists from
construction on (place files in share_dir before start()); stop() removes it unless
WATCHDOG_SANDBOX_KEEP is set (for debugging a failure).

The sandbox runs its own systemd-journald (socket + service, DefaultDependencies=no, like the
bus): Storage=volatile, so the journal lives only under the sandbox's /run, and the host's
/var/log/journal, if any, is covered by an empty tmpfs inside the namespace (never written,
never read). Units with output="journal" log there: `journalctl -u UNIT` run inside the
namespace finds them, and from outside `journalctl --directory=<sandbox.journal_dir>`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Literal, Self

SYSTEMD = Path("/lib/systemd/systemd")
DBUS_DAEMON = Path("/usr/bin/dbus-daemon")
JOURNALD = Path("/lib/systemd/systemd-journald")
HOST_JOURNAL = Path("/var/log/journal")  # covered inside the namespace, see mount_script
BASE_DIR_ENV = "WATCHDOG_SANDBOX_DIR"
DEFAULT_BASE_DIR = Path("/var/tmp")  # not /tmp: the namespace gets its own empty /tmp
TARGET = "sandbox.target"
HOST_TMP = Path("/tmp")
# A private network namespace (`private_network=True`) has only a loopback device, down: bring it
# up. Servers there pick ports that another of their processes binds later (SGLang's
# get_free_port_below_ephemeral, srt/utils/network.py:205 @ 0.5.23, reads this very sysctl;
# mooncake's transfer engine picks its RPC and data ports likewise): a high ephemeral range keeps
# outgoing connections off them (the namespace's own sysctl; the host's is untouched).
NETWORK_SETUP = "ip link set lo up; sysctl -qw net.ipv4.ip_local_port_range='43000 60999'"
# Where host paths under /tmp are parked while the private /tmp is mounted: inside the namespace's
# /run (the sandbox root's run/, reachable whatever the root's own path), emptied before systemd.
PARK_DIR = "/run/.sandbox-park"

_SAFE_ARG = re.compile(r"^[A-Za-z0-9_@+=:,./-]+$")


def skip_reason() -> str | None:
    """Why a sandbox cannot run here (for pytest.skip), or None when it can."""
    if os.geteuid() != 0:
        return (
            "the systemd sandbox needs root (unshare of PID and mount namespaces); CI runs as root"
        )
    # Each missing tool names its Debian package: tests/skipped_tools.py gathers them for make test.
    for tool, package in (
        ("unshare", "util-linux"),
        ("busctl", "systemd"),
        ("setsid", "util-linux"),
    ):
        if shutil.which(tool) is None:
            return (
                f"the systemd sandbox needs `{tool}`, not found on PATH (Debian package: {package})"
            )
    if not os.access(SYSTEMD, os.X_OK):
        return (
            f"the systemd sandbox needs the distro's systemd at {SYSTEMD} (Debian package: systemd)"
        )
    if not os.access(DBUS_DAEMON, os.X_OK):
        return f"the systemd sandbox needs dbus-daemon at {DBUS_DAEMON} (Debian package: dbus)"
    if not os.access(JOURNALD, os.X_OK):
        return f"the systemd sandbox needs systemd-journald at {JOURNALD} (Debian package: systemd)"
    return None


def quote_arg(arg: str) -> str:
    """One ExecStart= argument, quoted for systemd (also escaping its `%` and `$` expansion)."""
    arg = arg.replace("%", "%%").replace("$", "$$")
    if _SAFE_ARG.match(arg):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _command(argv: Sequence[str]) -> str:
    return " ".join(quote_arg(a) for a in argv)


def tmp_binds(paths: Sequence[Path]) -> list[Path]:
    """The host directories under /tmp, of `paths`, to bind back over the private /tmp.

    Resolved (symlinks followed: a unit's path resolves the same way inside); paths outside /tmp
    are dropped (the namespace sees them as they are), and so are paths inside another one (a
    bind mount carries its whole tree). /tmp itself is refused: binding it back would hand the
    sandboxed systemd the host's /tmp, which the private /tmp exists to prevent.
    """
    resolved: set[Path] = set()
    for path in paths:
        real = Path(path).resolve()
        if real == HOST_TMP:
            raise SandboxError(f"{path}: the host's /tmp itself cannot be shared with the sandbox")
        if HOST_TMP not in real.parents:
            continue
        if not real.is_dir():
            raise SandboxError(f"{path}: a directory to share with the sandbox must exist")
        resolved.add(real)
    return sorted(p for p in resolved if not any(a in resolved for a in p.parents))


def mount_script(root: Path, console: Path, binds: Sequence[Path], systemd_argv: str) -> str:
    """The namespace's start script: /run and the console, the private /tmp, then systemd.

    Order matters: /run is bound and /dev/console redirected before /tmp is replaced (their
    sources may lie under /tmp), and the private /tmp is mounted before systemd runs (never a
    systemd with the host's /tmp). Each of `binds` is parked under PARK_DIR, the tmpfs goes on
    /tmp, then the parked mount is bound back at its own path and the park is undone. The host's
    persistent journal directory, where it exists, gets an empty tmpfs on top: the sandbox's
    journald (volatile anyway) can never write it and a journalctl inside never reads it.
    """
    q = shlex.quote
    journal = q(str(HOST_JOURNAL))
    lines = [
        "set -e",
        f"mount --bind {q(str(root / 'run'))} /run",
        f"mount --bind {q(str(console))} /dev/console",
        f"[ ! -d {journal} ] || mount -t tmpfs -o mode=0755 sandbox-journal {journal}",
    ]
    parked = [f"{PARK_DIR}/{i}" for i in range(len(binds))]
    for path, park in zip(binds, parked, strict=True):
        lines += [f"mkdir -p {park}", f"mount --bind {q(str(path))} {park}"]
    lines.append("mount -t tmpfs -o mode=1777 sandbox-tmp /tmp")
    for path, park in zip(binds, parked, strict=True):
        lines += [
            f"mkdir -p {q(str(path))}",
            f"mount --bind {park} {q(str(path))}",
            f"umount {park}",
            f"rmdir {park}",
        ]
    if binds:
        lines.append(f"rmdir {PARK_DIR}")
    lines += ["export container=watchdog-sandbox", f"exec {systemd_argv}"]
    return "; ".join(lines)


@dataclass(frozen=True)
class UnitSpec:
    """A service unit for the sandbox. DefaultDependencies=no is always written (see module doc)."""

    name: str  # "sglang-test-prefill.service"
    exec_start: Sequence[str]
    description: str = ""
    service_type: str = "simple"
    environment: Mapping[str, str] = field(default_factory=dict)
    working_directory: str | None = None
    restart: str = "no"
    exec_start_pre: Sequence[Sequence[str]] = ()
    timeout_stop_seconds: float = 5.0
    extra_unit: Sequence[str] = ()  # raw lines for [Unit]
    extra_service: Sequence[str] = ()  # raw lines for [Service]
    wanted: bool = True  # started with sandbox.target
    # "file": stdout+stderr appended to <logs_dir>/<name>.log; "journal": the sandbox's journald
    # (what incident evidence reads with journalctl).
    output: Literal["file", "journal"] = "file"

    def render(self, logs_dir: Path) -> str:
        """The unit file text."""
        lines = [
            "[Unit]",
            f"Description={self.description or self.name}",
            "DefaultDependencies=no",
            # Tests restart units many times a minute; systemd's start rate limit would fail them.
            "StartLimitIntervalSec=0",
            *self.extra_unit,
            "",
            "[Service]",
            f"Type={self.service_type}",
        ]
        lines += [f"ExecStartPre={_command(cmd)}" for cmd in self.exec_start_pre]
        lines.append(f"ExecStart={_command(self.exec_start)}")
        for key, value in self.environment.items():
            lines.append(f"Environment={quote_arg(f'{key}={value}')}")
        if self.working_directory:
            lines.append(f"WorkingDirectory={self.working_directory}")
        log = logs_dir / f"{self.name}.log"
        # systemd orders a unit logging to the journal after systemd-journald.socket by itself.
        target = "journal" if self.output == "journal" else f"append:{log}"
        lines += [
            f"Restart={self.restart}",
            f"TimeoutStopSec={self.timeout_stop_seconds:g}",
            f"StandardOutput={target}",
            f"StandardError={target}",
            *self.extra_service,
        ]
        return "\n".join(lines) + "\n"


_DBUS_SOCKET = """[Unit]
Description=sandbox system bus socket
DefaultDependencies=no

[Socket]
ListenStream=/run/dbus/system_bus_socket
"""

# The names must be dbus.socket/dbus.service: systemd attaches to the system bus only when those
# units are active. Restart=always so a test that kills the bus gets it back.
_DBUS_SERVICE = f"""[Unit]
Description=sandbox system bus
DefaultDependencies=no
Requires=dbus.socket

[Service]
ExecStart={DBUS_DAEMON} --system --address=systemd: --nofork --nopidfile --systemd-activation
Restart=always
RestartSec=100ms
"""


# systemd-journald under the names systemd knows (a unit with StandardOutput=journal is ordered
# after systemd-journald.socket), trimmed to what the sandbox needs: no /dev/log, no audit socket,
# none of the distro unit's sandboxing, which a nested namespace may not support.
_JOURNALD_SOCKET = """[Unit]
Description=sandbox journal socket
DefaultDependencies=no

[Socket]
ListenDatagram=/run/systemd/journal/socket
ListenStream=/run/systemd/journal/stdout
PassCredentials=yes
PassSecurity=yes
ReceiveBuffer=8M
Service=systemd-journald.service
SocketMode=0666
Timestamping=us
"""

_JOURNALD_SERVICE = f"""[Unit]
Description=sandbox journal
DefaultDependencies=no
Requires=systemd-journald.socket
After=systemd-journald.socket

[Service]
Type=notify
ExecStart={JOURNALD}
Sockets=systemd-journald.socket
StandardOutput=null
RuntimeDirectory=systemd/journal
RuntimeDirectoryPreserve=yes
FileDescriptorStoreMax=4224
Restart=always
RestartSec=100ms
"""

# Read by journald from the namespace's /run (the sandbox's own); sorted last among drop-ins, so
# it wins over any host /etc/systemd/journald.conf.d. Volatile: nothing under /var/log/journal.
# No rate limit (a test's burst of log lines must all arrive); nothing forwarded to the host's
# kmsg, console, wall or syslog, and the host's kernel ring buffer is not read.
JOURNALD_CONF_NAME = "zz-watchdog-sandbox.conf"
_JOURNALD_CONF = """[Journal]
Storage=volatile
RateLimitIntervalSec=0
RateLimitBurst=0
ReadKMsg=no
ForwardToSyslog=no
ForwardToKMsg=no
ForwardToConsole=no
ForwardToWall=no
RuntimeMaxUse=64M
"""

_MASKED = (
    "systemd-tmpfiles-setup.service",
    "systemd-tmpfiles-setup-dev.service",
    "systemd-tmpfiles-setup-dev-early.service",
    "systemd-tmpfiles-clean.service",
    "systemd-tmpfiles-clean.timer",
    # Would move the journal from /run to /var/log/journal (the host's, were it not covered).
    "systemd-journal-flush.service",
)


class SandboxError(RuntimeError):
    """The sandbox could not start or be driven; the message has systemd's log tail."""


class SystemdSandbox:
    """A systemd (PID 1 of a private namespace) with the given units, driven over its own bus."""

    def __init__(
        self,
        units: Sequence[UnitSpec] = (),
        *,
        base_dir: Path | None = None,
        start_timeout_seconds: float = 30.0,
        host_paths: Sequence[Path] = (),
        private_network: bool = False,
    ) -> None:
        # Checked before anything is created, so a bad path leaves nothing behind.
        self._binds = tmp_binds(host_paths)
        base = base_dir or Path(os.environ.get(BASE_DIR_ENV) or DEFAULT_BASE_DIR)
        base.mkdir(parents=True, exist_ok=True)
        self._units: dict[str, UnitSpec] = {u.name: u for u in units}
        self._start_timeout = start_timeout_seconds
        # Created now, so tests can place files (fault files, configs) before the boot.
        self.root = Path(tempfile.mkdtemp(prefix="watchdog-sandbox-", dir=base))
        for sub in ("run/dbus", "run/systemd/system", "logs", "share"):
            self.root.joinpath(*sub.split("/")).mkdir(parents=True, exist_ok=True)
        self._proc: subprocess.Popen[bytes] | None = None
        self._init_pid: int | None = None  # host PID of the namespace's PID 1 (systemd)
        self._stopped = False
        self._private_network = private_network

    # --- paths ------------------------------------------------------------------------------------

    def _path(self, *parts: str) -> Path:
        return self.root.joinpath(*parts)

    @property
    def units_dir(self) -> Path:
        """Where unit files live (the namespace's /run/systemd/system)."""
        return self._path("run", "systemd", "system")

    @property
    def logs_dir(self) -> Path:
        """Per-unit stdout/stderr files."""
        return self._path("logs")

    @property
    def journal_dir(self) -> Path:
        """The sandbox's journal, for `journalctl --directory` from outside the namespace."""
        return self._path("run", "log", "journal")

    @property
    def share_dir(self) -> Path:
        """A directory with the same path inside and outside the namespace, free for tests."""
        return self._path("share")

    @property
    def netns_path(self) -> Path:
        """The network namespace of the units: the sandbox's own with `private_network`, else
        the host's (enter it with `nsenter --net=PATH` or sandbox.netns.in_netns)."""
        return Path(f"/proc/{self.init_pid}/ns/net")

    @property
    def bus_address(self) -> str:
        """The sandbox's system bus, for DBUS_SYSTEM_BUS_ADDRESS or SystemdClient(address)."""
        return f"unix:path={self._path('run', 'dbus', 'system_bus_socket')}"

    @property
    def init_pid(self) -> int:
        """Host PID of the sandbox's systemd."""
        if self._init_pid is None:
            raise SandboxError("the sandbox is not running")
        return self._init_pid

    def unit_log(self, name: str) -> str:
        """What a unit wrote to stdout/stderr so far ("" if nothing), from its file or journal."""
        spec = self._units.get(name)
        if spec is not None and spec.output == "journal":
            return self.journal_text(name)
        try:
            return (self.logs_dir / f"{name}.log").read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def journal_text(self, unit: str) -> str:
        """A unit's journal messages so far, one a line ("" if none or unreadable)."""
        cmd = ["journalctl", f"--directory={self.journal_dir}", "-u", unit, "-o", "cat"]
        try:
            result = subprocess.run(
                [*cmd, "--no-pager"], capture_output=True, text=True, timeout=10, check=False
            )
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return result.stdout if result.returncode == 0 else ""

    def console_log(self) -> str:
        """systemd's own log so far."""
        try:
            return self._path("console.log").read_text(errors="replace")
        except FileNotFoundError:
            return ""

    # --- lifecycle --------------------------------------------------------------------------------

    def _write_units(self) -> None:
        units_dir = self.units_dir
        units_dir.mkdir(parents=True, exist_ok=True)
        (units_dir / "dbus.socket").write_text(_DBUS_SOCKET)
        (units_dir / "dbus.service").write_text(_DBUS_SERVICE)
        (units_dir / "systemd-journald.socket").write_text(_JOURNALD_SOCKET)
        (units_dir / "systemd-journald.service").write_text(_JOURNALD_SERVICE)
        conf_dir = self._path("run", "systemd", "journald.conf.d")
        conf_dir.mkdir(parents=True, exist_ok=True)
        (conf_dir / JOURNALD_CONF_NAME).write_text(_JOURNALD_CONF)
        for spec in self._units.values():
            (units_dir / spec.name).write_text(spec.render(self.logs_dir))
        # Belt and braces: runtime-mask the tmpfiles units, so nothing can pull them in.
        for name in _MASKED:
            link = units_dir / name
            if not link.is_symlink():
                link.symlink_to("/dev/null")
        base = [
            "dbus.socket",
            "dbus.service",
            "systemd-journald.socket",
            "systemd-journald.service",
        ]
        wants = " ".join([*base, *self._wanted()])
        (units_dir / TARGET).write_text(
            f"[Unit]\nDescription=sandbox\nDefaultDependencies=no\nWants={wants}\n"
        )

    def _wanted(self) -> list[str]:
        return [u.name for u in self._units.values() if u.wanted]

    def start(self) -> None:
        """Boot systemd in a new namespace and wait until it reports running (or degraded)."""
        if self._proc is not None or self._stopped:
            raise SandboxError("a sandbox starts once; make a new SystemdSandbox")
        self._write_units()
        console = self._path("console.log")
        console.touch()
        # The root holds the unit logs and the share dir: under /tmp it is bound back like the rest.
        binds = tmp_binds([*self._binds, self.root])
        script = mount_script(
            self.root,
            console,
            binds,
            f"{SYSTEMD} --system --unit={TARGET} --log-target=console --show-status=no",
        )
        namespaces = ["--pid", "--fork", "--mount", "--uts", "--cgroup", "--mount-proc"]
        if self._private_network:
            namespaces.append("--net")
            script = f"{NETWORK_SETUP}; {script}"
        with console.open("ab") as out:
            self._proc = subprocess.Popen(
                ["unshare", *namespaces, "--propagation=private", "bash", "-c", script],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            self._wait_for_running()
        except BaseException:
            self.stop()
            raise

    def _wait_for_running(self) -> None:
        deadline = time.monotonic() + self._start_timeout
        socket = self._path("run", "dbus", "system_bus_socket")
        state = ""
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise SandboxError(
                    f"the sandbox exited with {self._proc.returncode} while starting:\n"
                    f"{self.console_log()[-3000:]}"
                )
            if self._init_pid is None:
                self._init_pid = _first_child(self._proc.pid)
            if self._init_pid is not None and socket.exists():
                state = self.manager_property("SystemState")
                if state in ("running", "degraded"):
                    return
            time.sleep(0.05)
        raise SandboxError(
            f"the sandbox did not reach running within {self._start_timeout:g} s "
            f"(SystemState={state or 'unknown'}):\n{self.console_log()[-3000:]}"
        )

    def stop(self, timeout_seconds: float = 20.0) -> None:
        """Manager.Exit(), then SIGKILL of the namespace's PID 1 if it lingers; remove the root."""
        proc, self._proc = self._proc, None
        try:
            if proc is not None and proc.poll() is None:
                self.busctl("call", SD_BUS, SD_PATH, SD_MANAGER, "Exit", check=False, timeout=5)
                try:
                    proc.wait(timeout=timeout_seconds)
                except subprocess.TimeoutExpired:
                    self._kill_namespace(proc)
        finally:
            self._init_pid = None
            self._stopped = True
            if not os.environ.get("WATCHDOG_SANDBOX_KEEP"):
                shutil.rmtree(self.root, ignore_errors=True)

    def _kill_namespace(self, proc: subprocess.Popen[bytes]) -> None:
        # SIGKILL to the namespace's PID 1 kills every process in it (systemd ignores SIGTERM).
        pid = self._init_pid or _first_child(proc.pid)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    async def astart(self) -> None:
        """start() without blocking the event loop."""
        await asyncio.to_thread(self.start)

    async def astop(self) -> None:
        """stop() without blocking the event loop."""
        await asyncio.to_thread(self.stop)

    # --- driving it -------------------------------------------------------------------------------

    def busctl(
        self, *args: str, check: bool = True, timeout: float = 10.0
    ) -> subprocess.CompletedProcess[str]:
        """Run `busctl --address=<sandbox bus> ARGS` (setup and teardown, not code under test)."""
        cmd = ["busctl", f"--address={self.bus_address}", *args]
        try:
            result = subprocess.run(
                cmd, capture_output=True, text=True, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired as exc:
            if check:
                raise SandboxError(f"{' '.join(cmd)} timed out after {timeout:g} s") from None
            return subprocess.CompletedProcess(cmd, 124, "", str(exc))
        if check and result.returncode != 0:
            raise SandboxError(f"{' '.join(cmd)} failed: {result.stderr.strip()}")
        return result

    def queue_unit_job(
        self, method: str, unit: str, *, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Manager.StartUnit/StopUnit/RestartUnit(unit, "replace"): returns once the job is
        queued, not when it is done."""
        return self.busctl(
            "call", SD_BUS, SD_PATH, SD_MANAGER, method, "ss", unit, "replace", check=check
        )

    def manager_property(self, name: str) -> str:
        """A Manager property as busctl prints it without the type ("" when unreadable)."""
        result = self.busctl("get-property", SD_BUS, SD_PATH, SD_MANAGER, name, check=False)
        if result.returncode != 0:
            return ""
        return _strip_type(result.stdout)

    def unit_property(self, unit: str, name: str, interface: str = "Unit") -> str:
        """A unit property (interface "Unit" or "Service") as text ("" when unreadable)."""
        path = self.busctl("call", SD_BUS, SD_PATH, SD_MANAGER, "LoadUnit", "s", unit)
        obj = _strip_type(path.stdout)
        result = self.busctl(
            "get-property", SD_BUS, obj, f"org.freedesktop.systemd1.{interface}", name, check=False
        )
        return _strip_type(result.stdout) if result.returncode == 0 else ""

    def add_unit(self, spec: UnitSpec, *, start: bool = False) -> None:
        """Add (or replace) a unit; on a running sandbox the unit is loaded by a daemon-reload."""
        self._units[spec.name] = spec
        if self._proc is None:
            return  # written with the others at start()
        (self.units_dir / spec.name).write_text(spec.render(self.logs_dir))
        self.daemon_reload()
        if start:
            self.queue_unit_job("StartUnit", spec.name)

    def daemon_reload(self) -> None:
        """Manager.Reload(): reread unit files."""
        self.busctl("call", SD_BUS, SD_PATH, SD_MANAGER, "Reload", timeout=30)

    def host_pid(self, unit: str) -> int | None:
        """Host PID of a unit's main process (MainPID is a namespace PID), or None."""
        main = self.unit_property(unit, "MainPID", "Service")
        if not main or main == "0":
            return None
        return namespace_to_host_pid(self.init_pid, int(main))

    def kill_unit(self, unit: str, sig: int = signal.SIGKILL) -> int:
        """Signal a unit's main process by its host PID; returns that PID."""
        pid = self.host_pid(unit)
        if pid is None:
            raise SandboxError(f"{unit} has no main process")
        os.kill(pid, sig)
        return pid

    def restart_dbus(self, timeout_seconds: float = 15.0) -> None:
        """Kill the sandbox's dbus-daemon (systemd restarts it); wait until systemd is back on it.

        Every client connection drops, as in a real `systemctl restart dbus`.
        """
        old = self.kill_unit("dbus.service", signal.SIGTERM)
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            pid = None
            if self.manager_property("SystemState"):
                pid = self.host_pid("dbus.service")
            if pid is not None and pid != old:
                return
            time.sleep(0.05)
        raise SandboxError(f"the sandbox's bus did not come back within {timeout_seconds:g} s")


SD_BUS = "org.freedesktop.systemd1"
SD_PATH = "/org/freedesktop/systemd1"
SD_MANAGER = "org.freedesktop.systemd1.Manager"


def _strip_type(text: str) -> str:
    # busctl prints `s "running"`, `u 42`, `o "/org/..."`.
    _, _, value = text.strip().partition(" ")
    return value.strip().strip('"')


def _first_child(pid: int) -> int | None:
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return None
    return int(children[0]) if children else None


def namespace_to_host_pid(init_host_pid: int, ns_pid: int) -> int | None:
    """The host PID of process `ns_pid` of the PID namespace whose PID 1 is `init_host_pid`."""
    try:
        ns = os.readlink(f"/proc/{init_host_pid}/ns/pid")
    except OSError:
        return None
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.readlink(entry / "ns" / "pid") != ns:
                continue
            for line in (entry / "status").read_text().splitlines():
                if line.startswith("NSpid:") and int(line.split()[-1]) == ns_pid:
                    return int(entry.name)
        except (OSError, ValueError):
            continue
    return None
