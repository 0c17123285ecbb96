"""Fetching /metrics and /v1/loads from SGLang servers and the router, under a deadline and a cap.

Every failure of the target (refused, timeout, non-200, oversize, cut short, not Prometheus) comes
back as a snapshot with ok=False and a reason; httpx exceptions never leave this module.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import httpx

from watchdog.clock import Clock
from watchdog.model import LoadsSnapshot, MetricsSnapshot, RankLoad, Role, ScrapeFailure
from watchdog.observe.bounded import (
    ACCEPT_ENCODING,
    BodyCutShort,
    ParseBusy,
    ParseSlot,
    parse_sized,
    read_into,
    size_text,
)
from watchdog.observe.sglang_metrics import (
    decode_moment_tokens,
    extract_snapshot,
    row_decode_tokens,
    with_timing,
)
from watchdog.observe.transport import TransportFault, classify_transport_error, describe

# A large SGLang deployment's page is a few MiB (histograms per TP rank); 16 MiB leaves room for
# that and stays far below the unit's MemoryMax. Pages over 256 KiB are parsed off the loop.
DEFAULT_MAX_BYTES = 16 * 2**20
# A non-200 body is kept as evidence, but only its start: error pages can be large.
_ERROR_BODY_BYTES = 4096
# One row of a few hundred bytes per DP rank: 1 MiB is thousands of ranks.
LOADS_MAX_BYTES = 2**20


@dataclass(frozen=True, slots=True)
class ScrapeResult:
    """One /metrics scrape: the extracted snapshot and the raw body (capped), for evidence."""

    snapshot: MetricsSnapshot
    raw: bytes | None


# A scrape tells no phases apart: any timeout is a timeout, a broken read a failed connection.
_SCRAPE_FAILURE = {
    TransportFault.REFUSED: ScrapeFailure.CONNECT_REFUSED,
    TransportFault.CONNECT_ERROR: ScrapeFailure.CONNECT_ERROR,
    TransportFault.CONNECT_TIMEOUT: ScrapeFailure.TIMEOUT,
    TransportFault.TIMEOUT: ScrapeFailure.TIMEOUT,
    TransportFault.BROKEN: ScrapeFailure.CONNECT_ERROR,
}


def scrape_failure(exc: httpx.TransportError) -> ScrapeFailure:
    """The ScrapeFailure of an httpx transport error."""
    return _SCRAPE_FAILURE[classify_transport_error(exc)]


async def scrape_metrics(
    client: httpx.AsyncClient,
    role: Role,
    url: str,
    *,
    timeout_seconds: float,
    max_bytes: int = DEFAULT_MAX_BYTES,
    clock: Clock = time.time,
    parse_slot: ParseSlot | None = None,
) -> ScrapeResult:
    """GET `url` (a /metrics endpoint) and extract `role`'s snapshot; never raises for the target.

    The deadline covers the whole exchange, body included: a server that trickles bytes
    (slowloris) hits it like one that never answers, because httpx's read timeout restarts on
    every chunk. With the target's `parse_slot` (the observer's), a target whose previous page
    is still being parsed is not fetched again: PARSE_BUSY, so abandoned parses never pile up.
    """
    started = clock()
    started_mono = time.monotonic()

    def failed(error: ScrapeFailure, detail: str, raw: bytes | None = None) -> ScrapeResult:
        snapshot = MetricsSnapshot(
            role=role,
            scraped_at=started,
            ok=False,
            error=error,
            detail=f"{url}: {detail}",
            duration_seconds=time.monotonic() - started_mono,
        )
        return ScrapeResult(snapshot, raw)

    if parse_slot is not None and parse_slot.busy:
        # Checked before the request too: a second page downloaded beside the one in the
        # parse would double what the target holds in memory.
        return failed(ScrapeFailure.PARSE_BUSY, parse_slot.refusal())
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_seconds):
            # Plain text only: OpenMetrics mangles the ":" in SGLang names (client_python#1177).
            headers = {"Accept": "text/plain;version=0.0.4;q=1,*/*;q=0.1", **ACCEPT_ENCODING}
            async with client.stream(
                "GET", url, headers=headers, timeout=timeout_seconds
            ) as response:
                if response.status_code != 200:
                    await read_into(response, body, _ERROR_BODY_BYTES)
                    return failed(
                        ScrapeFailure.HTTP_STATUS, f"HTTP {response.status_code}", bytes(body)
                    )
                declared = response.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > max_bytes:
                    return failed(
                        ScrapeFailure.PAYLOAD_TOO_LARGE,
                        f"Content-Length {declared} exceeds the {max_bytes}-byte cap",
                    )
                # Decoded bytes are counted, so a gzip bomb stops at the cap as well.
                if await read_into(response, body, max_bytes):
                    return failed(
                        ScrapeFailure.PAYLOAD_TOO_LARGE,
                        f"body exceeds the {max_bytes}-byte cap ({size_text(max_bytes)})",
                        bytes(body),
                    )
    except TimeoutError:
        return failed(
            ScrapeFailure.TIMEOUT,
            f"no complete response within {timeout_seconds:g} s ({len(body)} bytes read)",
            bytes(body) or None,
        )
    except httpx.TransportError as exc:
        return failed(scrape_failure(exc), describe(exc), bytes(body) or None)
    except BodyCutShort as exc:  # before HTTPError: a cut is a truncated body, not a transport
        return failed(ScrapeFailure.TRUNCATED, str(exc), bytes(body) or None)
    except httpx.HTTPError as exc:  # e.g. a redirect loop or a decoding error
        return failed(ScrapeFailure.CONNECT_ERROR, f"{type(exc).__name__}: {exc}", bytes(body))
    raw = bytes(body)
    del body  # the parse below may take a while: hold one copy of the page, not two
    # Pure parsing; a big page in a worker thread so the other fetches are not held up.
    try:
        snapshot = await parse_sized(_extract(role, started), raw, len(raw), parse_slot)
    except ParseBusy as busy:
        return failed(ScrapeFailure.PARSE_BUSY, str(busy))
    if not snapshot.ok:
        snapshot = _with_url(snapshot, url)
    return ScrapeResult(with_timing(snapshot, time.monotonic() - started_mono), raw)


def _extract(role: Role, scraped_at: float) -> Callable[[bytes], MetricsSnapshot]:
    def parse(raw: bytes) -> MetricsSnapshot:
        return extract_snapshot(raw.decode("utf-8", errors="replace"), role, scraped_at=scraped_at)

    return parse


def _with_url(snapshot: MetricsSnapshot, url: str) -> MetricsSnapshot:
    return replace(snapshot, detail=f"{url}: {snapshot.detail}")


# --- /v1/loads (SGLang 0.5.9+, three generations: docs/sglang.md §7.6) ---


def _int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return int(value)


def _sum(rows: list[Mapping[str, Any]], *keys: str) -> int | None:
    """The sum over DP ranks of the first of `keys` each row has; None when no row has any."""
    total: int | None = None
    for row in rows:
        for key in keys:
            value = _int(row.get(key))
            if value is not None:
                total = value if total is None else total + value
                break
    return total


def _rank_rows(rows: list[Mapping[str, Any]]) -> tuple[RankLoad, ...]:
    """Each row that names its DP rank, as that rank's tokens and work (entrypoints/v1_loads.py:
    141-150, managers/scheduler_components/load_inquirer.py:229-256 @ 0.5.23); a rank named
    twice says nothing."""
    ranks: dict[int, RankLoad] = {}
    repeated: set[int] = set()
    for row in rows:
        rank = _int(row.get("dp_rank"))
        if rank is None or rank < 0:
            continue
        if rank in ranks:
            repeated.add(rank)
        running, waiting = _int(row.get("num_running_reqs")), _int(row.get("num_waiting_reqs"))
        ranks[rank] = RankLoad(
            dp_rank=rank,
            decode_tokens=row_decode_tokens(row),
            running_reqs=float(running) if running is not None else None,
            waiting_reqs=float(waiting) if waiting is not None else None,
        )
    return tuple(ranks[r] for r in sorted(ranks) if r not in repeated)


def parse_loads(payload: Any, role: Role, fetched_at: float) -> LoadsSnapshot:
    """The LoadsSnapshot of a decoded /v1/loads?include=disagg answer (one row per DP rank)."""
    rows_raw: Any
    if isinstance(payload, list):
        rows_raw = payload
    elif isinstance(payload, dict):
        rows_raw = payload.get("loads", [payload])
    else:
        rows_raw = None
    if not isinstance(rows_raw, list) or not all(isinstance(r, dict) for r in rows_raw):
        return LoadsSnapshot(role, fetched_at, ok=False, error=ScrapeFailure.NOT_PROMETHEUS)
    rows: list[Mapping[str, Any]] = rows_raw
    disagg: list[Mapping[str, Any]] = [
        r["disaggregation"] for r in rows if isinstance(r.get("disaggregation"), dict)
    ]
    stamps = [
        float(r["timestamp"])
        for r in [*rows, payload if isinstance(payload, dict) else {}]
        if isinstance(r.get("timestamp"), int | float) and not isinstance(r["timestamp"], bool)
    ]
    version = payload.get("version") if isinstance(payload, dict) else None
    return LoadsSnapshot(
        role=role,
        fetched_at=fetched_at,
        ok=True,
        # The newest rank's. Whether a timestamp that stops moving means a stuck scheduler loop
        # depends on the version (docs/sglang.md §7.6), which is kept beside it.
        timestamp=max(stamps) if stamps else None,
        version=version if isinstance(version, str) and version else None,
        running_reqs=_sum(rows, "num_running_reqs"),
        waiting_reqs=_sum(rows, "num_waiting_reqs"),
        prefill_inflight_queue_reqs=_sum(disagg, "prefill_inflight_queue_reqs"),
        prefill_bootstrap_queue_reqs=_sum(
            disagg, "prefill_bootstrap_queue_reqs", "prefill_prealloc_queue_reqs"
        ),
        decode_prealloc_queue_reqs=_sum(disagg, "decode_prealloc_queue_reqs"),
        decode_transfer_queue_reqs=_sum(disagg, "decode_transfer_queue_reqs"),
        decode_tokens_total=decode_moment_tokens(rows),
        ranks=_rank_rows(rows),
    )


async def fetch_loads(
    client: httpx.AsyncClient,
    role: Role,
    base_url: str,
    *,
    timeout_seconds: float,
    clock: Clock = time.time,
    max_bytes: int = LOADS_MAX_BYTES,
    api_key: str | None = None,
) -> LoadsSnapshot:
    """GET {base_url}/v1/loads?include=disagg; 404 (SGLang before 0.5.9) gives UNSUPPORTED.

    The API key is sent when configured: SGLang checks `--api-key` on this endpoint.
    """
    fetched_at = clock()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    headers.update(ACCEPT_ENCODING)
    # The query in the text: the client parses each URL text once (observe/pool.py).
    url = f"{base_url.rstrip('/')}/v1/loads?include=disagg"
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_seconds):
            async with client.stream(
                "GET", url, headers=headers, timeout=timeout_seconds
            ) as response:
                if response.status_code in (404, 405):
                    return LoadsSnapshot(
                        role, fetched_at, ok=False, error=ScrapeFailure.UNSUPPORTED
                    )
                if response.status_code != 200:
                    return LoadsSnapshot(
                        role, fetched_at, ok=False, error=ScrapeFailure.HTTP_STATUS
                    )
                if await read_into(response, body, max_bytes):
                    return LoadsSnapshot(
                        role, fetched_at, ok=False, error=ScrapeFailure.PAYLOAD_TOO_LARGE
                    )
    except TimeoutError:
        return LoadsSnapshot(role, fetched_at, ok=False, error=ScrapeFailure.TIMEOUT)
    except httpx.TransportError as exc:
        return LoadsSnapshot(role, fetched_at, ok=False, error=scrape_failure(exc))
    except httpx.HTTPError:
        return LoadsSnapshot(role, fetched_at, ok=False, error=ScrapeFailure.CONNECT_ERROR)
    try:
        payload = await parse_sized(json.loads, bytes(body), len(body))
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
        return LoadsSnapshot(role, fetched_at, ok=False, error=ScrapeFailure.NOT_PROMETHEUS)
    return parse_loads(payload, role, fetched_at)
