"""The direct PD probe: the same body to one prefill and one decode, paired as the router pairs them."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.unit.fakerouter import FakeStack, running_fake
from tests.unit.test_probe_scheduler import (
    FakeTime,
    Probes,
    run_until_parked,
    stop_scheduler,
)
from watchdog.config import GroupSection, parse_config
from watchdog.model import ProbeFailure, ProbeKind, ProbeResult
from watchdog.observe.probes.direct import (
    DEFAULT_BOOTSTRAP_PORT,
    ROOM_LIMIT,
    run_direct_probe,
)
from watchdog.observe.probes.scheduler import ProbeScheduler
from watchdog.pairs import Pair, pairs


@contextlib.asynccontextmanager
async def two_fakes() -> AsyncIterator[tuple[FakeStack, FakeStack]]:
    """A fake prefill and a fake decode on 127.0.0.1."""
    async with contextlib.AsyncExitStack() as stack:
        prefill = await stack.enter_async_context(contextlib.asynccontextmanager(running_fake)())
        decode = await stack.enter_async_context(contextlib.asynccontextmanager(running_fake)())
        yield prefill, decode


def group(prefill: str, decode: str, *, bootstrap_port: int | None = 9100) -> GroupSection:
    """A one-group config with one prefill and one decode at the given URLs."""
    prefill_section: dict[str, Any] = {"unit": "p.service", "url": prefill}
    if bootstrap_port is not None:
        prefill_section["bootstrap_port"] = bootstrap_port
    data = {
        "group": [
            {
                "name": "fake",
                "prefill": prefill_section,
                "decode": {"unit": "d.service", "url": decode},
                "router": {"unit": "r.service", "url": "http://127.0.0.1:9"},
                "probe": {
                    "path": "/v1/completions",
                    "timeout_seconds": 2.0,
                    "stream_idle_seconds": 1.0,
                    "connect_timeout_seconds": 1.0,
                },
            }
        ]
    }
    return parse_config(data, "<test>").group[0]


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client that ignores proxy settings, since the fakes listen on 127.0.0.1."""
    async with httpx.AsyncClient(trust_env=False) as c:
        yield c


async def test_same_body_to_both_with_the_bootstrap_fields(client: httpx.AsyncClient) -> None:
    """The same body, bootstrap host, port and room included, goes to prefill and to decode."""
    async with two_fakes() as (prefill, decode):
        config = group(prefill.base_url, decode.base_url)
        result = await run_direct_probe(client, config, Pair(0, 0), api_key=None)
        assert result.ok, result.detail
        assert result.kind is ProbeKind.DIRECT
        assert (result.target, result.worker, result.peer) == ("decode", 0, 0)
        assert result.tokens == 3  # decode's stream is the one read
        (to_prefill,) = prefill.requests_to("/generate")
        (to_decode,) = decode.requests_to("/generate")
    assert to_prefill.body == to_decode.body
    body = to_decode.body
    assert body["rid"] == result.request_id
    assert body["bootstrap_host"] == "127.0.0.1"
    assert body["bootstrap_port"] == 9100
    assert 0 <= body["bootstrap_room"] < ROOM_LIMIT
    assert body["stream"] is True
    assert "/v1/completions" not in {s.path for s in prefill.seen + decode.seen}


async def test_unset_bootstrap_port_is_sglangs_default(client: httpx.AsyncClient) -> None:
    """An unset bootstrap_port is SGLang's default 8998, where prefill listens if not told."""
    async with two_fakes() as (prefill, decode):
        config = group(prefill.base_url, decode.base_url, bootstrap_port=None)
        await run_direct_probe(client, config, Pair(0, 0), api_key=None)
        (seen,) = decode.requests_to("/generate")
    assert seen.body["bootstrap_port"] == DEFAULT_BOOTSTRAP_PORT == 8998


async def test_rooms_are_random(client: httpx.AsyncClient) -> None:
    """Each direct probe picks a fresh random room, so two probes never share a transfer."""
    async with two_fakes() as (prefill, decode):
        config = group(prefill.base_url, decode.base_url)
        for _ in range(3):
            await run_direct_probe(client, config, Pair(0, 0), api_key=None)
        rooms = {s.body["bootstrap_room"] for s in decode.requests_to("/generate")}
    assert len(rooms) == 3


async def test_decode_hang_fails_and_aborts_on_the_pair_only(client: httpx.AsyncClient) -> None:
    """A decode hang fails the probe and aborts it on that prefill and decode only."""
    async with two_fakes() as (prefill, decode):
        decode.mode = "hang_before_headers"
        config = group(prefill.base_url, decode.base_url)
        result = await run_direct_probe(client, config, Pair(0, 0), api_key=None)
        assert not result.ok
        assert result.reason is ProbeFailure.TIMEOUT_BEFORE_HEADERS
        assert result.abort_sent
        assert result.detail.startswith("prefill+decode: ")
        assert len(prefill.requests_to("/abort_request")) == 1
        assert len(decode.requests_to("/abort_request")) == 1


async def test_prefill_error_fails_the_probe(client: httpx.AsyncClient) -> None:
    """An HTTP error from prefill fails the direct probe, naming the side that answered it."""
    async with two_fakes() as (prefill, decode):
        prefill.mode = "http_500"
        config = group(prefill.base_url, decode.base_url)
        result = await run_direct_probe(client, config, Pair(0, 0), api_key=None)
    assert not result.ok
    assert result.reason is ProbeFailure.HTTP_ERROR
    assert "prefill answered HTTP 500" in result.detail


def test_pairs_cover_every_prefill_and_decode() -> None:
    """The direct pairs are every prefill with every decode, so no worker goes unprobed."""
    data = {
        "group": [
            {
                "name": "g",
                "prefill": [
                    {"unit": "p1.service", "url": "http://127.0.0.1:1"},
                    {"unit": "p2.service", "url": "http://127.0.0.1:2"},
                ],
                "decode": [
                    {"unit": "d1.service", "url": "http://127.0.0.1:3"},
                    {"unit": "d2.service", "url": "http://127.0.0.1:4"},
                    {"unit": "d3.service", "url": "http://127.0.0.1:5"},
                ],
                "router": {"unit": "r.service", "url": "http://127.0.0.1:6"},
            }
        ]
    }
    config = parse_config(data, "<test>").group[0]
    assert len(pairs(config)) == 6
    assert pairs(config)[-1] == Pair(1, 2)


class Direct:
    """A direct probe function that records the pairs it was asked for."""

    def __init__(self) -> None:
        self.pairs: list[Pair] = []

    async def __call__(
        self,
        client: httpx.AsyncClient,
        group: GroupSection,
        pair: Pair,
        *,
        api_key: str | None,
        clock: object,
    ) -> ProbeResult:
        self.pairs.append(pair)
        assert callable(clock)
        return ProbeResult(
            kind=ProbeKind.DIRECT,
            target="decode",
            ok=True,
            reason=ProbeFailure.OK,
            started_at=float(clock()),
            duration_seconds=0.0,
            worker=pair.decode,
            peer=pair.prefill,
        )


async def _run(
    client: httpx.AsyncClient, *, ok: bool, limit: float, **probe: object
) -> tuple[Direct, ProbeScheduler]:
    time = FakeTime(limit=1000.0 + limit)
    probes = Probes(block=False)
    probes.ok = ok
    direct = Direct()
    data = {
        "group": [
            {
                "name": "g",
                "prefill": {"unit": "p.service", "url": "http://127.0.0.1:1"},
                "decode": {"unit": "d.service", "url": "http://127.0.0.1:2"},
                "router": {"unit": "r.service", "url": "http://127.0.0.1:3"},
                "probe": {"period_seconds": 5.0, "multiround_every_seconds": 0, **probe},
            }
        ]
    }
    config = parse_config(data, "<test>").group[0]
    scheduler = ProbeScheduler(
        config,
        client,
        api_key=None,
        clock=time.clock,
        sleep=time.sleep,
        completion_probe=probes.completion,
        multiround_probe=probes.multiround,
        direct_probe=direct,
    )
    await stop_scheduler(await run_until_parked(scheduler, time))
    return direct, scheduler


async def test_no_direct_probes_while_router_probes_pass(client: httpx.AsyncClient) -> None:
    """While router probes pass no direct probe runs: they would only add load."""
    direct, _ = await _run(client, ok=True, limit=60)
    assert direct.pairs == []


async def test_a_round_per_period_while_router_probes_fail(client: httpx.AsyncClient) -> None:
    """While router probes fail a direct round runs every period, beside the router probes."""
    direct, scheduler = await _run(client, ok=False, limit=30)
    # The first router probe fails at once; from the next wake a round starts every period.
    assert 4 <= len(direct.pairs) <= 7, direct.pairs
    kinds = {r.kind for r in scheduler.drain_finished()}
    assert kinds == {ProbeKind.COMPLETION, ProbeKind.DIRECT}


async def test_direct_on_failure_can_be_turned_off(client: httpx.AsyncClient) -> None:
    """direct_on_failure = false runs no direct probes when router probes fail."""
    direct, _ = await _run(client, ok=False, limit=30, direct_on_failure=False)
    assert direct.pairs == []


async def test_a_slow_cadence_runs_while_all_is_well(client: httpx.AsyncClient) -> None:
    """A slow cadence of direct probes runs while everything is well, at the configured period."""
    direct, _ = await _run(client, ok=True, limit=125, direct_every_seconds=60)
    assert len(direct.pairs) == 2
