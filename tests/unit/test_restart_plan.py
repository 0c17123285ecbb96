"""Co-restart plans, the never-decode-alone guard, refusals, and the restarters against fakes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from structlog.testing import capture_logs

from watchdog.act.plan import (
    REASON_DECODE_WITHOUT_PREFILL,
    REASON_PARTIAL,
    REASON_PREFILL_WITHOUT_DECODE,
    build_plan,
    format_outcome,
    format_plan,
    guard_plan,
    plan_for_request,
    refusal_message,
    refusal_reason,
    resolve_roles,
)
from watchdog.act.restarters import (
    DryRunRestarter,
    HttpReadiness,
    ReadyCheck,
    SystemdRestarter,
    execute_locked,
)
from watchdog.config import DECODE_ONLY_EXPLANATION, GroupSection, parse_config
from watchdog.errors import JobFailed, LockHeld, NoSuchUnit, RestartRefused, UsageError
from watchdog.model import RestartPlan, RestartStep, Role, UnitState
from watchdog.statefiles import RestartHistory, RestartLock

P, D, R = Role.PREFILL, Role.DECODE, Role.ROUTER


def make_group(**restart: Any) -> GroupSection:
    """A valid one-group config's group, with restart-section overrides."""
    data = {
        "group": [
            {
                "name": "g1",
                "prefill": {"unit": "p.service", "url": "http://127.0.0.1:30000"},
                "decode": {"unit": "d.service", "url": "http://127.0.0.1:30002"},
                "router": {"unit": "r.service", "url": "http://127.0.0.1:30001"},
                "probe": {"timeout_seconds": 1, "stream_idle_seconds": 1},
                "restart": {"ready_timeout_seconds": 30, "verify_timeout_seconds": 30, **restart},
            }
        ]
    }
    return parse_config(data, "test.toml").group[0]


GROUP = make_group()


def plan_of(*roles: Role, timeout: float = 5.0) -> RestartPlan:
    """A hand-built plan (bypassing build_plan) to feed the guard and the restarters."""
    full = build_plan(make_group(ready_timeout_seconds=max(timeout, 2.0)), "test")
    by_role = {s.role: s for s in full.steps}
    steps = tuple(
        RestartStep(s.role, s.unit, s.ready_url, timeout, s.expect_workers)
        for s in (by_role[r] for r in roles)
    )
    return RestartPlan(group="g1", trigger="test", steps=steps)


# --- plans and the guard --------------------------------------------------------------------------


def test_plan_follows_configured_order_with_readiness_urls() -> None:
    """build_plan lists prefill, decode, router with /health, /health, /readiness and the timeout."""
    plan = build_plan(GROUP, "probe_failures")
    assert plan.group == "g1"
    assert plan.trigger == "probe_failures"
    assert [(s.role, s.unit, s.ready_url, s.ready_timeout_seconds) for s in plan.steps] == [
        (P, "p.service", "http://127.0.0.1:30000/health", 30.0),
        (D, "d.service", "http://127.0.0.1:30002/health", 30.0),
        (R, "r.service", "http://127.0.0.1:30001/readiness", 30.0),
    ]
    assert plan.steps[2].expect_workers == ("http://127.0.0.1:30000", "http://127.0.0.1:30002")
    assert plan.steps[0].expect_workers == ()


@pytest.mark.parametrize(
    ("roles", "reason"),
    [
        ((P, D, R), None),
        ((P, D), None),
        ((R,), None),
        ((), None),
        ((D,), REASON_DECODE_WITHOUT_PREFILL),
        ((D, R), REASON_DECODE_WITHOUT_PREFILL),
        ((D, P, R), REASON_DECODE_WITHOUT_PREFILL),
        ((R, D, P), REASON_DECODE_WITHOUT_PREFILL),
        ((P,), REASON_PREFILL_WITHOUT_DECODE),
        ((P, R), REASON_PREFILL_WITHOUT_DECODE),
    ],
)
def test_guard_plan_table(roles: tuple[Role, ...], reason: str | None) -> None:
    """guard_plan refuses decode without prefill before it, and prefill without decode after it."""
    plan = plan_of(*roles)
    if reason is None:
        guard_plan(plan)
        return
    with pytest.raises(RestartRefused) as info:
        guard_plan(plan)
    assert info.value.reason == reason


def test_guard_message_explains_bootstrap_degradation() -> None:
    """The guard's refusal names the plan and carries the shared decode-only explanation."""
    with pytest.raises(RestartRefused) as info:
        guard_plan(plan_of(D, R))
    assert str(info.value) == (
        f"refusing plan decode -> router for group 'g1': {DECODE_ONLY_EXPLANATION}"
    )


@pytest.mark.parametrize(
    ("requested", "reason"),
    [
        ((P, D, R), None),
        ((R,), None),
        ((D,), REASON_DECODE_WITHOUT_PREFILL),
        ((D, R), REASON_DECODE_WITHOUT_PREFILL),
        ((P,), REASON_PREFILL_WITHOUT_DECODE),
        ((P, R), REASON_PREFILL_WITHOUT_DECODE),
        ((P, D), REASON_PARTIAL),
    ],
)
def test_refusal_reason_table(requested: tuple[Role, ...], reason: str | None) -> None:
    """Only the full co-restart or the router alone may be requested by hand."""
    assert refusal_reason(requested) == reason


def test_decode_only_refusal_message_is_exact() -> None:
    """`restart --unit decode` explains the degradation and offers the co-restart command."""
    message = refusal_message(GROUP, (D,), REASON_DECODE_WITHOUT_PREFILL, "/etc/w.toml")
    assert message == (
        "refused to restart decode of group 'g1' (decode_without_prefill): "
        f"{DECODE_ONLY_EXPLANATION}.\n"
        "Run the safe co-restart instead: watchdog restart --config /etc/w.toml --group g1"
    )


def test_prefill_only_and_partial_messages_name_their_reason() -> None:
    """Prefill alone and prefill+decode get their own explanations, both offering the co-restart."""
    prefill = refusal_message(GROUP, (P,), REASON_PREFILL_WITHOUT_DECODE, "w.toml")
    assert "leaves decode holding KV-transfer bootstrap state for the old prefill" in prefill
    partial = refusal_message(GROUP, (P, D), REASON_PARTIAL, "w.toml")
    assert partial.startswith("refused to restart prefill, decode of group 'g1' (partial_restart)")
    for text in (prefill, partial):
        assert text.endswith("watchdog restart --config w.toml --group g1")


def test_plan_for_request_refuses_logs_and_counts() -> None:
    """A refused request is logged as restart_refused and reported to the refusal callback."""
    counted: list[tuple[str, str]] = []
    with capture_logs() as logs, pytest.raises(RestartRefused) as info:
        plan_for_request(
            GROUP, (D,), "manual", config="w.toml", on_refused=lambda g, r: counted.append((g, r))
        )
    assert info.value.reason == REASON_DECODE_WITHOUT_PREFILL
    assert counted == [("g1", REASON_DECODE_WITHOUT_PREFILL)]
    assert [e["event"] for e in logs] == ["restart_refused"]
    assert logs[0]["roles"] == ["decode"]


def test_plan_for_request_router_alone_and_full() -> None:
    """The router alone is a one-step plan; all three roles give the configured co-restart."""
    router = plan_for_request(GROUP, (R,), "manual", config="w.toml")
    assert [s.role for s in router.steps] == [R]
    full = plan_for_request(GROUP, (R, D, P), "manual", config="w.toml")
    assert [s.role for s in full.steps] == [P, D, R]


def test_resolve_roles_accepts_roles_and_unit_names_in_config_order() -> None:
    """--unit takes role names, unit names, or unit names without .service; order is the config's."""
    assert resolve_roles(GROUP, ["router", "d.service", "p"]) == (P, D, R)
    assert resolve_roles(GROUP, ["decode", "decode"]) == (D,)
    with pytest.raises(UsageError) as info:
        resolve_roles(GROUP, ["nope"])
    assert str(info.value) == (
        "--unit 'nope' is not a role or unit of group 'g1' "
        "(known: prefill, decode, router, p.service, d.service, r.service)"
    )


def test_format_plan_lists_sequence_timeouts_and_checks() -> None:
    """`watchdog plan` text: numbered steps with every check and the step timeout."""
    text = format_plan(build_plan(GROUP, "manual"))
    lines = text.splitlines()
    assert lines[0] == (
        "group g1 (trigger: manual): restart 3 unit(s) in this order, each step within 30 s "
        "(restart.ready_timeout_seconds)"
    )
    assert lines[1] == "  1. prefill  p.service"
    assert lines[2:5] == [
        '       StopUnit("p.service", "replace"), wait for JobRemoved result "done"',
        "       wait up to 60 s for no process left in the unit, 127.0.0.1:30000 refusing "
        "connections",
        '       StartUnit("p.service", "replace"), wait for JobRemoved result "done"',
    ]
    assert "       wait for GET http://127.0.0.1:30001/readiness -> 200" in lines
    assert (
        "       wait for GET http://127.0.0.1:30001/workers to list http://127.0.0.1:30000 and "
        "http://127.0.0.1:30002 as healthy"
    ) in lines


# --- fakes ----------------------------------------------------------------------------------------


class FakeUnits:
    """A UnitController that records its jobs; behaviour per unit is scripted.

    `job_results` script the start job (a stop that succeeds and a start that fails is what a
    failing server looks like), `stop_results` the stop job, `leftovers` the PIDs the unit still
    holds after its stop (one entry per look, the last one repeating).
    """

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.job_results: dict[str, str | Exception] = {}
        self.stop_results: dict[str, str | Exception] = {}
        self.leftovers: dict[str, list[tuple[int, ...]]] = {}
        self.active_errors: dict[str, Exception] = {}
        self.states: dict[str, str] = {}
        self.job_gate: asyncio.Event | None = None  # when set, start jobs wait for it

    async def stop_unit(self, unit: str, *, timeout_seconds: float) -> str:
        self.calls.append(("stop", unit))
        return _job_result(unit, self.stop_results.get(unit, "done"))

    async def start_unit(self, unit: str, *, timeout_seconds: float) -> str:
        self.calls.append(("start", unit))
        if self.job_gate is not None:
            await self.job_gate.wait()
        return _job_result(unit, self.job_results.get(unit, "done"))

    async def unit_processes(self, unit: str) -> tuple[int, ...]:
        script = self.leftovers.get(unit, [()])
        return script.pop(0) if len(script) > 1 else script[0]

    async def wait_for_active(self, role: Role, unit: str, *, timeout_seconds: float) -> UnitState:
        self.calls.append(("active", unit))
        if unit in self.active_errors:
            raise self.active_errors[unit]
        return UnitState(role=role, unit=unit, ok=True, active_state="active")

    async def read_unit(self, role: Role, unit: str) -> UnitState:
        state = self.states.get(unit, "active")
        return UnitState(role=role, unit=unit, ok=True, active_state=state, sub_state="x")


def _job_result(unit: str, result: str | Exception) -> str:
    if isinstance(result, Exception):
        raise result
    if result != "done":
        raise JobFailed(unit, result)
    return result


async def ports_free(host: str, port: int) -> bool | None:
    """A port probe that finds every port free (the unit tests' ports are only numbers)."""
    return False


class FakeReadiness:
    """Readiness answers scripted per unit: a list consumed in order, the last one repeating."""

    def __init__(self, answers: dict[str, list[bool]] | None = None) -> None:
        self.answers = answers or {}
        self.checked: list[str] = []
        self.on_check: Callable[[RestartStep], None] | None = None

    async def check(self, step: RestartStep) -> ReadyCheck:
        self.checked.append(step.unit)
        if self.on_check is not None:
            self.on_check(step)
        script = self.answers.get(step.unit, [True])
        ok = script.pop(0) if len(script) > 1 else script[0]
        return ReadyCheck(ok, f"{step.unit} {'ready' if ok else 'not ready'}")


def restarter(
    units: FakeUnits, ready: FakeReadiness, shutdown: asyncio.Event | None = None
) -> SystemdRestarter:
    """A SystemdRestarter over fakes with a fast poll."""
    return SystemdRestarter(
        units, ready, shutdown_requested=shutdown, poll_seconds=0.01, port_probe=ports_free
    )


# --- SystemdRestarter -----------------------------------------------------------------------------


async def test_restarter_runs_steps_in_order_each_ready_before_next() -> None:
    """Each unit is restarted, awaited active and ready before the next one is touched."""
    units, ready = FakeUnits(), FakeReadiness({"p.service": [False, False, True]})
    with capture_logs() as logs:
        outcome = await restarter(units, ready).execute(plan_of(P, D, R))
    assert outcome.ok
    assert not outcome.dry_run
    assert units.calls == [
        *[("stop", "p.service"), ("start", "p.service"), ("active", "p.service")],
        *[("stop", "d.service"), ("start", "d.service"), ("active", "d.service")],
        *[("stop", "r.service"), ("start", "r.service"), ("active", "r.service")],
    ]
    assert {s.clear for s in outcome.steps} == {"clear after 0.0 s"}
    assert ready.checked == ["p.service"] * 3 + ["d.service", "r.service"]
    assert [(s.unit, s.ok, s.phase) for s in outcome.steps] == [
        ("p.service", True, "ready"),
        ("d.service", True, "ready"),
        ("r.service", True, "ready"),
    ]
    events = [e["event"] for e in logs]
    assert events == [
        "restart_planned",
        *["unit_restart_started", "unit_restart_finished"] * 3,
        "restart_sequence_finished",
    ]
    assert logs[0]["sequence"] == ["p.service", "d.service", "r.service"]


async def test_failed_job_stops_sequence_and_names_step() -> None:
    """A start job that ends 'failed' stops the sequence; later units are never touched."""
    units, ready = FakeUnits(), FakeReadiness()
    units.job_results["d.service"] = "failed"
    with capture_logs() as logs:
        outcome = await restarter(units, ready).execute(plan_of(P, D, R))
    assert not outcome.ok
    assert not [call for call in units.calls if call[1] == "r.service"]
    failed = outcome.failed_step
    assert failed is not None
    assert (failed.unit, failed.phase) == ("d.service", "start_job")
    assert (
        failed.detail == "systemd job for d.service finished with result 'failed' (expected 'done')"
    )
    assert [(s.unit, s.phase) for s in outcome.steps] == [
        ("p.service", "ready"),
        ("d.service", "start_job"),
        ("r.service", "not_started"),
    ]
    assert outcome.steps[2].detail == "stopped after d.service failed (start_job)"
    final = logs[-1]
    assert final["event"] == "restart_sequence_finished"
    assert (final["failed_step"], final["failed_phase"]) == ("d.service", "start_job")
    assert format_outcome(outcome).splitlines()[-1] == (
        "co-restart of group g1 FAILED at decode (d.service, phase start_job)"
    )


@pytest.mark.parametrize(
    ("error", "detail"),
    [
        (NoSuchUnit("systemd has no unit 'p.service'"), "systemd has no unit 'p.service'"),
        (TimeoutError(), "no result for the start job of p.service within 5 s"),
    ],
)
async def test_job_errors_become_step_failures(error: Exception, detail: str) -> None:
    """NoSuchUnit and a job-wait timeout fail the first step with a clear detail."""
    units, ready = FakeUnits(), FakeReadiness()
    units.job_results["p.service"] = error
    outcome = await restarter(units, ready).execute(plan_of(P, D, R))
    failed = outcome.failed_step
    assert failed is not None
    assert (failed.unit, failed.phase, failed.detail) == ("p.service", "start_job", detail)
    assert units.calls == [("stop", "p.service"), ("start", "p.service")]


async def test_unit_not_active_fails_the_active_phase() -> None:
    """A unit that does not reach active fails its step in phase 'active'."""
    units, ready = FakeUnits(), FakeReadiness()
    units.active_errors["p.service"] = TimeoutError()
    outcome = await restarter(units, ready).execute(plan_of(P, D, R))
    failed = outcome.failed_step
    assert failed is not None
    assert (failed.unit, failed.phase, failed.detail) == (
        "p.service",
        "active",
        "p.service not active within 5 s",
    )


async def test_readiness_timeout_reports_last_check() -> None:
    """A unit that never gets ready fails in phase 'ready' naming the last check."""
    units, ready = FakeUnits(), FakeReadiness({"p.service": [False]})
    outcome = await restarter(units, ready).execute(plan_of(P, D, R, timeout=0.05))
    failed = outcome.failed_step
    assert failed is not None
    assert failed.phase == "ready"
    assert failed.detail == "p.service not ready within 0.05 s; last check: p.service not ready"


async def test_unit_that_dies_while_waiting_for_ready_fails_fast() -> None:
    """A unit found failed during the readiness wait fails at once, not at the deadline."""
    units, ready = FakeUnits(), FakeReadiness({"p.service": [False]})
    units.states["p.service"] = "failed"
    outcome = await restarter(units, ready).execute(plan_of(P, D, R, timeout=3600))
    failed = outcome.failed_step
    assert failed is not None
    assert failed.phase == "ready"
    assert failed.detail.startswith("p.service became failed (x) while waiting for readiness")


async def test_shutdown_during_readiness_stops_after_job_and_starts_nothing_else() -> None:
    """Shutdown while prefill is getting ready: no further unit starts, interrupted=True."""
    units, ready = FakeUnits(), FakeReadiness({"p.service": [False]})
    shutdown = asyncio.Event()
    ready.on_check = lambda step: shutdown.set()
    outcome = await restarter(units, ready, shutdown).execute(plan_of(P, D, R, timeout=3600))
    assert outcome.interrupted
    assert not outcome.ok
    assert units.calls == [("stop", "p.service"), ("start", "p.service"), ("active", "p.service")]
    assert [(s.unit, s.phase) for s in outcome.steps] == [
        ("p.service", "interrupted"),
        ("d.service", "not_started"),
        ("r.service", "not_started"),
    ]


async def test_shutdown_during_job_wait_lets_the_job_wait_finish() -> None:
    """Shutdown while the start job runs: the job result is still awaited, then it stops."""
    units, ready = FakeUnits(), FakeReadiness()
    gate = asyncio.Event()
    units.job_gate = gate
    shutdown = asyncio.Event()
    task = asyncio.create_task(restarter(units, ready, shutdown).execute(plan_of(P, D, R)))
    while not units.calls:
        await asyncio.sleep(0)
    shutdown.set()
    await asyncio.sleep(0.01)
    assert not task.done()  # still waiting for the job
    gate.set()
    outcome = await task
    assert outcome.interrupted
    assert units.calls == [("stop", "p.service"), ("start", "p.service")]
    assert outcome.steps[0].detail == (
        "shutdown requested: the unit was started again, readiness was not awaited"
    )


async def test_shutdown_before_start_restarts_nothing() -> None:
    """A shutdown requested before execute() starts no unit at all."""
    units, ready = FakeUnits(), FakeReadiness()
    shutdown = asyncio.Event()
    shutdown.set()
    outcome = await restarter(units, ready, shutdown).execute(plan_of(P, D, R))
    assert units.calls == []
    assert outcome.interrupted
    assert {s.phase for s in outcome.steps} == {"not_started"}


async def test_restarter_refuses_unsafe_plan_before_acting() -> None:
    """Defence in depth: a decode-only plan handed to the restarter raises and restarts nothing."""
    units, ready = FakeUnits(), FakeReadiness()
    with capture_logs() as logs, pytest.raises(RestartRefused):
        await restarter(units, ready).execute(plan_of(D))
    assert units.calls == []
    assert [(e["event"], e["reason"]) for e in logs] == [
        ("restart_refused", REASON_DECODE_WITHOUT_PREFILL)
    ]


# --- DryRunRestarter ------------------------------------------------------------------------------


async def test_dry_run_records_and_logs_the_full_plan() -> None:
    """The dry run restarts nothing, keeps the plan and logs restart_skipped_dry_run with it."""
    dry = DryRunRestarter(clock=lambda: 100.0)
    plan = build_plan(GROUP, "probe_failures")
    with capture_logs() as logs:
        outcome = await dry.execute(plan)
    assert dry.executed == [plan]
    assert outcome.ok
    assert outcome.dry_run
    assert [s.phase for s in outcome.steps] == ["dry_run"] * 3
    assert [e["event"] for e in logs] == [
        "restart_planned",
        "restart_skipped_dry_run",
        "restart_sequence_finished",
    ]
    skipped = logs[1]
    assert skipped["sequence"] == ["p.service", "d.service", "r.service"]
    assert skipped["plan"]["steps"][2]["ready_url"] == "http://127.0.0.1:30001/readiness"
    assert format_outcome(outcome).splitlines()[-1] == "dry run: nothing was restarted"


# --- HttpReadiness --------------------------------------------------------------------------------

WORKERS_BODY = {
    "workers": [
        {"url": "http://127.0.0.1:30000", "worker_type": "prefill", "is_healthy": True},
        {"url": "http://127.0.0.1:30002", "worker_type": "decode", "is_healthy": True},
    ]
}


def readiness_with(handler: Callable[[httpx.Request], httpx.Response]) -> HttpReadiness:
    """HttpReadiness over an in-memory transport."""
    return HttpReadiness(httpx.AsyncClient(transport=httpx.MockTransport(handler)))


def router_step() -> RestartStep:
    """The router step of the test group."""
    return build_plan(GROUP, "t").steps[2]


async def test_worker_ready_on_health_200() -> None:
    """A worker is ready when /health answers 200, not ready on 503."""
    codes = iter([503, 200])
    ready = readiness_with(lambda req: httpx.Response(next(codes)))
    step = build_plan(GROUP, "t").steps[0]
    assert await ready.check(step) == ReadyCheck(False, "GET http://127.0.0.1:30000/health -> 503")
    assert (await ready.check(step)).ok


@pytest.mark.parametrize(
    ("workers", "ok", "detail"),
    [
        (
            WORKERS_BODY,
            True,
            "router ready with http://127.0.0.1:30000, http://127.0.0.1:30002 registered and healthy",
        ),
        (
            {"workers": [WORKERS_BODY["workers"][0]]},
            False,
            "router does not list http://127.0.0.1:30002 as healthy yet",
        ),
        (
            {
                "workers": [
                    WORKERS_BODY["workers"][0],
                    {**WORKERS_BODY["workers"][1], "is_healthy": False},
                ]
            },
            False,
            "router does not list http://127.0.0.1:30002 as healthy yet",
        ),
        ({"oops": 1}, False, "router /workers answer has no 'workers' list"),
    ],
)
async def test_router_ready_needs_both_workers_registered(
    workers: dict[str, Any], ok: bool, detail: str
) -> None:
    """Router readiness is /readiness 200 plus both configured workers healthy in /workers."""

    def handler(req: httpx.Request) -> httpx.Response:
        if req.url.path == "/readiness":
            return httpx.Response(200, json={"status": "ready"})
        return httpx.Response(200, json=workers)

    assert await readiness_with(handler).check(router_step()) == ReadyCheck(ok, detail)


async def test_readiness_never_raises_on_connection_errors() -> None:
    """A refused connection is a not-ready answer naming the error, not an exception."""

    def handler(req: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=req)

    check = await readiness_with(handler).check(router_step())
    assert check == ReadyCheck(False, "ConnectError: connection refused")


# --- execute_locked -------------------------------------------------------------------------------


async def test_execute_locked_records_history_and_fails_fast_when_locked(tmp_path: Path) -> None:
    """The sequence runs under the group lock and is recorded; a held lock fails fast."""
    plan = build_plan(GROUP, "manual")
    outcome = await execute_locked(
        plan, DryRunRestarter(), state_dir=tmp_path, purpose="test", clock=lambda: 50.0
    )
    assert outcome.ok
    history = RestartHistory.load(tmp_path, "g1", now=60.0)
    assert [(r.trigger, r.dry_run, r.ok) for r in history.records] == [("manual", True, True)]
    units = FakeUnits()
    with RestartLock(tmp_path, "g1", purpose="daemon"), pytest.raises(LockHeld):
        await execute_locked(
            plan, restarter(units, FakeReadiness()), state_dir=tmp_path, purpose="manual"
        )
    assert units.calls == []
