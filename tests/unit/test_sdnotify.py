"""sd_notify over a real AF_UNIX datagram socket, WATCHDOG_USEC parsing and the liveness gate."""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from watchdog.run import sdnotify
from watchdog.run.sdnotify import LivenessGate, Notifier, watchdog_interval_seconds


@pytest.fixture
def listener() -> Iterator[tuple[str, socket.socket]]:
    """A datagram socket standing in for systemd's notify socket, at a short path."""
    # A short directory: AF_UNIX paths are limited to 108 bytes, pytest's tmp_path can be longer.
    with (
        tempfile.TemporaryDirectory(prefix="sdn") as directory,
        socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock,
    ):
        path = str(Path(directory) / "notify")
        sock.bind(path)
        # A safety net so a broken sender fails the test instead of hanging it; never an assertion.
        sock.settimeout(10)
        yield path, sock


def test_without_notify_socket_nothing_is_sent() -> None:
    """Outside systemd (no NOTIFY_SOCKET) every call is a silent no-op."""
    notifier = Notifier.from_environ({})
    assert not notifier.enabled
    assert notifier.ready() is False
    assert notifier.watchdog_ping() is False


def test_from_environ_reads_notify_socket() -> None:
    """NOTIFY_SOCKET names the address."""
    assert Notifier.from_environ({"NOTIFY_SOCKET": "/run/x"}).address == "/run/x"


@pytest.mark.parametrize(
    ("send", "expected"),
    [
        (lambda n: n.ready(), b"READY=1"),
        (lambda n: n.watchdog_ping(), b"WATCHDOG=1"),
        (lambda n: n.stopping(), b"STOPPING=1"),
        (lambda n: n.status("dsv4: healthy"), b"STATUS=dsv4: healthy"),
    ],
)
def test_messages_arrive_on_the_socket(
    listener: tuple[str, socket.socket], send: Callable[[Notifier], bool], expected: bytes
) -> None:
    """Each call delivers its exact datagram to the notify socket."""
    path, sock = listener
    notifier = Notifier(path)
    assert send(notifier) is True
    assert sock.recv(4096) == expected


def test_module_functions_use_notify_socket_from_the_environment(
    listener: tuple[str, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    """sdnotify.ready()/status()/watchdog_ping()/stopping() send to $NOTIFY_SOCKET."""
    path, sock = listener
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    assert sdnotify.ready()
    assert sdnotify.status("ok")
    assert sdnotify.watchdog_ping()
    assert sdnotify.stopping()
    received = [sock.recv(4096) for _ in range(4)]
    assert received == [b"READY=1", b"STATUS=ok", b"WATCHDOG=1", b"STOPPING=1"]


def test_module_functions_are_no_ops_outside_systemd(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without NOTIFY_SOCKET the module functions send nothing and do not fail."""
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.ready() is False


def test_status_cannot_smuggle_other_assignments(listener: tuple[str, socket.socket]) -> None:
    """Newlines in a status text are flattened, so it stays one STATUS= assignment."""
    path, sock = listener
    Notifier(path).status("group x\nREADY=1")
    assert sock.recv(4096) == b"STATUS=group x READY=1"


def test_abstract_socket_address() -> None:
    """A leading @ addresses a socket in the abstract namespace."""
    name = f"sglang-watchdog-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(10)
        assert Notifier("@" + name).ready() is True
        assert sock.recv(4096) == b"READY=1"


def test_send_failure_is_logged_not_raised(tmp_path: Path) -> None:
    """A notify socket that does not exist yields False and an sd_notify_failed event."""
    with capture_logs() as logs:
        assert Notifier(str(tmp_path / "missing")).ready() is False
    assert logs == [
        {
            "event": "sd_notify_failed",
            "log_level": "warning",
            "socket": str(tmp_path / "missing"),
            "message": "READY",
            "error": "No such file or directory",
        }
    ]


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, None),
        ({"WATCHDOG_USEC": "30000000"}, 30.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "4242"}, 30.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({"WATCHDOG_USEC": "-5"}, None),
    ],
)
def test_watchdog_interval_seconds(environ: dict[str, str], expected: float | None) -> None:
    """WatchdogSec= comes from WATCHDOG_USEC, only for the process WATCHDOG_PID names."""
    assert watchdog_interval_seconds(environ, pid=4242) == expected


def test_gate_stays_closed_before_the_first_cycle() -> None:
    """No ping before the main loop has completed any cycle."""
    assert not LivenessGate(30).should_ping(now=100.0)


@pytest.mark.parametrize(("elapsed", "expected"), [(0.0, True), (15.0, True), (15.5, False)])
def test_gate_opens_only_within_half_the_watchdog_interval(elapsed: float, expected: bool) -> None:
    """A ping is allowed only if a cycle completed within the last half WatchdogSec."""
    gate = LivenessGate(30)
    gate.cycle_completed(now=100.0)
    assert gate.should_ping(now=100.0 + elapsed) is expected


def test_gate_reopens_when_cycles_resume() -> None:
    """A wedged loop closes the gate; the next completed cycle opens it again."""
    gate = LivenessGate(10)
    gate.cycle_completed(now=0.0)
    assert not gate.should_ping(now=60.0)
    gate.cycle_completed(now=61.0)
    assert gate.should_ping(now=62.0)


def test_gate_never_opens_without_watchdog_sec() -> None:
    """Without WatchdogSec= (interval None) there is nobody to ping."""
    gate = LivenessGate(None)
    gate.cycle_completed(now=0.0)
    assert not gate.should_ping(now=0.0)


def test_gate_rejects_a_non_positive_interval() -> None:
    """WatchdogSec must be positive."""
    with pytest.raises(ValueError, match="positive"):
        LivenessGate(0)
