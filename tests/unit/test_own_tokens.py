"""Own tokens counted at the edge: what our probes received, each token once over a probe's life.

docs/decisions.md, "Progress": decode's counters are progress only beyond the tokens we can prove
are ours, so the probes count what they receive as it arrives (watchdog/observe/probes/tally.py),
the scheduler sums finished and in-flight probes, and the observer hands decide() the growth
since the previous observation.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from tests.unit.fakerouter import FakeStack, group_for, running_fake
from tests.unit.test_probe_scheduler import FakeTime, run_until_parked, stop_scheduler
from watchdog.config import GroupSection
from watchdog.model import OwnTokens, ProbeFailure, ProbeKind, ProbeResult
from watchdog.observe.observer import GroupObserver
from watchdog.observe.probes.completion import run_completion_probe
from watchdog.observe.probes.multiround import run_multiround_probe
from watchdog.observe.probes.scheduler import ProbeScheduler
from watchdog.observe.probes.tally import CURRENT_TALLY, ProbeTally, StreamCount, stream_count

PATHS = ["/v1/completions", "/v1/chat/completions", "/generate"]


@pytest.fixture
async def fake() -> AsyncIterator[FakeStack]:
    """A running fake stack for the test."""
    async for stack in running_fake():
        yield stack


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client that ignores proxy settings, since the fake listens on 127.0.0.1."""
    async with httpx.AsyncClient(trust_env=False) as c:
        yield c


def test_a_stream_counts_growth_once_and_its_first_token_once() -> None:
    """A stream adds only its growth to the tally and its first token once, never a drop below."""
    tally = ProbeTally()
    first, second = StreamCount(tally), StreamCount(tally)
    for seen in (1, 1, 3, 2, 4):  # a count that goes down (a usage total below the chunks) adds 0
        first.update(seen)
    second.update(0)
    second.update(2)
    assert (tally.received, tally.first) == (4 + 2, 2)


def test_outside_a_probe_task_nothing_is_reported() -> None:
    """A stream outside a probe task reports to no tally: user traffic is never counted ours."""
    count = stream_count()
    count.update(5)
    assert count.tally is None
    assert count.seen == 5


@pytest.mark.parametrize("path", PATHS)
async def test_a_stalled_stream_has_reported_what_it_received_while_in_flight(
    fake: FakeStack, client: httpx.AsyncClient, path: str
) -> None:
    """One token, then silence: the tally has it before the probe ends, and the end adds none."""
    fake.mode = "stall_midstream"
    group = group_for(fake.base_url, path=path, timeout_seconds=5.0, stream_idle_seconds=0.5)
    tally = ProbeTally()

    async def probe() -> ProbeResult:
        CURRENT_TALLY.set(tally)  # as the scheduler does, in the probe's own task
        return await run_completion_probe(client, group, api_key=None)

    task = asyncio.create_task(probe())
    for _ in range(200):
        if tally.received:
            break
        await asyncio.sleep(0.01)
    assert (tally.received, tally.first) == (1, 1)
    assert not task.done()
    result = await task
    assert result.reason is ProbeFailure.STALLED_MIDSTREAM
    assert (tally.received, tally.first) == (result.tokens, 1) == (1, 1)


@pytest.mark.parametrize("path", PATHS)
async def test_every_round_of_a_conversation_is_counted(
    fake: FakeStack, client: httpx.AsyncClient, path: str
) -> None:
    """Every round of a multi-round probe is counted as our own tokens and first tokens."""
    group = group_for(fake.base_url, path=path)
    tally = ProbeTally()

    async def probe() -> ProbeResult:
        CURRENT_TALLY.set(tally)
        return await run_multiround_probe(client, group, api_key=None, rounds=3)

    result = await asyncio.create_task(probe())
    assert result.ok, result.detail
    assert (tally.received, tally.first) == (result.tokens, 3) == (9, 3)


class Streaming:
    """A probe function that streams `tokens` through stream_count(), then waits for `done`."""

    def __init__(self, tokens: int, result_tokens: int | None = None) -> None:
        self.tokens = tokens
        self.result_tokens = tokens if result_tokens is None else result_tokens
        self.streamed = asyncio.Event()
        self.done = asyncio.Event()

    async def __call__(
        self, client: httpx.AsyncClient, group: GroupSection, *, api_key: str | None, clock: object
    ) -> ProbeResult:
        count = stream_count()
        for seen in range(1, self.tokens + 1):
            count.update(seen)
        self.streamed.set()
        await self.done.wait()
        return ProbeResult(
            kind=ProbeKind.COMPLETION,
            target="router",
            ok=True,
            reason=ProbeFailure.OK,
            started_at=0.0,
            duration_seconds=0.0,
            tokens=self.result_tokens,
        )


async def test_the_scheduler_counts_in_flight_tokens_then_the_finished_probe_once(
    client: httpx.AsyncClient,
) -> None:
    """The scheduler counts a probe's tokens while it streams, then its finished total once."""
    probe = Streaming(3, result_tokens=4)  # the final usage says one more than the chunks
    time = FakeTime(limit=1000.0 + 1)  # one start, then parked
    group = group_for("http://127.0.0.1:9", period_seconds=5.0, multiround_every_seconds=0)
    scheduler = ProbeScheduler(
        group, client, api_key=None, clock=time.clock, sleep=time.sleep, completion_probe=probe
    )
    task = await run_until_parked(scheduler, time)
    try:
        await probe.streamed.wait()
        assert scheduler.own_tokens() == OwnTokens(received=3, first=1, finished=0)
        probe.done.set()
        for _ in range(5):
            await asyncio.sleep(0)
        assert scheduler.in_flight == 0
        assert scheduler.own_tokens() == OwnTokens(received=4, first=1, finished=4)
    finally:
        await stop_scheduler(task)


async def test_the_observer_hands_decide_the_growth_since_the_previous_observation(
    fake: FakeStack, client: httpx.AsyncClient
) -> None:
    """The observer hands decide only the own tokens grown since its previous observation."""
    probe = Streaming(3)
    group = group_for(fake.base_url, period_seconds=5.0, multiround_every_seconds=0)
    time = FakeTime(limit=1000.0 + 1)
    scheduler = ProbeScheduler(
        group, client, api_key=None, clock=time.clock, sleep=time.sleep, completion_probe=probe
    )
    observer = GroupObserver(group, client, scheduler=scheduler, observe_loads=False)
    task = await run_until_parked(scheduler, time)
    try:
        await probe.streamed.wait()
        first = (await observer.observe()).observation
        assert first.own_tokens == OwnTokens(received=3, first=1)
        assert first.own_tokens_during == OwnTokens()  # all of it before the fetches began
        probe.done.set()
        for _ in range(5):
            await asyncio.sleep(0)
        second = (await observer.observe()).observation
        # Finished now; its 3 tokens were handed over already: only the finish is new.
        assert second.own_tokens == OwnTokens(received=0, first=0, finished=3)
        assert [p.tokens for p in second.probes] == [3]
    finally:
        await stop_scheduler(task)
