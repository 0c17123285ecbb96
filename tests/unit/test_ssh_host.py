"""SshHost against asyncssh's in-process server on 127.0.0.1: host keys, uid, argv, reconnects."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import asyncssh
import pytest

from tests.unit.fake_sshd import UID, FakeSshd, Hostile, running_sshd
from watchdog.act.ssh import (
    COMMAND_GUARD,
    HostUnreachable,
    SshHost,
    parse_uid,
    remote_command_line,
)
from watchdog.config import SshTarget


@pytest.fixture
async def sshd(tmp_path: Path) -> AsyncIterator[FakeSshd]:
    """An in-process SSH server on 127.0.0.1, stopped after the test."""
    async with running_sshd(tmp_path) as server:
        yield server


def _host(target: SshTarget) -> SshHost:
    return SshHost(
        target,
        connect_timeout_seconds=5.0,
        backoff_min_seconds=0.05,
        backoff_max_seconds=0.2,
    )


async def test_connects_reads_the_remote_uid_and_forwards_the_bus(sshd: FakeSshd) -> None:
    """A connection reads the remote uid and forwards the remote system bus to a local socket."""
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
    assert sshd.lines[2] == remote_command_line(hostile)
    assert sshd.lines[2].endswith(" sh cat -- '/proc/1/cmdline; touch /tmp/pwned' '$(id)' 'a b'")


async def test_a_host_key_other_than_the_pinned_one_is_refused_clearly(sshd: FakeSshd) -> None:
    """A host key other than the pinned one is refused clearly, and commands say so, not raise."""
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
    """A lost connection is reported at once and the host reconnects once the server is back."""
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
    """`id -u` output, whitespace and newline included, parses to the uid."""
    assert parse_uid(text) == uid


@pytest.mark.parametrize("text", ["", "root", "-1", "1000 1001", "uid=0(root)"])
def test_parse_uid_refuses_anything_else(text: str) -> None:
    """Anything but a plain uid is refused, so a stray banner is never taken for one."""
    with pytest.raises(ValueError, match="not a uid"):
        parse_uid(text)


async def _closed(hostile: Hostile) -> None:
    # Generous: the close is on its way once run() returned; a busy machine may take a while.
    async with asyncio.timeout(30):
        await hostile.closed.wait()


async def test_endless_output_is_cut_at_the_cap_and_the_remote_command_stopped(
    sshd: FakeSshd,
) -> None:
    """The output is read as it comes: stdout stops at the cap, the channel is closed at once
    and the host never got to send more than the cap and a few flow-control windows."""
    hostile = sshd.scripts["journalctl -u x.service"] = Hostile(stream=True)
    host = _host(sshd.target())
    cap = 2**20
    try:
        await host.ensure(wait=True)
        result = await host.run(("journalctl", "-u", "x.service"), 60.0, cap)
        assert result.returncode is None
        assert result.stdout_truncated
        assert len(result.stdout) == cap
        assert result.stdout.startswith(b"y\ny\n")
        assert "stdout exceeded 1048576 bytes over ssh; remote command stopped" in result.error
        await _closed(hostile)
        # Far below the 256 MiB the host would have streamed: memory stayed bounded.
        assert hostile.sent <= cap + 16 * 2**20
        # The connection itself is fine: the next command runs.
        assert (await host.run(("echo", "after"), 30.0)).ok
    finally:
        await host.close()


async def test_a_command_that_never_exits_is_stopped_at_the_timeout(sshd: FakeSshd) -> None:
    """At the deadline the remote command is killed and its channel closed, not left running."""
    hostile = sshd.scripts["nvidia-smi"] = Hostile(stream=False)
    host = _host(sshd.target())
    try:
        await host.ensure(wait=True)
        result = await host.run(("nvidia-smi",), 0.5)
        assert result.returncode is None
        assert result.error == "timed out after 0.5 s over ssh; remote command stopped"
        await _closed(hostile)
        assert (await host.run(("echo", "after"), 30.0)).ok
    finally:
        await host.close()


async def test_a_cancelled_command_is_stopped_too(sshd: FakeSshd) -> None:
    """A caller giving up (its own deadline, shutdown) closes the remote command's channel."""
    hostile = sshd.scripts["cat -- /proc/1/environ"] = Hostile(stream=False)
    host = _host(sshd.target())
    try:
        await host.ensure(wait=True)
        task = asyncio.create_task(host.run(("cat", "--", "/proc/1/environ"), 600.0))
        async with asyncio.timeout(30):
            while not sshd.commands[1:]:
                await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _closed(hostile)
    finally:
        await host.close()


async def test_id_u_at_connect_is_bounded_in_bytes(sshd: FakeSshd) -> None:
    """A host answering `id -u` with an endless stream fails the connect at 64 bytes."""
    hostile = sshd.scripts["id -u"] = Hostile(stream=True, safety_bytes=64 * 2**20)
    host = _host(sshd.target())
    try:
        with pytest.raises(HostUnreachable) as caught:
            await host.ensure(wait=True)
        assert "`id -u`: stdout exceeded 64 bytes over ssh; remote command stopped" in str(
            caught.value
        )
        await _closed(hostile)
        assert hostile.sent <= 16 * 2**20
        assert not host.connected
    finally:
        await host.close()


async def test_id_u_at_connect_is_bounded_in_time(sshd: FakeSshd) -> None:
    """A host whose `id -u` never exits fails the connect at the connect timeout."""
    hostile = sshd.scripts["id -u"] = Hostile(stream=False)
    host = SshHost(sshd.target(), connect_timeout_seconds=1.0, backoff_min_seconds=60.0)
    try:
        with pytest.raises(HostUnreachable) as caught:
            await host.ensure(wait=True)
        assert "timed out" in str(caught.value)
        await _closed(hostile)
    finally:
        await host.close()


@pytest.mark.parametrize("mode", [0o664, 0o646, 0o666])
async def test_a_known_hosts_file_others_may_write_is_refused_at_connect(
    sshd: FakeSshd, mode: int
) -> None:
    """Whoever may write the pinned keys may stand in for the host: no connection at all."""
    target = sshd.target()
    target.known_hosts_file.chmod(mode)
    host = _host(target)
    try:
        with pytest.raises(HostUnreachable) as caught:
            await host.ensure(wait=True)
        message = str(caught.value)
        assert f"known_hosts_file {str(target.known_hosts_file)!r}" in message
        assert f"writable by group or others (mode {mode:o})" in message
    finally:
        await host.close()
    assert sshd.connections == []  # refused before any connection was made


async def _guarded(*argv: str) -> asyncio.subprocess.Process:
    """`argv` under COMMAND_GUARD in a local sh, as sshd runs the line on the host."""
    return await asyncio.create_subprocess_exec(
        "sh",
        "-c",
        COMMAND_GUARD,
        "sh",
        *argv,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def test_the_guard_passes_words_output_and_exit_status_through() -> None:
    """Under the guard (a real sh) each argument stays one word and is never shell text, and
    output and exit status are the command's, while stdin stays open."""
    script = 'printf "%s|" "$@"; echo err >&2; exit 3'
    proc = await _guarded("sh", "-c", script, "x", "a b", "$(id)", ";", "*")
    assert proc.stdout is not None
    assert proc.stderr is not None
    try:
        async with asyncio.timeout(60):
            out, err = await asyncio.gather(proc.stdout.read(), proc.stderr.read())
            code = await proc.wait()
        assert (code, out, err) == (3, b"a b|$(id)|;|*|", b"err\n")
    finally:
        assert proc.stdin is not None
        proc.stdin.close()  # ends the guard's watcher (cat) as a closed channel would
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_the_guard_kills_the_command_when_its_stdin_ends() -> None:
    """The end of stdin (sshd closes it with the channel) kills the command, which reads none
    itself and would otherwise sleep on: no signal request needed."""
    proc = await _guarded("sh", "-c", "echo $$; exec sleep 1000")
    assert proc.stdout is not None
    assert proc.stdin is not None
    pid = 0
    try:
        async with asyncio.timeout(60):
            pid = int(await proc.stdout.readline())
            proc.stdin.close()
            code = await proc.wait()
        assert code == 128 + signal.SIGKILL
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # reaped by the guard's wait: gone
    finally:
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
