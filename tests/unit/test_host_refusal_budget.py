"""A co-restart refused before its first step because a host is unreachable restarted nothing: it
is not charged to the restart budget (in memory or in the history), never holds the group, and
the first try after the host returns acts."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
from prometheus_client import CollectorRegistry

from tests.unit.builders import T0, Harness, group_config
from watchdog.act.hosts import (
    HostCheck,
    HostCheckedRestarter,
    UnitBuses,
    refusal_before_lock,
    unreachable_refusal,
)
from watchdog.act.plan import build_plan
from watchdog.act.restarters import DryRunRestarter, execute_locked, open_restarter
from watchdog.decide import after_restart
from watchdog.model import Action, RestartOutcome, RestartPlan, State
from watchdog.run.metrics import WatchdogMetrics
from watchdog.statefiles import RestartHistory, RestartRecord, StepRecord

DOWN = HostCheck("w@gpu-b:22", False, "ssh w@gpu-b:22: connection refused")


def _refusal(at: float) -> RestartOutcome:
    plan = build_plan(group_config(), trigger="silent_stall")
    return unreachable_refusal(plan, [DOWN], at)


def test_refusals_through_a_long_outage_never_hold_and_are_not_charged() -> None:
    """A stall during a host outage: every co-restart is refused before its first step, far more
    often than max_restarts, and the group never goes to held; nothing is charged, no failed
    attempt is counted; when the host is back the next try acts and verifies."""
    h = Harness().warm()
    refusals = 0
    for _ in range(2000):  # 10 000 s of stall at 5 s a cycle
        decision = h.stall()
        assert decision.state.state is not State.HELD, decision.reasons
        if decision.action is Action.CO_RESTART:
            assert h.state is not None
            h.state = after_restart(h.state, _refusal(h.stack.now), h.stack.now)
            refusals += 1
            assert h.state.state is State.STALLED
            assert h.state.budget.restart_times == ()
            assert h.state.budget.consecutive_failures == 0
            assert h.state.budget_remaining(h.config, h.stack.now) == 3
    assert refusals > h.config.restart.max_restarts
    # The host is back: the next co-restart runs and the group verifies, its budget charged once.
    decision = h.stall()
    while decision.action is not Action.CO_RESTART:
        decision = h.stall()
    assert decision.state.budget.restart_times == (h.stack.now,)
    assert h.restarted(ok=True).state is State.VERIFYING


def test_a_refusal_retries_after_one_backoff_not_a_doubled_one() -> None:
    """The retry waits restart.backoff_seconds from the refusal, however many came before."""
    h = Harness().warm()
    decision = h.stall(9)
    assert decision.action is Action.CO_RESTART
    assert h.state is not None
    backoff = h.config.restart.backoff_seconds
    for _ in range(3):
        now = h.stack.now
        h.state = after_restart(h.state, _refusal(now), now)
        assert h.state.budget.backoff_until == now + backoff
        decision = h.stall()
        while decision.action is not Action.CO_RESTART:
            decision = h.stall()
        assert h.stack.now - now <= backoff + h.stack.cycle_seconds


class _HostDown(UnitBuses):
    """UnitBuses whose hosts are all unreachable."""

    def __init__(self) -> None:
        super().__init__(None, {})

    async def unreachable(self, plan: RestartPlan) -> list[HostCheck]:
        """Every host of the plan is down."""
        return [DOWN]


class _MustNotRun:
    async def execute(self, plan: RestartPlan) -> RestartOutcome:
        """A refused plan never reaches the restarter."""
        raise AssertionError("a refused plan was executed")


def test_a_manual_restart_refused_for_a_down_host_is_not_charged_in_the_history(
    tmp_path: Path,
) -> None:
    """`watchdog restart` with a host down: the refusal is recorded, marked refused, and neither
    the budget (restart_times) nor the failure streak the next daemon loads counts it."""
    plan = build_plan(group_config(), trigger="manual")
    restarter = HostCheckedRestarter(_MustNotRun(), _HostDown(), clock=lambda: T0)
    outcome = asyncio.run(
        execute_locked(plan, restarter, state_dir=tmp_path, purpose="test", clock=lambda: T0)
    )
    assert outcome.refused == "host_unreachable"
    history = RestartHistory.load(tmp_path, plan.group, now=T0 + 1)
    (record,) = history.records
    assert record.refused == "host_unreachable"
    assert history.restart_times(3600.0, T0 + 1) == ()
    assert history.consecutive_failures() == 0
    assert history.last_restart_at() is None


def test_refusals_recorded_before_the_field_existed_are_not_charged(tmp_path: Path) -> None:
    """An older record of the same refusal (every step not_started, no shutdown) is read as one;
    a sequence cut by a shutdown before its first step still counts, as before."""
    history = RestartHistory.load(tmp_path, "g", now=T0)
    plan = build_plan(group_config(), trigger="manual")
    not_started = tuple(
        StepRecord(role=s.role, unit=s.unit, ok=False, phase="not_started") for s in plan.steps
    )
    history.records = [
        RestartRecord(T0, T0, "manual", dry_run=False, ok=False, steps=not_started),
        RestartRecord(
            T0 + 10, T0 + 10, "manual", dry_run=False, ok=False, interrupted=True, steps=not_started
        ),
    ]
    assert history.restart_times(3600.0, T0 + 20) == (T0 + 10,)


def test_a_refusal_is_not_counted_as_a_restart() -> None:
    """restarts_total and the last-restart time are left alone by a refusal (it is counted by
    restart_refusals_total{reason="host_unreachable"} instead)."""
    registry = CollectorRegistry()
    metrics = WatchdogMetrics(registry)
    metrics.add_group("g")
    metrics.observe_restart("g", _refusal(T0))
    for result in ("done", "failed"):
        value = registry.get_sample_value(
            "sglang_watchdog_restarts_total", {"group": "g", "result": result}
        )
        assert not value, result
    assert not registry.get_sample_value(
        "sglang_watchdog_last_restart_timestamp_seconds", {"group": "g"}
    )


class _RemoteDown(_HostDown):
    """_HostDown that says some unit is remote, as the daemon's buses do for a multi-host config."""

    @property
    def has_remote(self) -> bool:
        """Some unit lives on another host."""
        return True


def test_the_one_restarter_assembly_checks_hosts_and_reports_each_refusal() -> None:
    """open_restarter given the daemon's buses (remote hosts, all down) refuses the plan before
    its first step, and reports the refusal to on_host_refused (the daemon's metrics counter)."""
    counted: list[str] = []

    async def run() -> RestartOutcome:
        async with (
            httpx.AsyncClient(trust_env=False) as http,
            open_restarter(
                dry_run=False,
                units=_RemoteDown(),
                http=http,
                clock=lambda: T0,
                on_host_refused=counted.append,
            ) as restarter,
        ):
            return await restarter.execute(build_plan(group_config(), trigger="stall"))

    outcome = asyncio.run(run())
    assert outcome.refused == "host_unreachable"
    assert {s.phase for s in outcome.steps} == {"not_started"}
    assert counted == [outcome.plan.group]


def test_the_daemon_checks_hosts_before_the_lock_only_where_the_restarter_checks_them() -> None:
    """refusal_before_lock (the daemon's check before the lock, so that its refusals stay out of
    the history) refuses through a HostCheckedRestarter and counts once; another restarter has
    no hosts to check."""
    counted: list[str] = []
    plan = build_plan(group_config(), trigger="stall")
    checked = HostCheckedRestarter(
        _MustNotRun(), _HostDown(), clock=lambda: T0, on_refused=counted.append
    )
    refused = asyncio.run(refusal_before_lock(checked, plan))
    assert refused is not None
    assert refused.refused == "host_unreachable"
    assert counted == [plan.group]
    assert asyncio.run(refusal_before_lock(DryRunRestarter(), plan)) is None
