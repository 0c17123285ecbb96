"""systemd's notify protocol (sd_notify) with the standard library, and the gate for watchdog pings.

Sending is a no-op without `NOTIFY_SOCKET` and never raises: a lost notification is logged, because
a watchdog that dies of its own bookkeeping is worse than one systemd briefly thinks is slow.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

import structlog

log = structlog.get_logger(__name__)


class Notifier:
    """Sends `KEY=value` datagrams to systemd's notify socket (or nowhere, without one)."""

    def __init__(self, address: str | None) -> None:
        self.address = address or None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> Notifier:
        """The notifier systemd asked for through `NOTIFY_SOCKET` (none when unset)."""
        return cls(environ.get("NOTIFY_SOCKET"))

    @property
    def enabled(self) -> bool:
        """Whether messages go anywhere."""
        return self.address is not None

    def notify(self, message: str) -> bool:
        """Send one message; True when it was handed to the socket, False otherwise (logged)."""
        if self.address is None:
            return False
        # A leading "@" names a socket in the abstract namespace (sd_notify(3)).
        target = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                # Non-blocking: a full receive queue in systemd must not stall the event loop.
                sock.setblocking(False)
                sock.connect(target)
                sock.sendall(message.encode("utf-8"))
        except OSError as exc:
            log.warning(
                "sd_notify_failed",
                socket=self.address,
                message=message.split("=", 1)[0],
                error=exc.strerror or str(exc),
            )
            return False
        return True

    def ready(self) -> bool:
        """Startup finished: the metrics listener is bound and the bus is connected."""
        return self.notify("READY=1")

    def status(self, text: str) -> bool:
        """A one-line status for `systemctl status`."""
        # A newline would start a new assignment (e.g. a group name smuggling "READY=1").
        return self.notify("STATUS=" + " ".join(text.splitlines()))

    def watchdog_ping(self) -> bool:
        """Tell systemd the main loop is alive (only after a completed cycle, see LivenessGate)."""
        return self.notify("WATCHDOG=1")

    def stopping(self) -> bool:
        """Shutdown has begun."""
        return self.notify("STOPPING=1")


def ready() -> bool:
    """READY=1 to the notify socket of this process's environment."""
    return Notifier.from_environ().ready()


def status(text: str) -> bool:
    """STATUS=<text> to the notify socket of this process's environment."""
    return Notifier.from_environ().status(text)


def watchdog_ping() -> bool:
    """WATCHDOG=1 to the notify socket of this process's environment."""
    return Notifier.from_environ().watchdog_ping()


def stopping() -> bool:
    """STOPPING=1 to the notify socket of this process's environment."""
    return Notifier.from_environ().stopping()


def watchdog_interval_seconds(
    environ: Mapping[str, str] = os.environ, pid: int | None = None
) -> float | None:
    """systemd's WatchdogSec= for this process (from WATCHDOG_USEC), or None when it is not on.

    WATCHDOG_PID, when set, names the process that must ping; a child that inherited the
    environment gets None.
    """
    usec = environ.get("WATCHDOG_USEC", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    owner = environ.get("WATCHDOG_PID")
    if owner is not None and owner != str(os.getpid() if pid is None else pid):
        return None
    return int(usec) / 1_000_000


class LivenessGate:
    """Allows a watchdog ping only while the main loop keeps completing cycles.

    Pings come from proof of progress, never from a free-running timer: a wedged loop stops
    completing cycles, the gate closes, and systemd restarts the process after WatchdogSec.
    With `watchdog_seconds` None (WatchdogSec= not set) the gate never opens: nobody listens.
    """

    def __init__(self, watchdog_seconds: float | None) -> None:
        if watchdog_seconds is not None and watchdog_seconds <= 0:
            raise ValueError(f"watchdog_seconds must be positive, got {watchdog_seconds!r}")
        # Half of WatchdogSec, as sd_watchdog_enabled(3) recommends, so one late cycle is tolerated.
        self.fresh_seconds = None if watchdog_seconds is None else watchdog_seconds / 2
        self._last_cycle_at: float | None = None

    def cycle_completed(self, now: float) -> None:
        """The main loop finished a cycle at `now` (monotonic seconds)."""
        self._last_cycle_at = now

    def should_ping(self, now: float) -> bool:
        """True when a cycle completed within the last half WatchdogSec."""
        if self._last_cycle_at is None or self.fresh_seconds is None:
            return False
        return now - self._last_cycle_at <= self.fresh_seconds
