"""The detector under the shipped fetch cadences decides when it did fetching everything every
cycle: /health is skipped only in calm cycles (a passing probe, a healthy decision, every answer
ok), which no stall verdict is reached in, and a /health failure found after skipped cycles is
dated from the first of them (watchdog/observe/cadence.py, docs/decisions.md "Fetch cadence").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

from tests.unit.builders import WORKER_ROLES, Harness, Stack, group_config
from watchdog.config import GroupSection
from watchdog.decide import Decision, Verdict
from watchdog.model import Observation, ProbeResult, Role, State
from watchdog.observe.cadence import Ages, Cadences, Calm, plan_fetches, probes_passed

# The shipped timings (config.py), not the pinned timeline ones of builders.group_config.
SHIPPED_PROBE: dict[str, Any] = {"timeout_seconds": 12.0, "stream_idle_seconds": 8.0}
SHIPPED_STALL: dict[str, Any] = {"no_progress_seconds": 25.0}


def shipped() -> GroupSection:
    """A group at the shipped probe and stall timings."""
    return group_config(probe=SHIPPED_PROBE, stall=SHIPPED_STALL)


class Cadenced:
    """Feeds a Harness the observations the observer would make at the configured cadences:
    where /health is not due, the last checks repeated and `health_checked` False; where worker
    /metrics are not due (only while the last /v1/loads read decode's tokens), no scrape."""

    def __init__(self, harness: Harness) -> None:
        self.harness = harness
        self.cadences = Cadences.of(harness.config.probe)
        self.ages = Ages()
        self.last_health: tuple[ProbeResult, ...] = ()
        self.answers_ok = False
        self.last_probes: tuple[ProbeResult, ...] = ()
        self.live_progress = False
        self.skipped = 0
        self.scrapes_skipped = 0

    def feed(self, obs: Observation) -> Decision:
        """One observation, its /health repeated when the cadence skips it."""
        decisions = self.harness.decisions
        last = decisions[-1] if decisions else None
        calm = Calm(
            decided_healthy=last is not None
            and last.state.state is State.HEALTHY
            and last.verdict is Verdict.OK,
            # The observer also counts the probes the previous observation collected.
            probes_passed=probes_passed(self.last_probes + obs.probes),
            none_late=obs.oldest_probe_in_flight_seconds
            <= self.harness.config.probe.period_seconds,
            answers_ok=self.answers_ok,
        )
        plan = plan_fetches(
            self.cadences, self.ages, in_doubt=calm.in_doubt, live_progress=self.live_progress
        )
        self.last_probes = obs.probes
        self.ages = self.ages.after(plan)
        if plan.health:
            self.last_health = obs.health
        else:
            self.skipped += 1
            obs = replace(obs, health=self.last_health, health_checked=False)
        if not plan.worker_metrics:
            self.scrapes_skipped += 1
            obs = replace(obs, metrics=())
        decodes = [x for x in obs.loads if x.role is Role.DECODE]
        self.live_progress = bool(decodes) and all(
            x.ok and x.decode_tokens_total is not None for x in decodes
        )
        self.answers_ok = (
            all(h.ok for h in obs.health)
            and all(m.ok for m in obs.metrics)
            and all(x.ok for x in obs.loads)
        )
        return self.harness.feed(obs)


def _twins(config: GroupSection, *, live: bool = False) -> tuple[Harness, Cadenced]:
    """Two detectors on identical stacks: one fed everything, one at the cadences; `live`:
    the stacks answer /v1/loads with decode's tokens (SGLang 0.5.23) and report realtime
    tokens."""

    def stack() -> Stack:
        return Stack(live=True, realtime=dict.fromkeys(WORKER_ROLES, 0.0)) if live else Stack()

    return Harness(config=config, stack=stack()), Cadenced(Harness(config=config, stack=stack()))


def _first(decisions: list[Decision], verdict: Verdict) -> int:
    return next(i for i, d in enumerate(decisions) if d.verdict is verdict)


def _run(
    plain: Harness, cadenced: Cadenced, script: Iterator[Callable[[Stack], Observation]]
) -> None:
    for make in script:
        plain.feed(make(plain.stack))
        cadenced.feed(make(cadenced.harness.stack))


def _healthy(stack: Stack) -> Observation:
    return stack.cycle()


def _stalled(stack: Stack) -> Observation:
    return stack.stalled()


def _hanging(cycle: int) -> Callable[[Stack], Observation]:
    """The `cycle`-th cycle of a stall as the daemon sees it: probes hang (pending, none
    finished) for two cycles, then time out one per cycle."""

    def make(stack: Stack) -> Observation:
        pending = min(cycle + 1, 4)
        oldest = 5.0 * (cycle + 1) if cycle < 2 else 12.0
        stack.http_active = max(stack.http_active, 4.0)
        finished: tuple[bool, ...] = () if cycle < 2 else (False,)
        return stack.cycle(
            finished, progress=False, in_flight=pending, oldest_in_flight_seconds=oldest
        )

    return make


def test_silent_stall_is_decided_in_the_same_cycle_at_the_shipped_cadences() -> None:
    """A silent stall after a calm stretch: decided in the same cycle as with /health every
    cycle, every decision the same; the calm cycles before it did skip /health."""
    plain, cadenced = _twins(shipped())
    script = [_healthy] * 10 + [_stalled] * 8
    _run(plain, cadenced, iter(script))
    assert cadenced.skipped >= 7  # the calm stretch skipped /health
    assert [d.verdict for d in cadenced.harness.decisions] == [d.verdict for d in plain.decisions]
    stall = _first(plain.decisions, Verdict.SILENT_STALL)
    assert _first(cadenced.harness.decisions, Verdict.SILENT_STALL) == stall
    assert stall == 9 + 5  # 25 s (5 cycles of 5 s) after the last progress, in cycle 9


def test_stall_with_hanging_probes_is_decided_in_the_same_cycle() -> None:
    """The stall as the daemon sees it at the shipped timings: probes hang (pending, none
    finished) for two cycles, then time out one per cycle. The first hanging cycle may still
    skip /health (last cycle's probe passed, none pending past a period); the verdicts, and
    the cycle of the stall decision, are those of a detector fed everything."""
    plain, cadenced = _twins(shipped())
    _run(plain, cadenced, iter([_healthy] * 10 + [_hanging(i) for i in range(9)]))
    assert [d.verdict for d in cadenced.harness.decisions] == [d.verdict for d in plain.decisions]
    stall = _first(plain.decisions, Verdict.SILENT_STALL)
    assert _first(cadenced.harness.decisions, Verdict.SILENT_STALL) == stall


def test_silent_stall_with_scrapes_on_their_cadence_is_decided_in_the_same_cycle() -> None:
    """On SGLang 0.5.23 (/v1/loads reads decode's tokens every cycle) worker /metrics wait their
    cadence while calm: the stall after a calm stretch is decided in the same cycle as with
    every scrape made. The first scrape after the stall steps the counters from a scrape made
    before the last progress /v1/loads showed: that step began before the mark and must not
    date progress after it (decide/fold.py `_moved_mark`)."""
    for calm_cycles in range(8, 12):  # the stall at each phase of the scrape cadence
        plain, cadenced = _twins(shipped(), live=True)
        script = [_healthy] * calm_cycles + [_stalled] * 8
        _run(plain, cadenced, iter(script))
        assert cadenced.scrapes_skipped >= 4  # the calm stretch skipped worker scrapes
        assert [d.verdict for d in cadenced.harness.decisions] == [
            d.verdict for d in plain.decisions
        ], calm_cycles
        stall = _first(plain.decisions, Verdict.SILENT_STALL)
        assert _first(cadenced.harness.decisions, Verdict.SILENT_STALL) == stall
        assert stall == calm_cycles - 1 + 5  # 25 s (5 cycles of 5 s) after the last progress


def test_hanging_stall_with_scrapes_on_their_cadence_is_decided_in_the_same_cycle() -> None:
    """The hanging-probe stall at the shipped timings on SGLang 0.5.23: scrapes skipped while
    calm, the verdicts and the cycle of the stall decision those of a detector fed everything."""
    for calm_cycles in range(8, 12):
        plain, cadenced = _twins(shipped(), live=True)
        _run(plain, cadenced, iter([_healthy] * calm_cycles + [_hanging(i) for i in range(9)]))
        assert cadenced.scrapes_skipped >= 4
        assert [d.verdict for d in cadenced.harness.decisions] == [
            d.verdict for d in plain.decisions
        ], calm_cycles
        stall = _first(plain.decisions, Verdict.SILENT_STALL)
        assert _first(cadenced.harness.decisions, Verdict.SILENT_STALL) == stall


def test_scrapes_every_cycle_without_decode_tokens_in_loads() -> None:
    """Before 0.5.23 (no /v1/loads tokens) a scrape is the only reading of decode's tokens:
    none is skipped at the shipped cadences."""
    plain, cadenced = _twins(shipped())
    _run(plain, cadenced, iter([_healthy] * 12 + [_stalled] * 8))
    assert cadenced.scrapes_skipped == 0
    assert [d.verdict for d in cadenced.harness.decisions] == [d.verdict for d in plain.decisions]


def test_health_failing_after_skipped_checks_is_dated_from_the_first_skipped_cycle() -> None:
    """A /health failure found after cycles that repeated the last check is dated from the
    first of them: the hung-worker clock never starts later than checking every cycle."""
    h = Harness(config=shipped())
    h.warm()
    checked = h.stack.cycle()
    h.feed(checked)
    first_skipped = h.stack.cycle()
    h.feed(replace(first_skipped, health=checked.health, health_checked=False))
    for _ in range(2):
        h.feed(replace(h.stack.cycle(), health=checked.health, health_checked=False))
    assert h.state is not None
    assert h.state.units.health_unchecked_since == first_skipped.at
    h.feed(h.stack.stalled(health_ok={Role.DECODE: False}))
    assert {s.role: s.at for s in h.state.units.unhealthy_since} == {Role.DECODE: first_skipped.at}
    assert h.state.units.health_unchecked_since is None


def test_hung_worker_is_restarted_no_later_than_checking_every_cycle() -> None:
    """/health starts failing in a calm cycle whose probe passed (skipped at the cadence), then
    probes fail and nothing progresses: the hung-worker verdict (crash, health_failing) comes
    no later than with /health checked every cycle."""
    plain, cadenced = _twins(shipped())

    def breaks(stack: Stack) -> Observation:
        return stack.cycle(health_ok={Role.DECODE: False})

    def hung(stack: Stack) -> Observation:
        return stack.stalled(health_ok={Role.DECODE: False})

    _run(plain, cadenced, iter([_healthy] * 4 + [breaks] + [hung] * 10))
    assert cadenced.skipped >= 1
    plain_crash = _first(plain.decisions, Verdict.CRASH)
    assert _first(cadenced.harness.decisions, Verdict.CRASH) <= plain_crash
    reasons = [r.code for r in cadenced.harness.decisions[plain_crash].reasons]
    assert "health_failing" in reasons


def test_checks_every_cycle_leave_nothing_unchecked() -> None:
    """A checked observation clears the unchecked mark: a later failure is dated from its own
    cycle, as before cadences."""
    h = Harness(config=shipped())
    h.warm()
    h.feed(h.stack.cycle())
    obs = h.stack.stalled(health_ok={Role.DECODE: False})
    h.feed(obs)
    assert h.state is not None
    assert h.state.units.health_unchecked_since is None
    assert {s.role: s.at for s in h.state.units.unhealthy_since} == {Role.DECODE: obs.at}
