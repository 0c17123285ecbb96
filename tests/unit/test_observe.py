"""GroupObserver: one concurrent observation under one deadline, with counter deltas between cycles."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import httpx
import pytest
import structlog

from pdsim.payloads import router_payload, sglang_payload
from tests.unit.fakerouter import FakeStack, group_for, running_fake
from watchdog.model import (
    MetricsSnapshot,
    OperatorControls,
    ProbeFailure,
    ProbeKind,
    ProbeResult,
    Role,
    ScrapeFailure,
    UnitState,
)
from watchdog.observe import scrape as scrape_module
from watchdog.observe import sglang_metrics
from watchdog.observe.bounded import PARSE_ON_LOOP_MAX_BYTES
from watchdog.observe.observer import GroupObserver
from watchdog.observe.probes.scheduler import ProbeScheduler


@pytest.fixture
async def fake() -> AsyncIterator[FakeStack]:
    """A fake router + workers on 127.0.0.1 serving an SGLang /metrics payload."""
    async for stack in running_fake():
        stack.metrics_body = sglang_payload("0.5.23", "decode", transfer_failed_per_rank=[1] * 8)
        yield stack


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    """The watchdog's kind of client."""
    async with httpx.AsyncClient(trust_env=False) as c:
        yield c


class Units:
    """A UnitReader that answers, hangs or raises, per role."""

    def __init__(self, hang: Role | None = None, fail: Role | None = None) -> None:
        self.hang = hang
        self.fail = fail

    async def read_unit(self, role: Role, unit: str) -> UnitState:
        if role == self.hang:
            await asyncio.Event().wait()
        if role == self.fail:
            raise RuntimeError("bus bug")
        return UnitState(role=role, unit=unit, ok=True, active_state="active", main_pid=42)


async def test_one_shot_observation(fake: FakeStack, client: httpx.AsyncClient) -> None:
    """Without a scheduler: one completion probe, health of all three, scrapes, loads, raw bodies."""
    group = group_for(fake.base_url)
    observer = GroupObserver(group, client, clock=lambda: 50.0)
    cycle = await observer.observe()
    obs = cycle.observation
    assert obs.group == "fake"
    assert obs.at == 50.0
    (probe,) = obs.probes
    assert probe.kind == ProbeKind.COMPLETION
    assert probe.ok, probe.detail
    assert [(h.target, h.kind, h.ok) for h in obs.health] == [
        ("prefill", ProbeKind.HEALTH, True),
        ("decode", ProbeKind.HEALTH, True),
        ("router", ProbeKind.READINESS, True),
    ]
    assert [m.role for m in obs.metrics] == [Role.PREFILL, Role.DECODE]
    assert all(m.ok and m.transfer_failed == 1.0 for m in obs.metrics)
    assert [x.error for x in obs.loads] == [ScrapeFailure.UNSUPPORTED] * 2
    assert obs.units == ()
    assert obs.operator == OperatorControls()
    assert cycle.raw_metrics[Role.DECODE] == fake.metrics_body.encode()
    assert Role.ROUTER not in cycle.raw_metrics
    assert cycle.deltas == ()


async def test_router_metrics_and_units(fake: FakeStack, client: httpx.AsyncClient) -> None:
    """A configured router metrics URL is scraped; a unit reader fills the units."""
    group = group_for(fake.base_url)
    group = group.model_copy(
        update={
            "router": group.router.model_copy(update={"metrics_url": f"{fake.base_url}/metrics"})
        }
    )
    fake.metrics_body = router_payload(health=(1, 0))
    observer = GroupObserver(
        group,
        client,
        unit_reader=Units(),
        operator_reader=lambda: OperatorControls(pause_reason="maintenance"),
    )
    obs = (await observer.observe()).observation
    router = obs.metrics_for(Role.ROUTER)
    assert router is not None
    assert router.ok
    assert router.workers_unhealthy == 1
    assert router.circuit_breakers_open == 0
    assert [u.unit for u in obs.units] == ["p.service", "d.service", "r.service"]
    assert obs.operator.pause_reason == "maintenance"


async def test_counter_deltas_across_cycles_and_a_reset(
    fake: FakeStack, client: httpx.AsyncClient
) -> None:
    """The second cycle has deltas; counters that dropped (a restart) count from zero."""
    group = group_for(fake.base_url)
    observer = GroupObserver(group, client)
    counters = 'sglang:num_requests_total{{model_name="m"}} {}\n' + (
        'sglang:num_transfer_failed_reqs_total{{tp_rank="0"}} {}\n'
    )
    fake.metrics_body = counters.format(100, 21)
    await observer.observe()
    fake.metrics_body = counters.format(130, 21)
    grown = await observer.observe()
    fake.metrics_body = 'sglang:num_requests_total{model_name="m"} 4\n'  # restarted
    reset = await observer.observe()

    delta = grown.deltas_for(Role.PREFILL)
    assert delta is not None
    assert delta.requests_total == 30.0
    assert not delta.reset
    after = reset.deltas_for(Role.DECODE)
    assert after is not None
    assert after.reset
    assert after.requests_total == 4.0
    assert after.transfer_failed == 0.0


async def test_failed_scrape_keeps_the_previous_good_one(
    fake: FakeStack, client: httpx.AsyncClient
) -> None:
    """A failed scrape yields no delta; the next good one is compared with the last good one."""
    observer = GroupObserver(group_for(fake.base_url), client)
    fake.metrics_body = 'sglang:num_requests_total{a="b"} 10\n'
    await observer.observe()
    fake.metrics_body = ""  # 404: scrape fails
    failed = await observer.observe()
    assert failed.deltas == ()
    fake.metrics_body = 'sglang:num_requests_total{a="b"} 15\n'
    good = await observer.observe()
    delta = good.deltas_for(Role.PREFILL)
    assert delta is not None
    assert delta.requests_total == 5.0


async def test_deadline_fills_what_did_not_answer(
    fake: FakeStack, client: httpx.AsyncClient
) -> None:
    """A unit read that hangs is cut at the deadline and recorded; everything else is kept."""
    group = group_for(fake.base_url)
    observer = GroupObserver(
        group,
        client,
        scheduler=ProbeScheduler(group, client, api_key=None),
        unit_reader=Units(hang=Role.DECODE),
        deadline_seconds=4.0,  # cuts the hanging read; everything else must answer before it
    )
    obs = (await observer.observe()).observation
    decode = obs.unit_of(Role.DECODE, 0)
    assert decode is not None
    assert not decode.ok
    assert "deadline" in decode.error
    assert [u.ok for u in obs.units] == [True, False, True]
    assert all(h.ok for h in obs.health)
    assert all(m.ok for m in obs.metrics)
    assert obs.probes == ()  # the scheduler never ran: nothing finished


async def test_a_raising_fetcher_costs_only_its_slot(
    fake: FakeStack, client: httpx.AsyncClient
) -> None:
    """A unit reader that raises (a bug) is logged and counted; the observation still completes."""
    observer = GroupObserver(group_for(fake.base_url), client, unit_reader=Units(fail=Role.ROUTER))
    with structlog.testing.capture_logs() as logs:
        obs = (await observer.observe()).observation
    router = obs.unit_of(Role.ROUTER, 0)
    assert router is not None
    assert not router.ok
    assert observer.internal_errors == 1
    assert [e["event"] for e in logs] == ["observe_internal_error"]


async def test_scheduled_probes_are_drained(fake: FakeStack, client: httpx.AsyncClient) -> None:
    """With a scheduler, the probes finished since the last observation are collected, once.

    The scheduler's clock and sleep are injected: it starts one round and then parks, so what
    the observation drains does not depend on how fast this machine runs the loop (with real
    time, a slow observation let the scheduler start more rounds, direct probes among them).
    """
    group = group_for(fake.base_url, period_seconds=5.0, multiround_every_seconds=0)
    failed = ProbeResult(ProbeKind.COMPLETION, "router", False, ProbeFailure.HTTP_ERROR, 1.0, 0.1)
    finished = asyncio.Event()
    parked = asyncio.Event()

    async def probe(
        client: httpx.AsyncClient, group: object, *, api_key: str | None, clock: object
    ) -> ProbeResult:
        finished.set()
        return failed

    async def park(seconds: float) -> None:
        parked.set()
        await asyncio.Event().wait()  # until the test cancels the scheduler

    scheduler = ProbeScheduler(
        group, client, api_key=None, clock=lambda: 1000.0, sleep=park, completion_probe=probe
    )
    observer = GroupObserver(group, client, scheduler=scheduler, observe_loads=False)
    async with asyncio.TaskGroup() as tasks:
        runner = tasks.create_task(scheduler.run())
        await finished.wait()
        await parked.wait()
        assert scheduler.in_flight == 0  # the probe returned without awaiting: already collected
        obs = (await observer.observe()).observation
        again = (await observer.observe()).observation
        runner.cancel()
    assert obs.probes == (failed,)
    assert obs.probes_in_flight == 0
    assert obs.loads == ()
    assert again.probes == ()  # drained means gone


def _big_page(min_bytes: int) -> str:
    """A valid SGLang page past the size that is parsed off the loop."""
    line = 'sglang:num_running_reqs{{model_name="m",tp_rank="{}"}} 1.0\n'
    lines = [line.format(i) for i in range(min_bytes // 40)]
    return 'sglang:num_requests_total{model_name="m"} 7\n' + "".join(lines)


async def test_a_parse_still_running_is_never_joined_by_another_for_its_target(
    fake: FakeStack, client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cycles against a page whose parse does not end start one parse per target, not one per
    cycle: while it runs, the target is not even fetched again (parse_busy, counted in the
    detail); once it ends, the next cycle scrapes it normally."""
    release = threading.Event()
    started: list[Role] = []
    real = sglang_metrics.extract_snapshot

    def blocked(text: str, role: Role, *, scraped_at: float) -> MetricsSnapshot:
        started.append(role)
        release.wait(timeout=300)  # set by the test; the timeout only guards the test process
        return real(text, role, scraped_at=scraped_at)

    monkeypatch.setattr(scrape_module, "extract_snapshot", blocked)
    fake.metrics_body = _big_page(PARSE_ON_LOOP_MAX_BYTES + 1)
    # 20 s: the deadline a cycle would hit while waiting for a parse that does not end.
    observer = GroupObserver(group_for(fake.base_url), client, deadline_seconds=20.0)
    try:
        first = asyncio.create_task(observer.observe())
        # Generous: one parse starts as soon as its page came; the other target's page waits for
        # the one parse permit (bounded.PARSES_AT_ONCE) but holds its target's slot already.
        slots = observer._parse_slots
        async with asyncio.timeout(60):
            while len(started) < 1 or len(slots) < 2 or not all(s.busy for s in slots.values()):
                await asyncio.sleep(0.01)
        first.cancel()  # abandoned, as at the deadline: the parses run on in their threads
        with pytest.raises(asyncio.CancelledError):
            await first
        details = []
        for _ in range(4):
            metrics = (await observer.observe()).observation.metrics
            assert len(started) == 1  # the one running; the other waits, none joined
            assert [str(m.error) for m in metrics] == ["parse_busy"] * 2
            details += [m.detail for m in metrics]
        assert len(fake.requests_to("/metrics")) == 2  # the first cycle's fetches only
        assert "the previous parse of this target's page is still running" in details[-1]
        assert "(4 refused so far)" in details[-1]
    finally:
        release.set()
    async with asyncio.timeout(60):  # the threads end and free their slots
        while not all(m.ok for m in (await observer.observe()).observation.metrics):
            await asyncio.sleep(0.01)
