"""Evidence of a unit on another host, fetched over its SSH connection with fixed commands.

Each command is a fixed argv (shlex-joined by the runner, one word per argument) in which only a
validated unit name or an integer PID is interpolated; its output goes through the same parsers,
filters and redaction as the local evidence (journal.py, procinfo.py, gpu.py).
"""

from __future__ import annotations

import asyncio
import shlex
from collections.abc import Sequence
from typing import Protocol

from watchdog.evidence.blocking import CommandResult
from watchdog.evidence.gpu import read_nvidia_smi
from watchdog.evidence.journal import JournalctlReader
from watchdog.evidence.procinfo import (
    ProcessInfo,
    parse_cmdline,
    parse_environ,
    parse_stat,
    redact_cmdline,
)
from watchdog.evidence.records import GpuReading, GpuSource, JournalExcerpt

_MAX_PROC_FILE_BYTES = 256 * 1024  # a cmdline or environ larger than this is not a real one
_NOT_FOUND = 127  # the remote shell's status for a command that is not installed


class RemoteHost(Protocol):
    """A remote host's command runner (watchdog.act.ssh.SshHost)."""

    @property
    def label(self) -> str:
        """user@host:port, as reports name the host."""
        ...

    async def run(
        self, argv: Sequence[str], timeout_seconds: float, max_output_bytes: int = ...
    ) -> CommandResult:
        """A fixed argv on the host; never raises."""
        ...


def plain_word(value: str) -> str:
    """`value` when the remote shell would read it as one literal word; ValueError otherwise.

    Config validation already restricts unit names to systemd's characters: this is the guard
    that keeps anything else out of a remote command line.
    """
    if not value or shlex.quote(value) != value:
        raise ValueError(f"{value[:80]!r} is not a plain word; refusing to send it to a shell")
    return value


class RemoteJournalReader:
    """JournalReader running journalctl on the remote host, parsed exactly as the local journal."""

    def __init__(self, host: RemoteHost) -> None:
        self._reader = JournalctlReader(runner=host.run)

    async def read_journal(self, unit: str, lines: int, timeout_seconds: float) -> JournalExcerpt:
        """The tail of `unit`'s journal on the host; unavailable instead of raising."""
        try:
            plain_word(unit)
        except ValueError as exc:
            return JournalExcerpt(unit, ok=False, detail=str(exc))
        return await self._reader.read_journal(unit, int(lines), timeout_seconds)


async def _cat(host: RemoteHost, pid: int, name: str, timeout_seconds: float) -> bytes:
    path = f"/proc/{int(pid)}/{name}"
    result = await host.run(("cat", "--", path), timeout_seconds, _MAX_PROC_FILE_BYTES)
    if result.returncode is None:
        raise OSError(result.error)
    if result.returncode != 0:
        message = result.stderr[:300].decode("utf-8", "replace").strip()
        raise OSError(f"{path} on {host.label}: {message or f'cat exited {result.returncode}'}")
    return result.stdout


async def read_remote_process(
    host: RemoteHost, pid: int, timeout_seconds: float
) -> tuple[tuple[ProcessInfo, ...], tuple[str, ...] | None, dict[str, str] | None, str]:
    """(MainPID as a one-process tree, raw cmdline, full environ, environ error) from the host.

    The same shape as the local read (capture._read_process); OSError when the process is gone.
    Only the main process: its children would need one round trip per process.
    """
    stat, cmdline, environ = await asyncio.gather(
        _cat(host, pid, "stat", timeout_seconds),
        _cat(host, pid, "cmdline", timeout_seconds),
        _cat(host, pid, "environ", timeout_seconds),
        return_exceptions=True,
    )
    if isinstance(stat, BaseException):
        raise stat
    try:
        comm, ppid = parse_stat(stat.decode("utf-8", "replace"))
    except (ValueError, IndexError) as exc:
        raise OSError(f"/proc/{pid}/stat on {host.label}: unreadable ({exc})") from None
    if isinstance(cmdline, BaseException):
        info = ProcessInfo(pid, ppid, comm, (), error=f"cmdline unreadable: {cmdline}")
        raw_cmdline: tuple[str, ...] | None = None
    else:
        raw_cmdline = parse_cmdline(cmdline)
        info = ProcessInfo(pid, ppid, comm, redact_cmdline(raw_cmdline))
    if isinstance(environ, BaseException):
        return (info,), raw_cmdline, None, f"environ unreadable: {environ}"
    return (info,), raw_cmdline, parse_environ(environ), ""


async def read_remote_raw(
    host: RemoteHost, pid: int, timeout_seconds: float
) -> tuple[tuple[str, ...], dict[str, str]]:
    """(raw cmdline, full environ) of a remote PID, for the drift check; OSError if unreadable."""
    cmdline, environ = await asyncio.gather(
        _cat(host, pid, "cmdline", timeout_seconds), _cat(host, pid, "environ", timeout_seconds)
    )
    return parse_cmdline(cmdline), parse_environ(environ)


class RemoteGpuReader:
    """GpuReader running nvidia-smi on a remote host (NVML is a library: it cannot be remote)."""

    def __init__(self, host: RemoteHost, binary: str = "nvidia-smi") -> None:
        self.host = host
        self.binary = binary

    async def read_gpus(self, timeout_seconds: float) -> GpuReading:
        """The host's GPUs via nvidia-smi, or unavailable naming the host and why."""
        devices, why = await read_nvidia_smi(timeout_seconds, self.binary, runner=self.host.run)
        if devices is not None:
            return GpuReading(GpuSource.NVIDIA_SMI, devices)
        if why.startswith(f"{self.binary} exited {_NOT_FOUND}:"):
            why = f"{self.binary} not found"
        return GpuReading(GpuSource.UNAVAILABLE, (), f"{self.host.label}: nvidia-smi: {why}")
