"""One handler per group state: what a cycle in that state decides (docs/decisions.md)."""

from __future__ import annotations

from dataclasses import replace

from watchdog.config import GroupSection
from watchdog.decide.accounting import window_failures
from watchdog.decide.assess import Assessment, assess, unit_assessment
from watchdog.decide.fold import WORKER_ROLES, Facts
from watchdog.decide.never_healthy import co_restart_limit_seconds, never_healthy
from watchdog.decide.reasons import health_reason, reason, since_advance
from watchdog.decide.soak import Soak, relapse, relapsed
from watchdog.decide.state import Decision, GroupState
from watchdog.decide.transitions import (
    act,
    decision,
    move,
    page_never_healthy,
    settle,
    unit_events,
    verification_failed,
    warm,
)
from watchdog.decide.verdict import Verdict
from watchdog.model import Action, Reason, State


def judge(mem: GroupState, facts: Facts, config: GroupSection, now: float) -> Decision:
    """healthy, overloaded, degraded: unit events first, then the verdict table."""
    event = unit_events(mem, facts, config, now)
    if event is not None:
        return event
    assessment = assess(mem, facts, config, now)
    if mem.verdict is Verdict.NEVER_HEALTHY:
        # A level, not an edge: it holds until the group serves or its units start again, so
        # the verdicts the missing service causes (a blip, a worker unhealthy) do not page anew.
        never = never_healthy(mem, config, now)
        if never is not None:
            return page_never_healthy(mem, never, assessment.reasons, now)
    return settle(mem, facts, assessment, config, now)


def stalled(mem: GroupState, facts: Facts, config: GroupSection, now: float) -> Decision:
    """stalled: act while the verdict says so; a failed start stays until it has recovered."""
    event = unit_events(mem, facts, config, now)
    if event is not None:
        return event
    assessment = assess(mem, facts, config, now)
    if assessment.act:
        return act(mem, facts, assessment, config, now)
    sticky = mem.budget.stall_verdict
    # A pending decode-only restart is handled by unit_events until a co-restart resolves it.
    if sticky is Verdict.FAILED_START and assessment.verdict is not Verdict.MONITORING_OUTAGE:
        last_ok = mem.progress.last_probe_ok_at
        ready = last_ok is not None and last_ok >= mem.since and not facts.workers_failing
        if not ready:
            why = reason("not_started", "the failed start has not recovered")
            cause = Assessment(sticky, (why, *assessment.reasons), act=True)
            return act(mem, facts, cause, config, now)
    return settle(mem, facts, assessment, config, now)


def _warming_since(mem: GroupState) -> float:
    since = mem.readiness.warming_since
    return since if since is not None else mem.since


def _ready(mem: GroupState, facts: Facts, config: GroupSection, now: float) -> Reason | None:
    """Whether warm-up is over: health passes and a probe succeeded (or units long settled)."""
    if facts.workers_failing:
        return None
    since = _warming_since(mem)
    last_ok = mem.progress.last_probe_ok_at
    # Strictly after: a probe that finished in the cycle the restart was seen may predate it.
    if last_ok is not None and last_ok > since:
        return reason("warm_up_complete", "health passes and an end-to-end probe succeeded")
    timeout = config.stall.startup_timeout_seconds
    settled = [
        role
        for role in WORKER_ROLES
        if role in facts.units
        and facts.units[role].exec_main_start_us > 0
        and now - facts.units[role].exec_main_start_us / 1e6 >= timeout
    ]
    if facts.workers_healthy and len(settled) == len(WORKER_ROLES):
        return reason(
            "units_settled",
            f"health passes and both workers have run longer than {timeout:g}s: nothing to warm up",
        )
    return None


def _warmed(mem: GroupState) -> GroupState:
    return replace(mem, readiness=replace(mem.readiness, warming_since=None))


def warming(mem: GroupState, facts: Facts, config: GroupSection, now: float) -> Decision:
    """warming: wait for readiness up to startup_timeout_seconds, then judge or fail the start."""
    event = unit_events(mem, facts, config, now)
    if event is not None:
        return event
    elapsed = now - _warming_since(mem)
    ready = _ready(mem, facts, config, now)
    if ready is not None:
        settled = settle(_warmed(mem), facts, assess(mem, facts, config, now), config, now)
        return replace(settled, reasons=(ready, *settled.reasons))
    timeout = config.stall.startup_timeout_seconds
    if elapsed < timeout:
        stopped = unit_assessment(mem, facts, config, now, hung=False)
        if stopped is not None:  # crash still within its wait, or a unit stopped: tell
            return decision(mem, stopped.verdict, stopped.reasons)
        why = reason(
            "warming_up",
            f"warming up for {elapsed:.0f}s of at most {timeout:g}s: waiting for health and a "
            "successful probe",
            elapsed_seconds=elapsed,
            startup_timeout_seconds=timeout,
        )
        return decision(mem, Verdict.WARMING_UP, (why, health_reason(facts)))
    assessment = assess(mem, facts, config, now)
    timed_out = reason(
        "startup_timeout",
        f"not ready {elapsed:.0f}s after the start (startup_timeout_seconds {timeout:g})",
        elapsed_seconds=elapsed,
        startup_timeout_seconds=timeout,
    )
    advance = since_advance(mem, now)
    advancing = advance is not None and advance < config.stall.no_progress_seconds
    failed = assessment.act or (
        bool(facts.workers_failing) and not facts.nothing_reached and not advancing
    )
    if not failed:
        settled = settle(_warmed(mem), facts, assessment, config, now)
        return replace(settled, reasons=(timed_out, *settled.reasons))
    never = never_healthy(mem, config, now)
    if never is not None:
        # Not a failed start to retry: nothing came up since the units started.
        reasons = (timed_out, *assessment.reasons, health_reason(facts))
        return page_never_healthy(_warmed(mem), never, reasons, now)
    # Not our attempt: the backoff is measured from our last restart, if any.
    last = max(mem.budget.restart_times, default=None)
    counted = replace(
        _warmed(mem),
        budget=mem.budget.failed_attempt(config.restart.backoff_seconds, last, keep_longer=True),
    )
    reasons = (timed_out, *assessment.reasons, health_reason(facts))
    cause = Assessment(Verdict.FAILED_START, reasons, act=True)
    return act(counted, facts, cause, config, now)


def verifying(mem: GroupState, facts: Facts, config: GroupSection, now: float) -> Decision:
    """verifying: the group comes back, then a soak holds (docs/decisions.md, "Verification is a
    soak"); rising failures, a relapse or a timeout fail the attempt."""
    event = unit_events(mem, facts, config, now)
    if event is not None:
        return event
    readiness = mem.readiness
    started = readiness.verify_started_at if readiness.verify_started_at is not None else mem.since
    restart = config.restart
    recovered_at = readiness.recovered_at
    if recovered_at is None and readiness.verify_successes >= restart.verify_probes:
        recovered_at = now
        mem = replace(mem, readiness=replace(readiness, recovered_at=now))
    failures = window_failures(mem.progress.failure_samples, started)
    soak = Soak(
        started_at=started,
        elapsed_seconds=now - started,
        passes=mem.readiness.soak_passes,
        recovered_at=recovered_at,
        failures=failures,
        decode_tokens=mem.readiness.soak_decode_tokens,
    )
    progress = soak.reason(mem, config)
    new_failures = failures.net
    if new_failures > 0:
        why = reason(
            "new_transfer_failures",
            f"transfer/bootstrap failures rose by {new_failures:g} after the co-restart, beyond "
            f"what aborts explain (raw +{failures.raw:g})",
            increase=new_failures,
            raw_increase=failures.raw,
            **{f"{role}_increase": value for role, value in failures.net_by_role().items()},
        )
        told = (relapsed(soak, why),) if recovered_at is not None else ()
        return verification_failed(mem, (*told, why, progress), config, now)
    if recovered_at is not None:
        cause = relapse(mem, facts, config, now)
        if cause is not None:
            # The same incident, not a new one: the attempt it verifies failed.
            return verification_failed(mem, (relapsed(soak, cause), cause, progress), config, now)
    if soak.held_long_enough(config):
        healthy = move(mem, State.HEALTHY, now)
        passed = replace(
            healthy,
            readiness=replace(healthy.readiness, verify_started_at=None, warming_since=None),
            budget=healthy.budget.recovered(),
        )
        resolved = reason("resolved", "the restart helped and the soak held: incident resolved")
        return decision(passed, Verdict.VERIFICATION_PASSED, (progress, resolved))
    if recovered_at is None and soak.elapsed_seconds >= restart.verify_timeout_seconds:
        why = reason(
            "verify_timeout",
            f"fewer than {restart.verify_probes} consecutive probe successes within "
            f"{restart.verify_timeout_seconds:g}s",
        )
        return verification_failed(mem, (why, progress), config, now)
    deadline = restart.soak_seconds + restart.verify_timeout_seconds
    if soak.elapsed_seconds >= deadline:
        why = reason(
            "soak_timeout",
            f"only {soak.passes} of {restart.soak_probes} probes passed within {deadline:g}s "
            "(soak_seconds + verify_timeout_seconds)",
            deadline_seconds=deadline,
        )
        return verification_failed(mem, (why, progress), config, now)
    return decision(mem, Verdict.VERIFYING, (progress,))


def held(mem: GroupState, facts: Facts, config: GroupSection, now: float) -> Decision:
    """held: no actions until a re-arm newer than the hold; then judge with a cleared budget."""
    budget = mem.budget
    rearmed = facts.operator.rearmed_at
    held_since = budget.held_since if budget.held_since is not None else mem.since
    if rearmed is None or rearmed <= held_since:
        underlying = assess(mem, facts, config, now)
        why = reason(
            "held",
            f"held since {now - (budget.held_since or now):.0f}s ago ({budget.held_reason}); no "
            f"actions until `watchdog reset`; meanwhile: {underlying.verdict}",
            underlying=str(underlying.verdict),
        )
        return decision(mem, Verdict.HELD, (why, *underlying.reasons))
    healthy = move(mem, State.HEALTHY, now)
    rearmed_state = replace(
        healthy,
        budget=replace(budget.recovered(), held_since=None, held_reason="", restart_times=()),
        alerted=(),
    )
    judged = judge(rearmed_state, facts, config, now)
    rearm = reason("rearmed", "re-armed by an operator: budget and failure count cleared")
    return replace(judged, reasons=(rearm, *judged.reasons))


def pause_ended(mem: GroupState, facts: Facts, config: GroupSection, now: float) -> Decision:
    """paused, lease over: back to held if it was, else warm up before judging again."""
    if mem.budget.held_since is not None:
        back = move(mem, State.HELD, now)
        return decision(back, Verdict.HELD, (reason("pause_ended", "lease over: still held"),))
    why = reason("pause_ended", "maintenance lease over: warming up before judging again")
    return decision(warm(mem, now), Verdict.WARMING_UP, (why,))


def restarting(mem: GroupState, facts: Facts, config: GroupSection, now: float) -> Decision:
    """restarting: wait for the daemon's outcome; one far overdue was lost and counts as failed."""
    # Three steps, each bounded by ready_timeout_seconds: longer means the outcome never came back
    # through after_restart; count it as failed rather than stay inert forever.
    limit = co_restart_limit_seconds(config)
    if now - mem.since <= limit:
        return decision(mem, Verdict.RESTARTING, (reason("restarting", "co-restart in progress"),))
    lost = reason(
        "restart_outcome_lost",
        f"no outcome {now - mem.since:.0f}s after the co-restart began (at most "
        f"{limit:g}s expected): counted as a failed attempt",
    )
    failed = move(mem, State.STALLED, now)
    failed = replace(
        failed,
        budget=failed.budget.failed_attempt(config.restart.backoff_seconds, now),
        units=replace(failed.units, starts=()),
    )
    return decision(failed, Verdict.RESTARTING, (lost,), Action.ALERT)
