"""httpx's API on aiohttp's connection pool and C HTTP parser: the daemon's transport.

An httpx request through httpcore costs ~2 ms of CPU on the machines this was measured on (its
pure-Python h11 parser, anyio cancel scopes, sniffio), and the daemon makes about six per group
and cycle: most of its CPU at fleet size (bench/profile.md, "An aiohttp transport"). aiohttp
parses HTTP in C and costs a third of that for the same exchange, so the daemon keeps httpx's
client (its timeouts, streams and the code and tests written against it) and hands each request
to aiohttp underneath.

What this module adds over a plain adapter (httpx-aiohttp 0.1.12 maps a refused connection and a
server that closed without answering to httpx.ConnectTimeout, and lets aiohttp's exceptions for a
malformed response escape as they are) is the one thing the watchdog's reports depend on: every
aiohttp failure becomes the httpx exception httpcore raises for the same wire event, so
`classify_transport_error` reads refused, connect timeout, read timeout and broken exchanges the
same whichever transport carried them (tests/unit/test_aiotransport.py runs each fault through
both). A body closed before its end closes its connection: SGLang aborts a request whose client
went away, which is how a timed-out probe is aborted.

One difference is aiohttp's and kept: a GET whose connection the server closed before answering
is sent once more on a new one (RFC 9112 §9.3.1; aiohttp/client.py @ 3.14.5), as a keep-alive
connection the server was closing at that moment would need. A server that drops every
connection still fails the request, as broken; the probes are POSTs and are never sent twice.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import aiohttp
import httpx

_HTTP11 = b"HTTP/1.1"


@contextmanager
def _as_httpx_errors() -> Iterator[None]:
    """Re-raise aiohttp's exceptions as the httpx exception httpcore raises for the same event.

    Most specific first: aiohttp's hierarchy nests them (ClientConnectorError is a ClientOSError,
    the timeouts are ServerConnectionErrors). Cancellation and our own deadlines pass untouched.
    """
    try:
        yield
    except aiohttp.ClientConnectorError as exc:  # refused, unreachable, DNS, TLS handshake
        raise httpx.ConnectError(str(exc)) from exc
    except aiohttp.ConnectionTimeoutError as exc:  # no connection, or no pool slot, in time
        raise httpx.ConnectTimeout(str(exc)) from exc
    except aiohttp.ServerTimeoutError as exc:  # connected, then the socket went idle too long
        raise httpx.ReadTimeout(str(exc)) from exc
    except aiohttp.ServerDisconnectedError as exc:  # closed before or during the response
        raise httpx.RemoteProtocolError(str(exc) or "Server disconnected") from exc
    except (aiohttp.ClientPayloadError, aiohttp.ClientResponseError) as exc:  # cut or garbled
        raise httpx.RemoteProtocolError(str(exc)) from exc
    except aiohttp.ClientOSError as exc:  # reset by the peer, broken pipe
        raise httpx.ReadError(str(exc)) from exc
    except aiohttp.ClientError as exc:  # anything else aiohttp raises for the exchange
        raise httpx.TransportError(str(exc)) from exc


class _Body(httpx.AsyncByteStream):
    """A response body read from aiohttp as it arrives; closing it early drops the connection."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _as_httpx_errors():
            # As the bytes arrive: an SSE event must not wait for a buffer to fill.
            async for chunk in self._response.content.iter_any():
                yield chunk

    async def aclose(self) -> None:
        if self._response.content.at_eof():
            self._response.release()  # read to its end: the connection may serve another
        else:
            self._response.close()  # abandoned: close it, so the server sees the client leave


class AiohttpTransport(httpx.AsyncBaseTransport):
    """One aiohttp session: at most `per_host` connections to each (host, port), idle ones
    dropped after `keepalive_seconds`; no proxies, no cookies, bodies left encoded for the caller
    (watchdog/observe/bounded.py decodes them within its caps)."""

    def __init__(self, *, per_host: int, keepalive_seconds: float, ssl_context: ssl.SSLContext):
        self._per_host = per_host
        self._keepalive_seconds = keepalive_seconds
        self._ssl_context = ssl_context
        self._session: aiohttp.ClientSession | None = None  # made in the loop, on first use

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(
                limit=0,  # no bound across hosts: each target is bounded on its own
                limit_per_host=self._per_host,
                keepalive_timeout=self._keepalive_seconds,
                ssl=self._ssl_context,
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                auto_decompress=False,
                trust_env=False,
                cookie_jar=aiohttp.DummyCookieJar(),
                # httpx already wrote every header the request carries.
                skip_auto_headers=("User-Agent", "Accept-Encoding", "Accept"),
            )
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeout: dict[str, float | None] = request.extensions.get("timeout", {})
        options: dict[str, Any] = {
            "headers": list(request.headers.multi_items()),
            "data": request.content or None,  # the daemon's requests carry bytes, never a stream
            "allow_redirects": False,
            "timeout": aiohttp.ClientTimeout(
                total=None,
                connect=timeout.get("pool"),  # waiting for a pool slot and connecting
                sock_connect=timeout.get("connect"),
                sock_read=timeout.get("read"),
            ),
        }
        with _as_httpx_errors():
            response = await self._client().request(request.method, str(request.url), **options)
        extensions: dict[str, Any] = {"http_version": _HTTP11}
        if response.reason:
            extensions["reason_phrase"] = response.reason.encode("latin-1", "replace")
        return httpx.Response(
            status_code=response.status,
            headers=response.raw_headers,
            stream=_Body(response),
            request=request,
            extensions=extensions,
        )

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()
