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
from watchdog.evidence.blocking import CommandResult

if TYPE_CHECKING:
    # Imported where used: asyncssh (and cryptography under it) costs ~25 MiB of RSS, which a
    # watchdog without remote hosts should not pay.
    import asyncssh

REMOTE_BUS_SOCKET = "/run/dbus/system_bus_socket"

log = structlog.get_logger("watchdog.act.ssh")


class HostUnreachable(BusDisconnected):
    """The SSH connection to a remote host is down (or refused); the message says why."""


def parse_uid(text: str) -> int:
    """The uid printed by `id -u`; ValueError for anything else."""
    value = text.strip()
    if not value.isdigit():
        raise ValueError(f"`id -u` printed {value[:80]!r}, not a uid")
    return int(value)


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
                result = await conn.run(shlex.join(["id", "-u"]), check=False)
                if result.exit_status != 0:
                    raise OSError(f"`id -u` exited {result.exit_status}")
                uid = parse_uid(str(result.stdout))
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

        Arguments come from code and validated config values (unit names, PIDs) only.
        """
        import asyncssh  # noqa: PLC0415  # lazy, see the TYPE_CHECKING import

        try:
            await self.ensure(wait=False)
        except HostUnreachable as exc:
            return CommandResult(None, error=str(exc))
        conn = self._conn
        assert conn is not None
        try:
            async with asyncio.timeout(timeout_seconds):
                result = await conn.run(shlex.join(argv), check=False, encoding=None)
        except TimeoutError:
            return CommandResult(None, error=f"timed out after {timeout_seconds:g} s over ssh")
        except (asyncssh.Error, OSError) as exc:
            return CommandResult(None, error=f"ssh {self.label}: {describe_ssh_error(exc)}")
        stdout = _as_bytes(result.stdout)
        stderr = _as_bytes(result.stderr)
        code = result.exit_status
        if code is None:  # killed by a signal, or the channel closed without a status
            return CommandResult(None, stdout, stderr, error="ended without exit status over ssh")
        return CommandResult(
            code,
            stdout[:max_output_bytes],
            stderr[:max_output_bytes],
            stdout_truncated=len(stdout) > max_output_bytes,
        )


def _as_bytes(data: bytes | str | None) -> bytes:
    # encoding=None gives bytes; asyncssh's annotation covers the text mode too.
    if data is None:
        return b""
    return data.encode("utf-8", "replace") if isinstance(data, str) else bytes(data)
