"""The direct PD probe: one prefill and one decode asked directly, paired as the router pairs them.

The router (sglang-router 0.3.2, smg) sends each request to a prefill and a decode with the same
body plus `bootstrap_host` (the prefill URL's host), `bootstrap_port` (the prefill's) and a random
`bootstrap_room` in [0, 2**63), streams the decode's answer back and drains the prefill's
(docs/sglang.md §4). This probe does exactly that without the router, on `/generate` (every
SGLang version serves it, and it needs no model name), so a failing router probe next to a
passing direct probe points at the router, and a failing direct probe at that pair.

A probe pinned to one DP rank of the decode carries the version's pinning field in the decode's
request only (docs/sglang.md §7.10): the prefill is asked as the router asks it, so the failure
is that rank's (docs/decisions.md, "DP-attention ranks").
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from dataclasses import dataclass, replace
from urllib.parse import urlsplit

import httpx

from watchdog.clock import Clock
from watchdog.config import GroupSection, PrefillSection
from watchdog.model import ProbeFailure, ProbeKind, ProbeResult, Role
from watchdog.observe.bounded import ACCEPT_ENCODING, read_capped
from watchdog.observe.probes import auth_headers, new_request_id, transport_failure
from watchdog.observe.probes.completion import request_body, stream_exchange
from watchdog.observe.transport import describe
from watchdog.pairs import Pair, pair_name

DIRECT_PATH = "/generate"
# SGLang's --disaggregation-bootstrap-port default (srt/arg_groups/fields/disagg.py:82-83 @
# 0.5.23).
DEFAULT_BOOTSTRAP_PORT = 8998
# The prefill's answer is drained, not judged beyond its status: a probe's is a few KiB.
PREFILL_BODY_MAX_BYTES = 2**20
ROOM_LIMIT = 2**63  # bootstrap_room is an int in [0, 2**63) (docs/sglang.md §2)


@dataclass(frozen=True, slots=True)
class PinnedPair:
    """A group's first prefill and one decode, pinned to one of the decode's DP ranks."""

    pair: Pair
    dp_rank: int


def pinned_pairs(group: GroupSection) -> tuple[PinnedPair, ...]:
    """One pinned pair per DP rank of every decode with dp_size > 1 (none without DP)."""
    return tuple(
        PinnedPair(Pair(0, d), rank)
        for d, decode in enumerate(group.decodes)
        for rank in range(decode.dp_size if decode.dp_size > 1 else 0)
    )


def bootstrap_fields(prefill: PrefillSection, room: int) -> dict[str, object]:
    """The PD fields the router adds to a request for this prefill."""
    port = prefill.bootstrap_port or DEFAULT_BOOTSTRAP_PORT
    return {
        "bootstrap_host": urlsplit(prefill.url).hostname,
        "bootstrap_port": port,
        "bootstrap_room": room,
    }


async def _prefill_exchange(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, object],
    api_key: str | None,
    group: GroupSection,
) -> str:
    """POST to the prefill and drain its answer: "" when 2xx, else what went wrong."""
    probe = group.probe
    timeout = httpx.Timeout(
        connect=probe.connect_timeout_seconds,
        read=probe.timeout_seconds,
        write=probe.connect_timeout_seconds,
        pool=probe.connect_timeout_seconds,
    )
    headers = {"Accept": "text/event-stream", **ACCEPT_ENCODING, **auth_headers(api_key)}
    headers_received = False
    try:
        async with client.stream(
            "POST", url, json=body, headers=headers, timeout=timeout
        ) as response:
            headers_received = True
            await read_capped(response, PREFILL_BODY_MAX_BYTES)
            if not 200 <= response.status_code < 300:
                return f"prefill answered HTTP {response.status_code}"
    except httpx.TransportError as exc:
        failure = transport_failure(exc, headers_received=headers_received)
        return f"prefill {failure}: {describe(exc)}"
    except httpx.HTTPError as exc:
        return f"prefill {describe(exc)}"
    return ""


async def run_direct_probe(
    client: httpx.AsyncClient,
    group: GroupSection,
    pair: Pair,
    *,
    api_key: str | None,
    clock: Clock = time.time,
    dp_rank: int | None = None,
) -> ProbeResult:
    """One direct PD exchange with `pair` (the decode's `dp_rank` only, when given); a failing
    target is a result, never an exception."""
    prefill = group.prefills[pair.prefill]
    decode = group.workers(Role.DECODE)[pair.decode]
    request_id = new_request_id(group.name, "direct")
    body = request_body(group.probe, request_id, path=DIRECT_PATH)
    body.update(bootstrap_fields(prefill, secrets.randbelow(ROOM_LIMIT)))
    to_prefill = asyncio.create_task(
        _prefill_exchange(client, prefill.url + DIRECT_PATH, body, api_key, group)
    )
    if dp_rank is not None:
        body = {**body, group.probe.dp_rank_field: dp_rank}
    try:
        exchange = await stream_exchange(
            client,
            group,
            body,
            kind=ProbeKind.DIRECT,
            request_id=request_id,
            api_key=api_key,
            clock=clock,
            path=DIRECT_PATH,
            url=decode.url + DIRECT_PATH,
            abort_urls=(prefill.url, decode.url),
            target=str(Role.DECODE),
        )
        prefill_error = ""
        if exchange.result.ok:
            # The prefill answers once its KV is sent, before decode's first token: it is done
            # or nearly; the whole probe still keeps to its deadline.
            left = group.probe.timeout_seconds - exchange.result.duration_seconds
            try:
                async with asyncio.timeout(max(left, 0.0)):
                    prefill_error = await asyncio.shield(to_prefill)
            except TimeoutError:
                prefill_error = "prefill answered nothing within the deadline"
    finally:
        to_prefill.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await to_prefill
    result = replace(exchange.result, worker=pair.decode, peer=pair.prefill, dp_rank=dp_rank)
    name = pair_name(group, pair) + ("" if dp_rank is None else f" dp_rank {dp_rank}")
    if prefill_error:
        return replace(
            result, ok=False, reason=ProbeFailure.HTTP_ERROR, detail=f"{name}: {prefill_error}"
        )
    return replace(result, detail=f"{name}: {result.detail}" if result.detail else "")
