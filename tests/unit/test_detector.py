"""The stall detector as tables: each scenario drives a simulated group and names the verdict."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import pytest
from pydantic import TypeAdapter

from tests.unit.builders import (
    T0,
    Harness,
    Stack,
    group_config,
    outcome,
    probe,
)
from watchdog.decide import (
    Decision,
    GroupState,
    Verdict,
    after_restart,
    decide,
    initial_state,
)
from watchdog.decide.machine import HANDLERS
from watchdog.decide.state import Budget
from watchdog.model import (
    Action,
    LoadsSnapshot,
    Observation,
    OperatorControls,
    OwnTokens,
    ProbeFailure,
    ProbeKind,
    Role,
    ScrapeFailure,
    State,
)

Scenario = Callable[[Harness], Decision]


def codes(decision: Decision) -> list[str]:
    """The reason codes of a decision."""
    return [r.code for r in decision.reasons]


def values(decision: Decision, code: str) -> dict[str, float | str]:
    """The numbers behind one reason."""
    reason = next(r for r in decision.reasons if r.code == code)
    return dict(reason.values)


def unreachable(stack: Stack, **kwargs: Any) -> Observation:
    """A cycle in which nothing answers: every probe, health check and scrape fails to connect."""
    return stack.cycle(
        (probe(False, at=stack.now + stack.cycle_seconds, reason=ProbeFailure.CONNECT_ERROR),),
        progress=False,
        scrape=False,
        scrape_error=ScrapeFailure.CONNECT_ERROR,
        health_ok=False,
        health_reason=ProbeFailure.CONNECT_ERROR,
        **kwargs,
    )


# --- scenarios: each returns the decision the table checks ---------------------------------------


def silent_stall_frozen_gauges(h: Harness) -> Decision:
    """Queue gauges reported before the stall, then frozen, with no tokens: a silent stall."""
    h.warm()
    h.stack.inflight_queue = 3.0  # reported before the stall, then frozen
    h.stack.transfer_queue = 2.0
    return h.stall(9)


def silent_stall_live_loads(h: Harness) -> Decision:
    """A prefill inflight queue /v1/loads still reports while nothing moves: a silent stall."""
    h.warm()
    loads = (
        LoadsSnapshot(role=Role.PREFILL, fetched_at=0, ok=True, prefill_inflight_queue_reqs=5),
    )
    last = h.stall(8, loads=loads)
    assert last.verdict is Verdict.STALL_SUSPECTED
    return h.stall(1, loads=loads)


def silent_stall_units_not_observed(h: Harness) -> Decision:
    """A stall is still judged when the unit states cannot be read."""
    h.stack.observe_units = False
    h.warm()
    return h.stall(9)


def silent_stall_last_known_flat_then_scrapes_fail(h: Harness) -> Decision:
    """Counters last seen flat, then unscrapeable while probes fail: still a silent stall."""
    h.config = group_config(stall={"probe_failures": 12})
    h.warm()
    assert h.stall(10).verdict is Verdict.BLIP  # 50s flat seen, too few failures
    return h.stall(2, scrape=False)  # more failures; counters now unknown, last known flat


def scrapes_and_probes_fail_progress_unknown(h: Harness) -> Decision:
    """Probes and scrapes failing together leave progress unknown: an outage, not a stall."""
    h.warm()
    h.stall(2)  # flat for 10s only
    return h.stall(60, scrape=False)


def overloaded(h: Harness) -> Decision:
    """Failing probes while tokens keep growing are overload, never a stall."""
    h.warm()
    return h.steps(60, (False,), progress=True, in_flight=4)


def ten_minute_generation(h: Harness) -> Decision:
    """One ten-minute request that counts only when it finishes is healthy while probes pass."""
    h.warm()
    h.stack.http_active = 1.0  # one long user request that only counts when it finishes
    return h.steps(120, (True,), in_flight=1)


def single_blip(h: Harness) -> Decision:
    """Two failed probes in a row are a blip."""
    h.warm()
    h.step((False,), progress=False)
    return h.step((False,), progress=False)


def blips_below_threshold(h: Harness) -> Decision:
    """Failures that recur but never reach the threshold in a row stay blips for hours."""
    h.warm()
    for _ in range(30):
        h.step((False,), progress=False, in_flight=2)
        h.step((False,), progress=False, in_flight=2)
        h.step((True,))
    return h.step((False,), progress=False)


def scrape_outage(h: Harness) -> Decision:
    """Scrapes failing while probes pass is a monitoring outage."""
    h.warm()
    return h.steps(3, (True,), scrape=False)


def cut_off_from_everything(h: Harness) -> Decision:
    """Nothing reachable for a long time is a monitoring outage, never a restart."""
    h.warm()
    decision = None
    for _ in range(200):
        decision = h.feed(unreachable(h.stack))
    assert decision is not None
    return decision


def warming_after_external_restart(h: Harness) -> Decision:
    """All units restarted by someone else and not ready yet are warming up, not stalled."""
    h.warm()
    for role in Role:
        h.stack.restart(role)
    h.stack.active[Role.DECODE] = "active"
    return h.steps(100, (False,), progress=False, health_ok=False)


def warm_up_complete(h: Harness) -> Decision:
    """A probe passing after an external restart ends the warm-up."""
    h.warm()
    for role in Role:
        h.stack.restart(role)
    h.steps(20, (False,), progress=False, health_ok=False)
    return h.step((True,))


def daemon_start_on_healthy_stack(h: Harness) -> Decision:
    """The daemon starting beside a healthy stack ends its warm-up at the first passing probe."""
    return h.step((True,))


def daemon_start_on_stalled_stack(h: Harness) -> Decision:
    """The daemon starting beside a stack already stalled judges it without a warm-up."""
    return h.stall(10)  # units have run for a day: no warm-up needed, the stall is judged


def failed_start(h: Harness) -> Decision:
    """A stack that served, then is not ready at the end of its startup timeout: failed start."""
    # Served since its units started, then not ready at the end of a warm-up (after a lease).
    h.config = group_config(stall={"startup_timeout_seconds": 120})
    h.warm()
    h.steps(2, (True,), operator=OperatorControls(paused_until=h.stack.now + 10))
    for _ in range(30):
        decision = h.step((False,), progress=False, health_ok=False)
        if decision.action is not Action.NONE:
            break
    return decision


def never_healthy_after_deploy(h: Harness) -> Decision:
    """Units started again by a deploy that never become healthy are alerted on, not restarted."""
    # Every unit started again by someone else (a deploy); nothing served since.
    h.config = group_config(stall={"startup_timeout_seconds": 120})
    h.warm()
    for role in Role:
        h.stack.restart(role)
    return h.steps(25, (False,), progress=False, health_ok=False)


def decode_only_restart_grace(h: Harness) -> Decision:
    """Decode restarted alone is given its grace first."""
    h.warm()
    h.stack.restart(Role.DECODE)
    return h.step((True,))


def decode_only_restart_co_restart(h: Harness) -> Decision:
    """Decode restarted alone, past its grace, gets the co-restart that prefill needs."""
    h.warm()
    h.stack.restart(Role.DECODE)
    return h.steps(13, (True,))


def decode_only_restart_alert(h: Harness) -> Decision:
    """With on_decode_only_restart = "alert", decode restarted alone alerts once, no more."""
    h.config = group_config(stall={"on_decode_only_restart": "alert"})
    h.warm()
    h.stack.restart(Role.DECODE)
    alert = h.steps(13, (True,))
    assert (alert.verdict, alert.action) == (Verdict.DECODE_ONLY_RESTART, Action.ALERT)
    return h.step((True,))


def decode_then_prefill_within_grace(h: Harness) -> Decision:
    """Decode then prefill restarted within the grace is a warm-up, not a decode-only restart."""
    h.warm()
    h.stack.restart(Role.DECODE)
    h.steps(3, (True,))
    h.stack.restart(Role.PREFILL)
    return h.step((True,))


def external_co_restart_across_cycles(h: Harness) -> Decision:
    """An operator's co-restart spread over several cycles ends healthy with no restart of ours."""
    h.warm()
    h.stack.restart(Role.PREFILL)
    h.steps(6, (False,), progress=False, health_ok={Role.PREFILL: False})
    h.stack.restart(Role.DECODE)
    h.steps(6, (False,), progress=False, health_ok={Role.DECODE: False})
    h.stack.restart(Role.ROUTER)
    return h.steps(14, (True,))


def our_co_restart(h: Harness) -> Decision:
    """Our own co-restart is followed by verification."""
    h.warm()
    h.stall(9)
    h.restarted()
    return h.step((True,))


def crash_waiting_for_systemd(h: Harness) -> Decision:
    """A crashed unit is left to systemd's Restart= for a while."""
    h.warm()
    h.stack.active[Role.DECODE] = "failed"
    return h.steps(3, (False,), progress=False, health_ok={Role.DECODE: False})


def crash_not_brought_back(h: Harness) -> Decision:
    """A crashed unit systemd does not bring back within the startup timeout is co-restarted."""
    h.config = group_config(stall={"startup_timeout_seconds": 60})
    h.warm()
    h.stack.active[Role.PREFILL] = "failed"
    return h.steps(13, (False,), progress=False, health_ok={Role.PREFILL: False})


def crash_brought_back_alone(h: Harness) -> Decision:
    """A crashed decode that systemd starts again alone is a decode-only restart."""
    h.warm()
    h.stack.active[Role.DECODE] = "failed"
    h.steps(2, (False,), progress=False, health_ok={Role.DECODE: False})
    h.stack.restart(Role.DECODE)  # systemd's Restart= starts decode again, alone
    return h.step((False,), progress=False, health_ok={Role.DECODE: False})


def unit_stopped(h: Harness) -> Decision:
    """A unit an operator stopped is reported, never started behind their back."""
    h.config = group_config(stall={"startup_timeout_seconds": 60})
    h.warm()
    h.stack.active[Role.DECODE] = "inactive"
    return h.steps(40, (False,), progress=False, health_ok={Role.DECODE: False})


def hung_worker(h: Harness) -> Decision:
    """A hung worker after warm-up is judged on no_progress_seconds, not the model-load time."""
    # No startup_timeout override: after warm-up a hung worker is judged on no_progress_seconds
    # (45 s by default), not on the model-load allowance (1200 s).
    h.warm()
    return h.steps(
        10,
        (False,),
        progress=False,
        health_ok={Role.DECODE: False},
        health_reason=ProbeFailure.TIMEOUT,
    )


def degraded_bootstrap(h: Harness) -> Decision:
    """Transfer failures over the threshold for three cycles of failed probes:
    degraded_bootstrap."""
    h.warm()
    h.stack.fail_transfers(6)
    h.step((False,), progress=True)
    h.step((False,), progress=True)
    return h.step((False,), progress=True)


def transfer_failures_rising(h: Harness) -> Decision:
    """Transfer failures below the threshold while probes pass are only an alert."""
    h.warm()
    h.stack.fail_transfers(5, roles=(Role.PREFILL,))
    return h.step((True,))


def per_rank_and_per_role_not_summed(h: Harness) -> Decision:
    """The same failed requests counted by prefill and by decode are not summed into double."""
    h.warm()
    h.stack.fail_transfers(3)  # the same 3 failed requests, counted by prefill and by decode
    return h.step((True,))


def counter_reset_after_restart(h: Harness) -> Decision:
    """Counters starting from zero in new processes are no negative increase; new failures count."""
    h.stack.failures = {Role.PREFILL: 21.0, Role.DECODE: 21.0}
    h.warm()
    for role in Role:
        h.stack.restart(role)  # counters start from 0 in the new processes
    h.step((True,))
    h.stack.fail_transfers(2)  # a new process's first failures are counted, from zero
    return h.step((True,))


def counter_reset_units_not_observed(h: Harness) -> Decision:
    """A counter reset with unit states unreadable is not mistaken for failures."""
    h.stack.observe_units = False
    h.stack.failures = {Role.PREFILL: 21.0, Role.DECODE: 21.0}
    h.warm()
    h.stack.failures = {Role.PREFILL: 0.0, Role.DECODE: 0.0}
    return h.step((True,))


def pinned_handoff(h: Harness) -> Decision:
    """A hand-off queue held for two minutes while probes pass is a pinned request alert."""
    h.warm()
    h.stack.inflight_queue = 1.0
    return h.steps(121, (True,))


def pinned_probe(h: Harness) -> Decision:
    """One probe in flight for ten minutes while the others pass is a pinned request alert."""
    h.warm()
    return h.step((True,), in_flight=2, oldest_in_flight_seconds=601.0)


def budget_exhausted(h: Harness) -> Decision:
    """A stall with the restart budget spent alerts and holds instead of restarting."""
    h.state = initial_state(h.stack.now, restart_times=(T0 - 600, T0 - 400, T0 - 200))
    h.warm()
    return h.stall(9)


def held_stays_held(h: Harness) -> Decision:
    """A group held by the budget stays held however long the stall lasts."""
    budget_exhausted(h)
    return h.stall(100)


def backoff_after_failed_verification(h: Harness) -> Decision:
    """A stall after a failed verification waits out its backoff before another restart."""
    h.warm()
    h.stall(9)
    h.restarted(dry_run=True)
    h.stall(60)
    return h.stall(1)


def verification_passed(h: Harness) -> Decision:
    """Probes passing after our co-restart pass the verification."""
    h.warm()
    h.stall(9)
    h.restarted()
    return h.steps(8, (True,))


def verification_failed_transfer(h: Harness) -> Decision:
    """A new transfer failure after our co-restart fails the verification."""
    h.warm()
    h.stall(9)
    h.restarted()
    h.steps(3, (True,))
    h.stack.fail_transfers(1)
    return h.step((True,))


def paused_during_stall(h: Harness) -> Decision:
    """A stall during an operator's pause is reported as paused and not acted on."""
    h.warm()
    lease = OperatorControls(paused_until=T0 + 3600, pause_reason="driver upgrade")
    return h.stall(40, operator=lease)


def health_unknown(h: Harness) -> Decision:
    """Flat progress with /health unknown is suspected, never acted on."""
    h.warm()
    return h.stall(20, health_ok=None)


def multiround_counted(h: Harness) -> Decision:
    """A failed multi-round probe counts toward the failures in a row like any other."""
    h.warm()
    at = h.stack.now + h.stack.cycle_seconds
    mr = probe(False, at=at, kind=ProbeKind.MULTIROUND, reason=ProbeFailure.STALLED_MIDSTREAM)
    return h.step((False, mr, False), progress=False, in_flight=1)


@dataclass(frozen=True)
class Row:
    """One table row: a scenario and what its last decision must be."""

    scenario: Scenario
    verdict: Verdict
    action: Action
    state: State
    reason: str | None = None  # a reason code that must be present


TABLE = [
    Row(
        silent_stall_frozen_gauges,
        Verdict.SILENT_STALL,
        Action.CO_RESTART,
        State.RESTARTING,
        "no_progress",
    ),
    Row(
        silent_stall_live_loads,
        Verdict.SILENT_STALL,
        Action.CO_RESTART,
        State.RESTARTING,
        "work_pending",
    ),
    Row(silent_stall_units_not_observed, Verdict.SILENT_STALL, Action.CO_RESTART, State.RESTARTING),
    Row(
        silent_stall_last_known_flat_then_scrapes_fail,
        Verdict.SILENT_STALL,
        Action.CO_RESTART,
        State.RESTARTING,
        "metrics_unavailable",
    ),
    Row(
        scrapes_and_probes_fail_progress_unknown,
        Verdict.MONITORING_OUTAGE,
        Action.NONE,
        State.DEGRADED,
        "progress_unknown",
    ),
    Row(overloaded, Verdict.OVERLOADED, Action.NONE, State.OVERLOADED),
    Row(ten_minute_generation, Verdict.OK, Action.NONE, State.HEALTHY),
    Row(single_blip, Verdict.BLIP, Action.NONE, State.HEALTHY, "probe_failures"),
    Row(blips_below_threshold, Verdict.BLIP, Action.NONE, State.HEALTHY),
    Row(scrape_outage, Verdict.MONITORING_OUTAGE, Action.ALERT, State.DEGRADED, "scrape_failing"),
    Row(
        cut_off_from_everything,
        Verdict.MONITORING_OUTAGE,
        Action.NONE,
        State.DEGRADED,
        "nothing_reachable",
    ),
    Row(warming_after_external_restart, Verdict.WARMING_UP, Action.NONE, State.WARMING),
    Row(warm_up_complete, Verdict.OK, Action.NONE, State.HEALTHY, "warm_up_complete"),
    Row(daemon_start_on_healthy_stack, Verdict.OK, Action.NONE, State.HEALTHY, "warm_up_complete"),
    Row(daemon_start_on_stalled_stack, Verdict.SILENT_STALL, Action.CO_RESTART, State.RESTARTING),
    Row(failed_start, Verdict.FAILED_START, Action.CO_RESTART, State.RESTARTING, "startup_timeout"),
    Row(
        never_healthy_after_deploy,
        Verdict.NEVER_HEALTHY,
        Action.ALERT,
        State.DEGRADED,
        "never_healthy",
    ),
    Row(
        decode_only_restart_grace, Verdict.DECODE_ONLY_RESTART, Action.NONE, State.WARMING, "grace"
    ),
    Row(
        decode_only_restart_co_restart,
        Verdict.DECODE_ONLY_RESTART,
        Action.CO_RESTART,
        State.RESTARTING,
    ),
    Row(decode_only_restart_alert, Verdict.OK, Action.NONE, State.HEALTHY),
    Row(
        decode_then_prefill_within_grace,
        Verdict.WARMING_UP,
        Action.NONE,
        State.WARMING,
        "decode_then_prefill_restart",
    ),
    Row(external_co_restart_across_cycles, Verdict.OK, Action.NONE, State.HEALTHY),
    Row(our_co_restart, Verdict.VERIFYING, Action.NONE, State.VERIFYING, "verification"),
    Row(crash_waiting_for_systemd, Verdict.CRASH, Action.NONE, State.DEGRADED, "unit_failed"),
    Row(crash_not_brought_back, Verdict.CRASH, Action.CO_RESTART, State.RESTARTING, "unit_failed"),
    Row(crash_brought_back_alone, Verdict.DECODE_ONLY_RESTART, Action.NONE, State.WARMING),
    Row(unit_stopped, Verdict.UNIT_STOPPED, Action.NONE, State.DEGRADED, "unit_stopped"),
    Row(hung_worker, Verdict.CRASH, Action.CO_RESTART, State.RESTARTING, "health_failing"),
    Row(
        degraded_bootstrap,
        Verdict.DEGRADED_BOOTSTRAP,
        Action.CO_RESTART,
        State.RESTARTING,
        "transfer_failures",
    ),
    Row(transfer_failures_rising, Verdict.TRANSFER_FAILURES_RISING, Action.ALERT, State.DEGRADED),
    Row(per_rank_and_per_role_not_summed, Verdict.OK, Action.NONE, State.HEALTHY),
    Row(counter_reset_after_restart, Verdict.OK, Action.NONE, State.HEALTHY),
    Row(counter_reset_units_not_observed, Verdict.OK, Action.NONE, State.HEALTHY),
    Row(
        pinned_handoff, Verdict.PINNED_REQUEST, Action.ALERT, State.DEGRADED, "handoff_queue_pinned"
    ),
    Row(pinned_probe, Verdict.PINNED_REQUEST, Action.ALERT, State.DEGRADED, "probe_pinned"),
    Row(budget_exhausted, Verdict.BUDGET_EXHAUSTED, Action.ALERT, State.HELD, "budget_exhausted"),
    Row(held_stays_held, Verdict.HELD, Action.NONE, State.HELD, "held"),
    Row(backoff_after_failed_verification, Verdict.BACKOFF, Action.ALERT, State.STALLED, "backoff"),
    Row(verification_passed, Verdict.VERIFICATION_PASSED, Action.NONE, State.HEALTHY, "resolved"),
    Row(
        verification_failed_transfer,
        Verdict.VERIFICATION_FAILED,
        Action.ALERT,
        State.STALLED,
        "new_transfer_failures",
    ),
    Row(paused_during_stall, Verdict.PAUSED, Action.NONE, State.PAUSED, "paused"),
    Row(health_unknown, Verdict.STALL_SUSPECTED, Action.NONE, State.HEALTHY),
    Row(multiround_counted, Verdict.STALL_SUSPECTED, Action.NONE, State.HEALTHY, "probe_failures"),
]


@pytest.mark.parametrize("row", TABLE, ids=[row.scenario.__name__ for row in TABLE])
def test_verdict_table(row: Row) -> None:
    """Each scenario's last decision has the expected verdict, action, state and reason."""
    decision = row.scenario(Harness())
    assert (decision.verdict, decision.action, decision.state.state) == (
        row.verdict,
        row.action,
        row.state,
    ), [r.message for r in decision.reasons]
    if row.reason is not None:
        assert row.reason in codes(decision)


# --- sequences: what must never (or must exactly once) happen -------------------------------------

NEVER_ACT = [
    overloaded,
    ten_minute_generation,
    blips_below_threshold,
    scrape_outage,
    cut_off_from_everything,
    warming_after_external_restart,
    scrapes_and_probes_fail_progress_unknown,
    unit_stopped,
    decode_only_restart_alert,
    decode_then_prefill_within_grace,
    external_co_restart_across_cycles,
    counter_reset_after_restart,
    per_rank_and_per_role_not_summed,
    pinned_handoff,
    paused_during_stall,
    health_unknown,
    held_stays_held,
]


@pytest.mark.parametrize("scenario", NEVER_ACT, ids=[s.__name__ for s in NEVER_ACT])
def test_scenarios_that_never_restart(scenario: Scenario) -> None:
    """No decision in these scenarios asks for a co-restart."""
    h = Harness()
    scenario(h)
    assert Action.CO_RESTART not in h.actions, h.verdicts


@pytest.mark.parametrize(
    "scenario", [scrape_outage, pinned_handoff, unit_stopped, transfer_failures_rising]
)
def test_alerts_are_sent_once_per_episode(scenario: Scenario) -> None:
    """An alert-worthy condition that persists alerts once, not every cycle."""
    h = Harness()
    scenario(h)
    h.steps(5, (True,), scrape=scenario is not scrape_outage)
    assert h.actions.count(Action.ALERT) == 1, h.verdicts


def test_frozen_gauges_are_not_progress() -> None:
    """Non-zero queue gauges that stay put neither reset the no-progress clock nor count as work done."""
    h = Harness().warm()
    h.stack.inflight_queue = 7.0
    decision = h.stall(8)
    assert decision.verdict is Verdict.STALL_SUSPECTED
    assert values(decision, "no_progress")["flat_seconds"] == 40.0


def test_silent_stall_reasons_carry_the_numbers() -> None:
    """The silent-stall decision names probe failures, flat seconds, pending work and health."""
    decision = silent_stall_frozen_gauges(Harness())
    assert values(decision, "probe_failures")["consecutive"] == 9
    assert values(decision, "no_progress")["flat_seconds"] == 45.0
    pending = values(decision, "work_pending")
    assert pending["probes_in_flight"] == 4
    assert pending["prefill_inflight_queue"] == 3.0
    assert values(decision, "worker_health") == {"prefill": "ok", "decode": "ok"}
    assert values(decision, "budget")["used"] == 1


def test_monitoring_outage_does_not_freeze_the_clock_into_a_stall() -> None:
    """Scrapes failing for a long time while probes fail do not add up to known no-progress."""
    h = Harness().warm()
    h.stall(3)
    decision = h.stall(200, scrape=False)
    assert values(decision, "metrics_unavailable")["flat_seconds"] == 15.0
    assert Action.CO_RESTART not in h.actions


def test_scrape_gap_with_flat_counters_is_known_flat() -> None:
    """Counters equal on both sides of a scrape gap were flat throughout (they are monotonic)."""
    h = Harness().warm()
    h.stall(2)
    h.stall(10, scrape=False)
    decision = h.stall(1)
    assert decision.verdict is Verdict.SILENT_STALL
    assert values(decision, "no_progress")["flat_seconds"] == 65.0


def test_counter_advance_across_scrape_gap_is_progress() -> None:
    """Counters that grew during a scrape gap count as progress when the scrape returns."""
    h = Harness().warm()
    h.stall(2)
    for _ in range(10):
        h.stack.advance()
        h.feed(h.stack.stalled(scrape=False))
    decision = h.stall(1)
    assert decision.verdict is Verdict.OVERLOADED


def test_idle_server_is_flat_by_right() -> None:
    """Counters flat with nothing pending never start the no-progress clock."""
    h = Harness().warm()
    decision = h.steps(30, (), progress=False)
    assert decision.verdict is Verdict.OK
    # The clock starts at the last idle cycle: three stalled cycles later it reads 15s.
    assert values(h.stall(3), "no_progress")["flat_seconds"] == 15.0


def test_probes_that_raise_inside_the_watchdog_are_not_evidence() -> None:
    """internal_error probes on an idle server: no failure run, no pending work, never a restart."""
    h = Harness().warm()
    raised = ProbeFailure.INTERNAL_ERROR
    for _ in range(40):
        decision = h.feed(h.stack.cycle((probe(False, at=h.stack.now + 5, reason=raised),)))
        assert decision.verdict is Verdict.OK, decision
    assert decision.state.probes.failures == 0
    assert Action.CO_RESTART not in h.actions


def test_realtime_tokens_are_progress() -> None:
    """On SGLang 0.5.23, realtime_tokens_total advancing while probes fail is overload, not a stall."""
    h = Harness()
    h.stack.realtime = {Role.PREFILL: 0.0, Role.DECODE: 0.0}
    h.warm()
    for _ in range(40):
        h.stack.realtime[Role.DECODE] += 50.0  # decode iterations run; nothing finished yet
        decision = h.feed(h.stack.stalled())
    assert decision.verdict is Verdict.OVERLOADED
    assert Action.CO_RESTART not in h.actions


def test_decode_only_restart_records_first_seen_time() -> None:
    """The decode-only restart is remembered from the cycle it was first seen until acted upon."""
    h = Harness().warm()
    h.stack.restart(Role.DECODE)
    first = h.step((True,))
    assert first.state.units.decode_only_seen_at == h.stack.now
    later = h.step((True,))
    assert later.state.units.decode_only_seen_at == first.state.units.decode_only_seen_at
    acted = h.steps(11, (True,))
    assert acted.action is Action.CO_RESTART
    assert h.restarted().units.decode_only_seen_at is None


def test_decode_only_needs_prefill_readable() -> None:
    """A decode restart seen while prefill's unit cannot be read is judged once prefill is readable."""
    h = Harness().warm()
    h.stack.restart(Role.DECODE)
    obs = h.stack.cycle((True,))
    units = tuple(u for u in obs.units if u.role is not Role.PREFILL)
    first = h.feed(replace(obs, units=units))
    assert first.verdict is not Verdict.DECODE_ONLY_RESTART
    second = h.step((True,))
    assert second.verdict is Verdict.DECODE_ONLY_RESTART


def test_our_restart_is_not_an_external_or_decode_only_restart() -> None:
    """After our co-restart (prefill first), the new start timestamps are baselines, not events."""
    h = Harness().warm()
    h.stall(9)
    h.restarted()
    h.steps(8, (True,))
    assert h.decisions[-1].verdict is Verdict.VERIFICATION_PASSED
    assert Verdict.DECODE_ONLY_RESTART not in h.verdicts
    assert "external_restart" not in [c for d in h.decisions for c in codes(d)]


def test_crash_alerts_first_then_co_restarts() -> None:
    """A failed unit is an alert while systemd may bring it back, a co-restart once it has not."""
    h = Harness()
    crash_not_brought_back(h)
    crash = [d for d in h.decisions if d.verdict is Verdict.CRASH]
    assert crash[0].action is Action.ALERT
    assert crash[-1].action is Action.CO_RESTART
    assert h.actions.count(Action.CO_RESTART) == 1


def test_failed_start_counts_as_failed_attempt() -> None:
    """A warm-up that times out with failing health counts one failed attempt."""
    decision = failed_start(Harness())
    assert decision.state.budget.consecutive_failures == 1


def test_warm_up_timeout_with_progress_is_not_a_failed_start() -> None:
    """Counters advancing when warm-up times out mean overload, not a failed start."""
    h = Harness(config=group_config(stall={"startup_timeout_seconds": 60}))
    h.warm()
    for role in Role:
        h.stack.restart(role)
    decision = h.steps(14, (False,), progress=True, in_flight=4)
    assert decision.verdict is Verdict.OVERLOADED
    assert Action.CO_RESTART not in h.actions


def test_no_stall_verdicts_while_warming() -> None:
    """During warm-up, failing probes and flat counters give no stall verdict."""
    h = Harness().warm()
    for role in Role:
        h.stack.restart(role)
    h.step((True,), progress=False)  # the restart is seen
    for _ in range(50):
        h.feed(h.stack.stalled())
    assert set(h.verdicts[2:]) == {"warming_up"}


def test_backoff_doubles_per_consecutive_failed_attempt() -> None:
    """Each failed co-restart doubles the wait before the next one."""
    config = group_config(restart={"backoff_seconds": 100, "max_restarts": 5})
    state = GroupState(
        state=State.RESTARTING,
        since=T0,
        budget=Budget(backoff_base_seconds=100, left_after_attempt=3),
    )
    first = after_restart(state, outcome(False, at=T0), T0)
    assert (first.state, first.budget.consecutive_failures, first.budget.backoff_until) == (
        State.STALLED,
        1,
        T0 + 100,
    )
    second = after_restart(with_budget_left(first, 2), outcome(False, at=T0), T0 + 500)
    assert second.budget.backoff_until == T0 + 500 + 200
    third = after_restart(with_budget_left(second, 1), outcome(False, at=T0), T0 + 1000)
    assert third.budget.backoff_until == T0 + 1000 + 400
    del config


def with_budget_left(state: GroupState, left: int) -> GroupState:
    """`state` with `left` restarts left in the budget after its last attempt."""
    return replace(state, budget=replace(state.budget, left_after_attempt=left))


def test_failed_restart_with_no_budget_left_holds() -> None:
    """A failed co-restart that used the last of the budget moves to held."""
    state = GroupState(state=State.RESTARTING, since=T0, budget=Budget(left_after_attempt=0))
    held = after_restart(state, outcome(False, at=T0), T0 + 10)
    assert held.state is State.HELD
    assert held.budget.held_since == T0 + 10


def test_dry_run_outcome_is_treated_as_performed() -> None:
    """A dry-run outcome moves to verifying like a real restart, and fails verification faithfully."""
    h = Harness().warm()
    h.stall(9)
    assert h.restarted(dry_run=True).state is State.VERIFYING
    decision = h.stall(60)
    assert decision.verdict is Verdict.VERIFICATION_FAILED
    assert decision.state.budget.consecutive_failures == 1


def test_dry_run_rehearsal_plays_out_to_held() -> None:
    """A persistent stall under dry-run co-restarts exactly max_restarts times, then holds."""
    h = Harness().warm()
    for _ in range(600):
        decision = h.stall()
        if decision.action is Action.CO_RESTART:
            h.restarted(dry_run=True)
    assert h.actions.count(Action.CO_RESTART) == 3
    assert h.state is not None
    assert h.state.state is State.HELD


def test_rearm_leaves_held_and_clears_budget() -> None:
    """A re-arm newer than the hold clears the budget and lets the group act again."""
    h = Harness()
    budget_exhausted(h)
    h.stall(3)
    assert h.state is not None
    rearm = OperatorControls(rearmed_at=h.state.since + 1)
    decision = h.stall(1, operator=rearm)
    assert decision.action is Action.CO_RESTART
    assert "rearmed" in codes(decision)
    assert decision.state.budget.restart_times == (h.stack.now,)


def test_old_rearm_does_not_release_a_new_hold() -> None:
    """A re-arm older than the current hold is ignored."""
    h = Harness()
    budget_exhausted(h)
    decision = h.stall(3, operator=OperatorControls(rearmed_at=T0 - 10))
    assert decision.state.state is State.HELD


def test_pause_ends_in_warm_up_then_judges() -> None:
    """When the maintenance lease ends the group warms up, then judges afresh."""
    h = Harness().warm()
    lease = OperatorControls(paused_until=h.stack.now + 30)
    ended = h.stall(6, operator=lease)
    assert (ended.verdict, ended.state.state) == (Verdict.WARMING_UP, State.WARMING)
    assert Action.CO_RESTART not in h.actions
    # Units that ran through the lease need no warm-up; the stall evidence starts afresh.
    assert h.stall(8).action is Action.NONE
    assert h.stall(1).action is Action.CO_RESTART


def test_decode_only_restart_during_pause_is_absorbed() -> None:
    """Maintenance restarts in any order are not judged as decode-only restarts afterwards."""
    h = Harness().warm()
    lease = OperatorControls(paused_until=h.stack.now + 30)
    h.stack.restart(Role.DECODE)
    h.steps(3, (True,), operator=lease)
    h.steps(20, (True,), operator=lease)
    assert Verdict.DECODE_ONLY_RESTART not in h.verdicts


def test_blip_then_success_returns_to_ok() -> None:
    """A single failed probe followed by a success leaves no trace."""
    h = Harness().warm()
    h.step((False,), progress=False)
    decision = h.step((True,))
    assert decision.verdict is Verdict.OK
    assert decision.state.probes.failures == 0


def test_several_probes_per_cycle_are_counted_in_order() -> None:
    """Probes finishing in one cycle count in order: a success last resets the run."""
    h = Harness().warm()
    decision = h.step((False, False, True), progress=False)
    assert decision.state.probes.failures == 0
    decision = h.step((True, False, False, False), progress=False, in_flight=2)
    assert decision.state.probes.failures == 3


def test_state_round_trips_through_json() -> None:
    """GroupState survives pydantic's JSON round trip unchanged (plain, serialisable values)."""
    h = Harness()
    decode_only_restart_grace(h)
    h.stack.fail_transfers(2)
    h.stall(3)
    assert h.state is not None
    adapter = TypeAdapter(GroupState)
    assert adapter.validate_json(adapter.dump_json(h.state)) == h.state


def test_initial_state_seeds_budget_and_hold() -> None:
    """initial_state warms up with the persisted budget, or starts held."""
    config = group_config()
    state = initial_state(T0, restart_times=(T0 - 100, T0 - 4000), consecutive_failures=2)
    assert (state.state, state.budget.consecutive_failures) == (State.WARMING, 2)
    assert state.budget_remaining(config, T0) == 2
    held = initial_state(T0, held=True)
    assert held.state is State.HELD
    assert held.budget_remaining(config, T0) == 0


def test_decide_is_deterministic() -> None:
    """The same state, observation, config and time give the same decision."""
    h = Harness().warm()
    obs = h.stack.stalled()
    assert h.state is not None
    config = group_config()
    assert decide(h.state, obs, config, obs.at) == decide(h.state, obs, config, obs.at)


def test_old_transfer_failures_do_not_outlive_a_co_restart() -> None:
    """Failures counted before a co-restart do not turn later probe failures into an action."""
    h = Harness().warm()
    h.stack.fail_transfers(6)
    h.step((False,), progress=True)
    h.step((False,), progress=True)
    assert h.step((False,), progress=True).verdict is Verdict.DEGRADED_BOOTSTRAP
    h.restarted()
    assert h.steps(8, (True,)).verdict is Verdict.VERIFICATION_PASSED
    decision = h.steps(3, (False,), progress=True)
    assert decision.verdict is Verdict.OVERLOADED


def test_hung_worker_with_progress_is_not_a_crash() -> None:
    """A worker whose /health fails while counters advance is only an alert, however long."""
    h = Harness(config=group_config(stall={"startup_timeout_seconds": 60}))
    h.warm()
    decision = h.steps(40, (True,), health_ok={Role.DECODE: False})
    assert decision.verdict is Verdict.WORKER_UNHEALTHY
    assert Action.CO_RESTART not in h.actions


def test_initial_state_carries_backoff_across_daemon_restart() -> None:
    """With backoff_seconds, persisted consecutive failures keep their backoff after a restart."""
    state = initial_state(
        T0, restart_times=(T0 - 100,), consecutive_failures=2, backoff_seconds=300
    )
    assert state.budget.backoff_until == T0 - 100 + 600


def test_alerts_start_afresh_after_an_external_restart() -> None:
    """An alert already sent is sent again for the same condition after the units restarted."""
    h = Harness().warm()
    h.stack.active[Role.DECODE] = "inactive"
    h.steps(3, (True,))
    h.stack.restart(Role.DECODE)
    h.stack.restart(Role.PREFILL, at=h.stack.now - 1)
    h.steps(3, (True,))
    h.stack.active[Role.DECODE] = "inactive"
    h.steps(3, (True,))
    stopped = [d for d in h.decisions if d.verdict is Verdict.UNIT_STOPPED]
    assert [d.action for d in stopped].count(Action.ALERT) == 2


def test_never_starts_a_unit_stopped_on_purpose() -> None:
    """A condition that calls for a co-restart while a unit is stopped only alerts."""
    h = Harness(config=group_config(stall={"startup_timeout_seconds": 60}))
    h.warm()
    for role in Role:
        h.stack.restart(role)
    h.stack.active[Role.ROUTER] = "inactive"
    decision = h.steps(30, (False,), progress=False, health_ok=False)
    assert decision.verdict is Verdict.UNIT_STOPPED
    assert Action.CO_RESTART not in h.actions


def test_lost_restart_outcome_counts_as_failed_attempt() -> None:
    """A group left in restarting far longer than any sequence takes is failed, not inert."""
    h = Harness().warm()
    h.stall(9)
    assert h.state is not None
    assert h.state.state is State.RESTARTING
    quick = h.stall(2)
    assert (quick.verdict, quick.state.state) == (Verdict.RESTARTING, State.RESTARTING)
    lost = h.stall(1, seconds=3 * 900 + 30)
    assert lost.state.state is State.STALLED
    assert lost.action is Action.ALERT
    assert lost.state.budget.consecutive_failures == 1
    assert "restart_outcome_lost" in codes(lost)


def _stall_with_tokens(prefill_tokens: float, decode_tokens: float) -> list[Decision]:
    harness = Harness(
        stack=Stack(realtime=dict.fromkeys((Role.PREFILL, Role.DECODE), 500.0)),
    )
    harness.warm()
    assert harness.stack.realtime is not None
    decisions = []
    for _ in range(12):
        harness.stack.realtime[Role.PREFILL] += prefill_tokens
        harness.stack.realtime[Role.DECODE] += decode_tokens
        decisions.append(harness.stall())
    return decisions


def test_prefill_tokens_are_not_progress_during_a_transfer_stall() -> None:
    """Prefill computing new prompts does not mask a stall."""
    # Prefill keeps computing arriving prompts (they park in its inflight queue); decode's fake
    # health requests finish without a decode step, so its counters stay flat.
    decisions = _stall_with_tokens(prefill_tokens=400.0, decode_tokens=0.0)
    assert Action.CO_RESTART in [d.action for d in decisions]
    assert Verdict.OVERLOADED not in [d.verdict for d in decisions]


def test_decode_tokens_beyond_our_own_are_progress() -> None:
    """Decode tokens beyond our own (a few a cycle, past the slack) are overload, never a restart."""
    decisions = _stall_with_tokens(prefill_tokens=0.0, decode_tokens=3.0)
    assert Action.CO_RESTART not in [d.action for d in decisions]
    assert decisions[-1].verdict is Verdict.OVERLOADED


def test_decode_stalling_mid_stream_is_a_stall_although_prefill_completes() -> None:
    """Prefill finishing transfers and probes' first tokens on decode are not end-to-end progress."""
    harness = Harness(stack=Stack(realtime=dict.fromkeys((Role.PREFILL, Role.DECODE), 500.0)))
    harness.warm()
    assert harness.stack.realtime is not None
    decisions = []
    for _ in range(12):
        # Prefill's side completes (its requests_total advances when the transfer concludes);
        # each of 4 probes gets two tokens out of decode (and we count them) and then nothing
        # more.
        harness.stack.requests[Role.PREFILL] += 2
        harness.stack.realtime[Role.DECODE] += 2 * 4
        decisions.append(harness.stall(own=OwnTokens(received=2 * 4, first=4)))
    assert Action.CO_RESTART in [d.action for d in decisions]
    assert Verdict.OVERLOADED not in [d.verdict for d in decisions]


def test_hung_worker_waits_no_progress_seconds() -> None:
    """One cycle short of no_progress_seconds of failing /health, a hung worker is only an alert."""
    h = Harness().warm()
    decision = h.steps(
        9,
        (False,),
        progress=False,
        health_ok={Role.DECODE: False},
        health_reason=ProbeFailure.TIMEOUT,
    )
    assert decision.verdict is Verdict.WORKER_UNHEALTHY
    assert Action.CO_RESTART not in h.actions


def test_every_state_has_a_handler() -> None:
    """decide() dispatches every group state through the handler table."""
    assert set(HANDLERS) == set(State)
