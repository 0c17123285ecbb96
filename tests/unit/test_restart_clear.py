"""Each restart step: stop, wait until the old processes are gone and the ports free, then start.

Against the fakes of test_restart_plan.py; tests/sandbox/test_clear_before_start.py does the same
against a real systemd with a process that outlives its unit's stop job.
"""

from __future__ import annotations

import asyncio
import dataclasses

from tests.unit.test_restart_plan import D, FakeReadiness, FakeUnits, P, R, plan_of, restarter
from watchdog.act.clear import ClearCheck, look
from watchdog.act.plan import format_outcome
from watchdog.act.restarters import SystemdRestarter
from watchdog.errors import AccessDenied, JobFailed
from watchdog.model import RestartPlan

PORT = ("127.0.0.1", 30000)


def with_ports(plan: RestartPlan, clear_timeout_seconds: float = 60.0) -> RestartPlan:
    """The plan with every step listening on PORT."""
    steps = tuple(
        dataclasses.replace(s, ports=(PORT,), clear_timeout_seconds=clear_timeout_seconds)
        for s in plan.steps
    )
    return dataclasses.replace(plan, steps=steps)


class LookingUnits(FakeUnits):
    """FakeUnits that also record each look at a unit's processes, in order with the jobs."""

    async def unit_processes(self, unit: str) -> tuple[int, ...]:
        self.calls.append(("look", unit))
        return await super().unit_processes(unit)


class ScriptedPorts:
    """A port probe answering from a script per look (the last answer repeating)."""

    def __init__(self, answers: list[bool | None]) -> None:
        self.answers = answers
        self.looks = 0

    async def __call__(self, host: str, port: int) -> bool | None:
        self.looks += 1
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


async def test_start_waits_until_the_old_processes_are_gone() -> None:
    """PIDs left in the unit after its stop job hold the start until systemd lists none."""
    units, ready = LookingUnits(), FakeReadiness()
    units.leftovers["p.service"] = [(41, 42), (42,), ()]
    outcome = await restarter(units, ready).execute(plan_of(P, D, R))
    assert outcome.ok, outcome
    assert units.calls[:6] == [
        ("stop", "p.service"),
        ("look", "p.service"),
        ("look", "p.service"),
        ("look", "p.service"),
        ("start", "p.service"),
        ("active", "p.service"),
    ]
    clear = outcome.steps[0].clear
    assert clear.startswith("clear after ")
    assert clear.endswith(
        "(waited for: PID(s) 41, 42 still in the unit / PID(s) 42 still in the unit)"
    )
    assert "stopped, before its start: clear after" in format_outcome(outcome)


async def test_start_waits_until_the_port_is_free() -> None:
    """A port still accepting connections after the stop holds the start until it refuses."""
    units, ready = LookingUnits(), FakeReadiness()
    ports = ScriptedPorts([True, True, False])
    restart = SystemdRestarter(units, ready, poll_seconds=0.01, port_probe=ports)
    outcome = await restart.execute(with_ports(plan_of(P, D, R)))
    assert outcome.ok, outcome
    assert ports.looks == 3 + 1 + 1  # prefill's port twice busy, then each unit's free at once
    assert units.calls[:5] == [
        ("stop", "p.service"),
        ("look", "p.service"),
        ("look", "p.service"),
        ("look", "p.service"),
        ("start", "p.service"),
    ]
    assert "127.0.0.1:30000 still accepting connections" in outcome.steps[0].clear


async def test_not_clear_by_the_deadline_starts_anyway_and_says_what_was_left() -> None:
    """A leftover that never goes: the unit is started at the deadline (never left stopped)."""
    units, ready = LookingUnits(), FakeReadiness()
    units.leftovers["p.service"] = [(77,)]
    restart = SystemdRestarter(units, ready, poll_seconds=0.01, port_probe=ScriptedPorts([True]))
    outcome = await restart.execute(with_ports(plan_of(P, D, R), clear_timeout_seconds=0.05))
    assert outcome.ok, outcome
    assert ("start", "p.service") in units.calls
    assert outcome.steps[0].clear == (
        "not clear after 0.05 s, started anyway: PID(s) 77 still in the unit; "
        "127.0.0.1:30000 still accepting connections"
    )


async def test_a_failed_stop_job_still_starts_the_unit_and_fails_the_step() -> None:
    """The watchdog never leaves a unit stopped: after a failed stop it starts it, then stops."""
    units, ready = LookingUnits(), FakeReadiness()
    units.stop_results["p.service"] = "timeout"
    outcome = await restarter(units, ready).execute(plan_of(P, D, R))
    assert units.calls == [("stop", "p.service"), ("start", "p.service")]
    failed = outcome.failed_step
    assert failed is not None
    assert failed.phase == "stop_job"
    assert failed.detail.endswith("; the unit was started again")
    assert [s.phase for s in outcome.steps[1:]] == ["not_started", "not_started"]


async def test_a_failed_stop_and_start_name_both() -> None:
    """Both jobs failing: the detail says the start failed too."""
    units, ready = LookingUnits(), FakeReadiness()
    units.stop_results["p.service"] = "timeout"
    units.job_results["p.service"] = JobFailed("p.service", "failed")
    outcome = await restarter(units, ready).execute(plan_of(P, D, R))
    failed = outcome.failed_step
    assert failed is not None
    assert "starting it again failed too" in failed.detail


async def test_shutdown_during_the_wait_starts_the_unit_at_once() -> None:
    """A shutdown request while leftovers remain: start now (never leave it stopped), stop after."""
    units, ready = LookingUnits(), FakeReadiness()
    units.leftovers["p.service"] = [(5,)]
    shutdown = asyncio.Event()
    original = units.unit_processes

    async def unit_processes(unit: str) -> tuple[int, ...]:
        shutdown.set()
        return await original(unit)

    units.unit_processes = unit_processes  # type: ignore[method-assign]
    outcome = await restarter(units, ready, shutdown).execute(plan_of(P, D, R))
    assert outcome.interrupted
    assert ("start", "p.service") in units.calls
    assert not [call for call in units.calls if call[1] != "p.service"]
    assert outcome.steps[0].clear == (
        "shutdown requested, started without waiting: PID(s) 5 still in the unit"
    )


async def test_unreadable_processes_do_not_hold_the_start() -> None:
    """A bus that refuses GetUnitProcesses: reported as unknown, the start goes ahead."""
    units = LookingUnits()

    async def denied(unit: str) -> tuple[int, ...]:
        raise AccessDenied("GetUnitProcesses p.service: access denied")

    units.unit_processes = denied  # type: ignore[method-assign]
    check = await look(units, plan_of(P).steps[0], ScriptedPorts([None]))
    assert check.clear
    assert check.unknown[0].startswith("processes unknown (")


def test_leftovers_name_pids_and_ports() -> None:
    """The line people read names both kinds of leftover."""
    check = ClearCheck(pids=(1, 2), busy_ports=(PORT,))
    assert not check.clear
    assert check.leftovers() == (
        "PID(s) 1, 2 still in the unit; 127.0.0.1:30000 still accepting connections"
    )
