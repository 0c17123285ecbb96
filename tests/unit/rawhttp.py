"""A raw asyncio HTTP/1.1 server on 127.0.0.1 for tests that need misbehaving targets.

Handlers get the request and write whatever bytes they like (wrong status, HTML, a trickle of
bytes, a connection closed mid-body), which a well-behaved framework would not let them do.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field


@dataclass
class Request:
    """One parsed request: method, path (with query) and headers (lower-case names), body."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes


Handler = Callable[[Request, asyncio.StreamWriter], Awaitable[None]]


@dataclass
class RawServer:
    """The running server: its base URL and the requests it has seen."""

    base_url: str
    requests: list[Request] = field(default_factory=list)


def response_head(status: int, headers: dict[str, str] | None = None) -> bytes:
    """An HTTP/1.1 status line and headers, ready to write."""
    lines = [f"HTTP/1.1 {status} X"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def write_full(
    writer: asyncio.StreamWriter,
    status: int,
    body: bytes,
    content_type: str = "text/plain; version=0.0.4",
) -> None:
    """A complete response with Content-Length; the connection is closed after it."""
    head = {"Content-Type": content_type, "Content-Length": str(len(body)), "Connection": "close"}
    writer.write(response_head(status, head) + body)
    await writer.drain()


async def _read_request(reader: asyncio.StreamReader) -> Request:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    body = await reader.readexactly(length) if length else b""
    return Request(method, path, headers, body)


@contextlib.asynccontextmanager
async def serve(routes: Mapping[str, Handler]) -> AsyncIterator[RawServer]:
    """Serve `routes` (keyed by path without query) until the block exits; 404 otherwise."""
    tasks: set[asyncio.Task[None]] = set()
    server_state = RawServer(base_url="")

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        try:
            request = await _read_request(reader)
            server_state.requests.append(request)
            handler = routes.get(request.path.split("?", 1)[0])
            if handler is None:
                await write_full(writer, 404, b"not found")
            else:
                await handler(request, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            tasks.discard(task)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server_state.base_url = f"http://127.0.0.1:{port}"
    try:
        yield server_state
    finally:
        server.close()
        for task in list(tasks):
            task.cancel()
        for task in list(tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await server.wait_closed()


def refused_url() -> str:
    """A 127.0.0.1 URL whose port was just free (nothing listens on it: connects are refused)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"
