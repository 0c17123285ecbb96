"""The daemon's HTTP client: one connection pool per target origin behind one httpx.AsyncClient.

httpcore's pool matches every queued request against every pooled connection each time one is
queued or released, so a single pool shared by N groups costs O(N²) per cycle: at 32 groups
(~300 concurrent requests each cycle against its default 100 connections) that matching was 92 %
of the daemon's CPU (bench/profile.md). A pool per origin (scheme, host, port) keeps each one a
handful of connections, whatever the number of groups; callers keep passing one client and full
URLs.

Probes pinned to DP ranks get a lane of their own: one per decode rank start as a round, so a
decode with dp_size 32 would otherwise hold 32 of its worker's connections (and as many of the
first prefill's) for up to a probe timeout, and the health check and scrapes of that worker would
wait for a slot until they failed, reading as the worker unhealthy. Requests made while POOL_LANE
is PINNED_LANE (set by the probe scheduler in a pinned probe's task; tasks it creates inherit it)
go to a separate pool per origin, bounded by PINNED_LIMITS; the scheduler runs at most
PINNED_PROBES_AT_ONCE of them at a time, so they queue for a slot before their clock starts
instead of failing on a pool timeout.
"""

from __future__ import annotations

import ssl
from contextvars import ContextVar

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


# The lane of the requests made in this context: "" (the shared pools) or PINNED_LANE.
PINNED_LANE = "pinned"
POOL_LANE: ContextVar[str] = ContextVar("watchdog_pool_lane", default="")
# Pinned probes of one group at once; each holds at most two connections to an origin (its
# stream, and an abort sent when it times out), so the lane's pool never makes one wait.
PINNED_PROBES_AT_ONCE = 8
PINNED_LIMITS = httpx.Limits(
    max_connections=2 * PINNED_PROBES_AT_ONCE,
    max_keepalive_connections=PINNED_PROBES_AT_ONCE,
    keepalive_expiry=KEEPALIVE_EXPIRY_SECONDS,
)


class PerOriginTransport(httpx.AsyncBaseTransport):
    """Routes each request to the pool of its origin and lane, created on first use and kept
    until close."""

    def __init__(
        self, limits: httpx.Limits = ORIGIN_LIMITS, pinned_limits: httpx.Limits = PINNED_LIMITS
    ) -> None:
        self._limits = {"": limits, PINNED_LANE: pinned_limits}
        # One TLS context for all origins (building one costs ~0.1 s of CPU); proxies never apply.
        self._ssl_context: ssl.SSLContext = httpx.create_ssl_context(trust_env=False)
        self._pools: dict[tuple[str, bytes, bytes, int | None], httpx.AsyncHTTPTransport] = {}

    @property
    def origins(self) -> int:
        """How many origins have a pool (in either lane)."""
        return len({key[1:] for key in self._pools})

    def _pool(self, url: httpx.URL) -> httpx.AsyncHTTPTransport:
        lane = POOL_LANE.get()
        lane = lane if lane in self._limits else ""
        key = (lane, url.raw_scheme, url.raw_host, url.port)
        pool = self._pools.get(key)
        if pool is None:
            pool = httpx.AsyncHTTPTransport(
                verify=self._ssl_context, limits=self._limits[lane], trust_env=False
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
