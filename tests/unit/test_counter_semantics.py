"""Counters read from bad data: a missing series is unknown, a drop counts only with a new process.

The scenarios feed real /metrics text through extract_snapshot, so a series that is absent from a
payload is absent the way the daemon sees it, then through decide(). See docs/decisions.md,
"Failure accounting".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from tests.unit.builders import Harness, group_config
from watchdog.decide import Decision, Verdict
from watchdog.decide.accounting import window_failures
from watchdog.decide.counters import CounterStep, step
from watchdog.decide.fold import observe
from watchdog.model import Action, Observation, Role, State
from watchdog.observe.sglang_metrics import extract_snapshot

WORKER_ROLES = (Role.PREFILL, Role.DECODE)
# Counter name in these tests -> the SGLang series it is written as.
SERIES = {
    "requests": 'sglang:num_requests_total{model_name="m",tp_rank="0"}',
    "tokens": 'sglang:generation_tokens_total{model_name="m",tp_rank="0"}',
    "failed": 'sglang:num_transfer_failed_reqs_total{model_name="m",tp_rank="0"}',
    "aborted": 'sglang:num_aborted_requests_total{model_name="m",tp_rank="0"}',
}


def payload(counters: Mapping[str, float], absent: Iterable[str], pending: float) -> str:
    """A worker's /metrics text: the counters not in `absent`, and the pending-work gauges."""
    lines = [
        f"{SERIES[name]} {value:.1f}" for name, value in counters.items() if name not in absent
    ]
    lines.append(f'sglang:num_running_reqs{{model_name="m",tp_rank="0"}} {pending:.1f}')
    lines.append(f'sglang:http_requests_active{{endpoint="/generate"}} {pending:.1f}')
    return "\n".join(lines) + "\n"


@dataclass
class Run:
    """A Harness whose scrapes are real payloads of counters kept here, per worker."""

    h: Harness = field(default_factory=Harness)
    counters: dict[Role, dict[str, float]] = field(
        default_factory=lambda: {
            role: {"requests": 100.0, "tokens": 1000.0, "failed": 0.0, "aborted": 0.0}
            for role in WORKER_ROLES
        }
    )

    def grow(self, **by: float) -> None:
        """Counters grow by these amounts on both workers."""
        for role in WORKER_ROLES:
            for name, amount in by.items():
                self.counters[role][name] += amount

    def set(self, **values: float) -> None:
        """Counters take these values on both workers (a drop, a restart)."""
        for role in WORKER_ROLES:
            self.counters[role].update(values)

    def observation(
        self, probes: tuple[bool, ...], absent: Iterable[str], pending: float, **kwargs: Any
    ) -> Observation:
        obs = self.h.stack.cycle(probes, progress=False, **kwargs)
        absent = tuple(absent)
        metrics = tuple(
            extract_snapshot(payload(self.counters[m.role], absent, pending), m.role, m.scraped_at)
            if m.ok
            else m
            for m in obs.metrics
        )
        return replace(obs, metrics=metrics)

    def cycle(
        self,
        probes: tuple[bool, ...] = (True,),
        *,
        absent: Iterable[str] = (),
        pending: float = 0.0,
        **kwargs: Any,
    ) -> Decision:
        """One cycle through decide()."""
        return self.h.feed(self.observation(probes, absent, pending, **kwargs))

    def warm(self) -> Run:
        """One healthy cycle out of warm-up."""
        assert self.cycle().state.state is State.HEALTHY
        return self

    def raw_failures(self) -> float:
        """Transfer failures counted in the window, before aborts explain any."""
        assert self.h.state is not None
        samples = self.h.state.progress.failure_samples
        return window_failures(samples, self.h.stack.now - 300.0).raw


def loaded(run: Run, cycles: int, **kwargs: Any) -> Decision:
    """Cycles of a busy server that progresses while our probes time out (overload)."""
    decision = None
    for _ in range(cycles):
        run.grow(requests=30.0, tokens=3000.0)
        decision = run.cycle((False,), pending=8.0, **kwargs)
    assert decision is not None
    return decision


# --- the two examples: a series that vanishes and comes back, a counter that goes down ---------


def test_failure_series_that_vanishes_and_comes_back_counts_nothing() -> None:
    """21 failures from before, the series missing from one scrape, then back at 21: +0, not +21."""
    run = Run()
    run.set(failed=21.0)
    run.warm()
    loaded(run, 2)
    loaded(run, 1, absent=("failed",))
    decision = loaded(run, 2)
    assert run.raw_failures() == 0.0
    assert decision.verdict is not Verdict.DEGRADED_BOOTSTRAP
    assert Action.CO_RESTART not in run.h.actions, run.h.verdicts


def test_failure_series_that_comes_back_higher_counts_from_its_last_value() -> None:
    """Missing for a scrape, back 2 higher: the 2 are counted, against the value last known."""
    run = Run()
    run.set(failed=21.0)
    run.warm()
    loaded(run, 1, absent=("failed",))
    run.grow(failed=2.0)
    loaded(run, 1)
    assert run.raw_failures() == 2.0


def test_decreasing_failure_counter_without_restart_counts_nothing() -> None:
    """993,500 then 993,000 in the same processes: not +993,000 failures, and said so."""
    run = Run()
    run.set(failed=993_500.0)
    run.warm()
    loaded(run, 2)
    run.set(failed=993_000.0)
    decision = loaded(run, 2)
    assert run.raw_failures() == 0.0
    assert Action.CO_RESTART not in run.h.actions, run.h.verdicts
    progress = decision.state.progress
    assert progress.counter_decreases == 4  # each of the two lower scrapes, on each worker
    assert progress.last_decrease is not None
    assert (progress.last_decrease.counter, progress.last_decrease.after) == (
        "transfer_failed",
        993_000.0,
    )


def test_lower_reading_keeps_the_higher_baseline() -> None:
    """A lower reading in the same process is ignored: the true value back is +0, not +500.

    The baseline stays at the higher value, so growth below it is nothing and growth past it
    counts only what is past it.
    """
    run = Run()
    run.set(failed=993_500.0)
    run.warm()
    run.set(failed=993_000.0)
    loaded(run, 1)
    run.set(failed=993_500.0)
    loaded(run, 1)
    assert run.raw_failures() == 0.0
    run.grow(failed=1.0)
    loaded(run, 1)
    assert run.raw_failures() == 1.0


def test_attempts_and_aborts_follow_the_same_rules() -> None:
    """Finished requests (attempts) and aborts: no full value for a returning or falling series."""
    run = Run()
    run.set(requests=1_000_000.0, aborted=50.0)
    run.warm()
    loaded(run, 1, absent=("requests", "aborted"))
    loaded(run, 1)
    run.set(requests=993_000.0, aborted=10.0)
    loaded(run, 1)
    assert run.h.state is not None
    window = window_failures(run.h.state.progress.failure_samples, run.h.stack.now - 300.0)
    assert window.attempts == 60.0  # the two loaded cycles after the series returned: 30 each
    assert window.explained == 0.0


# --- progress counters: a drop or a returning series is not progress ---------------------------


def stalled(run: Run, cycles: int, **kwargs: Any) -> Decision:
    """Probes time out, work is pending, the counters stay as they are."""
    decision = None
    for _ in range(cycles):
        decision = run.cycle((False,), pending=4.0, in_flight=4, **kwargs)
    assert decision is not None
    return decision


def test_plain_stall_is_acted_on() -> None:
    """The reference: a stall with flat counters is a silent stall after these many cycles."""
    run = Run().warm()
    decision = stalled(run, 9)
    assert (decision.verdict, decision.action) == (Verdict.SILENT_STALL, Action.CO_RESTART)


def test_decreasing_token_counter_is_not_progress() -> None:
    """Tokens going down without a restart, mid-stall, do not restart the no-progress clock."""
    run = Run()
    run.set(tokens=1_000_000.0)
    run.warm()
    stalled(run, 2)
    run.set(tokens=993_000.0)
    decision = stalled(run, 7)
    assert (decision.verdict, decision.action) == (Verdict.SILENT_STALL, Action.CO_RESTART)


def test_token_series_that_vanishes_and_comes_back_is_not_progress() -> None:
    """A token series missing from one scrape and back unchanged is no progress."""
    run = Run().warm()
    stalled(run, 2)
    stalled(run, 1, absent=("tokens",))
    decision = stalled(run, 6)
    assert (decision.verdict, decision.action) == (Verdict.SILENT_STALL, Action.CO_RESTART)


# --- a reset with a new process is still evidence ----------------------------------------------


@dataclass(frozen=True)
class Row:
    """One fold: counters before, the next scrape's, whether the process changed, what counts."""

    name: str
    before: Mapping[str, float]
    after: Mapping[str, float]
    absent: tuple[str, ...] = ()
    restart: bool = False
    failures: float = 0.0  # transfer failures counted on prefill
    finished: float = 0.0  # attempts counted on prefill
    decreases: int = 0
    progress: bool = False  # decode's counters advanced


BASE = {"requests": 100.0, "tokens": 1000.0, "failed": 21.0, "aborted": 0.0}
ROWS = [
    Row("growth", BASE, {**BASE, "requests": 130.0, "failed": 23.0}, failures=2, finished=30),
    Row("vanished", BASE, BASE, absent=("failed", "requests", "tokens")),
    # Both workers go down: two counters each.
    Row("decrease", BASE, {**BASE, "requests": 90.0, "failed": 20.0}, decreases=4),
    Row("token decrease", BASE, {**BASE, "tokens": 900.0}, decreases=2),
    Row(
        "reset with restart",
        BASE,
        {"requests": 3.0, "tokens": 400.0, "failed": 4.0, "aborted": 0.0},
        restart=True,
        failures=4,
        finished=3,
        progress=True,
    ),
    Row(
        "restart, failure series not created yet",
        BASE,
        {"requests": 3.0, "tokens": 400.0, "aborted": 0.0},
        absent=("failed",),
        restart=True,
        finished=3,
        progress=True,
    ),
    Row(
        "restart, nothing done yet: a drop that is no anomaly",
        BASE,
        {"requests": 0.0, "tokens": 0.0, "failed": 0.0, "aborted": 0.0},
        restart=True,
    ),
]


def fold_once(row: Row) -> tuple[float, float, int, bool]:
    """Warm up on `row.before`, fold one scrape of `row.after`: what it counted."""
    run = Run()
    run.set(**row.before)
    run.warm()
    if row.restart:
        for role in WORKER_ROLES:
            run.h.stack.restart(role, reset_counters=False)
    run.set(**row.after)
    if "failed" not in row.after:
        run.set(failed=0.0)
    obs = run.observation((), row.absent, 0.0)
    assert run.h.state is not None
    before = run.h.state.progress.advanced_at
    mem, _ = observe(run.h.state, obs, group_config(), obs.at, quiet=False)
    new = [s for s in mem.progress.failure_samples if s.at == obs.at and s.role is Role.PREFILL]
    progress = mem.progress.advanced_at != before
    return (
        sum(s.increase for s in new),
        sum(s.finished for s in new),
        mem.progress.counter_decreases,
        progress,
    )


@pytest.mark.parametrize("row", ROWS, ids=[row.name for row in ROWS])
def test_fold_counts(row: Row) -> None:
    """Each row's one scrape counts these failures, attempts, decreases and progress."""
    assert fold_once(row) == (row.failures, row.finished, row.decreases, row.progress)


def test_restart_is_counted_once() -> None:
    """A reset with a new process counts its new value once; the next scrape counts growth only."""
    run = Run()
    run.set(failed=21.0)
    run.warm()
    for role in WORKER_ROLES:
        run.h.stack.restart(role, reset_counters=False)
    run.set(failed=4.0)
    run.cycle()
    assert run.h.state is not None
    assert run.h.state.state is State.WARMING  # an external co-restart: warming again
    run.grow(failed=1.0)
    run.cycle()
    samples = [s for s in run.h.state.progress.failure_samples if s.role is Role.PREFILL]
    assert [s.increase for s in samples] == [1.0]  # the 4 went with the old processes' memory


# --- one counter, one scrape ---------------------------------------------------------------------

NAN, INF = float("nan"), float("inf")
STEPS = [
    # known, current, new process, first seen counts from zero -> new baseline, counted, decreased
    ((10.0, 13.0, False, False), CounterStep(13.0, 3.0)),
    ((10.0, 10.0, False, False), CounterStep(10.0, 0.0)),
    ((10.0, None, False, False), CounterStep(10.0, 0.0)),  # missing: unknown, baseline kept
    # Lower in the same process: a suspect scrape, not counted, the higher baseline kept.
    ((10.0, 7.0, False, False), CounterStep(10.0, 0.0, decreased=True)),
    ((10.0, 7.0, False, True), CounterStep(10.0, 0.0, decreased=True)),
    ((10.0, 7.0, True, False), CounterStep(7.0, 7.0)),  # a reset: counted from zero, once
    ((10.0, 12.0, True, False), CounterStep(12.0, 12.0)),  # new process, past the old value
    ((10.0, None, True, False), CounterStep(None, 0.0)),  # new process, series not created yet
    ((None, 4.0, False, True), CounterStep(4.0, 4.0)),  # first seen, may count: from zero
    ((None, 4.0, False, False), CounterStep(4.0, 0.0)),  # first seen, may not: the baseline
    ((None, None, False, True), CounterStep(None, 0.0)),
    ((10.0, NAN, False, False), CounterStep(10.0, 0.0)),  # not a number: unknown
    ((10.0, INF, False, False), CounterStep(10.0, 0.0)),
    ((10.0, -1.0, False, False), CounterStep(10.0, 0.0)),
    ((None, INF, True, True), CounterStep(None, 0.0)),
]


@pytest.mark.parametrize(("args", "expected"), STEPS, ids=[str(a) for a, _ in STEPS])
def test_counter_step(
    args: tuple[float | None, float | None, bool, bool], expected: CounterStep
) -> None:
    """Each reading of a counter counts and keeps or moves its baseline as the table says."""
    known, current, new_process, from_zero = args
    assert step(known, current, new_process=new_process, from_zero=from_zero) == expected
