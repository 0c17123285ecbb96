"""The daemon's HTTP client: one connection pool per target origin behind one httpx.AsyncClient.

httpcore's pool matches every queued request against every pooled connection each time one is
queued or released, so a single pool shared by N groups costs O(N²) per cycle: at 32 groups
(~300 concurrent requests each cycle against its default 100 connections) that matching was 92 %
of the daemon's CPU (bench/profile.md). A pool per origin (scheme, host, port) keeps each one a
handful of connections, whatever the number of groups; callers keep passing one client and full
URLs.
"""

from __future__ import annotations

import ssl

import httpx

# Per origin. What one origin needs at once: a worker gets /health, /metrics and /v1/loads per
# cycle plus an abort per timed-out probe; the router /readiness plus up to probe.max_in_flight
# completion probes, one multi-round probe and evidence reads. 32 is well above that; a request
# beyond it waits for a slot within its own timeout (PoolTimeout, a connect failure).
MAX_CONNECTIONS_PER_ORIGIN = 32
MAX_KEEPALIVE_PER_ORIGIN = 8
# Below the 5 s keep-alive timeout of uvicorn (SGLang's HTTP server): a connection idle that long
# is dropped by us first, so a request is never written into one the server is closing at that
# moment (which would fail it with "server disconnected"). At the default 5 s cycle that means
# connections are reused within a cycle and by probes, not from one cycle to the next.
KEEPALIVE_EXPIRY_SECONDS = 4.0

ORIGIN_LIMITS = httpx.Limits(
    max_connections=MAX_CONNECTIONS_PER_ORIGIN,
    max_keepalive_connections=MAX_KEEPALIVE_PER_ORIGIN,
    keepalive_expiry=KEEPALIVE_EXPIRY_SECONDS,
)


class PerOriginTransport(httpx.AsyncBaseTransport):
    """Routes each request to the pool of its origin, created on first use and kept until close."""

    def __init__(self, limits: httpx.Limits = ORIGIN_LIMITS) -> None:
        self._limits = limits
        # One TLS context for all origins (building one costs ~0.1 s of CPU); proxies never apply.
        self._ssl_context: ssl.SSLContext = httpx.create_ssl_context(trust_env=False)
        self._pools: dict[tuple[bytes, bytes, int | None], httpx.AsyncHTTPTransport] = {}

    @property
    def origins(self) -> int:
        """How many origins have a pool."""
        return len(self._pools)

    def _pool(self, url: httpx.URL) -> httpx.AsyncHTTPTransport:
        key = (url.raw_scheme, url.raw_host, url.port)
        pool = self._pools.get(key)
        if pool is None:
            pool = httpx.AsyncHTTPTransport(
                verify=self._ssl_context, limits=self._limits, trust_env=False
            )
            self._pools[key] = pool
        return pool

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self._pool(request.url).handle_async_request(request)

    async def aclose(self) -> None:
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            await pool.aclose()


def make_client() -> httpx.AsyncClient:
    """The daemon's shared client (no proxy from the environment: targets are loopback or LAN)."""
    return httpx.AsyncClient(trust_env=False, transport=PerOriginTransport())
