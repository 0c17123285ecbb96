"""Properties of the detector over generated observation sequences (hypothesis)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.builders import T0, WORKER_ROLES, Stack, group_config, outcome, probe
from watchdog.act.plan import build_plan, guard_plan
from watchdog.config import GroupSection
from watchdog.decide import Decision, GroupState, Verdict, after_restart, decide, initial_state
from watchdog.model import (
    Action,
    LoadsSnapshot,
    Observation,
    OperatorControls,
    ProbeFailure,
    ProbeKind,
    ProbeResult,
    RestartPlan,
    Role,
    Rung,
    ScrapeFailure,
)

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Cheaper checks that ride on the same generator: fewer examples keep the file under ~20 s.
LIGHT = settings(SETTINGS, max_examples=100)

FAILURES = [
    ProbeFailure.TIMEOUT_BEFORE_HEADERS,
    ProbeFailure.STALLED_MIDSTREAM,
    ProbeFailure.CONNECT_ERROR,
    ProbeFailure.CONNECT_REFUSED,
    ProbeFailure.HTTP_ERROR,
    ProbeFailure.EMPTY_OUTPUT,
]
UNIT_EVENTS = [
    "none",
    "restart_decode",
    "restart_prefill",
    "restart_router",
    "co_restart",
    "fail_decode",
    "fail_prefill",
    "stop_decode",
    "recover",
]


@dataclass(frozen=True)
class Cycle:
    """One generated cycle: what happens in the stack and what the watchdog sees of it."""

    seconds: float
    probes: tuple[tuple[bool, ProbeKind, ProbeFailure], ...]
    progress: bool
    scrape: str  # "both", "none", "prefill", "decode"
    scrape_error: ScrapeFailure
    health: str  # "ok", "fail", "unknown", "decode_fail", "unreachable"
    in_flight: int
    oldest_in_flight_seconds: float
    http_active: float
    inflight_queue: float
    loads_queue: int | None
    transfer_failures: int
    unit_event: str
    paused: bool


def cycles(*, progress_always: bool, chaos: bool) -> st.SearchStrategy[Cycle]:
    """Cycles; `progress_always` makes counters advance in a successful scrape every cycle.

    With `chaos`, a cycle is a silent-stall cycle, a healthy one or anything at all (unit events,
    transfer failures, pauses), so that stalls, restarts, budgets and backoffs really happen.
    """
    probe_st = st.tuples(
        st.booleans(),
        st.sampled_from([ProbeKind.COMPLETION, ProbeKind.MULTIROUND]),
        st.sampled_from(FAILURES),
    )
    anything = st.builds(
        Cycle,
        seconds=st.floats(min_value=0.5, max_value=40.0),
        probes=st.lists(probe_st, max_size=3).map(tuple),
        progress=st.just(True) if progress_always else st.booleans(),
        # Progress is what decode delivers, so "counters advance" means decode is scraped.
        scrape=(
            st.sampled_from(["both", "decode"])
            if progress_always
            else st.sampled_from(["both", "both", "none", "prefill", "decode"])
        ),
        scrape_error=st.sampled_from(list(ScrapeFailure)[1:]),
        health=st.sampled_from(["ok", "ok", "fail", "unknown", "decode_fail", "unreachable"]),
        in_flight=st.integers(min_value=0, max_value=6),
        oldest_in_flight_seconds=st.floats(min_value=0.0, max_value=900.0),
        http_active=st.sampled_from([0.0, 1.0, 12.0]),
        inflight_queue=st.sampled_from([0.0, 0.0, 3.0]),
        loads_queue=st.one_of(st.none(), st.integers(min_value=0, max_value=4)),
        transfer_failures=st.integers(min_value=0, max_value=4) if chaos else st.just(0),
        unit_event=st.sampled_from(["none"] * 4 + UNIT_EVENTS) if chaos else st.just("none"),
        paused=st.sampled_from([False] * 5 + [True]) if chaos else st.just(False),
    )
    if not chaos:
        return anything
    quiet = {
        "scrape_error": ScrapeFailure.CONNECT_REFUSED,
        "oldest_in_flight_seconds": 0.0,
        "inflight_queue": 0.0,
        "loads_queue": None,
        "transfer_failures": 0,
        "unit_event": "none",
        "paused": False,
    }
    stalled = st.builds(
        Cycle,
        seconds=st.floats(min_value=2.0, max_value=20.0),
        probes=st.just(((False, ProbeKind.COMPLETION, ProbeFailure.TIMEOUT_BEFORE_HEADERS),)),
        progress=st.just(False),
        scrape=st.just("both"),
        health=st.just("ok"),
        in_flight=st.just(4),
        http_active=st.just(4.0),
        **{k: st.just(v) for k, v in quiet.items()},
    )
    healthy = st.builds(
        Cycle,
        seconds=st.floats(min_value=2.0, max_value=20.0),
        probes=st.just(((True, ProbeKind.COMPLETION, ProbeFailure.OK),)),
        progress=st.just(True),
        scrape=st.just("both"),
        health=st.just("ok"),
        in_flight=st.just(0),
        http_active=st.just(0.0),
        **{k: st.just(v) for k, v in quiet.items()},
    )
    return st.one_of(stalled, stalled, stalled, healthy, anything)


def fast_config(max_restarts: int, backoff_seconds: float, on_decode_only: str) -> GroupSection:
    """Short thresholds so that stalls, budgets and backoffs all happen within a few dozen cycles."""
    return group_config(
        stall={
            "probe_failures": 2,
            "no_progress_seconds": 15,
            "transfer_failures": 3,
            "window_seconds": 60,
            "pinned_inflight_seconds": 120,
            "startup_timeout_seconds": 60,
            "decode_only_grace_seconds": 10,
            "on_decode_only_restart": on_decode_only,
        },
        restart={
            "max_restarts": max_restarts,
            "budget_window_seconds": 300,
            "backoff_seconds": backoff_seconds,
            "verify_probes": 2,
            "verify_timeout_seconds": 30,
            "ready_timeout_seconds": 60,
        },
    )


def apply(stack: Stack, cycle: Cycle) -> Observation:
    """Make the cycle happen in the stack and return what the watchdog observes."""
    event = cycle.unit_event
    if event == "restart_decode":
        stack.restart(Role.DECODE)
    elif event == "restart_prefill":
        stack.restart(Role.PREFILL)
    elif event == "restart_router":
        stack.restart(Role.ROUTER)
    elif event == "co_restart":
        for offset, role in enumerate(Role):
            stack.restart(role, at=stack.now + offset * 0.1)
    elif event == "fail_decode":
        stack.active[Role.DECODE] = "failed"
    elif event == "fail_prefill":
        stack.active[Role.PREFILL] = "failed"
    elif event == "stop_decode":
        stack.active[Role.DECODE] = "inactive"
    elif event == "recover":
        stack.active = dict.fromkeys(Role, "active")
    stack.fail_transfers(cycle.transfer_failures)
    stack.http_active = cycle.http_active
    stack.inflight_queue = cycle.inflight_queue
    end = stack.now + cycle.seconds
    results: tuple[ProbeResult, ...] = tuple(
        probe(ok, at=end - 0.01 * (len(cycle.probes) - i), kind=kind, reason=None if ok else why)
        for i, (ok, kind, why) in enumerate(cycle.probes)
    )
    scrapes: dict[str, bool | tuple[Role, ...]] = {
        "both": True,
        "none": False,
        "prefill": (Role.PREFILL,),
        "decode": (Role.DECODE,),
    }
    scrape = scrapes[cycle.scrape]
    healths: dict[str, bool | dict[Role, bool] | None] = {
        "ok": True,
        "fail": False,
        "unknown": None,
        "decode_fail": {Role.DECODE: False},
        "unreachable": False,
    }
    health = healths[cycle.health]
    loads = (
        ()
        if cycle.loads_queue is None
        else (
            LoadsSnapshot(
                role=Role.PREFILL,
                fetched_at=end,
                ok=True,
                prefill_inflight_queue_reqs=cycle.loads_queue,
            ),
        )
    )
    return stack.cycle(
        results,
        progress=cycle.progress,
        scrape=scrape,
        scrape_error=cycle.scrape_error,
        health_ok=health,
        health_reason=ProbeFailure.CONNECT_ERROR if cycle.health == "unreachable" else None,
        in_flight=cycle.in_flight,
        oldest_in_flight_seconds=cycle.oldest_in_flight_seconds,
        loads=loads,
        operator=OperatorControls(paused_until=end + 20) if cycle.paused else None,
        seconds=cycle.seconds,
    )


def plan_of(config: GroupSection, decision: Decision) -> RestartPlan:
    """The plan the daemon builds for a co_restart decision."""
    return build_plan(
        config,
        trigger=str(decision.verdict),
        rung=decision.rung,
        fresh_prefills=decision.fresh_prefills,
    )


def run(
    config: GroupSection,
    sequence: list[Cycle],
    outcomes: list[str],
    *,
    seeded: tuple[float, ...] = (),
    observe_units: bool = True,
) -> tuple[list[Decision], list[float]]:
    """Drive the detector; co-restarts end as `outcomes` says (cycled). Returns decisions, restarts."""
    stack = Stack(observe_units=observe_units)
    state = initial_state(stack.now, restart_times=seeded)
    decisions: list[Decision] = []
    restarts: list[float] = []
    for cycle in sequence:
        observation = apply(stack, cycle)
        decision = decide(state, observation, config, observation.at)
        decisions.append(decision)
        state = decision.state
        if decision.action is Action.CO_RESTART:
            restarts.append(observation.at)
            kind = outcomes[len(restarts) % len(outcomes)] if outcomes else "ok"
            if kind == "ok":
                plan = plan_of(config, decision)
                for offset, step in enumerate(plan.steps):
                    stack.restart(step.role, at=stack.now + offset * 0.1)
            state = after_restart(
                state, outcome(kind != "failed", at=stack.now, dry_run=kind == "dry_run"), stack.now
            )
    return decisions, restarts


@SETTINGS
@given(
    sequence=st.lists(cycles(progress_always=True, chaos=False), min_size=1, max_size=60),
    observe_units=st.booleans(),
    max_restarts=st.integers(min_value=1, max_value=3),
)
def test_advancing_counters_never_restart(
    sequence: list[Cycle], observe_units: bool, max_restarts: int
) -> None:
    """Whatever probes and health say, counters that advance every cycle never yield a restart."""
    # The first scrape reads both workers, so every later scrape shows the advance.
    sequence = [replace(sequence[0], scrape="both"), *sequence[1:]]
    config = fast_config(max_restarts, 10.0, "co-restart")
    decisions, restarts = run(config, sequence, [], observe_units=observe_units)
    assert restarts == [], [str(d.verdict) for d in decisions]


@SETTINGS
@given(
    sequence=st.lists(cycles(progress_always=False, chaos=True), min_size=15, max_size=60),
    outcomes=st.lists(st.sampled_from(["ok", "failed", "dry_run"]), min_size=1, max_size=4),
    max_restarts=st.integers(min_value=1, max_value=3),
    backoff_seconds=st.sampled_from([0.0, 5.0, 30.0]),
    seeded_ages=st.lists(st.floats(min_value=1.0, max_value=600.0), max_size=3),
    on_decode_only=st.sampled_from(["co-restart", "alert"]),
)
def test_restarts_never_exceed_the_budget(
    *,
    sequence: list[Cycle],
    outcomes: list[str],
    max_restarts: int,
    backoff_seconds: float,
    seeded_ages: list[float],
    on_decode_only: str,
) -> None:
    """In no window of budget_window_seconds are there more than max_restarts co-restarts."""
    config = fast_config(max_restarts, backoff_seconds, on_decode_only)
    window = config.restart.budget_window_seconds
    seeded = tuple(sorted(T0 - age for age in seeded_ages))
    # The persisted history itself respects the budget (the daemon wrote it).
    seeded = seeded[-max_restarts:] if max_restarts else ()
    _, restarts = run(config, sequence, outcomes, seeded=seeded)
    times = sorted((*seeded, *restarts))
    for i, start in enumerate(times):
        in_window = [t for t in times[i:] if t <= start + window]
        assert len(in_window) <= max_restarts, (times, max_restarts)


@LIGHT
@given(
    sequence=st.lists(cycles(progress_always=False, chaos=True), min_size=15, max_size=60),
    outcomes=st.lists(st.sampled_from(["ok", "failed", "dry_run"]), min_size=1, max_size=4),
    on_decode_only=st.sampled_from(["co-restart", "alert"]),
)
def test_no_plan_restarts_decode_without_prefill_first(
    sequence: list[Cycle], outcomes: list[str], on_decode_only: str
) -> None:
    """Every restart the detector asks for starts each decode after the prefills it pairs with.

    The full rung restarts the whole group, prefill before decode; the router rung the router
    alone; the survivor rung decode and then the router, after a prefill restarted alone and
    never that prefill (docs/decisions.md, "Restart rungs").
    """
    config = fast_config(3, 5.0, on_decode_only)
    decisions, _ = run(config, sequence, outcomes)
    for decision in decisions:
        assert decision.action in (Action.NONE, Action.ALERT, Action.CO_RESTART)
        if decision.action is Action.CO_RESTART:
            plan = plan_of(config, decision)
            guard_plan(plan)
            roles = [step.role for step in plan.steps]
            if decision.rung is Rung.SURVIVOR:
                assert decision.verdict is Verdict.PREFILL_ONLY_RESTART
                assert roles == [Role.DECODE, Role.ROUTER]
            elif decision.rung is Rung.ROUTER:
                assert roles == [Role.ROUTER]
            else:
                assert set(roles) == set(Role)
                assert roles.index(Role.PREFILL) < roles.index(Role.DECODE)


@LIGHT
@given(sequence=st.lists(cycles(progress_always=False, chaos=True), min_size=1, max_size=40))
def test_decisions_are_consistent(sequence: list[Cycle]) -> None:
    """A co-restart decision has already moved to restarting; alerts and restarts carry reasons."""
    config = fast_config(3, 5.0, "co-restart")
    decisions, _ = run(config, sequence, ["ok"])
    for decision in decisions:
        if decision.action is Action.CO_RESTART:
            assert decision.state.state.value == "restarting"
            assert decision.state.budget.restart_times[-1] == decision.state.since
        if decision.action is not Action.NONE:
            assert decision.reasons
        assert decision.state.verdict is decision.verdict
    assert all(role in (*WORKER_ROLES, Role.ROUTER) for role in Role)


def _after_failed_attempt(config: GroupSection) -> tuple[Stack, GroupState]:
    """A group whose first co-restart (for a silent stall) failed: backing off now."""
    stack = Stack()
    state = initial_state(stack.now)
    stall = Cycle(
        seconds=5.0,
        probes=((False, ProbeKind.COMPLETION, ProbeFailure.TIMEOUT_BEFORE_HEADERS),),
        progress=False,
        scrape="both",
        scrape_error=ScrapeFailure.CONNECT_REFUSED,
        health="ok",
        in_flight=4,
        oldest_in_flight_seconds=0.0,
        http_active=4.0,
        inflight_queue=0.0,
        loads_queue=None,
        transfer_failures=0,
        unit_event="none",
        paused=False,
    )
    for _ in range(40):
        decision = decide(state, apply(stack, stall), config, stack.now)
        state = decision.state
        if decision.action is Action.CO_RESTART:
            break
    assert decision.action is Action.CO_RESTART
    state = after_restart(state, outcome(False, at=stack.now), stack.now)
    assert state.budget.consecutive_failures == 1
    assert state.budget.backoff_until > stack.now
    return stack, state


def overload_cycles() -> st.SearchStrategy[Cycle]:
    """Overload: probes time out while counters advance and probes pile up in flight."""
    return st.builds(
        Cycle,
        seconds=st.floats(min_value=1.0, max_value=20.0),
        probes=st.lists(
            st.tuples(
                st.booleans(),
                st.just(ProbeKind.COMPLETION),
                st.just(ProbeFailure.TIMEOUT_BEFORE_HEADERS),
            ),
            min_size=1,
            max_size=3,
        ).map(tuple),
        progress=st.just(True),
        scrape=st.just("both"),
        scrape_error=st.just(ScrapeFailure.CONNECT_REFUSED),
        health=st.just("ok"),
        in_flight=st.integers(min_value=2, max_value=6),
        oldest_in_flight_seconds=st.just(0.0),
        http_active=st.just(12.0),
        inflight_queue=st.just(0.0),
        loads_queue=st.just(None),
        transfer_failures=st.integers(min_value=0, max_value=2),
        unit_event=st.just("none"),
        paused=st.just(False),
    )


@SETTINGS
@given(
    sequence=st.lists(
        st.one_of(overload_cycles(), cycles(progress_always=False, chaos=True)),
        min_size=1,
        max_size=60,
    ),
    backoff_seconds=st.sampled_from([60.0, 300.0]),
    outcomes=st.lists(st.sampled_from(["ok", "failed"]), min_size=1, max_size=3),
)
def test_backoff_and_failure_count_survive_every_state_change(
    sequence: list[Cycle], backoff_seconds: float, outcomes: list[str]
) -> None:
    """After a failed attempt, nothing short of a passed verification or a re-arm ends the streak.

    Whatever follows (overload, success, stalls, unit events, pauses), no co-restart happens
    before backoff_until, and consecutive_failures only drops at VERIFICATION_PASSED.
    """
    config = fast_config(10, backoff_seconds, "co-restart")
    stack, state = _after_failed_attempt(config)
    restarts = 0
    for cycle in sequence:
        observation = apply(stack, cycle)
        decision = decide(state, observation, config, observation.at)
        if decision.action is Action.CO_RESTART:
            assert observation.at >= state.budget.backoff_until, (
                str(decision.verdict),
                observation.at - state.budget.backoff_until,
            )
        after = decision.state.budget.consecutive_failures
        if after < state.budget.consecutive_failures:
            assert decision.verdict is Verdict.VERIFICATION_PASSED, str(decision.verdict)
        assert decision.state.budget.backoff_until >= state.budget.backoff_until or (
            decision.verdict is Verdict.VERIFICATION_PASSED
        )
        state = decision.state
        if decision.action is Action.CO_RESTART:
            restarts += 1
            ok = outcomes[restarts % len(outcomes)] == "ok"
            if ok:
                for offset, role in enumerate(Role):
                    stack.restart(role, at=stack.now + offset * 0.1)
            failures = state.budget.consecutive_failures
            state = after_restart(state, outcome(ok, at=stack.now), stack.now)
            assert state.budget.consecutive_failures >= failures
