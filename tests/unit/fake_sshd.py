"""An SSH host in this process for the tests: asyncssh's server on 127.0.0.1 with fixed keys.

FakeSshd answers `id -u` with UID and echoes the argv of any other command, unless a script
answers it (Hostile: a host that streams without end, or never exits). Used by the SshHost tests
and by the hostile-load test, whose host streams at every command but `id -u`.
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncssh

from watchdog.act.ssh import COMMAND_GUARD
from watchdog.config import SshTarget

UID = 4321
# What answers one remote command (it ends the session its own way).
Script = Callable[[asyncssh.SSHServerProcess[str]], Awaitable[None]]


@dataclass
class FakeSshd:
    """An asyncssh server answering `id -u` and echoing every other command's argv (or, with a
    `fallback`, handing every other command to it)."""

    directory: Path
    host_key: asyncssh.SSHKey = field(
        default_factory=lambda: asyncssh.generate_private_key("ssh-ed25519")
    )
    client_key: asyncssh.SSHKey = field(
        default_factory=lambda: asyncssh.generate_private_key("ssh-ed25519")
    )
    port: int = 0
    commands: list[str] = field(default_factory=list)  # each argv, shlex-joined
    lines: list[str] = field(default_factory=list)  # the command lines as received
    # Commands answered by a script instead (`id -u` included): a hostile host.
    scripts: dict[str, Script] = field(default_factory=dict)
    # Every command that is neither scripted nor `id -u`: a host that answers all alike.
    fallback: Script | None = None
    server: asyncssh.SSHAcceptor | None = None
    connections: list[asyncssh.SSHServerConnection] = field(default_factory=list)

    def target(self, known_hosts_key: asyncssh.SSHKey | None = None) -> SshTarget:
        key_file = self.directory / "client_key"
        self.client_key.write_private_key(key_file)
        key_file.chmod(0o600)
        pinned = (known_hosts_key or self.host_key).export_public_key("openssh").decode().strip()
        known = self.directory / f"known_hosts-{pinned[-12:].replace('/', '_')}"
        known.write_text(f"[127.0.0.1]:{self.port} {pinned}\n")
        known.chmod(0o644)  # whatever the umask: SshHost refuses group/other-writable
        return SshTarget("wd", "127.0.0.1", self.port, key_file, known)

    async def start(self) -> None:
        outer = self

        class Server(asyncssh.SSHServer):
            def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
                outer.connections.append(conn)

        async def handle(process: asyncssh.SSHServerProcess[str]) -> None:
            # The argv under COMMAND_GUARD (this fake runs no shell: it answers the argv).
            outer.lines.append(process.command or "")
            words = shlex.split(process.command or "")
            assert words[:4] == ["sh", "-c", COMMAND_GUARD, "sh"], words[:4]
            command = shlex.join(words[4:])
            outer.commands.append(command)
            if command in outer.scripts:
                await outer.scripts[command](process)  # ends the session its own way
                return
            if command != "id -u" and outer.fallback is not None:
                await outer.fallback(process)
                return
            if command == "id -u":
                process.stdout.write(f"{UID}\n")
            else:
                process.stdout.write("\n".join(shlex.split(command)))
            process.exit(0)

        authorized = asyncssh.import_authorized_keys(
            self.client_key.export_public_key("openssh").decode()
        )
        self.server = await asyncssh.create_server(
            Server,
            "127.0.0.1",
            self.port,
            server_host_keys=[self.host_key],
            authorized_client_keys=authorized,
            process_factory=handle,
        )
        self.port = self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Stop listening and drop every session (as an sshd that went away)."""
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
            self.server = None
        for conn in self.connections:
            conn.abort()
        self.connections.clear()


@dataclass
class Hostile:
    """A remote command that streams without end (stopping at `safety_bytes`, far past any cap,
    so a watchdog that never stops it cannot take the test machine down) or never exits; it
    records what it sent and when its channel was closed."""

    stream: bool
    safety_bytes: int = 256 * 2**20
    sent: int = 0
    closed: asyncio.Event = field(default_factory=asyncio.Event)

    async def __call__(self, process: asyncssh.SSHServerProcess[str]) -> None:
        chunk = "y\n" * 32768
        try:
            while self.stream and self.sent < self.safety_bytes:
                process.stdout.write(chunk)
                await process.stdout.drain()  # flow control: waits while the client reads none
                self.sent += len(chunk)
        except (OSError, asyncssh.Error):
            pass  # the client closed the channel under the writer
        await process.wait_closed()  # never exits: only the client's close ends it
        self.closed.set()


@contextlib.asynccontextmanager
async def running_sshd(directory: Path, **fields: Any) -> AsyncIterator[FakeSshd]:
    """A started FakeSshd keeping its keys in `directory`, stopped on the way out."""
    server = FakeSshd(directory, **fields)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
