"""SshHost against asyncssh's in-process server on 127.0.0.1: host keys, uid, argv, reconnects."""

from __future__ import annotations

import asyncio
import shlex
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import asyncssh
import pytest

from watchdog.act.ssh import HostUnreachable, SshHost, parse_uid
from watchdog.config import SshTarget

UID = 4321


@dataclass
class FakeSshd:
    """An asyncssh server answering `id -u` and echoing every other command's argv."""

    directory: Path
    host_key: asyncssh.SSHKey = field(
        default_factory=lambda: asyncssh.generate_private_key("ssh-ed25519")
    )
    client_key: asyncssh.SSHKey = field(
        default_factory=lambda: asyncssh.generate_private_key("ssh-ed25519")
    )
    port: int = 0
    commands: list[str] = field(default_factory=list)
    server: asyncssh.SSHAcceptor | None = None
    connections: list[asyncssh.SSHServerConnection] = field(default_factory=list)

    def target(self, known_hosts_key: asyncssh.SSHKey | None = None) -> SshTarget:
        key_file = self.directory / "client_key"
        self.client_key.write_private_key(key_file)
        key_file.chmod(0o600)
        pinned = (known_hosts_key or self.host_key).export_public_key("openssh").decode().strip()
        known = self.directory / f"known_hosts-{pinned[-12:].replace('/', '_')}"
        known.write_text(f"[127.0.0.1]:{self.port} {pinned}\n")
        return SshTarget("wd", "127.0.0.1", self.port, key_file, known)

    async def start(self) -> None:
        outer = self

        class Server(asyncssh.SSHServer):
            def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
                outer.connections.append(conn)

        async def handle(process: asyncssh.SSHServerProcess[str]) -> None:
            command = process.command or ""
            outer.commands.append(command)
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


@pytest.fixture
async def sshd(tmp_path: Path) -> AsyncIterator[FakeSshd]:
    server = FakeSshd(tmp_path)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


def _host(target: SshTarget) -> SshHost:
    return SshHost(
        target,
        connect_timeout_seconds=5.0,
        backoff_min_seconds=0.05,
        backoff_max_seconds=0.2,
    )


async def test_connects_reads_the_remote_uid_and_forwards_the_bus(sshd: FakeSshd) -> None:
    host = _host(sshd.target())
    try:
        address, uid = await host.bus_endpoint(wait=True)
        assert uid == UID
        assert address.startswith("unix:path=")
        assert sshd.commands == ["id -u"]
    finally:
        await host.close()
    assert not host.connected


async def test_a_fixed_argv_reaches_the_server_as_one_shlex_joined_line(sshd: FakeSshd) -> None:
    """Each argument is one word on the remote side: `;`, spaces and `$()` are never a shell's."""
    host = _host(sshd.target())
    argv = ("journalctl", "-u", "sglang-decode.service", "-n", "50", "-o", "short-iso")
    hostile = ("cat", "--", "/proc/1/cmdline; touch /tmp/pwned", "$(id)", "a b")
    try:
        await host.ensure(wait=True)
        result = await host.run(argv, 5.0)
        assert result.ok
        assert result.stdout.decode().splitlines() == list(argv)
        result = await host.run(hostile, 5.0)
        assert result.stdout.decode().splitlines() == list(hostile)
    finally:
        await host.close()
    assert sshd.commands[1:] == [shlex.join(argv), shlex.join(hostile)]
    assert sshd.commands[2] == "cat -- '/proc/1/cmdline; touch /tmp/pwned' '$(id)' 'a b'"


async def test_a_host_key_other_than_the_pinned_one_is_refused_clearly(sshd: FakeSshd) -> None:
    other = asyncssh.generate_private_key("ssh-ed25519")
    host = _host(sshd.target(known_hosts_key=other))
    try:
        with pytest.raises(HostUnreachable) as caught:
            await host.ensure(wait=True)
        assert "host key verification failed" in str(caught.value)
        assert "refusing to connect" in str(caught.value)
        assert "wd@127.0.0.1" in str(caught.value)
        # Commands report the same reason and never raise.
        result = await host.run(("true",), 1.0)
        assert result.returncode is None
        assert "host key verification failed" in result.error
    finally:
        await host.close()
    assert sshd.commands == []  # no session was ever authenticated


async def test_reconnects_after_the_server_returns(sshd: FakeSshd) -> None:
    host = _host(sshd.target())
    try:
        await host.ensure(wait=True)
        assert host.connections == 1
        await sshd.stop()
        for _ in range(1500):  # the watcher notices the lost connection (30 s: a busy machine)
            if not host.connected:
                break
            await asyncio.sleep(0.02)
        assert not host.connected
        with pytest.raises(HostUnreachable):
            await host.ensure(wait=False)  # at once: a reader never waits for a down host
        result = await host.run(("true",), 1.0)
        assert result.returncode is None
        await sshd.start()  # same port
        await host.ensure(wait=True)
        assert host.connected
        assert host.connections == 2
        assert host.uid == UID
        assert (await host.run(("echo", "back"), 5.0)).ok
    finally:
        await host.close()


@pytest.mark.parametrize(("text", "uid"), [("0\n", 0), ("998", 998), ("  1000 \n", 1000)])
def test_parse_uid(text: str, uid: int) -> None:
    assert parse_uid(text) == uid


@pytest.mark.parametrize("text", ["", "root", "-1", "1000 1001", "uid=0(root)"])
def test_parse_uid_refuses_anything_else(text: str) -> None:
    with pytest.raises(ValueError, match="not a uid"):
        parse_uid(text)
