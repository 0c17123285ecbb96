"""Worker /health and router /readiness checks: evidence only, never a stall signal on their own.

SGLang's /health never exercises the prefill→decode transfer and the router's /readiness ignores
circuit breakers (docs/sglang.md §1), so these say "the process answers", nothing more.
"""

from __future__ import annotations

import asyncio
import time

import httpx

from watchdog.clock import Clock
from watchdog.model import ProbeFailure, ProbeKind, ProbeResult, Role
from watchdog.observe.probes import transport_failure
from watchdog.observe.transport import describe

_DETAIL_BYTES = 300


def health_url(role: Role, base_url: str) -> str:
    """Where the readiness of `role` is asked: /readiness on the router, /health on a worker."""
    path = "/readiness" if role == Role.ROUTER else "/health"
    return f"{base_url.rstrip('/')}{path}"


async def check_health(
    client: httpx.AsyncClient,
    target: str,
    url: str,
    *,
    timeout_seconds: float,
    clock: Clock = time.time,
) -> ProbeResult:
    """GET `url`; ok on 2xx. Kind READINESS for target "router", HEALTH otherwise. Never raises."""
    kind = ProbeKind.READINESS if target == Role.ROUTER.value else ProbeKind.HEALTH
    started_at = clock()
    started_mono = time.monotonic()
    reason = ProbeFailure.OK
    status: int | None = None
    detail = ""
    try:
        async with asyncio.timeout(timeout_seconds):
            response = await client.get(url, timeout=timeout_seconds)
        status = response.status_code
        if not 200 <= status < 300:
            reason = ProbeFailure.HTTP_ERROR
            detail = f"{url}: HTTP {status} {response.text[:_DETAIL_BYTES]}".strip()
    except TimeoutError:
        reason, detail = ProbeFailure.TIMEOUT, f"{url}: no answer within {timeout_seconds:g} s"
    except httpx.TimeoutException as exc:
        reason, detail = ProbeFailure.TIMEOUT, f"{url}: {describe(exc)}"
    except httpx.TransportError as exc:
        reason = transport_failure(exc, headers_received=False)
        detail = f"{url}: {describe(exc)}"
    except httpx.HTTPError as exc:
        reason, detail = ProbeFailure.CONNECT_ERROR, f"{url}: {describe(exc)}"
    return ProbeResult(
        kind=kind,
        target=target,
        ok=reason == ProbeFailure.OK,
        reason=reason,
        started_at=started_at,
        duration_seconds=time.monotonic() - started_mono,
        status_code=status,
        detail=detail,
    )
