"""The aiohttp transport reads every wire fault as httpcore does, streams as bytes arrive, and
closes an abandoned body's connection (how SGLang learns a probe gave up)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest

from watchdog.observe.pool import make_client
from watchdog.observe.transport import TransportFault, classify_transport_error, describe

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.readuntil(b"\r\n\r\n")
    await asyncio.sleep(3600)


async def _close_without_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.readuntil(b"\r\n\r\n")
    writer.close()


async def _cut_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.readuntil(b"\r\n\r\n")
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nabc")
    await writer.drain()
    writer.close()


async def _bad_chunk(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.readuntil(b"\r\n\r\n")
    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n")
    await writer.drain()
    await asyncio.sleep(3600)


async def _not_http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.readuntil(b"\r\n\r\n")
    writer.write(b"NOT HTTP AT ALL\r\n\r\n")
    await writer.drain()
    await asyncio.sleep(3600)


async def _headers_then_silence(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.readuntil(b"\r\n\r\n")
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nabc")
    await writer.drain()
    await asyncio.sleep(3600)


FAULTS: dict[str, tuple[Handler | None, TransportFault]] = {
    "refused": (None, TransportFault.REFUSED),
    "no answer": (_never_answer, TransportFault.TIMEOUT),
    "closed without an answer": (_close_without_answer, TransportFault.BROKEN),
    "body cut short": (_cut_body, TransportFault.BROKEN),
    "malformed chunk": (_bad_chunk, TransportFault.BROKEN),
    "not HTTP": (_not_http, TransportFault.BROKEN),
    "body goes silent": (_headers_then_silence, TransportFault.TIMEOUT),
}


async def _fault_of(
    client: httpx.AsyncClient, url: str, expected: TransportFault
) -> httpx.TransportError:
    # Short where the fault is a timeout; else generous, so that a loaded machine (a refused
    # connect once took longer than 0.5 s in a busy-machine run) cannot turn it into one.
    timeout = 0.5 if expected is TransportFault.TIMEOUT else 60.0
    with pytest.raises(httpx.TransportError) as caught:
        async with client.stream("GET", url, timeout=timeout) as response:
            await response.aread()
    return caught.value


@pytest.mark.parametrize("fault", FAULTS)
async def test_each_fault_reads_as_it_does_through_httpcore(fault: str) -> None:
    """Both transports raise an httpx error of the same kind, read as the same TransportFault."""
    handler, expected = FAULTS[fault]
    server = None
    if handler is None:
        with socket.socket() as unused:
            unused.bind(("127.0.0.1", 0))
            port = unused.getsockname()[1]
    else:
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        async with httpx.AsyncClient(trust_env=False) as httpcore_client, make_client() as ours:
            theirs = await _fault_of(httpcore_client, url, expected)
            mine = await _fault_of(ours, url, expected)
    finally:
        if server is not None:
            server.close()
    assert classify_transport_error(theirs) is expected, describe(theirs)
    assert classify_transport_error(mine) is expected, describe(mine)
    assert isinstance(mine, httpx.TimeoutException) == isinstance(theirs, httpx.TimeoutException)


@pytest.fixture
async def trickle() -> AsyncIterator[tuple[str, asyncio.Event, asyncio.Event]]:
    """A server that sends one SSE event, waits until told, then another; it sets `gone` when
    its client closes the connection."""
    go_on, gone = asyncio.Event(), asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        writer.write(b"9\r\ndata: 1\n\n\r\n")
        await writer.drain()
        await go_on.wait()
        writer.write(b"9\r\ndata: 2\n\n\r\n")
        await writer.drain()
        await reader.read()  # returns at EOF: once the client closed its end
        gone.set()
        writer.close()

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/", go_on, gone
    server.close()


async def test_a_stream_yields_each_event_as_it_arrives_and_closing_it_drops_the_connection(
    trickle: tuple[str, asyncio.Event, asyncio.Event],
) -> None:
    """The first event is read before the server sends the second; leaving the body before its
    end closes the connection, which the server sees as its client gone."""
    url, go_on, gone = trickle
    async with make_client() as client:
        async with client.stream("GET", url, timeout=60) as response:
            chunks = response.aiter_raw()
            assert await anext(chunks) == b"data: 1\n\n"
            go_on.set()
            assert await anext(chunks) == b"data: 2\n\n"
        async with asyncio.timeout(60):
            await gone.wait()


async def test_a_request_cut_by_its_deadline_before_the_headers_drops_the_connection() -> None:
    """A probe whose deadline passes while the server holds the headers (a wedged decode) leaves
    no connection behind: the server sees its client gone, as SGLang must to abort the request."""
    gone = asyncio.Event()

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reader.read()  # the body, then EOF: returns once the client closed its end
        gone.set()
        writer.close()

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/completions"
    try:
        async with make_client() as client:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.5):
                    await client.post(url, json={"prompt": "x"}, timeout=60)
            async with asyncio.timeout(60):
                await gone.wait()
    finally:
        server.close()
