"""The daemon's client: one connection pool per origin, requests routed by their URL."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from watchdog.observe.pool import ORIGIN_LIMITS, PerOriginTransport, make_client

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
    servers = [await asyncio.start_server(_answer, "127.0.0.1", 0) for _ in range(2)]
    yield [s.sockets[0].getsockname()[1] for s in servers]
    for server in servers:
        server.close()
        await server.wait_closed()


async def test_one_pool_per_origin(ports: list[int]) -> None:
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
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("ALL_PROXY", "http://127.0.0.1:9")
    async with make_client() as client:
        response = await client.get(f"http://127.0.0.1:{ports[0]}/health")
    assert response.status_code == 200


def test_limits_bound_each_origin() -> None:
    assert ORIGIN_LIMITS.max_connections is not None
    assert ORIGIN_LIMITS.max_keepalive_connections is not None
    assert ORIGIN_LIMITS.max_keepalive_connections <= ORIGIN_LIMITS.max_connections
    # Shorter than uvicorn's 5 s keep-alive (SGLang's HTTP server): never reuse a closing one.
    assert ORIGIN_LIMITS.keepalive_expiry is not None
    assert ORIGIN_LIMITS.keepalive_expiry < 5.0
