"""A group not once healthy since its units last started: paged as never_healthy, never restarted.

docs/decisions.md, "Never healthy": a deploy or config error is not a stall; a group that served
and then stalled keeps its co-restart, and our own co-restart that does not come back is a failed
verification (the existing streak and hold).
"""

from __future__ import annotations

from tests.unit.builders import Harness, Stack, group_config, probe
from watchdog.decide import Decision, Verdict, initial_state
from watchdog.model import Action, ProbeFailure, ProbeResult, Role, State

STARTUP_SECONDS = 120.0
LONG_RUN_CYCLES = 600  # 50 minutes at 5 s: many startup timeouts, budget windows and backoffs


def config_with_budget() -> Harness:
    """A harness with a short startup timeout and a budget of three restarts."""
    config = group_config(
        stall={"startup_timeout_seconds": STARTUP_SECONDS},
        restart={"backoff_seconds": 60, "max_restarts": 3},
    )
    return Harness(config=config)


def refused(stack: Stack) -> ProbeResult:
    """A probe the router answers with a 4xx (a wrong model name): it never passes."""
    return probe(False, at=stack.now + stack.cycle_seconds, reason=ProbeFailure.HTTP_ERROR)


def run_refused(h: Harness, cycles: int, **kwargs: object) -> Decision:
    """Feed cycles whose only probe is refused (nothing listens), returning the last decision."""
    decision = None
    for _ in range(cycles):
        decision = h.step((refused(h.stack),), progress=False, **kwargs)
    assert decision is not None
    return decision


def paged(h: Harness) -> list[Decision]:
    """The decisions that paged never_healthy."""
    return [d for d in h.decisions if d.verdict is Verdict.NEVER_HEALTHY]


def test_a_deploy_whose_probes_never_pass_is_paged_once_and_never_restarted() -> None:
    """Every unit started anew (a deploy), health passes, every probe is refused: an alert once,
    no co-restart however long it lasts."""
    h = config_with_budget()
    h.warm()
    for role in Role:
        h.stack.restart(role)
    last = run_refused(h, LONG_RUN_CYCLES)
    assert Action.CO_RESTART not in h.actions, sorted(set(h.verdicts))
    assert [d.action for d in paged(h)].count(Action.ALERT) == 1
    assert last.verdict is Verdict.NEVER_HEALTHY
    assert last.state.state is State.DEGRADED
    assert last.state.budget.consecutive_failures == 0
    assert last.state.budget.restart_times == ()
    reason = dict(next(r for r in last.reasons if r.code == "never_healthy").values)
    assert float(reason["unserved_seconds"]) > STARTUP_SECONDS


def test_a_model_that_never_loads_is_never_healthy_not_a_failed_start() -> None:
    """Health failing from the deploy on (a model path typo): never_healthy at the startup
    timeout, where a failed start used to co-restart and count an attempt."""
    h = config_with_budget()
    h.warm()
    for role in Role:
        h.stack.restart(role)
    h.steps(LONG_RUN_CYCLES, (False,), progress=False, health_ok=False)
    assert Action.CO_RESTART not in h.actions
    assert Verdict.FAILED_START not in {d.verdict for d in h.decisions}
    assert [d.action for d in paged(h)].count(Action.ALERT) == 1


def test_a_crash_looping_unit_after_a_deploy_is_never_healthy() -> None:
    """systemd's Restart= brings a decode that cannot load back again and again: its start moves
    every time, but the group has not served since the first of them."""
    h = config_with_budget()
    h.warm()
    for role in Role:
        h.stack.restart(role)
    for cycle in range(LONG_RUN_CYCLES):
        failing = cycle % 4 < 2
        h.stack.active[Role.DECODE] = "failed" if failing else "activating"
        if cycle % 4 == 2:
            h.stack.restart(Role.DECODE)
            h.stack.active[Role.DECODE] = "activating"
        h.step((refused(h.stack),), progress=False, health_ok={Role.DECODE: False})
    assert Action.CO_RESTART not in h.actions, sorted(set(h.verdicts))
    assert paged(h), sorted(set(h.verdicts))


def test_daemon_start_on_a_stack_that_never_served() -> None:
    """Units up for a day, decode has generated nothing, every probe refused: never healthy,
    and so again after the watchdog itself restarts (nothing in memory, the history persisted)."""
    stack = Stack(tokens={Role.PREFILL: 0.0, Role.DECODE: 0.0})
    h = Harness(config=config_with_budget().config, stack=stack)
    run_refused(h, LONG_RUN_CYCLES // 2)
    assert h.state is not None
    h.state = initial_state(h.stack.now, restart_times=h.state.budget.restart_times)
    run_refused(h, LONG_RUN_CYCLES // 2)
    assert Action.CO_RESTART not in h.actions, sorted(set(h.verdicts))
    assert [d.action for d in paged(h)].count(Action.ALERT) == 2  # once per daemon life


def test_a_stack_that_served_before_the_daemon_started_is_a_silent_stall() -> None:
    """Decode's counters already hold tokens beyond ours at the first scrape: it served since its
    units started, so a stall at daemon start is acted on (healthy, then stalled)."""
    h = config_with_budget()
    decision = h.stall(10)
    assert (decision.verdict, decision.action) == (Verdict.SILENT_STALL, Action.CO_RESTART)


def test_healthy_then_stalled_is_not_never_healthy() -> None:
    """A group that was healthy, then stalled, is acted on as a stall, not paged never_healthy."""
    h = config_with_budget()
    h.warm()
    h.stall(10)
    acted = [d.verdict for d in h.decisions if d.action is Action.CO_RESTART]
    assert acted == [Verdict.SILENT_STALL]


def test_our_co_restart_that_never_comes_back_is_a_failed_verification_then_held() -> None:
    """The starts are ours: verification fails, attempts back off and the budget ends in held."""
    h = config_with_budget()
    h.warm()
    for _ in range(LONG_RUN_CYCLES):
        decision = h.feed(h.stack.stalled())
        if decision.action is Action.CO_RESTART:
            h.restarted()
    assert h.actions.count(Action.CO_RESTART) == 3
    assert Verdict.VERIFICATION_FAILED in {d.verdict for d in h.decisions}
    assert not paged(h), sorted(set(h.verdicts))
    assert h.state is not None
    assert h.state.state is State.HELD


def test_a_deploy_that_comes_up_late_is_judged_afresh() -> None:
    """Paged as never healthy, then a probe passes: ok, the episode ends, no restart was made."""
    h = config_with_budget()
    h.warm()
    for role in Role:
        h.stack.restart(role)
    run_refused(h, 60)
    assert paged(h)
    decision = h.steps(3, (True,))
    assert (decision.verdict, decision.state.state) == (Verdict.OK, State.HEALTHY)
    assert decision.state.alerted == ()
    assert decision.state.units.unserved_since is None
    assert Action.CO_RESTART not in h.actions


def test_a_later_stall_of_a_group_that_came_up_is_acted_on() -> None:
    """never_healthy is about the current start: once a probe passes, a stall is a stall."""
    h = config_with_budget()
    h.warm()
    for role in Role:
        h.stack.restart(role)
    run_refused(h, 60)
    h.steps(3, (True,))
    decision = h.stall(12)
    assert Action.CO_RESTART in h.actions, h.verdicts[-15:]
    assert decision.state.state in (State.RESTARTING, State.STALLED)


def test_units_not_observed_never_page_never_healthy() -> None:
    """Without unit starts the rule cannot tell a deploy from a stall: the older rules apply."""
    stack = Stack(observe_units=False)
    h = Harness(config=config_with_budget().config, stack=stack)
    h.warm()
    run_refused(h, 100)
    assert not paged(h)


def test_unserved_since_is_the_first_start_without_service() -> None:
    """unserved_since is when the first unit started without serving since, not a later cycle."""
    h = config_with_budget()
    h.warm()
    start = h.stack.now + 1
    h.stack.restart(Role.ROUTER, at=start)
    decision = run_refused(h, 3)
    assert decision.state.units.unserved_since == start
