"""Between a unit's stop and its start: wait until its old processes are gone and its ports free.

A restart step is StopUnit, this wait, then StartUnit (not RestartUnit, which starts the new
process as soon as the stop job ends). The stop job ends when systemd is done with the unit's
main process; with `KillMode=process` or `mixed`, or a child that ignores SIGTERM within
`TimeoutStopSec`, processes of the old generation can outlive it, still holding the HTTP or
bootstrap port (the new server then dies on EADDRINUSE, or worse, the old one answers its
health checks) or GPU memory. So each step waits, up to `restart.clear_timeout_seconds`, until
systemd lists no process in the unit's control group and nothing accepts connections on the
unit's ports. At the deadline it starts the unit anyway: a unit left stopped by the watchdog is
worse than one whose start fails visibly; what was still there is reported with the step.

Reads that cannot say (the bus refused GetUnitProcesses, a port that neither accepts nor
refuses) do not hold the start: they are reported as unknown.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from watchdog.errors import SystemdError
from watchdog.model import RestartStep

# True: something accepts connections there; False: refused (free); None: cannot tell.
PortProbe = Callable[[str, int], Awaitable[bool | None]]
PORT_CONNECT_TIMEOUT_SECONDS = 1.0


class UnitProcesses(Protocol):
    """The one systemd read the wait needs (SystemdClient and UnitBuses implement it)."""

    async def unit_processes(self, unit: str) -> tuple[int, ...]:
        """The PIDs in the unit's control group."""
        ...


async def port_accepting(host: str, port: int) -> bool | None:
    """Whether a TCP connection to host:port is accepted now (None: no answer either way)."""
    try:
        async with asyncio.timeout(PORT_CONNECT_TIMEOUT_SECONDS):
            _, writer = await asyncio.open_connection(host, port)
    except ConnectionRefusedError:
        return False
    except (OSError, TimeoutError):
        return None
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


@dataclass(frozen=True, slots=True)
class ClearCheck:
    """One look at what of the unit's old generation is still there."""

    pids: tuple[int, ...] = ()
    busy_ports: tuple[tuple[str, int], ...] = ()
    unknown: tuple[str, ...] = ()  # what could not be read, and why

    @property
    def clear(self) -> bool:
        """Nothing known to be left (unknowns do not hold the start)."""
        return not self.pids and not self.busy_ports

    def leftovers(self) -> str:
        """What was still there, for people ("PIDs 12, 13 in the unit; 127.0.0.1:30000 ...")."""
        parts = []
        if self.pids:
            parts.append("PID(s) " + ", ".join(map(str, self.pids)) + " still in the unit")
        if self.busy_ports:
            ports = ", ".join(f"{host}:{port}" for host, port in self.busy_ports)
            parts.append(f"{ports} still accepting connections")
        return "; ".join(parts)


async def look(units: UnitProcesses, step: RestartStep, probe: PortProbe) -> ClearCheck:
    """Read the unit's processes and probe its ports once."""
    unknown: list[str] = []
    try:
        pids = await units.unit_processes(step.unit)
    except SystemdError as exc:
        pids = ()
        unknown.append(f"processes unknown ({exc})")
    busy: list[tuple[str, int]] = []
    for host, port in step.ports:
        accepting = await probe(host, port)
        if accepting:
            busy.append((host, port))
        elif accepting is None:
            unknown.append(f"{host}:{port} gave no answer")
    return ClearCheck(tuple(pids), tuple(busy), tuple(unknown))


async def wait_until_clear(
    units: UnitProcesses,
    step: RestartStep,
    *,
    timeout_seconds: float,
    poll_seconds: float,
    shutdown: asyncio.Event,
    probe: PortProbe = port_accepting,
) -> str:
    """Wait until nothing of the old generation is left; return how it went, for the report.

    Returns at the deadline or on a shutdown request too (the caller starts the unit anyway).
    """
    loop = asyncio.get_running_loop()
    began = loop.time()
    deadline = began + max(timeout_seconds, 0.0)
    waited_for: list[str] = []
    while True:
        check = await look(units, step, probe)
        took = loop.time() - began
        if check.clear:
            return _clear_line(took, waited_for, check.unknown)
        if check.leftovers() not in waited_for:
            waited_for.append(check.leftovers())
        if shutdown.is_set():
            return f"shutdown requested, started without waiting: {check.leftovers()}"
        if loop.time() >= deadline:
            return (
                f"not clear after {timeout_seconds:g} s, started anyway: {check.leftovers()}"
                + _unknown_suffix(check.unknown)
            )
        stop = asyncio.ensure_future(shutdown.wait())
        try:
            await asyncio.wait({stop}, timeout=min(poll_seconds, max(deadline - loop.time(), 0)))
        finally:
            stop.cancel()


def _clear_line(took: float, waited_for: Sequence[str], unknown: Sequence[str]) -> str:
    line = f"clear after {took:.1f} s"
    if waited_for:
        line += " (waited for: " + " / ".join(waited_for) + ")"
    return line + _unknown_suffix(unknown)


def _unknown_suffix(unknown: Sequence[str]) -> str:
    return "; " + "; ".join(unknown) if unknown else ""
