"""The daemon's client: one connection pool per origin, requests routed by their URL."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from watchdog.observe.pool import (
    ORIGIN_LIMITS,
    PINNED_LANE,
    PINNED_LIMITS,
    PINNED_PROBES_AT_ONCE,
    POOL_LANE,
    PerOriginTransport,
    make_client,
)

RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: text/plain\r\n\r\nok"


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while await reader.readuntil(b"\r\n\r\n"):
            writer.write(RESPONSE)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


@pytest.fixture
async def ports() -> AsyncIterator[list[int]]:
    """Two local servers that answer "ok", closed after the test."""
    servers = [await asyncio.start_server(_answer, "127.0.0.1", 0) for _ in range(2)]
    yield [s.sockets[0].getsockname()[1] for s in servers]
    for server in servers:
        server.close()
        await server.wait_closed()


async def test_one_pool_per_origin(ports: list[int]) -> None:
    """Each origin gets its own connection pool, and closing the client closes them all."""
    transport = PerOriginTransport()
    async with httpx.AsyncClient(transport=transport) as client:
        for port in ports:
            for path in ("/health", "/metrics"):
                response = await client.get(f"http://127.0.0.1:{port}{path}")
                assert response.text == "ok"
        assert transport.origins == 2
    assert transport.origins == 0  # closed with the client


async def test_make_client_ignores_proxies_from_the_environment(
    ports: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon's client ignores proxy variables, so probes reach the workers directly."""
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("ALL_PROXY", "http://127.0.0.1:9")
    async with make_client() as client:
        response = await client.get(f"http://127.0.0.1:{ports[0]}/health")
    assert response.status_code == 200


def test_limits_bound_each_origin() -> None:
    """Each origin's pool is bounded and drops idle connections before uvicorn's keep-alive."""
    assert ORIGIN_LIMITS.max_connections is not None
    assert ORIGIN_LIMITS.max_keepalive_connections is not None
    assert ORIGIN_LIMITS.max_keepalive_connections <= ORIGIN_LIMITS.max_connections
    # Shorter than uvicorn's 5 s keep-alive (SGLang's HTTP server): never reuse a closing one.
    assert ORIGIN_LIMITS.keepalive_expiry is not None
    assert ORIGIN_LIMITS.keepalive_expiry < 5.0


async def test_pinned_lane_has_its_own_bounded_pool(ports: list[int]) -> None:
    """Requests made in the pinned lane use a pool of their own for the same origin, limited by
    PINNED_LIMITS, so they never take the shared pool's connections."""
    transport = PerOriginTransport()
    url = f"http://127.0.0.1:{ports[0]}/health"

    async def pinned_get(client: httpx.AsyncClient) -> httpx.Response:
        POOL_LANE.set(PINNED_LANE)  # this task's context only
        return await client.get(url)

    async with httpx.AsyncClient(transport=transport) as client:
        assert (await client.get(url)).text == "ok"
        assert (await asyncio.create_task(pinned_get(client))).text == "ok"
        assert transport.origins == 1
        assert len(transport._pools) == 2  # the shared pool and the pinned lane's
    assert PINNED_LIMITS.max_connections is not None
    assert ORIGIN_LIMITS.max_connections is not None
    assert PINNED_LIMITS.max_connections < ORIGIN_LIMITS.max_connections
    assert PINNED_LIMITS.max_connections >= 2 * PINNED_PROBES_AT_ONCE  # stream + abort each
