"""A restart step waits until the unit's old processes are gone and its port is free (real systemd).

The prefill unit here runs with `KillMode=process`: its stop job ends when the main process
is gone, while a child that ignores SIGTERM keeps the listening socket for a few seconds more,
as an SGLang scheduler or detokenizer subprocess can. RestartUnit would start the new process
next to it; it would die on EADDRINUSE and the step would fail. StopUnit, the wait, then
StartUnit starts it once the child is gone: the new process binds and the step succeeds.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdsim.stack import free_ports
from sandbox.namespace import SystemdSandbox, UnitSpec
from watchdog.act.restarters import ReadyCheck, SystemdRestarter
from watchdog.act.systemd import SystemdClient
from watchdog.model import RestartPlan, RestartStep, Role

pytestmark = pytest.mark.sandbox

LINGER_SECONDS = 3.0

# The main process binds the port, then forks a child that keeps the socket, ignores SIGTERM and
# outlives the main process by LINGER_SECONDS. Each line of the log: "<event> <pid> <time>".
SERVER = """
import os, signal, socket, sys, time
port, log, linger = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
def note(event):
    with open(log, "a") as out:
        out.write(f"{event} {os.getpid()} {time.time()}\\n")
sock = socket.socket()
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    sock.bind(("127.0.0.1", port))
except OSError as exc:
    note("bind-failed")
    sys.exit(1)
sock.listen()
note("serving")
parent = os.getpid()
if os.fork() == 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while os.getppid() == parent:
        time.sleep(0.05)
    time.sleep(linger)
    note("child-exit")
    os._exit(0)
while True:
    time.sleep(3600)
"""


class ServingReadiness:
    """Ready once the prefill's log shows a new process serving (the others: at once)."""

    def __init__(self, log: Path, prefill_unit: str) -> None:
        self.log = log
        self.prefill_unit = prefill_unit
        self.serving_before = 0

    def serving(self) -> list[str]:
        """The log's lines of processes that bound the port."""
        return [line for line in self.log.read_text().splitlines() if line.startswith("serving")]

    async def check(self, step: RestartStep) -> ReadyCheck:
        """Ready when the unit's new process serves."""
        if step.unit != self.prefill_unit:
            return ReadyCheck(True, "ready")
        fresh = len(self.serving()) > self.serving_before
        return ReadyCheck(fresh, "a new process serves" if fresh else "no new process serving")


@pytest.fixture
def lingering(sandbox_available: None) -> Iterator[tuple[SystemdSandbox, int, Path]]:
    """A sandbox with a KillMode=process prefill whose child lingers, and two plain units."""
    (port,) = free_ports(1)
    sandbox = SystemdSandbox(host_paths=[Path(sys.prefix)])
    script = sandbox.share_dir / "server.py"
    script.write_text(SERVER)
    log = sandbox.share_dir / "server.log"
    log.touch()
    argv = [sys.executable, str(script), str(port), str(log), str(LINGER_SECONDS)]
    sandbox.add_unit(UnitSpec("linger-prefill.service", argv, extra_service=["KillMode=process"]))
    for name in ("linger-decode.service", "linger-router.service"):
        sandbox.add_unit(UnitSpec(name, ["/bin/sleep", "infinity"]))
    with sandbox:
        yield sandbox, port, log


def plan(port: int) -> RestartPlan:
    """The co-restart of the three units; the prefill listens on `port`."""
    steps = (
        RestartStep(
            Role.PREFILL,
            "linger-prefill.service",
            f"http://127.0.0.1:{port}/health",
            60.0,
            ports=(("127.0.0.1", port),),
            clear_timeout_seconds=60.0,
        ),
        RestartStep(Role.DECODE, "linger-decode.service", "http://127.0.0.1:1/health", 60.0),
        RestartStep(Role.ROUTER, "linger-router.service", "http://127.0.0.1:1/readiness", 60.0),
    )
    return RestartPlan(group="linger", trigger="test", steps=steps)


async def test_the_new_process_starts_after_the_lingering_child_is_gone(
    lingering: tuple[SystemdSandbox, int, Path],
) -> None:
    """The step waits for the child (PID listed, port busy) and then starts: it serves again."""
    sandbox, port, log = lingering
    readiness = ServingReadiness(log, "linger-prefill.service")
    deadline = time.monotonic() + 60
    while not readiness.serving():
        assert time.monotonic() < deadline, sandbox.unit_log("linger-prefill.service")
        await asyncio.sleep(0.1)
    readiness.serving_before = len(readiness.serving())
    async with SystemdClient(sandbox.bus_address) as client:
        restarter = SystemdRestarter(client, readiness, poll_seconds=0.1)
        outcome = await restarter.execute(plan(port))
    lines = log.read_text()
    assert outcome.ok, (outcome, lines, sandbox.unit_log("linger-prefill.service"))
    prefill = outcome.steps[0]
    assert prefill.clear.startswith("clear after "), prefill.clear
    assert "still in the unit" in prefill.clear
    assert f"127.0.0.1:{port} still accepting connections" in prefill.clear
    events = [line.split() for line in lines.splitlines()]
    child_exit = next(float(at) for event, _, at in events if event == "child-exit")
    second_start = [float(at) for event, _, at in events if event == "serving"][1]
    assert second_start >= child_exit, lines
    assert not [e for e in events if e[0] == "bind-failed"], lines
