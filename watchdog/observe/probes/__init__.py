"""Synthetic probes (one module per kind) and the helpers they share: ids, API key, error mapping.

The contract of every probe: `async def run_x(...) -> ProbeResult`. A failing target is a result
(ok=False with a ProbeFailure reason), never an exception; httpx errors are translated here.
Probes do not log: the caller (the daemon's cycle, `watchdog check`) logs `probe_failed` once
per failed result, so a result is never reported twice.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterable
from pathlib import Path

import httpx

from watchdog.config import GroupSection, ProbeSection
from watchdog.errors import ConfigError, ConfigIssue
from watchdog.model import ProbeFailure, ProbeKind, ProbeResult, Role
from watchdog.observe.bounded import ACCEPT_ENCODING, read_capped
from watchdog.observe.transport import TransportFault, classify_transport_error, describe
from watchdog.redact import remember_secret

# Best-effort abort of a timed-out probe: short, so a dead server cannot hold the probe slot long.
ABORT_TIMEOUT_SECONDS = 2.0
# SGLang answers /abort_request with an empty body; only the status code is used.
ABORT_BODY_MAX_BYTES = 4096


def new_request_id(group: str, kind: str) -> str:
    """A unique id for one probe, recognisable in SGLang and router logs."""
    return f"watchdog-{group}-{kind}-{uuid.uuid4().hex}"


def load_api_key(path: Path | None, key: str = "probe.api_key_file") -> str | None:
    """The API key in `path` (surrounding whitespace stripped), None when no file is configured.

    Raises ConfigError naming the file and the config `key` (never the secret) when it cannot be
    read or is empty.
    """
    if path is None:
        return None
    try:
        secret = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError([ConfigIssue(str(path), key, f"cannot read: {exc.strerror}")]) from None
    except UnicodeDecodeError:
        raise ConfigError([ConfigIssue(str(path), key, "not UTF-8 text")]) from None
    if not secret:
        raise ConfigError([ConfigIssue(str(path), key, "the file is empty")])
    remember_secret(secret)  # masked wherever it shows up from now on (watchdog/redact.py)
    return secret


def load_admin_api_key(probe: ProbeSection) -> str | None:
    """The admin key of `probe.admin_api_key_file` (ConfigError as for load_api_key).

    Read when an abort is sent, not kept: aborts are rare, and a rotated key is picked up.
    """
    return load_api_key(probe.admin_api_key_file, "probe.admin_api_key_file")


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The Authorization header for `api_key`, or nothing."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def transport_failure(exc: httpx.TransportError, *, headers_received: bool) -> ProbeFailure:
    """The ProbeFailure of an httpx transport error, by the phase of the exchange it hit."""
    match classify_transport_error(exc):
        case TransportFault.REFUSED:
            return ProbeFailure.CONNECT_REFUSED
        case TransportFault.CONNECT_ERROR | TransportFault.CONNECT_TIMEOUT:
            return ProbeFailure.CONNECT_ERROR
        case TransportFault.TIMEOUT:  # read or write: the stream went idle too long
            if headers_received:
                return ProbeFailure.STALLED_MIDSTREAM
            return ProbeFailure.TIMEOUT_BEFORE_HEADERS
        case TransportFault.BROKEN:  # after the headers, a broken connection truncates the stream
            return ProbeFailure.MALFORMED if headers_received else ProbeFailure.CONNECT_ERROR


def internal_error_result(
    kind: ProbeKind, target: str, exc: BaseException, *, started_at: float, duration_seconds: float
) -> ProbeResult:
    """The failed result of a probe that raised `exc` instead of returning one.

    A probe that raises (a bug, or input nobody foresaw) still counts as a failed probe, with its
    exception class in the detail, so the group is judged on it instead of waiting for results
    that never come.
    """
    return ProbeResult(
        kind=kind,
        target=target,
        ok=False,
        reason=ProbeFailure.INTERNAL_ERROR,
        started_at=started_at,
        duration_seconds=duration_seconds,
        detail=f"the probe raised {describe(exc)}"[:300],
    )


async def abort_request(
    client: httpx.AsyncClient,
    base_urls: Iterable[str],
    request_id: str,
    *,
    api_key: str | None,
    admin_api_key: str | None = None,
    timeout_seconds: float = ABORT_TIMEOUT_SECONDS,
) -> str:
    """POST /abort_request for `request_id` to every base URL at once; a summary, never raises.

    A probe that timed out is still queued or parked in a PD queue on the workers (the router
    does not propagate client disconnects), so without this, stuck probes would pile up. SGLang
    takes the admin key there when the server has one (--admin-api-key), else the API key
    (docs/sglang.md §2): the admin key is sent when configured.
    """
    urls = list(base_urls)
    headers = auth_headers(admin_api_key or api_key)

    async def one(base_url: str) -> str:
        try:
            async with (
                asyncio.timeout(timeout_seconds),
                client.stream(
                    "POST",
                    f"{base_url.rstrip('/')}/abort_request",
                    json={"rid": request_id, "abort_all": False},
                    headers={**headers, **ACCEPT_ENCODING},
                    timeout=timeout_seconds,
                ) as response,
            ):
                # Only the status is used; the body is read (capped) so the connection is reused.
                await read_capped(response, ABORT_BODY_MAX_BYTES)
            return str(response.status_code)
        except TimeoutError:
            return "timeout"
        except httpx.HTTPError as exc:
            return type(exc).__name__

    results = await asyncio.gather(*(one(url) for url in urls))
    return ", ".join(f"{url}={result}" for url, result in zip(urls, results, strict=True))


def worker_urls(group: GroupSection) -> tuple[str, ...]:
    """Every prefill and decode base URL, where /abort_request is sent (the router does not say
    which pair got the request)."""
    return tuple(w.url for role in (Role.PREFILL, Role.DECODE) for w in group.workers(role))
