"""Moves between states: alerts as edges, acting within budget and backoff, holding, warm-up.

See docs/decisions.md for the rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from watchdog.config import GroupSection
from watchdog.decide.assess import Assessment, unit_assessment
from watchdog.decide.fold import Facts
from watchdog.decide.judge import judge_prefill_only
from watchdog.decide.never_healthy import NOT_SERVING_VERDICTS, never_healthy, started_by_us
from watchdog.decide.reasons import budget_reason, prefill_only_reason, reason
from watchdog.decide.state import (
    Decision,
    GroupState,
    backoff_for,
    forget_old_processes,
    in_window,
)
from watchdog.decide.verdict import ALERT_VERDICTS, Verdict
from watchdog.model import Action, Reason, Role, Rung, State, worker_name
from watchdog.pairs import prefills_kept_running


def move(mem: GroupState, state: State, now: float) -> GroupState:
    """`mem` in `state`, entered now unless it already was in it."""
    return mem if mem.state is state else replace(mem, state=state, since=now)


def decision(
    mem: GroupState,
    verdict: Verdict,
    reasons: Sequence[Reason],
    action: Action = Action.NONE,
) -> Decision:
    """The decision, alerting once per episode for an alert verdict (an `ok` ends the episode)."""
    alerted = () if verdict is Verdict.OK else mem.alerted
    if action is Action.NONE and verdict in ALERT_VERDICTS and verdict not in alerted:
        action = Action.ALERT
    if action is Action.ALERT and verdict not in alerted:
        alerted = (*alerted, verdict)
    return Decision(replace(mem, verdict=verdict, alerted=alerted), verdict, action, tuple(reasons))


def hold(mem: GroupState, why: str, now: float) -> GroupState:
    """Held: no more actions until an operator re-arms."""
    held = move(mem, State.HELD, now)
    return replace(held, budget=replace(held.budget, held_since=now, held_reason=why))


def warm(mem: GroupState, now: float) -> GroupState:
    """Start (or restart) a warm-up: the new processes' failures and flat clock start afresh."""
    warming = forget_old_processes(move(mem, State.WARMING, now), now)
    return replace(
        warming,
        readiness=replace(warming.readiness, warming_since=now, verify_started_at=None),
    )


def act(
    mem: GroupState, facts: Facts, cause: Assessment, config: GroupSection, now: float
) -> Decision:
    """Co-restart for `cause` if the budget and backoff allow; otherwise wait (stalled) or hold."""
    verdict, reasons = cause.verdict, cause.reasons
    if facts.stopped:
        # RestartUnit would start what an operator stopped on purpose: tell, never act.
        names = ", ".join(r.value for r in facts.stopped)
        stopped = reason(
            "not_acting_unit_stopped",
            f"{verdict} calls for a co-restart, but {names} is stopped on purpose; "
            "use `watchdog pause` for maintenance",
            roles=names,
        )
        return decision(move(mem, State.DEGRADED, now), Verdict.UNIT_STOPPED, (*reasons, stopped))
    if verdict in NOT_SERVING_VERDICTS:
        never = never_healthy(mem, config, now)
        if never is not None:
            return page_never_healthy(mem, never, reasons, now)
    budget = mem.budget
    recent = in_window(budget.restart_times, config.restart.budget_window_seconds, now)
    used = budget_reason(recent, config)
    if len(recent) >= config.restart.max_restarts:
        held = hold(
            replace(mem, budget=replace(budget, stall_verdict=verdict, restart_times=recent)),
            f"{verdict}: restart budget exhausted",
            now,
        )
        exhausted = reason(
            "budget_exhausted",
            "restart budget exhausted: holding (no more actions) until an operator re-arms "
            "with `watchdog reset`",
        )
        return decision(held, Verdict.BUDGET_EXHAUSTED, (*reasons, used, exhausted), Action.ALERT)
    if now < budget.backoff_until:
        waiting = reason(
            "backoff",
            f"backing off {budget.backoff_until - now:.0f}s more after "
            f"{budget.consecutive_failures} consecutive failed attempt(s)",
            seconds_left=budget.backoff_until - now,
            consecutive_failures=budget.consecutive_failures,
        )
        stalled = move(mem, State.STALLED, now)
        stalled = replace(stalled, budget=replace(stalled.budget, stall_verdict=verdict))
        return decision(stalled, Verdict.BACKOFF, (*reasons, waiting, used))
    fresh = tuple(f.worker for f in mem.units.prefill_only)
    stale = tuple(
        worker_name(Role.PREFILL, p, len(config.prefills))
        for p in prefills_kept_running(config, fresh)
    )
    rung, rung_reason = _rung(verdict, budget.partial_tried, stale)
    restarting = move(mem, State.RESTARTING, now)
    restarting = replace(
        restarting,
        budget=replace(
            restarting.budget,
            restart_times=(*recent, now),
            stall_verdict=verdict,
            backoff_base_seconds=config.restart.backoff_seconds,
            left_after_attempt=config.restart.max_restarts - len(recent) - 1,
            partial_tried=budget.partial_tried or rung is not Rung.FULL,
        ),
    )
    charged = budget_reason((*recent, now), config)
    told = () if rung_reason is None else (rung_reason,)
    acted = decision(restarting, verdict, (*reasons, *told, charged), Action.CO_RESTART)
    if rung is Rung.SURVIVOR:
        return replace(acted, rung=rung, fresh_prefills=fresh)
    return replace(acted, rung=rung)


def page_never_healthy(
    mem: GroupState, why: Reason, reasons: Sequence[Reason], now: float
) -> Decision:
    """A group not once healthy since its units started: alert (once per episode), no restart.

    Degraded, not stalled: nothing is charged to the budget and no backoff starts, so a group
    that comes up later (a probe passes) is judged afresh (docs/decisions.md, "Never healthy").
    """
    paged = move(mem, State.DEGRADED, now)
    paged = replace(paged, budget=replace(paged.budget, stall_verdict=None))
    return decision(paged, Verdict.NEVER_HEALTHY, (why, *reasons))


def _rung(
    verdict: Verdict, partial_tried: bool, stale_prefills: tuple[str, ...] = ()
) -> tuple[Rung, Reason | None]:
    """Which rung a co-restart for `verdict` takes, and why (README "Restart rungs").

    The router alone only for a router wedge, the survivors of a prefill restarted alone only
    for that, and each only once per streak: if a partial restart did not help, the localisation
    was wrong and the next attempt is the full co-restart. The plain full co-restart adds no
    reason, so its decisions read as they always did.
    """
    if verdict is Verdict.PREFILL_ONLY_RESTART and not partial_tried and stale_prefills:
        kept = ", ".join(stale_prefills)
        return Rung.SURVIVOR, reason(
            "rung",
            "rung survivor: the decodes that pair with the restarted prefill also pair with "
            f"{kept}, which kept running; restarting those decodes under it would be a "
            f"decode-only restart, so {kept} first, then the decodes, then the router; the "
            "prefill restarted alone is not restarted again (it is already fresher than them)",
            rung=Rung.SURVIVOR.value,
            stale_prefills=kept,
        )
    if verdict is Verdict.PREFILL_ONLY_RESTART and not partial_tried:
        return Rung.SURVIVOR, reason(
            "rung",
            "rung survivor: the decodes that pair with the restarted prefill, then the router; "
            "the prefill is not restarted again (it is already the freshest process)",
            rung=Rung.SURVIVOR.value,
        )
    if verdict is Verdict.ROUTER_WEDGE and not partial_tried:
        return Rung.ROUTER, reason(
            "rung",
            "rung router: the router alone (the workers and their KV bootstrap state are left "
            "running); the full co-restart follows if this does not help",
            rung=Rung.ROUTER.value,
        )
    if partial_tried:
        return Rung.FULL, reason(
            "rung",
            "rung full (escalation): a partial restart (the router alone, or the survivors of "
            "a prefill restarted alone) did not help; every prefill, then every decode, then "
            "the router",
            rung=Rung.FULL.value,
            escalated="true",
        )
    return Rung.FULL, None


def settle(
    mem: GroupState, facts: Facts, assessment: Assessment, config: GroupSection, now: float
) -> Decision:
    """Apply an assessment to a group in healthy, overloaded, degraded or stalled."""
    if assessment.act:
        return act(mem, facts, assessment, config, now)
    verdict = assessment.verdict
    if verdict is Verdict.OK:
        target = State.HEALTHY
    elif verdict is Verdict.OVERLOADED:
        target = State.OVERLOADED
    elif verdict in (Verdict.BLIP, Verdict.STALL_SUSPECTED):
        keep = (State.HEALTHY, State.OVERLOADED, State.DEGRADED)
        target = mem.state if mem.state in keep else State.HEALTHY
    else:
        target = State.DEGRADED
    moved = move(mem, target, now)
    if mem.state is State.STALLED:
        # Out of stalled without our help: the trigger is history, but the failed attempts and
        # their backoff are not. Overload easing is no proof that the next co-restart would
        # work; only a passed verification or a re-arm ends the streak.
        moved = replace(moved, budget=replace(moved.budget, stall_verdict=None))
    return decision(moved, verdict, assessment.reasons)


def verification_failed(
    mem: GroupState, reasons: Sequence[Reason], config: GroupSection, now: float
) -> Decision:
    """Our co-restart did not help: count the failed attempt, back off, or hold if out of budget."""
    base = config.restart.backoff_seconds
    counted = replace(
        mem,
        budget=mem.budget.failed_attempt(base, now),
        readiness=replace(mem.readiness, verify_started_at=None, warming_since=None),
    )
    attempts = counted.budget.consecutive_failures
    recent = in_window(mem.budget.restart_times, config.restart.budget_window_seconds, now)
    if len(recent) >= config.restart.max_restarts:
        held = hold(counted, "verification failed and the restart budget is exhausted", now)
        extra = (
            budget_reason(recent, config),
            reason(
                "budget_exhausted", "restart budget exhausted: holding until an operator re-arms"
            ),
        )
        return decision(held, Verdict.VERIFICATION_FAILED, (*reasons, *extra), Action.ALERT)
    stalled = move(counted, State.STALLED, now)
    backoff = reason(
        "backoff",
        f"attempt {attempts} failed; next co-restart not before "
        f"{backoff_for(base, attempts):g}s from now",
        consecutive_failures=attempts,
        backoff_seconds=backoff_for(base, attempts),
    )
    return decision(stalled, Verdict.VERIFICATION_FAILED, (*reasons, backoff), Action.ALERT)


def unit_events(mem: GroupState, facts: Facts, config: GroupSection, now: float) -> Decision | None:
    """Crash (acting), decode-only restarts and external restarts, in every judging state."""
    units = unit_assessment(mem, facts, config, now, hung=mem.state is not State.WARMING)
    if units is not None and units.act:
        return act(mem, facts, units, config, now)
    if mem.units.decode_only_seen_at is not None:
        return _decode_only(mem, facts, config, now)
    if mem.units.prefill_only:
        survivor = _prefill_only(mem, facts, config, now)
        if survivor is not None:
            return survivor
    if facts.decode_only_cancelled:
        why = reason(
            "decode_then_prefill_restart",
            "decode was restarted and prefill followed within the grace window: treated as an "
            "external co-restart",
        )
        return decision(warm(mem, now), Verdict.WARMING_UP, (why,))
    if facts.restarted == {Role.ROUTER}:
        # The router holds no KV bootstrap state: no worker is restarted for it. Warming up
        # waits for a probe through the new router, which is its verification (docs/decisions.md,
        # "Restart rungs").
        why = reason(
            "router_restarted_alone",
            "the router was restarted alone (ExecMainStartTimestamp changed): it holds no KV "
            "bootstrap state, so no worker is restarted; warming up until a probe passes through "
            "it",
            roles=Role.ROUTER.value,
        )
        return decision(warm(mem, now), Verdict.WARMING_UP, (why,))
    if facts.restarted:
        names = ", ".join(sorted(r.value for r in facts.restarted))
        why = reason(
            "external_restart",
            f"restart of {names} detected (ExecMainStartTimestamp changed): warming up",
            roles=names,
        )
        return decision(warm(mem, now), Verdict.WARMING_UP, (why,))
    return None


def _decode_only(mem: GroupState, facts: Facts, config: GroupSection, now: float) -> Decision:
    if _never_served_with_its_prefills(mem, config):
        # A decode that cannot load, brought back alone by systemd's Restart= after a deploy:
        # no prefill of its group has served, so there is no bootstrap state of a serving
        # prefill to protect. Warm-up judges it, and pages never_healthy if nothing comes up.
        cleared = replace(
            mem,
            units=replace(
                mem.units, decode_only_seen_at=None, decode_only_workers=(), decode_only_prefills=()
            ),
        )
        why = reason(
            "decode_restarted_before_serving",
            "a decode was restarted alone, but the group has not served since its prefills "
            "started: nothing to co-restart for; warming up",
        )
        return decision(warm(cleared, now), Verdict.WARMING_UP, (why,))
    seen = mem.units.decode_only_seen_at
    assert seen is not None
    grace = config.stall.decode_only_grace_seconds
    waited = now - seen
    starts = {u.role: u.start_us for u in mem.units.starts if u.worker == 0}
    several = len(config.workers(Role.PREFILL)) + len(config.workers(Role.DECODE)) > 2
    which = "; ".join(mem.units.decode_only_workers)
    what = (
        f"a decode was restarted while a prefill of its group kept running: {which} "
        "(decode, and the prefills that kept running)"
        if several
        else "decode was restarted while prefill kept running (prefill started "
        f"{_age(starts.get(Role.PREFILL), now)}, decode {_age(starts.get(Role.DECODE), now)})"
    )
    extra: dict[str, str] = {"workers": which} if several else {}
    why = reason(
        "decode_only_restart",
        f"{what}; a decode restarted alone degrades the KV-transfer bootstrap state",
        seen_seconds_ago=waited,
        grace_seconds=grace,
        policy=config.stall.on_decode_only_restart,
        n_restarts=facts.units[Role.DECODE].n_restarts if Role.DECODE in facts.units else None,
        **extra,
    )
    if facts.decode_only_new:
        mem = warm(mem, now)
    if waited < grace:
        grace_reason = reason(
            "grace",
            f"waiting {grace - waited:.0f}s more in case prefill is being restarted too",
            seconds_left=grace - waited,
        )
        return decision(
            move(mem, State.WARMING, now), Verdict.DECODE_ONLY_RESTART, (why, grace_reason)
        )
    if config.stall.on_decode_only_restart == "alert":
        alerted = replace(mem, units=replace(mem.units, decode_only_seen_at=None))
        return decision(alerted, Verdict.DECODE_ONLY_RESTART, (why,), Action.ALERT)
    cause = Assessment(Verdict.DECODE_ONLY_RESTART, (why,), act=True)
    return act(mem, facts, cause, config, now)


def _never_served_with_its_prefills(mem: GroupState, config: GroupSection) -> bool:
    """The group has not served since every prefill's current start, and not after our restart."""
    since = mem.units.unserved_since
    prefills = [u.start_us / 1e6 for u in mem.units.starts if u.role is Role.PREFILL]
    return (
        since is not None
        and bool(prefills)
        and since <= min(prefills)
        and not started_by_us(mem, config, since)
    )


def _prefill_only(
    mem: GroupState, facts: Facts, config: GroupSection, now: float
) -> Decision | None:
    """A prefill restarted alone: once it serves, the survivor rung (docs/decisions.md).

    The decodes and the router are restarted only after the fresh prefill passes /health (the
    router drops for good a worker unreachable when it starts: docs/sglang.md §4), and only
    after `decode_only_grace_seconds` of it doing so, in which an operator restarting in order by
    hand (prefill, then decode once prefill is ready) restarts the decodes and resolves it. A
    prefill that does not serve within `startup_timeout_seconds` is left to warm-up: a failed
    start, the full co-restart.
    """
    seen = mem.units.prefill_only_seen_at
    assert seen is not None
    why = prefill_only_reason(mem, config, now)
    if facts.prefill_only_new:
        mem = warm(mem, now)  # the new prefill's counters start from zero; so does its run
    ready_at = mem.units.prefill_only_ready_at
    if facts.health.get(Role.PREFILL) is True:
        ready_at = now if ready_at is None else ready_at
    else:
        ready_at = None
    mem = replace(mem, units=replace(mem.units, prefill_only_ready_at=ready_at))
    timeout = config.stall.startup_timeout_seconds
    if ready_at is None:
        if now - seen >= timeout:
            return None
        waiting = reason(
            "waiting_for_prefill",
            f"waiting for the restarted prefill's /health ({now - seen:.0f}s of at most "
            f"{timeout:g}s) before restarting its decodes and the router",
            waited_seconds=now - seen,
            startup_timeout_seconds=timeout,
        )
        return decision(move(mem, State.WARMING, now), Verdict.PREFILL_ONLY_RESTART, (why, waiting))
    grace = config.stall.decode_only_grace_seconds
    if now - ready_at < grace:
        grace_reason = reason(
            "grace",
            f"the prefill serves; waiting {grace - (now - ready_at):.0f}s more in case its "
            "decodes are being restarted too",
            seconds_left=grace - (now - ready_at),
        )
        return decision(
            move(mem, State.WARMING, now), Verdict.PREFILL_ONLY_RESTART, (why, grace_reason)
        )
    reasons: tuple[Reason, ...] = (why,)
    if config.stall.on_prefill_only_restart == "judge":
        judged = judge_prefill_only(mem, config, facts.decode_versions, ready_at)
        reasons = (why, judged.why)
        if judged.recovered:
            units = replace(
                mem.units, prefill_only=(), prefill_only_seen_at=None, prefill_only_ready_at=None
            )
            alerted = replace(mem, units=units)
            return decision(alerted, Verdict.PREFILL_ONLY_RESTART, reasons, Action.ALERT)
    cause = Assessment(Verdict.PREFILL_ONLY_RESTART, reasons, act=True)
    return act(mem, facts, cause, config, now)


def _age(start_us: int | None, now: float) -> str:
    if not start_us:
        return "at an unknown time"
    return f"{max(0.0, now - start_us / 1e6):.0f}s ago"
