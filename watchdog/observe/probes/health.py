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
from watchdog.observe.bounded import ACCEPT_ENCODING, read_capped, size_text
from watchdog.observe.probes import transport_failure
from watchdog.observe.transport import describe

_DETAIL_BYTES = 300
# SGLang answers /health with an empty body and the router /readiness with a short JSON status:
# anything near this is not a health answer, and is a failed check rather than read on.
HEALTH_BODY_MAX_BYTES = 64 * 1024
# Of an error page (a proxy's 503 can be megabytes) only the start is kept, for the detail.
ERROR_BODY_MAX_BYTES = 4096


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
        async with (
            asyncio.timeout(timeout_seconds),
            client.stream("GET", url, headers=ACCEPT_ENCODING, timeout=timeout_seconds) as response,
        ):
            status = response.status_code
            if not 200 <= status < 300:
                body = await read_capped(response, ERROR_BODY_MAX_BYTES)
                reason = ProbeFailure.HTTP_ERROR
                detail = f"{url}: HTTP {status} {body.text()[:_DETAIL_BYTES]}".strip()
            elif (await read_capped(response, HEALTH_BODY_MAX_BYTES)).truncated:
                reason = ProbeFailure.MALFORMED
                detail = f"{url}: body exceeds the {size_text(HEALTH_BODY_MAX_BYTES)} cap"
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
