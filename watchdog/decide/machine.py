"""The state machine's entry points: decide() per cycle, after_restart() per co-restart outcome.

decide() folds the observation into memory and hands the group to its state's handler; a
maintenance lease pre-empts every state. See docs/decisions.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from types import MappingProxyType

from watchdog.config import GroupSection
from watchdog.decide import handlers
from watchdog.decide.fold import Facts, observe
from watchdog.decide.reasons import reason
from watchdog.decide.state import (
    Decision,
    GroupState,
    Readiness,
    UnitMemory,
    forget_old_processes,
)
from watchdog.decide.transitions import decision, move
from watchdog.decide.verdict import Verdict
from watchdog.model import Observation, OperatorControls, RestartOutcome, State

Handler = Callable[[GroupState, Facts, GroupSection, float], Decision]

HANDLERS: Mapping[State, Handler] = MappingProxyType(
    {
        State.WARMING: handlers.warming,
        State.HEALTHY: handlers.judge,
        State.OVERLOADED: handlers.judge,
        State.DEGRADED: handlers.judge,
        State.STALLED: handlers.stalled,
        State.RESTARTING: handlers.restarting,
        State.VERIFYING: handlers.verifying,
        State.HELD: handlers.held,
        State.PAUSED: handlers.pause_ended,
    }
)

# States whose cycles absorb unit restarts without judging them (ours, or an operator's).
_QUIET_STATES = frozenset({State.PAUSED, State.RESTARTING})


def decide(
    state: GroupState, observation: Observation, config: GroupSection, now: float
) -> Decision:
    """One cycle of the state machine: fold in the observation, judge, and say what to do."""
    operator = observation.operator
    paused = operator.paused_until is not None and now < operator.paused_until
    mem, facts = observe(
        state, observation, config, now, quiet=paused or state.state in _QUIET_STATES
    )
    if paused:
        return _lease(mem, operator, now)
    return HANDLERS[state.state](mem, facts, config, now)


def _lease(mem: GroupState, operator: OperatorControls, now: float) -> Decision:
    """A maintenance lease is running: observe only, in any state."""
    until = operator.paused_until
    assert until is not None
    lease = reason(
        "paused",
        f"maintenance lease for {until - now:.0f}s more"
        + (f": {operator.pause_reason}" if operator.pause_reason else "")
        + "; observing only",
        seconds_left=until - now,
    )
    return decision(move(mem, State.PAUSED, now), Verdict.PAUSED, (lease,))


def refused_before_first_step(state: GroupState, now: float) -> GroupState:
    """A co-restart refused before its first step (a host of the plan unreachable): nothing was
    restarted, so the charge act() made is taken back and no failed attempt is counted; the group
    stays stalled and tries again after one backoff_seconds (not doubled), so a long outage never
    holds it and the first try after the host returns acts.

    The refusal is counted on its own (restart_refusals_total{reason}), not as a restart.
    """
    budget = state.budget
    times = budget.restart_times
    # act() appended the charge last, at the time it moved the group into restarting.
    if state.state is State.RESTARTING and times and times[-1] == state.since:
        times = times[:-1]
    uncharged = replace(
        budget,
        restart_times=times,
        backoff_until=max(budget.backoff_until, now + budget.backoff_base_seconds),
    )
    return replace(state, state=State.STALLED, since=now, readiness=Readiness(), budget=uncharged)


def after_restart(state: GroupState, outcome: RestartOutcome, now: float) -> GroupState:
    """Fold in how a co-restart went: ok → verifying; failed → stalled (attempt counted) or held;
    refused before its first step → stalled, not charged (refused_before_first_step).

    A dry-run outcome counts as performed, so a rehearsal plays out verification, backoff and
    budget faithfully. Our own restart changes every start timestamp: forget them, so the next
    observation sets new baselines instead of reporting an external or decode-only restart.
    """
    if outcome.refused:
        return refused_before_first_step(state, now)
    fresh = replace(forget_old_processes(state, now), since=now, units=UnitMemory())
    if outcome.ok and not outcome.interrupted:
        return replace(
            fresh,
            state=State.VERIFYING,
            verdict=Verdict.VERIFYING,
            readiness=Readiness(warming_since=now, verify_started_at=now),
        )
    budget = state.budget
    failed = replace(
        fresh,
        readiness=Readiness(),
        budget=budget.failed_attempt(budget.backoff_base_seconds, now),
    )
    step = outcome.failed_step
    detail = f"{step.role} {step.phase}" if step is not None else "no step ran"
    if budget.left_after_attempt <= 0:
        return replace(
            failed,
            state=State.HELD,
            budget=replace(
                failed.budget,
                held_since=now,
                held_reason=f"co-restart failed ({detail}) and the restart budget is exhausted",
            ),
        )
    return replace(failed, state=State.STALLED)
