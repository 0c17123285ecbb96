"""Fetch cadences: what an observation fetches while nothing is in doubt, and that any doubt
fetches everything (watchdog/observe/cadence.py, the observer's choice against a fake stack).

No wall-clock speed matters: the probe source is a stub whose results and pending ages the test
sets, and the observer's clock is injected.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from pdsim.payloads import router_payload
from tests.unit.fakerouter import FakeStack, group_for, running_fake
from watchdog.config import GroupSection
from watchdog.model import (
    Observation,
    OwnTokens,
    ProbeFailure,
    ProbeKind,
    ProbeResult,
    RankTokens,
    Role,
)
from watchdog.observe.cadence import (
    FETCH_ALL,
    Ages,
    Cadences,
    Calm,
    FetchPlan,
    plan_fetches,
    probes_passed,
)
from watchdog.observe.observer import HEALTH_LEAD_SECONDS, GroupObserver

NOW = 1000.0


def passed(at: float = NOW) -> ProbeResult:
    """A completion probe that passed."""
    return ProbeResult(ProbeKind.COMPLETION, "router", True, ProbeFailure.OK, at, 0.1, tokens=4)


def failed(at: float = NOW) -> ProbeResult:
    """A completion probe that timed out."""
    return ProbeResult(
        ProbeKind.COMPLETION, "router", False, ProbeFailure.TIMEOUT_BEFORE_HEADERS, at, 12.0
    )


class Probes:
    """A probe source whose finished results and oldest pending age the test sets per cycle."""

    def __init__(self) -> None:
        self.finished: list[ProbeResult] = []
        self.oldest_seconds = 0.0

    @property
    def in_flight(self) -> int:
        """One probe pending while an age is set."""
        return 1 if self.oldest_seconds else 0

    def oldest_in_flight_seconds(self, now: float) -> float:
        """The age the test set."""
        return self.oldest_seconds

    def own_tokens(self) -> OwnTokens:
        """No tokens of our own counted here."""
        return OwnTokens()

    def own_rank_tokens(self) -> tuple[RankTokens, ...]:
        """No pinned probes."""
        return ()

    def finished_so_far(self) -> tuple[ProbeResult, ...]:
        """The results set, not drained."""
        return tuple(self.finished)

    def drain_finished(self) -> tuple[ProbeResult, ...]:
        """The results set, drained."""
        out, self.finished = tuple(self.finished), []
        return out


@pytest.fixture
async def fake() -> AsyncIterator[FakeStack]:
    """A fake router and workers on 127.0.0.1, serving a router /metrics page."""
    async for stack in running_fake():
        stack.metrics_body = router_payload(health=(1, 0))
        yield stack


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    """The watchdog's kind of client."""
    async with httpx.AsyncClient(trust_env=False) as c:
        yield c


def _group(fake: FakeStack, **probe: Any) -> GroupSection:
    group = group_for(fake.base_url, **probe)
    router = group.router.model_copy(update={"metrics_url": f"{fake.base_url}/metrics"})
    return group.model_copy(update={"router": router})


def _counts(fake: FakeStack) -> tuple[int, int, int]:
    """(/health, /readiness, /metrics) requests the fake has seen so far."""
    return tuple(len(fake.requests_to(p)) for p in ("/health", "/readiness", "/metrics"))  # type: ignore[return-value]


def _scheduled(
    group: GroupSection,
    client: httpx.AsyncClient,
    *,
    clock: Callable[[], float] = lambda: NOW,
    deadline_seconds: float | None = None,
) -> tuple[Probes, GroupObserver]:
    """A daemon's observer of `group` (probes run by a scheduler), and that scheduler's
    scripted probes."""
    probes = Probes()
    observer = GroupObserver(
        group, client, scheduler=probes, clock=clock, deadline_seconds=deadline_seconds
    )
    return probes, observer


async def _calm_cycle(
    observer: GroupObserver, probes: Probes, fake: FakeStack
) -> tuple[FetchPlan, tuple[int, int, int]]:
    """One observation after a passing probe and a healthy decision; what it fetched."""
    before = _counts(fake)
    probes.finished.append(passed())
    cycle = await observer.observe()
    observer.note_decision(healthy=True)
    after = _counts(fake)
    return cycle.plan, (after[0] - before[0], after[1] - before[1], after[2] - before[2])


# --- the pure rule ---------------------------------------------------------------------------


def test_everything_is_fetched_while_in_doubt_or_never_fetched() -> None:
    """Doubt, or a kind never fetched yet, fetches everything whatever the cadences."""
    cadences = Cadences(health=6, worker_metrics=2, router_metrics=3, loads=2)
    assert plan_fetches(cadences, Ages(), in_doubt=False, live_progress=True) == FETCH_ALL
    fresh = Ages().after(FETCH_ALL)
    assert plan_fetches(cadences, fresh, in_doubt=True, live_progress=True) == FETCH_ALL
    assert plan_fetches(cadences, fresh, in_doubt=False, live_progress=True) == FetchPlan(
        health=False, worker_metrics=False, router_metrics=False, loads=False
    )


def test_worker_metrics_wait_only_while_loads_read_decode_tokens() -> None:
    """Without decode's tokens in /v1/loads a scrape is the only reading of its progress: worker
    /metrics every cycle whatever their cadence; the other kinds keep theirs."""
    cadences = Cadences(health=6, worker_metrics=3, router_metrics=3, loads=2)
    fresh = Ages().after(FETCH_ALL)
    assert plan_fetches(cadences, fresh, in_doubt=False, live_progress=False) == FetchPlan(
        health=False, worker_metrics=True, router_metrics=False, loads=False
    )
    ages = fresh
    fetched = []
    for _ in range(6):
        plan = plan_fetches(cadences, ages, in_doubt=False, live_progress=True)
        fetched.append(plan.worker_metrics)
        ages = ages.after(plan)
    assert fetched == [False, False, True, False, False, True]


def test_each_kind_comes_due_on_its_own_cadence() -> None:
    """While calm, a kind every N is fetched on every N-th observation, no later."""
    cadences = Cadences(health=6, worker_metrics=1, router_metrics=3, loads=2)
    ages = Ages()
    fetched: list[FetchPlan] = []
    for _ in range(13):
        plan = plan_fetches(cadences, ages, in_doubt=False, live_progress=True)
        fetched.append(plan)
        ages = ages.after(plan)
    assert [i for i, p in enumerate(fetched) if p.health] == [0, 6, 12]
    assert [i for i, p in enumerate(fetched) if p.router_metrics] == [0, 3, 6, 9, 12]
    assert [i for i, p in enumerate(fetched) if p.loads] == [0, 2, 4, 6, 8, 10, 12]
    assert all(p.worker_metrics for p in fetched)


def test_calm_needs_every_condition() -> None:
    """A healthy decision, a passing probe, none late and the last answers ok: any one missing
    is doubt."""
    calm = Calm(decided_healthy=True, probes_passed=True, none_late=True, answers_ok=True)
    assert not calm.in_doubt
    for name in ("decided_healthy", "probes_passed", "none_late", "answers_ok"):
        args = {"decided_healthy": True, "probes_passed": True, "none_late": True}
        args["answers_ok"] = True
        args[name] = False
        assert Calm(**args).in_doubt, name


def test_probes_passed_needs_a_completion_and_no_failure() -> None:
    """No probe finished, or any that failed (of any kind), is not a pass."""
    assert probes_passed((passed(),))
    assert not probes_passed(())
    assert not probes_passed((passed(), failed()))
    multiround = ProbeResult(ProbeKind.MULTIROUND, "router", True, ProbeFailure.OK, NOW, 1.0)
    assert not probes_passed((multiround,))


def test_shipped_defaults_check_health_every_sixth_cycle_and_loads_every_cycle() -> None:
    """The shipped cadences: /health every 6 cycles while calm, the router's and the workers'
    /metrics every 3 (the workers' only while /v1/loads reads decode's tokens), /v1/loads every
    cycle (it dates the no-progress clock)."""
    cadences = Cadences.of(GroupSection.model_validate(_minimal_group()).probe)
    assert cadences == Cadences(health=6, worker_metrics=3, router_metrics=3, loads=1)


def _minimal_group() -> dict[str, object]:
    return {
        "name": "g",
        "prefill": {"unit": "p.service", "url": "http://127.0.0.1:30000"},
        "decode": {"unit": "d.service", "url": "http://127.0.0.1:30002"},
        "router": {"unit": "r.service", "url": "http://127.0.0.1:30001"},
    }


# --- the observer's choice -------------------------------------------------------------------


async def test_calm_cycles_skip_health_and_repeat_the_last_checks(
    fake: FakeStack, client: httpx.AsyncClient
) -> None:
    """While calm, /health is fetched on the first observation and every sixth after; the
    skipped ones repeat the last checks (health_checked False); worker /metrics every cycle,
    the router's every third."""
    probes, observer = _scheduled(_group(fake), client)
    seen = [await _calm_cycle(observer, probes, fake) for _ in range(7)]
    assert [plan.health for plan, _ in seen] == [True, False, False, False, False, False, True]
    assert [counts[0] for _, counts in seen] == [2, 0, 0, 0, 0, 0, 2]  # prefill + decode
    assert [counts[1] for _, counts in seen] == [1, 0, 0, 0, 0, 0, 1]  # router /readiness
    # /metrics: prefill + decode every cycle, + the router's every third.
    assert [counts[2] for _, counts in seen] == [3, 2, 2, 3, 2, 2, 3]
    probes.finished.append(passed())
    skipped = (await observer.observe()).observation
    assert not skipped.health_checked
    assert [(h.target, h.ok, h.started_at) for h in skipped.health] == [
        (h.target, h.ok, h.started_at) for h in (await _last_checked(observer, probes)).health
    ]


async def _last_checked(observer: GroupObserver, probes: Probes) -> Observation:
    """An observation forced to check (a failed probe), to compare what was repeated."""
    probes.finished.append(failed())
    cycle = await observer.observe()
    assert cycle.observation.health_checked
    return cycle.observation


async def test_health_is_fetched_on_the_cycle_after_a_failed_probe(
    fake: FakeStack, client: httpx.AsyncClient
) -> None:
    """A failed probe this cycle fetches everything, whatever the cadence."""
    probes, observer = _scheduled(_group(fake), client)
    await _calm_cycle(observer, probes, fake)
    plan, _ = await _calm_cycle(observer, probes, fake)
    assert not plan.health
    probes.finished.extend([passed(), failed()])
    assert (await observer.observe()).plan == FETCH_ALL


async def test_no_probe_finished_or_one_pending_past_a_period_fetches_everything(
    fake: FakeStack, client: httpx.AsyncClient
) -> None:
    """No probe finished over two observations, or one pending longer than a period (a stuck
    probe that has not timed out yet): everything is fetched."""
    probes, observer = _scheduled(_group(fake, period_seconds=5.0), client)
    await _calm_cycle(observer, probes, fake)
    assert not (await _calm_cycle(observer, probes, fake))[0].health
    # The probe the previous observation collected still counts (a probe started with a cycle
    # finishes during that cycle's fetches); a second cycle with none finished is doubt.
    assert not (await observer.observe()).plan.health
    observer.note_decision(healthy=True)
    assert (await observer.observe()).plan == FETCH_ALL
    observer.note_decision(healthy=True)
    assert not (await _calm_cycle(observer, probes, fake))[0].health
    probes.oldest_seconds = 5.5
    probes.finished.append(passed())
    assert (await observer.observe()).plan == FETCH_ALL


async def test_a_decision_not_healthy_fetches_everything(
    fake: FakeStack, client: httpx.AsyncClient
) -> None:
    """Warm-up, verification or any other verdict than ok: everything, every cycle."""
    probes, observer = _scheduled(_group(fake), client)
    await _calm_cycle(observer, probes, fake)
    for _ in range(3):
        observer.note_decision(healthy=False)
        probes.finished.append(passed())
        assert (await observer.observe()).plan == FETCH_ALL


async def test_a_failing_health_check_is_checked_again_next_cycle(
    fake: FakeStack, client: httpx.AsyncClient
) -> None:
    """A /health that failed (or any answer that was not ok) leaves doubt: the next
    observation checks again even though the probe passed."""
    probes, observer = _scheduled(_group(fake), client)
    fake.health_status = 503
    await _calm_cycle(observer, probes, fake)
    plan, counts = await _calm_cycle(observer, probes, fake)
    assert plan == FETCH_ALL
    assert counts[0] == 2


async def test_without_a_scheduler_everything_is_fetched(
    fake: FakeStack, client: httpx.AsyncClient
) -> None:
    """`check` and `--once` (no scheduler) always fetch everything."""
    observer = GroupObserver(_group(fake), client, clock=lambda: NOW)
    for _ in range(2):
        cycle = await observer.observe()
        observer.note_decision(healthy=True)
        assert cycle.plan == FETCH_ALL
        assert cycle.observation.health_checked


# A /v1/loads answer as SGLang 0.5.23 gives it, trimmed: one row with its decode-step tokens
# (decode_moments[5]).
LOADS_WITH_TOKENS = json.dumps(
    {
        "version": "0.5.23",
        "loads": [
            {
                "timestamp": NOW,
                "dp_rank": 0,
                "num_running_reqs": 0,
                "num_waiting_reqs": 0,
                "decode_moments": [3.0, 3.0, 17430.0, 3.0, 17430.0, 3.0],
                "disaggregation": {"mode": "decode", "decode_transfer_queue_reqs": 0},
            }
        ],
    }
)


async def test_worker_scrapes_wait_their_cadence_once_loads_read_decode_tokens(
    fake: FakeStack, client: httpx.AsyncClient
) -> None:
    """At the shipped cadences worker /metrics come every cycle while /v1/loads is missing
    (a server before 0.5.23), and every third calm cycle once it reads decode's tokens."""
    probes, observer = _scheduled(_group(fake), client)
    before = [await _calm_cycle(observer, probes, fake) for _ in range(4)]
    assert [plan.worker_metrics for plan, _ in before] == [True] * 4
    fake.loads_body = LOADS_WITH_TOKENS
    after = [await _calm_cycle(observer, probes, fake) for _ in range(7)]
    # The first cycle learns that /v1/loads reads the tokens; from there every third.
    assert [plan.worker_metrics for plan, _ in after] == [
        True,
        False,
        False,
        True,
        False,
        False,
        True,
    ]
    assert all(plan.loads for plan, _ in after)


async def test_skipped_scrapes_are_left_out_not_repeated(
    fake: FakeStack, client: httpx.AsyncClient
) -> None:
    """A scrape not fetched is absent from the observation (the detector reads it as not
    scraped, its counters unknown), never the last one repeated."""
    fake.loads_body = LOADS_WITH_TOKENS
    probes, observer = _scheduled(
        _group(fake, metrics_every_cycles=2, loads_every_cycles=2), client
    )
    await _calm_cycle(observer, probes, fake)
    probes.finished.append(passed())
    cycle = await observer.observe()
    assert not cycle.plan.worker_metrics
    assert not cycle.plan.loads
    assert cycle.observation.metrics == ()
    assert cycle.observation.loads == ()
    assert Role.DECODE not in cycle.raw_metrics


# --- /health asked ahead of the observation ----------------------------------------------------


async def _until_asked(fake: FakeStack, health: int, readiness: int) -> None:
    """Until the fake has seen this many /health and /readiness requests (the tasks asked ahead
    run on their own)."""
    async with asyncio.timeout(30):
        while _counts(fake)[:2] < (health, readiness):
            await asyncio.sleep(0.01)


async def test_health_asked_ahead_is_the_next_observations_check(
    fake: FakeStack, client: httpx.AsyncClient
) -> None:
    """In doubt (no decision yet), /health and /readiness asked ahead are the next observation's
    checks: dated when they were asked, awaited when still pending, and not asked again."""
    now = [NOW - HEALTH_LEAD_SECONDS]
    _, observer = _scheduled(_group(fake), client, clock=lambda: now[0])
    fake.mode = "hang_health"  # the answers wait until released, as SGLang's take ~1 s
    observer.start_health_ahead()
    await _until_asked(fake, 2, 1)
    now[0] = NOW
    observing = asyncio.create_task(observer.observe())
    await asyncio.sleep(0.05)
    assert not observing.done()  # the observation awaits the answers asked ahead
    fake.release.set()
    cycle = await observing
    assert cycle.plan.health
    assert cycle.observation.health_checked
    assert [(h.target, h.ok, h.started_at) for h in cycle.observation.health] == [
        ("prefill", True, NOW - HEALTH_LEAD_SECONDS),
        ("decode", True, NOW - HEALTH_LEAD_SECONDS),
        ("router", True, NOW - HEALTH_LEAD_SECONDS),
    ]
    assert _counts(fake)[:2] == (2, 1)


async def test_nothing_is_asked_ahead_while_health_is_not_due(
    fake: FakeStack, client: httpx.AsyncClient
) -> None:
    """Calm, with /health not due, nothing is asked ahead: the cadence holds."""
    probes, observer = _scheduled(_group(fake), client)
    await _calm_cycle(observer, probes, fake)
    probes.finished.append(passed())
    observer.start_health_ahead()
    plan, counts = await _calm_cycle(observer, probes, fake)
    assert not plan.health
    assert counts[:2] == (0, 0)


async def test_health_asked_ahead_in_doubt_is_taken_when_calm_returns(
    fake: FakeStack, client: httpx.AsyncClient
) -> None:
    """Asked ahead while in doubt, /health is the next observation's check even when that one
    would have skipped it (the doubt gone by then): an answer is never asked and dropped."""
    probes, observer = _scheduled(_group(fake), client)
    await _calm_cycle(observer, probes, fake)
    observer.note_decision(healthy=False)
    observer.start_health_ahead()
    observer.note_decision(healthy=True)
    plan, counts = await _calm_cycle(observer, probes, fake)
    assert plan.health
    assert counts[:2] == (2, 1)


async def test_health_asked_ahead_is_bounded_by_the_observations_deadline(
    fake: FakeStack, client: httpx.AsyncClient
) -> None:
    """An answer asked ahead that has not come by the observation's deadline is late like any
    other, and its request is cancelled with the observation's."""
    _, observer = _scheduled(_group(fake), client, deadline_seconds=0.2)
    fake.mode = "hang_health"
    observer.start_health_ahead()
    cycle = await observer.observe()
    assert [(h.ok, h.reason) for h in cycle.observation.health] == [
        (False, ProbeFailure.TIMEOUT)
    ] * 3
    observer.start_health_ahead()  # asked again: the previous ones were taken
    await _until_asked(fake, 4, 2)
    observer.cancel_ahead()  # the daemon stopping: dropped, not awaited
    fake.mode = "ok"
    cycle = await observer.observe()  # nothing pending from before: asked afresh
    assert all(h.ok for h in cycle.observation.health)
    assert _counts(fake)[:2] == (6, 3)
