"""Verdicts that hold on SGLang 0.5.23: progress from tokens, failures net of aborts, their ratio,
decode-only restarts whatever the boot order, backoff that survives, progress dated by its scrape.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import pytest

from tests.unit.builders import DAY_SECONDS, T0, Harness, group_config, probe
from watchdog.decide import Decision, Verdict
from watchdog.decide.accounting import window_failures
from watchdog.decide.state import FailureSample
from watchdog.model import (
    Action,
    LoadsSnapshot,
    MetricsSnapshot,
    Observation,
    OwnTokens,
    ProbeFailure,
    ProbeResult,
    Role,
    RoleCount,
    Rung,
    State,
)

WORKER_ROLES = (Role.PREFILL, Role.DECODE)


def codes(decision: Decision) -> list[str]:
    """The reason codes of a decision."""
    return [r.code for r in decision.reasons]


def values(decision: Decision, code: str) -> dict[str, float | str]:
    """The numbers behind one reason."""
    return dict(next(r for r in decision.reasons if r.code == code).values)


@dataclass
class Extra:
    """Counters the builders' Stack does not carry, cumulative per worker."""

    ttft: dict[Role, float]
    aborted: dict[Role, float]
    decode_moments: float | None = None


def with_extra(
    obs: Observation, extra: Extra, *, own_aborts: int = 0, scraped_before: float = 0.0
) -> Observation:
    """The observation with the extra counters, our aborts, and scrapes dated earlier."""
    metrics: list[MetricsSnapshot] = []
    for scraped in obs.metrics:
        snap = scraped
        if snap.ok and snap.role in WORKER_ROLES:
            snap = replace(
                snap,
                scraped_at=snap.scraped_at - scraped_before,
                ttft_count=extra.ttft[snap.role],
                aborted_requests_total=extra.aborted[snap.role],
            )
        metrics.append(snap)
    loads = obs.loads
    if extra.decode_moments is not None:
        decode_loads = LoadsSnapshot(
            role=Role.DECODE,
            fetched_at=obs.at - scraped_before,
            ok=True,
            decode_tokens_total=extra.decode_moments,
        )
        loads = (*loads, decode_loads)
    aborts = tuple(RoleCount(role, own_aborts) for role in WORKER_ROLES) if own_aborts else ()
    return replace(obs, metrics=tuple(metrics), loads=loads, own_aborts=aborts)


class Run:
    """A Harness plus the extra counters, stepped one cycle at a time."""

    def __init__(self) -> None:
        self.h = Harness(config=group_config())
        self.extra = Extra(
            ttft=dict.fromkeys(WORKER_ROLES, 50.0), aborted=dict.fromkeys(WORKER_ROLES, 0.0)
        )

    def cycle(
        self,
        probes: tuple[bool | ProbeResult, ...] = (True,),
        *,
        progress: bool | None = None,
        requests: float = 0.0,
        failures: float = 0.0,
        aborted: float = 0.0,
        own_aborts: int = 0,
        ttft: float = 0.0,
        moments: float = 0.0,
        scraped_before: float = 0.0,
        **kwargs: Any,
    ) -> Decision:
        """One cycle; the keyword counters grow on both workers by the given amounts."""
        stack = self.h.stack
        for role in WORKER_ROLES:
            stack.requests[role] += requests
            stack.failures[role] += failures
            self.extra.aborted[role] += aborted
        self.extra.ttft[Role.DECODE] += ttft
        if moments or self.extra.decode_moments is not None:
            self.extra.decode_moments = (self.extra.decode_moments or 0.0) + moments
        obs = stack.cycle(probes, progress=progress, **kwargs)
        return self.h.feed(
            with_extra(obs, self.extra, own_aborts=own_aborts, scraped_before=scraped_before)
        )

    def stalled(self, cycles: int, **kwargs: Any) -> Decision:
        """Probes time out, work pending, decode's tokens flat (unless kwargs say otherwise)."""
        self.h.stack.http_active = 4.0
        kwargs.setdefault("in_flight", 4)
        kwargs.setdefault("progress", False)
        decision = None
        for _ in range(cycles):
            decision = self.cycle((False,), **kwargs)
        assert decision is not None
        return decision

    def warm(self) -> Run:
        """One healthy cycle out of warm-up."""
        assert self.cycle().state.state is State.HEALTHY
        return self


# --- 1. progress from tokens, not finished requests ----------------------------------------------


def test_only_requests_total_growing_is_not_progress() -> None:
    """Aborts, PD failures and the waiting timeout finish requests too (0.5.23): not progress."""
    run = Run().warm()
    decision = run.stalled(9, requests=5.0)
    assert decision.verdict is Verdict.SILENT_STALL
    assert decision.action is Action.CO_RESTART


def test_generation_tokens_are_progress_while_probes_fail() -> None:
    """Generation tokens growing while probes fail are overload: 0.5.23's progress is tokens."""
    run = Run().warm()
    decision = run.stalled(12, progress=True)
    assert decision.verdict is Verdict.OVERLOADED


@pytest.mark.parametrize(
    ("ttft", "verdict"),
    [
        (11.0, Verdict.OVERLOADED),  # other requests get their first token: slow, not stuck
        # No more than our own probes got: the rounds of a conversation and 4 probes in flight.
        (10.0, Verdict.SILENT_STALL),
    ],
)
def test_ttft_count_is_progress_beyond_our_own_probes(ttft: float, verdict: Verdict) -> None:
    """TTFT counts beyond our own probes' first tokens are user progress; our own are not."""
    run = Run().warm()
    assert run.stalled(9, ttft=ttft, own=OwnTokens(received=10, first=10)).verdict is verdict


def test_finished_request_counters_are_not_progress_once_probes_stall_mid_stream() -> None:
    """A decode that stops after a few tokens still hands every new request its first token (the
    TTFT count), and each aborted request adds its few tokens at finish (generation_tokens_total):
    once our own probes got theirs and then stalled, those counters say nothing where a
    per-iteration counter (realtime_tokens_total) tells progress instead."""
    run = Run()
    run.h.stack.realtime = dict.fromkeys(WORKER_ROLES, 0.0)
    run.warm()
    run.h.stack.http_active = 4.0
    decision = None
    for _ in range(9):
        at = run.h.stack.now + run.h.stack.cycle_seconds - 0.1
        stalled = probe(False, at=at, reason=ProbeFailure.STALLED_MIDSTREAM)
        for role in WORKER_ROLES:
            run.h.stack.tokens[role] += 2.0  # the aborted probe's two tokens, counted at finish
        decision = run.cycle((stalled,), progress=False, in_flight=4, ttft=20.0)
    assert decision is not None
    assert decision.verdict is Verdict.SILENT_STALL


def test_without_a_per_iteration_counter_finished_tokens_stay_progress_mid_stream() -> None:
    """On versions without realtime_tokens_total (< 0.5.9) generation_tokens_total is the only
    progress signal: busy decoding goes on counting even while a probe's stream went idle."""
    run = Run().warm()
    run.h.stack.http_active = 4.0
    decision = None
    for _ in range(9):
        at = run.h.stack.now + run.h.stack.cycle_seconds - 0.1
        stalled = probe(False, at=at, reason=ProbeFailure.STALLED_MIDSTREAM)
        decision = run.cycle((stalled,), progress=True, in_flight=4)
    assert decision is not None
    assert decision.verdict is Verdict.OVERLOADED


@pytest.mark.parametrize(
    ("moments", "verdict"),
    [
        (400.0, Verdict.OVERLOADED),  # decode steps generate tokens
        (4.0, Verdict.SILENT_STALL),  # only our probes' 4 tokens (a health check adds none)
    ],
)
def test_loads_decode_moments_are_progress(moments: float, verdict: Verdict) -> None:
    """/v1/loads decode moments beyond our own tokens are progress; our own alone are not."""
    run = Run()
    run.extra.decode_moments = 1000.0
    run.warm()
    assert run.stalled(9, moments=moments, own=OwnTokens(received=4)).verdict is verdict


# --- 2. failure accounting that knows its own hand -----------------------------------------------


def test_overload_with_aborted_probes_never_restarts() -> None:
    """Probes time out in decode's queues and we abort them: each abort is a counted failure."""
    run = Run().warm()
    decisions = [
        run.cycle((False,), progress=True, in_flight=4, failures=1.0, aborted=1.0, own_aborts=1)
        for _ in range(60)
    ]
    assert all(d.action is not Action.CO_RESTART for d in decisions)
    assert Verdict.DEGRADED_BOOTSTRAP not in [d.verdict for d in decisions]
    assert decisions[-1].verdict is Verdict.OVERLOADED
    failures = window_failures(decisions[-1].state.progress.failure_samples, 0.0)
    assert failures.raw >= 5  # the failure counters really rose
    assert failures.net == 0


def test_own_aborts_explain_failures_even_where_the_worker_does_not_count_them() -> None:
    """Our aborts alone (num_aborted_requests_total absent or not grown) explain the failures."""
    run = Run().warm()
    decisions = [
        run.cycle((False,), progress=True, in_flight=4, failures=1.0, own_aborts=1)
        for _ in range(20)
    ]
    assert {d.verdict for d in decisions[2:]} == {Verdict.OVERLOADED}


def test_client_disconnects_are_not_degradation() -> None:
    """Failures matched by the worker's own abort count (client disconnects) are not rising."""
    run = Run().warm()
    decision = None
    for _ in range(10):
        decision = run.cycle(requests=10.0, failures=3.0, aborted=3.0)
    assert decision is not None
    assert decision.verdict is Verdict.OK


def test_failures_beyond_aborts_still_count() -> None:
    """Two aborts explain two of eight failures; the other six are degradation."""
    run = Run().warm()
    decision = run.cycle(failures=8.0, aborted=2.0, own_aborts=1)
    assert decision.verdict is Verdict.TRANSFER_FAILURES_RISING
    assert values(decision, "transfer_failures")["increase"] == 6.0


@dataclass(frozen=True)
class RatioRow:
    name: str
    attempts: float  # per cycle, prefill's finished requests (+1: the probe's own)
    failures: float  # per cycle
    cycles: int
    verdict: Verdict
    action: Action


RATIO_TABLE = [
    # 70 % of transfers fail; the router retries them, so probes pass: act all the same.
    RatioRow(
        "seventy_percent_behind_retries", 10, 7, 3, Verdict.DEGRADED_BOOTSTRAP, Action.CO_RESTART
    ),
    # 10 % failing: rising failures, an alert, not a restart.
    RatioRow("ten_percent", 20, 2, 3, Verdict.TRANSFER_FAILURES_RISING, Action.NONE),
    # Every transfer failed, but too few attempted to judge a ratio; below the count threshold.
    RatioRow("too_few_attempts", 2, 2, 2, Verdict.OK, Action.NONE),
    # Exactly at the ratio, once enough attempts: act.
    RatioRow("at_the_threshold", 9, 5, 2, Verdict.DEGRADED_BOOTSTRAP, Action.CO_RESTART),
]


@pytest.mark.parametrize("row", RATIO_TABLE, ids=[r.name for r in RATIO_TABLE])
def test_failed_share_of_attempted_transfers(row: RatioRow) -> None:
    """Transfer failures are judged as a share of attempted transfers, not as a raw count."""
    run = Run().warm()
    decision = None
    for _ in range(row.cycles):
        decision = run.cycle(requests=row.attempts, failures=row.failures)
        if decision.action is Action.CO_RESTART:
            break
    assert decision is not None
    assert decision.verdict is row.verdict
    if row.action is Action.CO_RESTART:
        assert decision.action is Action.CO_RESTART
        found = values(decision, "transfer_failures")
        assert float(found["attempts"]) >= 20
    else:
        assert decision.action is not Action.CO_RESTART


def test_abort_explained_failures_do_not_fail_a_ratio() -> None:
    """Under overload most finished prefill requests may be our aborted probes: still not acted on."""
    run = Run().warm()
    decision = None
    for _ in range(10):
        decision = run.cycle(
            (False,),
            progress=True,
            in_flight=4,
            requests=3.0,
            failures=3.0,
            aborted=3.0,
            own_aborts=1,
        )
        assert decision.action is not Action.CO_RESTART
    assert decision is not None
    assert decision.verdict is Verdict.OVERLOADED


def test_transfer_stall_is_a_silent_stall_not_a_bootstrap_failure() -> None:
    """Once aborts are explained, a transfer stall is caught for the right reason."""
    run = Run().warm()
    decision = run.stalled(9, failures=1.0, aborted=1.0, own_aborts=1)
    assert decision.verdict is Verdict.SILENT_STALL


def test_verification_ignores_failures_of_our_own_aborts() -> None:
    """Failures caused by the watchdog's own aborts do not fail the verification after a restart."""
    run = Run().warm()
    run.stalled(9)
    run.h.restarted()
    decision = run.cycle((False,), progress=False, failures=1.0, own_aborts=1)
    assert decision.verdict is Verdict.VERIFYING


def test_accounting_floors_per_role_and_never_double_counts() -> None:
    """Failures net of aborts floor at zero per role and our own aborts are not subtracted twice."""
    samples = [
        FailureSample(T0, Role.PREFILL, increase=2.0, aborted=10.0, finished=30.0),
        FailureSample(T0, Role.DECODE, increase=9.0, aborted=3.0, own_aborts=3.0),
        FailureSample(T0 - 100, Role.DECODE, increase=50.0),  # before the window
    ]
    failures = window_failures(samples, T0 - 10)
    # Prefill: 2 - 10 floors at 0. Decode: our 3 aborts are among its 3 counted aborts.
    assert failures.net_by_role() == {"prefill": 0.0, "decode": 6.0}
    assert (failures.raw, failures.net, failures.attempts) == (9.0, 6.0, 30.0)
    assert failures.ratio == pytest.approx(0.2)


# --- 3. decode-only restarts, whatever the boot order --------------------------------------------

Scenario = Callable[[Harness], Decision]
BOOT_US = int((T0 - DAY_SECONDS) * 1e6)


def booted(prefill_after_decode_us: int) -> Harness:
    """Units started together at boot, prefill a little after (or before) decode."""
    h = Harness()
    h.stack.starts_us = {
        Role.DECODE: BOOT_US,
        Role.PREFILL: BOOT_US + prefill_after_decode_us,
        Role.ROUTER: BOOT_US + 2 * abs(prefill_after_decode_us),
    }
    h.warm()
    return h


def decode_alone_after_boot(h: Harness) -> Decision:
    """Decode restarted alone after the group booted."""
    h.stack.restart(Role.DECODE)
    return h.step((True,))


def decode_alone_co_restarted(h: Harness) -> Decision:
    """Decode restarted alone, then left past its grace."""
    h.stack.restart(Role.DECODE)
    return h.steps(13, (True,))


def external_co_restart_across_cycles(h: Harness) -> Decision:
    """An operator's co-restart of prefill, decode and router spread over several cycles."""
    h.stack.restart(Role.PREFILL)
    h.steps(6, (False,), progress=False, health_ok={Role.PREFILL: False})
    h.stack.restart(Role.DECODE)
    h.steps(6, (False,), progress=False, health_ok={Role.DECODE: False})
    h.stack.restart(Role.ROUTER)
    return h.steps(14, (True,))


def decode_then_prefill_within_grace(h: Harness) -> Decision:
    """Decode restarted, then prefill within the grace."""
    h.stack.restart(Role.DECODE)
    h.steps(3, (True,))
    h.stack.restart(Role.PREFILL)
    return h.step((True,))


def decode_alone_long_after_prefill_alone(h: Harness) -> Decision:
    """Decode restarted alone long after a survivor restart for a prefill restarted alone."""
    # Prefill restarted alone (the survivor rung restarts decode, then the router), everything
    # ran for longer than a model load, then decode was restarted alone: that is decode-only.
    h.config = group_config(stall={"startup_timeout_seconds": 120})
    h.stack.restart(Role.PREFILL)
    survivor = h.steps(13, (True,))
    assert (survivor.action, survivor.rung) == (Action.CO_RESTART, Rung.SURVIVOR), h.verdicts
    h.restarted(roles=(Role.DECODE, Role.ROUTER))
    h.steps(40, (True,))
    h.stack.restart(Role.DECODE)
    return h.step((True,))


@dataclass(frozen=True)
class BootRow:
    scenario: Scenario
    prefill_after_decode_us: int
    verdict: Verdict
    action: Action
    reason: str | None = None


BOOT_TABLE = [
    BootRow(decode_alone_after_boot, 5_000, Verdict.DECODE_ONLY_RESTART, Action.NONE, "grace"),
    BootRow(decode_alone_after_boot, -5_000, Verdict.DECODE_ONLY_RESTART, Action.NONE, "grace"),
    BootRow(decode_alone_after_boot, 0, Verdict.DECODE_ONLY_RESTART, Action.NONE, "grace"),
    BootRow(decode_alone_co_restarted, 5_000, Verdict.DECODE_ONLY_RESTART, Action.CO_RESTART),
    BootRow(external_co_restart_across_cycles, 5_000, Verdict.OK, Action.NONE),
    BootRow(external_co_restart_across_cycles, -5_000, Verdict.OK, Action.NONE),
    BootRow(
        decode_then_prefill_within_grace,
        5_000,
        Verdict.WARMING_UP,
        Action.NONE,
        "decode_then_prefill_restart",
    ),
    BootRow(
        decode_then_prefill_within_grace,
        -5_000,
        Verdict.WARMING_UP,
        Action.NONE,
        "decode_then_prefill_restart",
    ),
    BootRow(decode_alone_long_after_prefill_alone, 5_000, Verdict.DECODE_ONLY_RESTART, Action.NONE),
]


@pytest.mark.parametrize(
    "row",
    BOOT_TABLE,
    ids=[f"{r.scenario.__name__}[{r.prefill_after_decode_us:+d}us]" for r in BOOT_TABLE],
)
def test_decode_only_restart_whatever_the_boot_order(row: BootRow) -> None:
    """Decode-only restarts are judged the same whichever unit booted first at startup."""
    h = booted(row.prefill_after_decode_us)
    decision = row.scenario(h)
    assert decision.verdict is row.verdict, (h.verdicts, codes(decision))
    assert decision.action is row.action
    if row.reason is not None:
        assert row.reason in codes(decision)
    flagged = [d for d in h.decisions if d.verdict is Verdict.DECODE_ONLY_RESTART]
    if row.scenario is external_co_restart_across_cycles:
        assert not flagged, h.verdicts


# --- 4. backoff survives overload -----------------------------------------------------------------


def test_overload_after_a_failed_attempt_keeps_the_backoff() -> None:
    """Three co-restarts in 18 s under overload: each overload verdict used to clear the backoff."""
    h = Harness()
    h.warm()
    first = h.stall(9)
    assert first.action is Action.CO_RESTART
    state = h.restarted(ok=False)
    assert state.budget.consecutive_failures == 1
    until = state.budget.backoff_until
    decisions = []
    for _ in range(5):
        decisions.append(h.step((False,), progress=True, in_flight=4))  # overload
        decisions.append(h.stall(9))
    assert h.stack.now < until
    assert Action.CO_RESTART not in [d.action for d in decisions]
    assert h.state is not None
    assert h.state.budget.consecutive_failures == 1
    assert h.state.budget.backoff_until == until
    assert Verdict.BACKOFF in [d.verdict for d in decisions]


def test_recovery_without_our_help_keeps_the_failure_count() -> None:
    """Recovering alone after a failed restart keeps the failure count behind the next backoff."""
    h = Harness()
    h.warm()
    h.stall(9)
    state = h.restarted(ok=False)
    ok = h.steps(3, (True,))
    assert ok.state.state is State.HEALTHY
    assert ok.state.budget.consecutive_failures == 1
    assert ok.state.budget.backoff_until == state.budget.backoff_until
    assert ok.state.budget.stall_verdict is None


# --- 5. progress dated by its scrape, not by the end of the cycle --------------------------------


def test_progress_read_before_a_stretched_cycle_is_not_fresh() -> None:
    """A hanging /health stretches a cycle: counters read at its start are dated then.

    Decode's last tokens (requests already decoding when the transfer path broke) were read 30 s
    before the cycle ended and the first probe failure was seen: they are not progress while the
    probes fail, and the flat clock runs from when they were read.
    """
    run = Run().warm()
    first = run.stalled(1, progress=True, scraped_before=30.0, seconds=35.0)
    assert first.state.progress.advanced_at == pytest.approx(run.h.stack.now - 30.0)
    later = run.stalled(3)
    assert later.verdict is Verdict.SILENT_STALL, run.h.verdicts
    assert Verdict.OVERLOADED not in [d.verdict for d in run.h.decisions]


def test_baselines_and_failure_samples_carry_the_scrape_time() -> None:
    """Baselines and failure samples carry the scrape time, not the decision's, so rates hold."""
    run = Run().warm()
    decision = run.cycle(failures=1.0, scraped_before=3.0)
    now = run.h.stack.now
    assert {b.at for b in decision.state.progress.baselines} == {now - 3.0}
    assert {s.at for s in decision.state.progress.failure_samples} == {now - 3.0}
    assert decision.state.progress.metrics_seen_at == now - 3.0


def test_own_aborts_of_an_unscraped_worker_are_kept_for_later() -> None:
    """Our own aborts on a worker not scraped this cycle are kept for its next scrape."""
    run = Run().warm()
    decision = run.cycle((False,), progress=False, own_aborts=1, scrape=(Role.PREFILL,))
    decode = [s for s in decision.state.progress.failure_samples if s.role is Role.DECODE]
    assert [s.own_aborts for s in decode] == [1.0]
