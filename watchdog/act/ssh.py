"""One SSH connection per remote host: its forwarded system bus, the remote uid, fixed commands.

The mechanism of `systemctl -H`: the remote system bus socket is forwarded to a local unix socket
(in a private 0700 directory) and the ordinary D-Bus client connects to it. The bus sees the SSH
user as the peer of the forwarded connection, so EXTERNAL authentication must claim the *remote*
user's uid, read once per connection with `id -u`.

Connections are made in the background: a reader that finds the host down gets HostUnreachable at
once (a monitoring outage for that host's roles, never a stall), while attempts go on with
exponential backoff. Only callers that may wait (a restart, `watchdog check`) wait for an attempt.
Authentication is by the configured key alone, against the pinned known_hosts file: no password,
no keyboard-interactive, no agent, no ~/.ssh/config.
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from watchdog.clock import Clock
from watchdog.config import SshTarget
from watchdog.errors import BusDisconnected
from watchdog.evidence.blocking import STDERR_MAX_BYTES, CommandResult

if TYPE_CHECKING:
    # Imported where used: asyncssh (and cryptography under it) costs ~25 MiB of RSS, which a
    # watchdog without remote hosts should not pay.
    import asyncssh

REMOTE_BUS_SOCKET = "/run/dbus/system_bus_socket"
_READ_CHUNK_BYTES = 65536
# `id -u` prints a few digits; anything longer is not a uid.
_UID_MAX_BYTES = 64
# Every remote command runs under this POSIX sh script, its argv passed as "$@" (never part of the
# script): the command's stdin is /dev/null and a watcher kills it when the channel's stdin ends.
# sshd closes that pipe when the channel closes, so a command we stopped waiting for dies with its
# channel even where sshd refuses signal requests (OpenSSH, for root logins).
COMMAND_GUARD = (
    'exec 3<&0 </dev/null; "$@" 3<&- & c=$!; '
    '{ cat <&3; kill -KILL "$c"; } >/dev/null 2>&1 & w=$!; '
    'exec 3<&-; wait "$c"; s=$?; kill "$w" 2>/dev/null; exit "$s"'
)

log = structlog.get_logger("watchdog.act.ssh")


class HostUnreachable(BusDisconnected):
    """The SSH connection to a remote host is down (or refused); the message says why."""


def parse_uid(text: str) -> int:
    """The uid printed by `id -u`; ValueError for anything else."""
    value = text.strip()
    if not value.isdigit():
        raise ValueError(f"`id -u` printed {value[:80]!r}, not a uid")
    return int(value)


def remote_command_line(argv: Sequence[str]) -> str:
    """The line sent for `argv`: COMMAND_GUARD running it, one shell word per argument."""
    return shlex.join(["sh", "-c", COMMAND_GUARD, "sh", *argv])


def check_known_hosts_file(path: Path) -> None:
    """OSError naming `path` when group or others may write it (or it is missing).

    Whoever can write the pinned keys can stand in for the host, as ssh's StrictModes knows;
    checked again at every connect, since the file may change after the config was validated.
    """
    mode = path.stat().st_mode
    if mode & 0o022:
        raise OSError(
            f"known_hosts_file {str(path)!r} is writable by group or others (mode "
            f"{mode & 0o777:o}); refusing to trust it (chmod go-w)"
        )


def describe_ssh_error(exc: BaseException) -> str:
    """An SSH failure in words an operator can act on (host key mismatch above all)."""
    import asyncssh  # noqa: PLC0415  # lazy, see the TYPE_CHECKING import

    if isinstance(exc, asyncssh.HostKeyNotVerifiable):
        return (
            f"host key verification failed ({exc.reason}); the host's key is not the one pinned "
            "in known_hosts_file: refusing to connect"
        )
    if isinstance(exc, asyncssh.PermissionDenied):
        return f"permission denied for the configured key ({exc.reason})"
    if isinstance(exc, asyncssh.DisconnectError):
        return f"{type(exc).__name__}: {exc.reason}"
    if isinstance(exc, TimeoutError):
        return "timed out"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class SshHost:
    """The connection to one SshTarget; a BusTransport for SystemdClient and a command runner."""

    def __init__(
        self,
        target: SshTarget,
        *,
        remote_bus_socket: str = REMOTE_BUS_SOCKET,
        connect_timeout_seconds: float = 10.0,
        backoff_min_seconds: float = 0.5,
        backoff_max_seconds: float = 10.0,
        clock: Clock = time.monotonic,
    ) -> None:
        self.target = target
        self.remote_bus_socket = remote_bus_socket
        self._connect_timeout = connect_timeout_seconds
        self._backoff_min = backoff_min_seconds
        self._backoff_max = backoff_max_seconds
        self._clock = clock
        self._conn: asyncssh.SSHClientConnection | None = None
        self._listener: asyncssh.SSHListener | None = None
        self._attempt: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._dir: Path | None = None
        self._failures = 0
        self._next_attempt_at = 0.0
        self._closed = False
        self.uid: int | None = None  # the remote user's uid on the current connection
        self.last_error = "not connected yet"
        self.connections = 0

    @property
    def label(self) -> str:
        """user@host:port."""
        return self.target.label

    @property
    def connected(self) -> bool:
        """True while the SSH connection and its bus forward are up."""
        return self._conn is not None and self._listener is not None

    @property
    def down(self) -> bool:
        """True once an attempt failed or the connection was lost, until the next connection
        (not before the first attempt has finished: that host is not known to be down)."""
        return not self.connected and self._failures > 0

    @property
    def bus_path(self) -> Path | None:
        """The local end of the forwarded bus socket while connected."""
        return None if self._dir is None or not self.connected else self._dir / "bus"

    # --- connection ------------------------------------------------------------------------------

    async def bus_endpoint(self, *, wait: bool) -> tuple[str, int | None]:
        """(D-Bus address of the forwarded socket, remote uid for EXTERNAL auth).

        HostUnreachable while the host is down: at once with `wait=False`, else after one attempt.
        """
        await self.ensure(wait=wait)
        path = self.bus_path
        if path is None:
            raise HostUnreachable(f"ssh {self.label}: {self.last_error}")
        return f"unix:path={path}", self.uid

    async def ensure(self, *, wait: bool) -> None:
        """Connected, or HostUnreachable with the last reason (see the module docstring)."""
        if self.connected:
            return
        if self._closed:
            raise HostUnreachable(f"ssh {self.label}: closed")
        attempt = self._attempt
        if attempt is None or attempt.done():
            if not wait and self._clock() < self._next_attempt_at:
                raise HostUnreachable(f"ssh {self.label}: {self.last_error}")
            attempt = self._attempt = asyncio.create_task(self._connect())
        if wait:
            # Shielded: a caller giving up must not cancel the attempt others may be waiting on.
            with contextlib.suppress(Exception):
                await asyncio.shield(attempt)
        if not self.connected:
            raise HostUnreachable(f"ssh {self.label}: {self.last_error}")

    async def _connect(self) -> None:
        import asyncssh  # noqa: PLC0415  # lazy, see the TYPE_CHECKING import

        target = self.target
        conn: asyncssh.SSHClientConnection | None = None
        try:
            check_known_hosts_file(target.known_hosts_file)
            async with asyncio.timeout(self._connect_timeout):
                conn = await asyncssh.connect(
                    target.hostname,
                    target.port,
                    username=target.user,
                    client_keys=[str(target.key_file)],
                    known_hosts=str(target.known_hosts_file),
                    config=[],  # no ~/.ssh/config: the watchdog's config is the whole truth
                    agent_path=None,
                    agent_forwarding=False,
                    password=None,
                    kbdint_auth=False,
                    preferred_auth="publickey",
                    keepalive_interval=5,
                    keepalive_count_max=3,
                )
                # Bounded like every command: a host answering with an endless stream or never
                # exiting costs one connect timeout and 64 bytes, not the daemon's memory.
                result = await run_remote(
                    conn, ("id", "-u"), self._connect_timeout, _UID_MAX_BYTES, label=self.label
                )
                if result.returncode is None:
                    raise OSError(f"`id -u`: {result.error}")
                if result.returncode != 0:
                    raise OSError(f"`id -u` exited {result.returncode}")
                uid = parse_uid(result.stdout.decode("utf-8", "replace"))
                directory = Path(tempfile.mkdtemp(prefix="watchdog-ssh-"))
                try:
                    listener = await conn.forward_local_path(
                        str(directory / "bus"), self.remote_bus_socket
                    )
                except BaseException:
                    shutil.rmtree(directory, ignore_errors=True)
                    raise
        except Exception as exc:
            if conn is not None:
                conn.close()
            self._failed(describe_ssh_error(exc))
            return
        self._conn, self._listener, self._dir, self.uid = conn, listener, directory, uid
        self._failures = 0
        self.last_error = ""
        self.connections += 1
        self._watcher = asyncio.create_task(self._watch(conn))
        log.info("ssh_host_connected", host=self.label, uid=uid, connections=self.connections)

    def _failed(self, reason: str) -> None:
        self._failures += 1
        delay = min(self._backoff_max, self._backoff_min * 2 ** (self._failures - 1))
        self._next_attempt_at = self._clock() + delay
        changed = reason != self.last_error
        self.last_error = reason
        # Logged when the reason changes, not at every backoff step of a long outage.
        if changed:
            log.warning(
                "ssh_host_unreachable", host=self.label, error=reason, retry_in_seconds=delay
            )

    async def _watch(self, conn: asyncssh.SSHClientConnection) -> None:
        with contextlib.suppress(Exception):
            await conn.wait_closed()
        if self._conn is conn:
            self._drop()
            if not self._closed:
                self._failed("the SSH connection was lost")

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        listener, self._listener = self._listener, None
        directory, self._dir = self._dir, None
        self.uid = None
        if listener is not None:
            listener.close()
        if conn is not None:
            conn.close()
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)

    async def close(self) -> None:
        """Disconnect and stop reconnecting."""
        self._closed = True
        attempt = self._attempt
        if attempt is not None and not attempt.done():
            attempt.cancel()
            await asyncio.gather(attempt, return_exceptions=True)
        conn = self._conn
        self._drop()
        if conn is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.wait_closed(), 5.0)
        watcher = self._watcher
        if watcher is not None:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)

    # --- commands --------------------------------------------------------------------------------

    async def run(
        self, argv: Sequence[str], timeout_seconds: float, max_output_bytes: int = 1024 * 1024
    ) -> CommandResult:
        """A fixed argv on the host (shlex-joined: one word per argument); never raises.

        Arguments come from code and validated config values (unit names, PIDs) only. Output is
        read as it arrives under the caps of local commands; see run_remote().
        """
        try:
            await self.ensure(wait=False)
        except HostUnreachable as exc:
            return CommandResult(None, error=str(exc))
        conn = self._conn
        assert conn is not None
        return await run_remote(conn, argv, timeout_seconds, max_output_bytes, label=self.label)


class _OverCap(Exception):
    """One of a remote command's streams went past its cap (args: the stream's name, the cap)."""


async def _pump(stream: asyncssh.SSHReader[bytes], into: bytearray, limit: int, name: str) -> None:
    # asyncssh buffers at most one receive window per channel and pauses the peer beyond it, so
    # reading as the bytes come is what bounds memory; conn.run() would keep everything.
    while chunk := await stream.read(_READ_CHUNK_BYTES):
        room = limit - len(into)
        into += chunk[: max(room, 0)]
        if len(chunk) > room:
            raise _OverCap(name, limit)


def _stop(process: asyncssh.SSHClientProcess[bytes] | None) -> None:
    """Kill the remote command and close its channel, without waiting for the peer.

    Two ways, since OpenSSH refuses signal requests for root logins ("session signalling
    requires privilege separation"): KILL where sshd delivers it, and the close, which ends the
    channel's stdin and so makes COMMAND_GUARD kill the command. The close also stops the peer
    sending past the window.
    """
    if process is None:
        return
    with contextlib.suppress(Exception):  # the channel may be closing already
        process.kill()
    with contextlib.suppress(Exception):
        process.close()


async def run_remote(
    conn: asyncssh.SSHClientConnection,
    argv: Sequence[str],
    timeout_seconds: float,
    max_output_bytes: int,
    *,
    label: str,
) -> CommandResult:
    """A fixed argv over `conn` with the deadline and caps of a local command (run_command).

    stdout is kept up to `max_output_bytes`, stderr up to STDERR_MAX_BYTES. Past either cap, at
    the deadline, or when the caller is cancelled, the remote command is killed and its channel
    closed at once (_stop): a broken or hostile host cannot stream into our memory, and a
    command we stopped waiting for does not go on streaming or waiting on our side.
    """
    import asyncssh  # noqa: PLC0415  # lazy, see the TYPE_CHECKING import

    process: asyncssh.SSHClientProcess[bytes] | None = None
    stdout, stderr = bytearray(), bytearray()
    try:
        async with asyncio.timeout(timeout_seconds):
            # stdin stays open, unwritten: its end is COMMAND_GUARD's signal to kill the command.
            process = await conn.create_process(remote_command_line(argv), encoding=None)
            await _collect(process, stdout, stderr, max_output_bytes)
    except _OverCap as over:
        _stop(process)
        name, cap = over.args
        return CommandResult(
            None,
            bytes(stdout),
            bytes(stderr),
            stdout_truncated=name == "stdout",
            error=f"{name} exceeded {cap} bytes over ssh; remote command stopped",
        )
    except TimeoutError:
        _stop(process)
        return CommandResult(
            None, error=f"timed out after {timeout_seconds:g} s over ssh; remote command stopped"
        )
    except (asyncssh.Error, OSError) as exc:
        _stop(process)
        return CommandResult(None, error=f"ssh {label}: {describe_ssh_error(exc)}")
    except BaseException:  # cancelled: the command must not outlive the caller
        _stop(process)
        raise
    code = process.exit_status
    if code is None:  # killed by a signal, or the channel closed without a status
        return CommandResult(
            None, bytes(stdout), bytes(stderr), error="ended without exit status over ssh"
        )
    return CommandResult(code, bytes(stdout), bytes(stderr))


async def _collect(
    process: asyncssh.SSHClientProcess[bytes], stdout: bytearray, stderr: bytearray, limit: int
) -> None:
    """Both streams to their end (or _OverCap), then the channel's close (the exit status)."""
    try:
        # Side by side: asyncssh pauses the whole channel when one stream's buffer is full.
        async with asyncio.TaskGroup() as readers:
            readers.create_task(_pump(process.stdout, stdout, limit, "stdout"))
            readers.create_task(_pump(process.stderr, stderr, STDERR_MAX_BYTES, "stderr"))
    except ExceptionGroup as failed:
        raise failed.exceptions[0] from None  # the first reader's: _OverCap or an SSH error
    await process.wait_closed()
