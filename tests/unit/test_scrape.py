"""Scraping /metrics and /v1/loads from misbehaving targets: every failure is a recorded result."""

from __future__ import annotations

import asyncio
import json
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest

from pdsim.payloads import sglang_payload
from tests.unit.rawhttp import Request, response_head, serve, write_full
from tests.unit.rawhttp import refused_url as make_refused_url
from watchdog.model import Role, ScrapeFailure
from watchdog.observe.scrape import fetch_loads, parse_loads, scrape_metrics

PAYLOAD = sglang_payload("0.5.23", "decode", tp=8, transfer_failed_per_rank=[2] * 8).encode()


async def ok(_: Request, writer: asyncio.StreamWriter) -> None:
    """A target that answers the payload."""
    await write_full(writer, 200, PAYLOAD)


async def status_503(_: Request, writer: asyncio.StreamWriter) -> None:
    """A target that answers 503 with a large body."""
    await write_full(writer, 503, b"Service Unavailable" * 1000)


async def html(_: Request, writer: asyncio.StreamWriter) -> None:
    """A target that answers a login page instead of metrics."""
    await write_full(writer, 200, b"<html><body>login</body></html>", "text/html")


async def empty(_: Request, writer: asyncio.StreamWriter) -> None:
    """A target that answers 200 with an empty body."""
    await write_full(writer, 200, b"")


async def oversize_declared(_: Request, writer: asyncio.StreamWriter) -> None:
    """A target that declares a 64 MiB body and never sends it."""
    writer.write(response_head(200, {"Content-Length": str(64 * 2**20)}))
    await writer.drain()
    await asyncio.sleep(3600)  # never sends the body: the cap must not wait for it


async def oversize_chunked(_: Request, writer: asyncio.StreamWriter) -> None:
    """A target that streams chunks past the size cap."""
    writer.write(response_head(200, {"Transfer-Encoding": "chunked"}))
    chunk = b"sglang:num_running_reqs 1\n" * 2000
    for _chunk in range(100):
        writer.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
        await writer.drain()
    writer.write(b"0\r\n\r\n")
    await writer.drain()


async def slowloris(_: Request, writer: asyncio.StreamWriter) -> None:
    """A target that sends its body one byte at a time, each gap under the read timeout."""
    writer.write(response_head(200, {"Content-Length": str(len(PAYLOAD))}))
    for index in range(len(PAYLOAD)):
        writer.write(PAYLOAD[index : index + 1])
        await writer.drain()
        await asyncio.sleep(0.02)  # each gap is far below any read timeout


async def no_headers(_: Request, writer: asyncio.StreamWriter) -> None:
    """A target that accepts the request and never answers."""
    await asyncio.sleep(3600)


async def truncated(_: Request, writer: asyncio.StreamWriter) -> None:
    """A target that declares a length and closes after 100 bytes."""
    writer.write(response_head(200, {"Content-Length": str(len(PAYLOAD))}) + PAYLOAD[:100])
    await writer.drain()


# The page cut after the first digit of a value: HTTP-complete, the Prometheus text not.
_CUT_LINE = PAYLOAD.index(b"sglang:num_transfer_failed_reqs_total{")
CUT = PAYLOAD[: PAYLOAD.index(b"} ", _CUT_LINE) + 3]


async def cut_declared(_: Request, writer: asyncio.StreamWriter) -> None:
    """A target that declares a body cut mid-line as complete."""
    await write_full(writer, 200, CUT)


async def cut_at_close(_: Request, writer: asyncio.StreamWriter) -> None:
    """A target whose body, cut mid-line, ends where the connection closes."""
    # No Content-Length, no chunking: the body ends where the connection does (HTTP/1.0 style).
    head = {"Content-Type": "text/plain; version=0.0.4", "Connection": "close"}
    writer.write(response_head(200, head) + CUT)
    await writer.drain()


def gzip_prefix(page: bytes, end: int, *, finish: bool) -> bytes:
    """`page[:end]` gzipped as a server streams it: flushed, and closed only when `finish`."""
    compressor = zlib.compressobj(6, zlib.DEFLATED, zlib.MAX_WBITS | 16)
    data = compressor.compress(page[:end]) + compressor.flush(zlib.Z_SYNC_FLUSH)
    return data + compressor.flush() if finish else data


# Whole lines up to the failure series: a cut there decodes to text ending at a line boundary.
GZIP_CUT_AT_LINE = gzip_prefix(PAYLOAD, PAYLOAD.rindex(b"\n", 0, _CUT_LINE) + 1, finish=False)
GZIP_WHOLE = gzip_prefix(PAYLOAD, len(PAYLOAD), finish=True)


def gzip_at_close(body: bytes) -> Callable[[Request, asyncio.StreamWriter], Awaitable[None]]:
    """A target that sends the given gzip bytes, ending the body by closing the connection."""

    async def handler(_: Request, writer: asyncio.StreamWriter) -> None:
        head = {
            "Content-Type": "text/plain; version=0.0.4",
            "Content-Encoding": "gzip",
            "Connection": "close",
        }
        writer.write(response_head(200, head) + body)
        await writer.drain()

    return handler


async def loads_404(_: Request, writer: asyncio.StreamWriter) -> None:
    """A target without /v1/loads, as SGLang before 0.5.9."""
    await write_full(writer, 404, b'{"detail":"Not Found"}', "application/json")


LOADS = {
    "timestamp": 1790000000.25,
    "loads": [
        {
            "dp_rank": 0,
            "timestamp": 1790000000.5,
            "num_running_reqs": 3,
            "num_waiting_reqs": 1,
            "disaggregation": {
                "mode": "prefill",
                "prefill_bootstrap_queue_reqs": 2,
                "prefill_inflight_queue_reqs": 17,
                "decode_prealloc_queue_reqs": 0,
                "decode_transfer_queue_reqs": 0,
            },
        },
        {
            "dp_rank": 1,
            "timestamp": 1790000000.4,
            "num_running_reqs": 1,
            "num_waiting_reqs": 0,
            "disaggregation": {"mode": "prefill", "prefill_inflight_queue_reqs": 1},
        },
    ],
}


async def loads_ok(request: Request, writer: asyncio.StreamWriter) -> None:
    """A target whose /v1/loads answers the sample document when asked for the disagg section."""
    assert "include=disagg" in request.path
    await write_full(writer, 200, json.dumps(LOADS).encode(), "application/json")


async def loads_garbage(_: Request, writer: asyncio.StreamWriter) -> None:
    """A target whose /v1/loads answers HTML."""
    await write_full(writer, 200, b"<html>", "text/html")


ROUTES = {
    "/metrics": ok,
    "/status503": status_503,
    "/html": html,
    "/empty": empty,
    "/oversize_declared": oversize_declared,
    "/oversize_chunked": oversize_chunked,
    "/slowloris": slowloris,
    "/no_headers": no_headers,
    "/truncated": truncated,
    "/cut_declared": cut_declared,
    "/cut_at_close": cut_at_close,
    "/gzip_cut_at_line": gzip_at_close(GZIP_CUT_AT_LINE),
    "/gzip_whole": gzip_at_close(GZIP_WHOLE),
}


@pytest.fixture
async def base_url() -> AsyncIterator[str]:
    """A misbehaving metrics server on 127.0.0.1."""
    async with serve(ROUTES) as server:
        yield server.base_url


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    """The client the watchdog uses: no proxies from the environment."""
    async with httpx.AsyncClient(trust_env=False) as c:
        yield c


async def test_good_scrape(client: httpx.AsyncClient, base_url: str) -> None:
    """A 200 Prometheus body gives an ok snapshot, the raw body and the scrape's timing."""
    result = await scrape_metrics(
        client, Role.DECODE, f"{base_url}/metrics", timeout_seconds=10, clock=lambda: 42.0
    )
    assert result.snapshot.ok, result.snapshot.detail
    assert result.snapshot.transfer_failed == 2.0
    assert result.snapshot.scraped_at == 42.0
    assert result.snapshot.duration_seconds > 0
    assert result.raw == PAYLOAD


@pytest.mark.parametrize(
    ("path", "error", "detail"),
    [
        ("/status503", ScrapeFailure.HTTP_STATUS, "HTTP 503"),
        ("/html", ScrapeFailure.NOT_PROMETHEUS, "HTML"),
        ("/empty", ScrapeFailure.NOT_PROMETHEUS, "empty body"),
        ("/nothing_here", ScrapeFailure.HTTP_STATUS, "HTTP 404"),
    ],
)
async def test_bad_answers_are_recorded(
    client: httpx.AsyncClient, base_url: str, path: str, error: ScrapeFailure, detail: str
) -> None:
    """Non-200, HTML and empty bodies give a failed snapshot naming the URL and the reason."""
    result = await scrape_metrics(client, Role.PREFILL, f"{base_url}{path}", timeout_seconds=10)
    assert not result.snapshot.ok
    assert result.snapshot.error == error
    assert detail in result.snapshot.detail
    assert f"{base_url}{path}" in result.snapshot.detail
    assert result.snapshot.role == Role.PREFILL


async def test_error_body_is_kept_but_capped(client: httpx.AsyncClient, base_url: str) -> None:
    """The start of a non-200 body is kept as evidence, not the whole of it."""
    result = await scrape_metrics(client, Role.PREFILL, f"{base_url}/status503", timeout_seconds=10)
    assert result.raw is not None
    assert result.raw.startswith(b"Service Unavailable")
    assert len(result.raw) <= 4096


@pytest.mark.parametrize("path", ["/oversize_declared", "/oversize_chunked"])
async def test_oversize_bodies(client: httpx.AsyncClient, base_url: str, path: str) -> None:
    """A body over the cap (declared or streamed) is refused as payload_too_large."""
    result = await scrape_metrics(
        client, Role.DECODE, f"{base_url}{path}", timeout_seconds=30, max_bytes=2**20
    )
    assert result.snapshot.error == ScrapeFailure.PAYLOAD_TOO_LARGE
    assert result.raw is None or len(result.raw) <= 2**20


async def test_slowloris_hits_the_deadline(client: httpx.AsyncClient, base_url: str) -> None:
    """A server trickling its body never trips a per-read timeout, but the whole-scrape deadline."""
    result = await scrape_metrics(client, Role.DECODE, f"{base_url}/slowloris", timeout_seconds=0.5)
    assert result.snapshot.error == ScrapeFailure.TIMEOUT
    assert "bytes read" in result.snapshot.detail


async def test_no_headers_hits_the_deadline(client: httpx.AsyncClient, base_url: str) -> None:
    """A server that accepts and never answers is a timeout."""
    result = await scrape_metrics(
        client, Role.DECODE, f"{base_url}/no_headers", timeout_seconds=0.3
    )
    assert result.snapshot.error == ScrapeFailure.TIMEOUT


async def test_truncated_body(client: httpx.AsyncClient, base_url: str) -> None:
    """A connection closed mid-body is a transport error, not a crash and not a partial parse."""
    result = await scrape_metrics(client, Role.DECODE, f"{base_url}/truncated", timeout_seconds=10)
    assert not result.snapshot.ok
    assert result.snapshot.error == ScrapeFailure.CONNECT_ERROR


@pytest.mark.parametrize("path", ["/cut_declared", "/cut_at_close"])
async def test_body_cut_mid_line_is_a_failed_scrape(
    client: httpx.AsyncClient, base_url: str, path: str
) -> None:
    """A body cut mid-value, complete as HTTP (its length declared, or ended by the close), is
    a truncated scrape: its last value, a prefix of the real one, is never read. The body is
    kept as evidence."""
    assert not CUT.endswith(b"\n")
    result = await scrape_metrics(client, Role.DECODE, f"{base_url}{path}", timeout_seconds=10)
    assert not result.snapshot.ok
    assert result.snapshot.error == ScrapeFailure.TRUNCATED
    assert "line boundary" in result.snapshot.detail
    assert f"{base_url}{path}" in result.snapshot.detail
    assert result.raw == CUT


async def test_gzip_body_cut_at_a_line_boundary_is_a_failed_scrape(
    client: httpx.AsyncClient, base_url: str
) -> None:
    """SGLang gzips its page when asked (we ask). A gzip stream the connection ends early is
    cut short even where its text ends at a line boundary (the failure series never came):
    truncated, not a page without the series. The whole stream, served the same way, is ok."""
    cut = await scrape_metrics(
        client, Role.DECODE, f"{base_url}/gzip_cut_at_line", timeout_seconds=10
    )
    assert (cut.snapshot.ok, cut.snapshot.error) == (False, ScrapeFailure.TRUNCATED)
    assert cut.raw is not None
    assert cut.raw.endswith(b"\n")
    assert b"sglang:num_transfer_failed_reqs_total{" not in cut.raw
    whole = await scrape_metrics(client, Role.DECODE, f"{base_url}/gzip_whole", timeout_seconds=10)
    assert whole.snapshot.ok, whole.snapshot.detail
    assert whole.raw == PAYLOAD


async def test_connection_refused(client: httpx.AsyncClient) -> None:
    """Nothing listening: connect_refused."""
    url = f"{make_refused_url()}/metrics"
    result = await scrape_metrics(client, Role.ROUTER, url, timeout_seconds=5)
    assert result.snapshot.error == ScrapeFailure.CONNECT_REFUSED
    assert result.raw is None


async def test_loads_summed_over_dp_ranks(client: httpx.AsyncClient) -> None:
    """/v1/loads rows are summed over DP ranks; the newest scheduler timestamp is kept."""
    async with serve({"/v1/loads": loads_ok}) as server:
        loads = await fetch_loads(
            client, Role.PREFILL, server.base_url, timeout_seconds=5, clock=lambda: 7.0
        )
    assert loads.ok
    assert loads.fetched_at == 7.0
    assert loads.timestamp == 1790000000.5
    assert loads.running_reqs == 4
    assert loads.waiting_reqs == 1
    assert loads.prefill_inflight_queue_reqs == 18
    assert loads.prefill_bootstrap_queue_reqs == 2
    assert loads.decode_transfer_queue_reqs == 0


async def test_loads_unsupported_and_garbage(client: httpx.AsyncClient) -> None:
    """A server without /v1/loads is UNSUPPORTED; a non-JSON answer is recorded, not raised."""
    async with serve({"/v1/loads": loads_404}) as server:
        missing = await fetch_loads(client, Role.DECODE, server.base_url, timeout_seconds=5)
    async with serve({"/v1/loads": loads_garbage}) as server:
        garbage = await fetch_loads(client, Role.DECODE, server.base_url, timeout_seconds=5)
    refused = await fetch_loads(client, Role.DECODE, make_refused_url(), timeout_seconds=5)
    assert missing.error == ScrapeFailure.UNSUPPORTED
    assert garbage.error == ScrapeFailure.NOT_PROMETHEUS
    assert refused.error == ScrapeFailure.CONNECT_REFUSED


async def test_loads_sends_the_api_key_and_keeps_the_version(client: httpx.AsyncClient) -> None:
    """SGLang checks --api-key on /v1/loads: the key goes as a bearer token; `version` is kept."""
    seen: list[dict[str, str]] = []

    async def loads_with_key(request: Request, writer: asyncio.StreamWriter) -> None:
        seen.append(request.headers)
        if request.headers.get("authorization") != "Bearer sk-test":
            await write_full(writer, 401, b'{"error":"Unauthorized"}', "application/json")
            return
        body = json.dumps({**LOADS, "version": "0.5.23"}).encode()
        await write_full(writer, 200, body, "application/json")

    async with serve({"/v1/loads": loads_with_key}) as server:
        keyed = await fetch_loads(
            client, Role.PREFILL, server.base_url, timeout_seconds=5, api_key="sk-test"
        )
        unkeyed = await fetch_loads(client, Role.PREFILL, server.base_url, timeout_seconds=5)
    assert keyed.ok
    assert keyed.version == "0.5.23"
    assert unkeyed.error == ScrapeFailure.HTTP_STATUS
    assert "authorization" not in seen[1]


def test_parse_loads_shapes() -> None:
    """A bare list of rows, the ≤0.5.5 prealloc key, and nonsense shapes are all handled."""
    rows = [{"num_running_reqs": 2, "disaggregation": {"prefill_prealloc_queue_reqs": 5}}]
    snap = parse_loads(rows, Role.PREFILL, 1.0)
    assert snap.ok
    assert snap.prefill_bootstrap_queue_reqs == 5
    assert snap.timestamp is None
    assert snap.version is None
    assert not parse_loads("nope", Role.PREFILL, 1.0).ok
    assert not parse_loads({"loads": [1, 2]}, Role.PREFILL, 1.0).ok
