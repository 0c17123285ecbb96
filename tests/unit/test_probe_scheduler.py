"""ProbeScheduler: starts on a fixed period regardless of pending probes, bounded by max_in_flight."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import structlog

from tests.unit.fakerouter import group_for
from watchdog.config import GroupSection
from watchdog.model import ProbeFailure, ProbeKind, ProbeResult
from watchdog.observe.probes.scheduler import ProbeScheduler, next_due

T0 = 1000.0


class FakeTime:
    """A clock that only moves when the scheduler sleeps; parks the scheduler at `limit`."""

    def __init__(self, limit: float = math.inf) -> None:
        self.now = T0
        self.limit = limit
        self.parked = asyncio.Event()

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        # Let the probe tasks started this round run up to their first await.
        for _ in range(3):
            await asyncio.sleep(0)
        if self.now + seconds > self.limit:
            self.parked.set()
            await asyncio.Event().wait()  # until the test cancels the scheduler
        self.now += seconds


class Probes:
    """Probe functions whose completion the test controls."""

    def __init__(self, *, block: bool) -> None:
        self.block = block
        self.gates: list[asyncio.Event] = []
        self.cancelled = 0
        self.ok = True
        self.raise_next = False

    async def completion(
        self, client: httpx.AsyncClient, group: GroupSection, *, api_key: str | None, clock: object
    ) -> ProbeResult:
        return await self._run(ProbeKind.COMPLETION, clock)

    async def multiround(
        self, client: httpx.AsyncClient, group: GroupSection, *, api_key: str | None, clock: object
    ) -> ProbeResult:
        return await self._run(ProbeKind.MULTIROUND, clock)

    async def _run(self, kind: ProbeKind, clock: object) -> ProbeResult:
        assert callable(clock)
        started = float(clock())
        if self.raise_next:
            self.raise_next = False
            raise RuntimeError("bug in a probe")
        gate = asyncio.Event()
        self.gates.append(gate)
        if self.block:
            try:
                await gate.wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        return ProbeResult(
            kind=kind,
            target="router",
            ok=self.ok,
            reason=ProbeFailure.OK if self.ok else ProbeFailure.STALLED_MIDSTREAM,
            started_at=started,
            duration_seconds=0.0,
        )


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    """An unused client (the fake probes do no I/O)."""
    async with httpx.AsyncClient(trust_env=False) as c:
        yield c


def _scheduler(
    client: httpx.AsyncClient, probes: Probes, time: FakeTime, **probe: object
) -> ProbeScheduler:
    settings: dict[str, Any] = {
        "period_seconds": 5.0,
        "max_in_flight": 4,
        "multiround_every_seconds": 0,
        **probe,
    }
    group = group_for("http://127.0.0.1:9", **settings)
    return ProbeScheduler(
        group,
        client,
        api_key=None,
        clock=time.clock,
        sleep=time.sleep,
        completion_probe=probes.completion,
        multiround_probe=probes.multiround,
    )


async def run_until_parked(scheduler: ProbeScheduler, time: FakeTime) -> asyncio.Task[None]:
    """Start the scheduler and return once it waits on the fake clock."""
    task = asyncio.create_task(scheduler.run())
    await time.parked.wait()
    return task


async def stop_scheduler(task: asyncio.Task[None]) -> None:
    """Cancel the scheduler task and wait for it to end."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def test_starts_every_period_while_probes_hang(client: httpx.AsyncClient) -> None:
    """Hung probes do not delay the next start; beyond max_in_flight the starts are skipped."""
    time = FakeTime(limit=T0 + 50)
    probes = Probes(block=True)
    scheduler = _scheduler(client, probes, time)
    task = await run_until_parked(scheduler, time)
    try:
        assert scheduler.started == 4
        assert scheduler.in_flight == 4
        assert scheduler.skipped_starts == 7  # 11 due starts (t0 .. t0+50), 4 ran
        assert scheduler.oldest_in_flight_seconds(time.now) == 50.0
        assert scheduler.drain_finished() == ()
        for gate in reversed(probes.gates):  # the newest finishes first
            gate.set()
        for _ in range(5):
            await asyncio.sleep(0)
        results = scheduler.drain_finished()
        assert [r.started_at for r in results] == [T0, T0 + 5, T0 + 10, T0 + 15]
        assert scheduler.in_flight == 0
        assert scheduler.oldest_in_flight_seconds(time.now) == 0.0
        assert scheduler.drain_finished() == ()
    finally:
        await stop_scheduler(task)


async def test_fast_probes_never_skip(client: httpx.AsyncClient) -> None:
    """Probes that finish within a period are all collected, oldest first, without skips."""
    time = FakeTime(limit=T0 + 20)
    scheduler = _scheduler(client, Probes(block=False), time)
    task = await run_until_parked(scheduler, time)
    try:
        results = scheduler.drain_finished()
        assert [r.started_at for r in results] == [T0 + 5 * i for i in range(5)]
        assert scheduler.skipped_starts == 0
        assert scheduler.in_flight == 0
    finally:
        await stop_scheduler(task)


async def test_multiround_runs_on_its_own_period_one_at_a_time(
    client: httpx.AsyncClient,
) -> None:
    """The multi-round probe starts one period in, then every N s, never two at once."""
    time = FakeTime(limit=T0 + 70)
    probes = Probes(block=True)
    scheduler = _scheduler(client, probes, time, multiround_every_seconds=30.0, max_in_flight=100)
    task = await run_until_parked(scheduler, time)
    try:
        assert scheduler.in_flight_of(ProbeKind.MULTIROUND) == 1
        assert scheduler.skipped_multiround == 2  # due at t0+35 and t0+65 while the first hangs
        assert scheduler.in_flight_of(ProbeKind.COMPLETION) == 15
    finally:
        await stop_scheduler(task)
    assert probes.cancelled == 16  # stopping the scheduler cancels every pending probe


async def test_a_probe_that_raises_is_counted_and_the_rest_go_on(
    client: httpx.AsyncClient,
) -> None:
    """A buggy probe is logged, counted and reported as a failed probe; later ones still run."""
    time = FakeTime(limit=T0 + 10)
    probes = Probes(block=False)
    probes.raise_next = True
    scheduler = _scheduler(client, probes, time)
    with structlog.testing.capture_logs() as logs:
        task = await run_until_parked(scheduler, time)
        await stop_scheduler(task)
    assert scheduler.internal_errors == 1
    finished = scheduler.drain_finished()
    assert len(finished) == 3  # the one that raised is a result too, not lost
    failed, *rest = finished
    assert (failed.ok, failed.reason, failed.kind) == (
        False,
        ProbeFailure.INTERNAL_ERROR,
        ProbeKind.COMPLETION,
    )
    assert failed.started_at == T0
    assert "RuntimeError: bug in a probe" in failed.detail
    assert all(r.ok for r in rest)
    assert [e["event"] for e in logs] == ["probe_internal_error"]


@pytest.mark.parametrize(
    ("due", "now", "expected"),
    [
        (100.0, 100.0, 105.0),  # on time
        (100.0, 103.0, 105.0),  # a little late: keep the grid
        (100.0, 160.0, 165.0),  # long pause: resume from now, no burst of catch-up starts
    ],
)
def test_next_due(due: float, now: float, expected: float) -> None:
    """The next start keeps the period grid unless a pause would cause a burst."""
    assert next_due(due, 5.0, now) == expected
