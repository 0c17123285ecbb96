"""The daemon's client: httpx on aiohttp, each origin bounded on its own, a lane for pinned probes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from watchdog.observe.aiotransport import AiohttpTransport
from watchdog.observe.pool import (
    KEEPALIVE_EXPIRY_SECONDS,
    MAX_CONNECTIONS_PER_ORIGIN,
    PINNED_CONNECTIONS_PER_ORIGIN,
    PINNED_LANE,
    PINNED_PROBES_AT_ONCE,
    POOL_LANE,
    LanedTransport,
    LeanClient,
    endpoint_url,
    make_client,
)
from watchdog.observe.transport import TransportFault, classify_transport_error

RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: text/plain\r\n\r\nok"


class _Servers:
    """Local servers that answer "ok" (never, for /hang), counting the connections they hold."""

    def __init__(self) -> None:
        self.ports: list[int] = []
        self.open = 0
        self.hanging = 0  # requests for /hang received
        self._servers: list[asyncio.Server] = []

    async def start(self, count: int) -> None:
        for _ in range(count):
            server = await asyncio.start_server(self._answer, "127.0.0.1", 0)
            self._servers.append(server)
            self.ports.append(server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        for server in self._servers:
            server.close()
            await server.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open += 1
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                if head.startswith(b"GET /hang"):
                    self.hanging += 1
                    await asyncio.sleep(3600)
                writer.write(RESPONSE)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.open -= 1
            writer.close()


@pytest.fixture
async def servers() -> AsyncIterator[_Servers]:
    """Two local servers, closed after the test."""
    made = _Servers()
    await made.start(2)
    yield made
    await made.close()


@pytest.fixture
def ports(servers: _Servers) -> list[int]:
    """The two servers' ports."""
    return servers.ports


async def test_each_origin_is_bounded_on_its_own(servers: _Servers) -> None:
    """A target whose connections all hang makes its own next request wait for a slot and fail
    as a connect timeout; another target is answered meanwhile."""
    transport = AiohttpTransport(
        per_host=2, keepalive_seconds=4.0, ssl_context=httpx.create_ssl_context()
    )
    hung, other = (f"http://127.0.0.1:{port}" for port in servers.ports)
    async with httpx.AsyncClient(transport=transport) as client:
        hanging = [asyncio.create_task(client.get(f"{hung}/hang", timeout=60)) for _ in range(2)]
        try:
            await _until(lambda: servers.hanging == 2)  # both slots taken, however slow the box
            assert (await client.get(f"{other}/health", timeout=30)).text == "ok"
            with pytest.raises(httpx.TransportError) as caught:
                await client.get(f"{hung}/health", timeout=httpx.Timeout(30, pool=0.5))
            assert classify_transport_error(caught.value) is TransportFault.CONNECT_TIMEOUT
        finally:
            for task in hanging:
                task.cancel()
            await asyncio.gather(*hanging, return_exceptions=True)


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
    """Each origin is bounded, the pinned lane below the shared one, and idle connections are
    dropped before uvicorn's keep-alive."""
    assert PINNED_CONNECTIONS_PER_ORIGIN < MAX_CONNECTIONS_PER_ORIGIN
    assert PINNED_CONNECTIONS_PER_ORIGIN >= 2 * PINNED_PROBES_AT_ONCE  # stream + abort each
    # Shorter than uvicorn's 5 s keep-alive (SGLang's HTTP server): never reuse a closing one.
    assert KEEPALIVE_EXPIRY_SECONDS < 5.0


async def test_pinned_lane_has_its_own_session(servers: _Servers) -> None:
    """Requests made in the pinned lane go to a session of their own, so they never take the
    shared lane's connections; closing the client closes both."""
    transport = LanedTransport()
    url = f"http://127.0.0.1:{servers.ports[0]}/health"

    async def pinned_get(client: httpx.AsyncClient) -> httpx.Response:
        POOL_LANE.set(PINNED_LANE)  # this task's context only
        return await client.get(url)

    async with httpx.AsyncClient(transport=transport) as client:
        assert (await asyncio.create_task(pinned_get(client))).text == "ok"
        assert (await client.get(url)).text == "ok"
        assert (await client.get(url)).text == "ok"  # reuses the shared lane's connection
        assert servers.open == 2  # the pinned lane's idle connection was not taken
    await _until(lambda: servers.open == 0)


async def _until(condition: Callable[[], bool]) -> None:
    """Wait until `condition` holds: the server sees a closed connection at its next read."""
    async with asyncio.timeout(60):
        while not condition():
            await asyncio.sleep(0.01)


def _recording_client(
    handler: Callable[[httpx.Request], httpx.Response],
) -> tuple[LeanClient, list[httpx.Request]]:
    sent: list[httpx.Request] = []

    def record(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return handler(request)

    return LeanClient(httpx.MockTransport(record)), sent


async def test_the_lean_client_keeps_no_cookie_and_reads_what_was_asked() -> None:
    """A Set-Cookie is ignored (httpx's own send would keep it: the layer this client leaves
    out); a plain request is read whole, a streamed one as it comes."""
    client, sent = _recording_client(
        lambda _: httpx.Response(200, headers={"Set-Cookie": "session=1; Path=/"}, content=b"ok")
    )
    async with client:
        response = await client.get("http://127.0.0.1:1/health")
        assert response.content == b"ok"
        assert response.request is sent[0]
        async with client.stream("GET", "http://127.0.0.1:1/v1/loads") as streamed:
            assert [chunk async for chunk in streamed.aiter_bytes()] == [b"ok"]
        await client.get("http://127.0.0.1:1/health")
    assert not client.cookies
    assert "cookie" not in sent[-1].headers
    with pytest.raises(RuntimeError, match="closed"):
        await client.get("http://127.0.0.1:1/health")


async def test_the_lean_client_hands_auth_and_redirects_to_httpx() -> None:
    """Asked for auth or redirects, a request takes httpx's own path and gets them."""

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/old":
            return httpx.Response(302, headers={"Location": "/new"})
        return httpx.Response(200, content=request.headers.get("authorization", "").encode())

    client, sent = _recording_client(answer)
    async with client:
        moved = await client.get("http://127.0.0.1:1/old", follow_redirects=True)
        signed = await client.get("http://127.0.0.1:1/new", auth=("ops", "secret"))
    assert moved.status_code == 200
    assert [r.url.path for r in sent[:2]] == ["/old", "/new"]
    assert signed.content.startswith(b"Basic ")


def test_endpoint_urls_are_parsed_once() -> None:
    """The same text gives the same parsed URL, query included, and the lean client builds
    every request from text on that one parse."""
    url = endpoint_url("http://127.0.0.1:30000/v1/loads?include=disagg")
    assert url is endpoint_url("http://127.0.0.1:30000/v1/loads?include=disagg")
    assert url.params["include"] == "disagg"
    client, _ = _recording_client(lambda _: httpx.Response(200))
    request = client.build_request("GET", "http://127.0.0.1:30000/v1/loads?include=disagg")
    # httpx wraps it in a URL of its own, around the same parse (copied, not parsed again).
    assert request.url._uri_reference is url._uri_reference
