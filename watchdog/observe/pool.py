"""The daemon's HTTP client: one httpx.AsyncClient on aiohttp (aiotransport.py), a bound per target.

Connections are pooled per origin (scheme, host, port), whatever the number of groups: a single
pool shared by N groups with httpcore matched every queued request against every pooled
connection, O(N²) per cycle, 92 % of the daemon's CPU at 32 groups (bench/profile.md); aiohttp
keeps a pool per (host, port) and bounds each on its own. Callers keep passing one client and
full URLs.

Probes pinned to DP ranks get a lane of their own: one per decode rank start as a round, so a
decode with dp_size 32 would otherwise hold 32 of its worker's connections (and as many of the
first prefill's) for up to a probe timeout, and the health check and scrapes of that worker would
wait for a slot until they failed, reading as the worker unhealthy. Requests made while POOL_LANE
is PINNED_LANE (set by the probe scheduler in a pinned probe's task; tasks it creates inherit it)
go to a separate session, bounded by PINNED_LIMITS per origin; the scheduler runs at most
PINNED_PROBES_AT_ONCE of them at a time, so they queue for a slot before their clock starts
instead of failing on a pool timeout.
"""

from __future__ import annotations

import functools
import ssl
from contextvars import ContextVar
from typing import Any

import httpx

from watchdog.observe.aiotransport import AiohttpTransport

# Per origin. What one origin needs at once: a worker gets /health, /metrics and /v1/loads per
# cycle plus an abort per timed-out probe; the router /readiness plus up to probe.max_in_flight
# completion probes, one multi-round probe and evidence reads. 32 is well above that; a request
# beyond it waits for a slot within its own timeout (a connect timeout).
MAX_CONNECTIONS_PER_ORIGIN = 32
# Below the 5 s keep-alive timeout of uvicorn (SGLang's HTTP server): a connection idle that long
# is dropped by us first (aiohttp checks a connection's idle time before reusing it), so a request
# is never written into one the server is closing at that moment (which would fail it with
# "server disconnected"). At the default 5 s cycle that means connections are reused within a
# cycle and by probes, not from one cycle to the next.
KEEPALIVE_EXPIRY_SECONDS = 4.0

# The lane of the requests made in this context: "" (the shared pools) or PINNED_LANE.
PINNED_LANE = "pinned"
POOL_LANE: ContextVar[str] = ContextVar("watchdog_pool_lane", default="")
# Pinned probes of one group at once; each holds at most two connections to an origin (its
# stream, and an abort sent when it times out), so the lane's pool never makes one wait.
PINNED_PROBES_AT_ONCE = 8
PINNED_CONNECTIONS_PER_ORIGIN = 2 * PINNED_PROBES_AT_ONCE


class LanedTransport(httpx.AsyncBaseTransport):
    """Routes each request to its lane's transport (the shared one, or the pinned probes')."""

    def __init__(self) -> None:
        # One TLS context for both lanes (building one costs ~0.1 s of CPU); proxies never apply.
        ssl_context: ssl.SSLContext = httpx.create_ssl_context(trust_env=False)
        self.lanes = {
            lane: AiohttpTransport(
                per_host=per_origin,
                keepalive_seconds=KEEPALIVE_EXPIRY_SECONDS,
                ssl_context=ssl_context,
            )
            for lane, per_origin in (
                ("", MAX_CONNECTIONS_PER_ORIGIN),
                (PINNED_LANE, PINNED_CONNECTIONS_PER_ORIGIN),
            )
        }

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        lane = self.lanes.get(POOL_LANE.get(), self.lanes[""])
        return await lane.handle_async_request(request)

    async def aclose(self) -> None:
        for lane in self.lanes.values():
            await lane.aclose()


class LeanClient(httpx.AsyncClient):
    """httpx's client with the layers between `send` and the transport left out (the daemon sets
    no auth, follows no redirect and keeps no cookie, yet the cookie layer alone was ~5 % of its
    CPU at 128 groups (it wraps every response for urllib's cookie parser whether or not it sets
    one; bench/profile.md, "The client's own layers"), and each URL text parsed once.

    A request that asks for auth or redirects goes through httpx's own path unchanged. What is
    skipped: Set-Cookie (ignored, as the aiohttp session's DummyCookieJar ignores it),
    `Response.elapsed` (never read) and httpx's per-request log line.
    """

    def __init__(self, transport: httpx.AsyncBaseTransport) -> None:
        super().__init__(trust_env=False, transport=transport)
        self._direct = transport

    def build_request(self, method: str, url: httpx.URL | str, **kwargs: Any) -> httpx.Request:
        """httpx's request, its URL parsed once per text (`endpoint_url`) for every caller."""
        return super().build_request(
            method, endpoint_url(url) if isinstance(url, str) else url, **kwargs
        )

    async def send(
        self,
        request: httpx.Request,
        *,
        stream: bool = False,
        auth: Any = httpx.USE_CLIENT_DEFAULT,
        follow_redirects: Any = httpx.USE_CLIENT_DEFAULT,
    ) -> httpx.Response:
        if auth is not httpx.USE_CLIENT_DEFAULT or follow_redirects is True:
            return await super().send(
                request, stream=stream, auth=auth, follow_redirects=follow_redirects
            )
        if self.is_closed:
            raise RuntimeError("Cannot send a request, as the client has been closed.")
        response = await self._direct.handle_async_request(request)
        response.request = request
        if not stream:
            try:
                await response.aread()
            except BaseException:
                await response.aclose()
                raise
        return response


def make_client() -> httpx.AsyncClient:
    """The daemon's shared client (no proxy from the environment: targets are loopback or LAN)."""
    return LeanClient(LanedTransport())


@functools.lru_cache(maxsize=4096)
def endpoint_url(url: str) -> httpx.URL:
    """`url` parsed once: httpx parses a str URL twice per request (merging it with the
    client's base, then building the request) and the daemon asks the same few per target
    every cycle (a query belongs in the text: `params=` would make a new URL each time).
    Bounded: a target set changed by a reload only ages out."""
    return httpx.URL(url)
