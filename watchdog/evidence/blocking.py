"""Wait for blocking work under a deadline: a call in a daemon thread, or an external command."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

T = TypeVar("T")
# What a command's stderr may keep (here and over ssh): enough for any error message.
STDERR_MAX_BYTES = 64 * 1024


async def wait_for_blocking(func: Callable[[], T], timeout_seconds: float) -> T:
    """Return func() run in a fresh daemon thread; TimeoutError after `timeout_seconds`.

    Why not asyncio.to_thread: a read of /proc/PID/cmdline of a process stuck on its mm lock, or an
    NVML call against a wedged GPU, can block forever. A default-executor thread stuck like that
    would also block asyncio.run()'s executor shutdown, so the daemon could not exit. A daemon
    thread is simply abandoned on timeout and never delays shutdown.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def succeed(result: T) -> None:
        if not future.done():  # cancelled by the timeout
            future.set_result(result)

    def fail(error: BaseException) -> None:
        if not future.done():
            future.set_exception(error)

    def target() -> None:
        # RuntimeError from call_soon_threadsafe: the loop closed while we were blocked and
        # nobody is waiting any more.
        try:
            result = func()
        except BaseException as exc:  # handed to the awaiting coroutine
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(fail, exc)
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(succeed, result)

    threading.Thread(target=target, name="watchdog-blocking", daemon=True).start()
    return await asyncio.wait_for(future, timeout=timeout_seconds)


@dataclass(frozen=True, slots=True)
class CommandResult:
    """How an external command ended: its exit status and output, or why it has none."""

    returncode: int | None  # None: did not start, or was killed at the deadline
    stdout: bytes = b""
    stderr: bytes = b""
    stdout_truncated: bool = False
    error: str = ""  # "not found", "timed out after N s", OSError text

    @property
    def ok(self) -> bool:
        """True when the command ran to completion with exit status 0."""
        return self.returncode == 0


class CommandRunner(Protocol):
    """Runs a fixed argv somewhere (this host: run_command; a remote host: SshHost.run).

    Never raises for a failing command: the result says how it ended or why it did not run.
    """

    async def __call__(
        self, argv: Sequence[str], timeout_seconds: float, max_output_bytes: int = ...
    ) -> CommandResult:
        """Run `argv` within `timeout_seconds`, keeping at most `max_output_bytes` of stdout."""
        ...


async def _read_capped(stream: asyncio.StreamReader | None, max_bytes: int) -> tuple[bytes, bool]:
    if stream is None:
        return b"", False
    data = bytearray()
    truncated = False
    while chunk := await stream.read(65536):
        room = max_bytes - len(data)
        if room > 0:
            data += chunk[:room]
        if len(chunk) > room:
            truncated = True  # keep draining so the child never blocks on a full pipe
    return bytes(data), truncated


async def run_command(
    argv: Sequence[str], timeout_seconds: float, max_output_bytes: int = 1024 * 1024
) -> CommandResult:
    """Run argv (argv[0] looked up on PATH) with a deadline; the child never outlives the call.

    Output beyond `max_output_bytes` per stream is discarded. On timeout or cancellation the child
    is killed and reaped, so a hung journalctl, nvidia-smi or py-spy leaves nothing behind.
    """
    path = shutil.which(argv[0])
    if path is None:
        return CommandResult(None, error=f"{argv[0]} not found")
    try:
        proc = await asyncio.create_subprocess_exec(
            path,
            *argv[1:],
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            stdin=asyncio.subprocess.DEVNULL,
        )
    except OSError as exc:
        return CommandResult(None, error=f"{argv[0]} could not start: {exc.strerror or exc}")
    try:
        async with asyncio.timeout(timeout_seconds):
            (stdout, truncated), (stderr, _) = await asyncio.gather(
                _read_capped(proc.stdout, max_output_bytes),
                _read_capped(proc.stderr, STDERR_MAX_BYTES),
            )
            returncode = await proc.wait()
    except TimeoutError:
        await _kill(proc)
        return CommandResult(None, error=f"{argv[0]} timed out after {timeout_seconds:g} s")
    except BaseException:
        await asyncio.shield(_kill(proc))
        raise
    return CommandResult(returncode, stdout, stderr, truncated)


async def _kill(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    await proc.wait()
