"""Hostile bodies: every read from the network stops at its cap, and the result is a failure.

Each server here is plain asyncio on 127.0.0.1 (tests/unit/rawhttp.py) writing bodies of hundreds
of MiB or GiB lazily, so neither side ever holds them; the assertions check both that the cap was
applied and how little the server got to send before the watchdog hung up.
"""

from __future__ import annotations

import asyncio
import gzip
import itertools
import json
import threading
import time
import zlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import httpx
import pytest
from httpx._decoders import LineDecoder  # the reference line splitting
from hypothesis import given
from hypothesis import strategies as st

from tests.unit.fakerouter import group_for
from tests.unit.rawhttp import Handler, Request, response_head, serve, write_full
from watchdog.act.restarters import READY_BODY_MAX_BYTES, HttpReadiness
from watchdog.model import (
    MetricsSnapshot,
    ProbeFailure,
    ProbeKind,
    ProbeResult,
    RestartStep,
    Role,
    ScrapeFailure,
)
from watchdog.observe import scrape
from watchdog.observe.bounded import (
    PARSE_ON_LOOP_MAX_BYTES,
    PARSES_AT_ONCE,
    CapExceeded,
    ParseBusy,
    ParseSlot,
    _LineSplitter,
    aiter_decoded,
    parse_sized,
    read_capped,
    size_text,
)
from watchdog.observe.observer import GroupObserver
from watchdog.observe.probes import completion
from watchdog.observe.probes.completion import run_completion_probe
from watchdog.observe.probes.health import ERROR_BODY_MAX_BYTES, HEALTH_BODY_MAX_BYTES, check_health
from watchdog.observe.scrape import fetch_loads, scrape_metrics
from watchdog.observe.sglang_metrics import extract_snapshot

MIB = 2**20
GIB = 2**30
CHUNK = b"x" * (64 * 1024)
ZEROS = bytes(MIB)
# The reads that must stop at a cap get this long: far past what a cap takes even on a machine
# whose cores are busy with other work, so a result before it is the cap's doing, never the
# deadline's (the reason and the bytes sent say which cap), and no assertion races the clock.
DEADLINE = 30.0
Writer = asyncio.StreamWriter


@dataclass
class Sent:
    """How many body bytes a hostile handler managed to write before the client hung up."""

    bytes: int = 0


async def write_forever(
    writer: Writer, sent: Sent, chunks: Callable[[], bytes], *, total: int, delay: float = 0.0
) -> None:
    """Write `chunks()` until `total` bytes went out or the client closed the connection."""
    while sent.bytes < total:
        chunk = chunks()
        writer.write(chunk)
        await writer.drain()
        sent.bytes += len(chunk)
        if delay:
            await asyncio.sleep(delay)


def plain(
    status: int,
    total: int,
    *,
    delay: float = 0.0,
    content_type: str = "text/plain",
    declare: bool = True,
) -> tuple[Handler, Sent]:
    """A handler sending `total` bytes of "x" under `status`, with a Content-Length or without."""
    sent = Sent()

    async def handle(_request: Request, writer: Writer) -> None:
        head = {"Content-Type": content_type}
        head.update({"Content-Length": str(total)} if declare else {"Connection": "close"})
        writer.write(response_head(status, head))
        await write_forever(writer, sent, lambda: CHUNK, total=total, delay=delay)

    return handle, sent


def _bomb_blocks() -> tuple[bytes, bytes]:
    """The gzip header with 1 MiB of zeros, and the next 1 MiB of zeros (~1 KiB each).

    After a full flush the compressor's state is the same each time, so one block repeated is a
    valid continuation: the bomb is generated lazily without compressing a GiB.
    """
    packer = zlib.compressobj(9, zlib.DEFLATED, zlib.MAX_WBITS | 16)
    first = packer.compress(ZEROS) + packer.flush(zlib.Z_FULL_FLUSH)
    block = packer.compress(ZEROS) + packer.flush(zlib.Z_FULL_FLUSH)
    return first, block


BOMB_FIRST, BOMB_BLOCK = _bomb_blocks()


def gzip_bomb(status: int = 200) -> tuple[Handler, Sent]:
    """1 GiB of zeros gzipped to about 1 MiB, sent block by block, no Content-Length.

    It never sends the gzip trailer: every reader under test stops at its cap long before.
    """
    sent = Sent()

    async def handle(_request: Request, writer: Writer) -> None:
        head = {"Content-Type": "text/plain", "Content-Encoding": "gzip", "Connection": "close"}
        writer.write(response_head(status, head) + BOMB_FIRST)
        total = len(BOMB_BLOCK) * (GIB // MIB - 1)
        await write_forever(writer, sent, lambda: BOMB_BLOCK, total=total)

    return handle, sent


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    """The client the watchdog uses: no proxies from the environment."""
    async with httpx.AsyncClient(trust_env=False) as c:
        yield c


# --- error bodies ---


async def test_a_200_mb_503_page_is_cut_at_the_error_cap(client: httpx.AsyncClient) -> None:
    """/health answering a 200 MB 503 page: a failed check; only the cap's worth is read."""
    handle, sent = plain(503, 200 * 10**6)
    async with serve({"/health": handle}) as server:
        url = f"{server.base_url}/health"
        started = time.monotonic()
        result = await check_health(client, "decode", url, timeout_seconds=DEADLINE)
    assert time.monotonic() - started < DEADLINE
    assert (result.ok, result.reason, result.status_code) == (False, ProbeFailure.HTTP_ERROR, 503)
    assert result.detail.startswith(f"{url}: HTTP 503 xxx")
    assert len(result.detail) < len(url) + 320
    assert sent.bytes < 20 * MIB  # the watchdog hung up early (socket buffers hold the rest)
    assert ERROR_BODY_MAX_BYTES == 4096


async def test_a_200_mb_503_metrics_page_keeps_only_its_start(client: httpx.AsyncClient) -> None:
    """A scrape of the same page: http_status, and at most 4 KiB of it kept as evidence."""
    handle, sent = plain(503, 200 * 10**6)
    async with serve({"/metrics": handle}) as server:
        result = await scrape_metrics(
            client, Role.DECODE, f"{server.base_url}/metrics", timeout_seconds=DEADLINE
        )
    assert result.snapshot.error == ScrapeFailure.HTTP_STATUS
    assert result.raw == b"x" * 4096
    assert sent.bytes < 20 * MIB


# --- decompressed size ---


async def test_a_gzip_bomb_stops_at_the_metrics_cap(client: httpx.AsyncClient) -> None:
    """1 MiB of gzip expanding to 1 GiB: payload_too_large at 16 MiB decoded."""
    handle, _sent = gzip_bomb()
    async with serve({"/metrics": handle}) as server:
        result = await scrape_metrics(
            client, Role.DECODE, f"{server.base_url}/metrics", timeout_seconds=DEADLINE
        )
    assert result.snapshot.error == ScrapeFailure.PAYLOAD_TOO_LARGE
    assert "16 MiB" in result.snapshot.detail
    assert result.raw is not None
    assert len(result.raw) == scrape.DEFAULT_MAX_BYTES


async def test_a_gzip_bomb_fails_a_health_check(client: httpx.AsyncClient) -> None:
    """A 200 /health whose body inflates without end is a failed (malformed) check."""
    handle, _sent = gzip_bomb()
    async with serve({"/health": handle}) as server:
        result = await check_health(
            client, "prefill", f"{server.base_url}/health", timeout_seconds=DEADLINE
        )
    assert (result.ok, result.reason) == (False, ProbeFailure.MALFORMED)
    assert f"exceeds the {size_text(HEALTH_BODY_MAX_BYTES)} cap" in result.detail


async def test_a_gzip_bomb_fails_a_readiness_attempt(client: httpx.AsyncClient) -> None:
    """Post-restart readiness: a /readiness bomb is "not ready", with the cap named."""
    handle, _sent = gzip_bomb()
    async with serve({"/readiness": handle}) as server:
        step = RestartStep(
            role=Role.ROUTER,
            unit="r.service",
            ready_url=f"{server.base_url}/readiness",
            ready_timeout_seconds=DEADLINE,
        )
        check = await HttpReadiness(client, attempt_timeout_seconds=DEADLINE).check(step)
    assert not check.ok
    assert f"exceeds the {size_text(READY_BODY_MAX_BYTES)} cap" in check.detail


async def test_nested_gzip_is_inflated_in_bounded_pieces(client: httpx.AsyncClient) -> None:
    """`gzip, gzip`: a few KiB that inflate to 64 MiB come out in pieces of at most 64 KiB."""
    inner = gzip.compress(bytes(64 * MIB), compresslevel=9)
    outer = gzip.compress(inner, compresslevel=9)
    assert len(outer) < 64 * 1024

    async def handle(_request: Request, writer: Writer) -> None:
        head = {"Content-Encoding": "gzip, gzip", "Content-Length": str(len(outer))}
        writer.write(response_head(200, head) + outer)
        await writer.drain()

    async with serve({"/x": handle}) as server:
        async with client.stream("GET", f"{server.base_url}/x") as response:
            sizes = [len(piece) async for piece in aiter_decoded(response)]
        async with client.stream("GET", f"{server.base_url}/x") as response:
            capped = await read_capped(response, MIB)
    assert sum(sizes) == 64 * MIB
    assert max(sizes) <= 64 * 1024
    assert capped.truncated
    assert capped.data == bytes(MIB)


async def test_deflate_raw_and_wrapped_are_both_read(client: httpx.AsyncClient) -> None:
    """`deflate` as the RFC says (zlib-wrapped) and as some servers send it (raw), like httpx."""
    wrapped = zlib.compress(b"hello")
    packer = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    raw = packer.compress(b"hello") + packer.flush()

    def sender(body: bytes) -> Handler:
        async def handle(_request: Request, writer: Writer) -> None:
            head = {"Content-Encoding": "deflate", "Content-Length": str(len(body))}
            writer.write(response_head(200, head) + body)
            await writer.drain()

        return handle

    async with serve({"/wrapped": sender(wrapped), "/raw": sender(raw)}) as server:
        for path in ("/wrapped", "/raw"):
            async with client.stream("GET", f"{server.base_url}{path}") as response:
                assert (await read_capped(response, 100)).data == b"hello"


async def test_a_corrupt_or_unknown_encoding_is_a_decoding_error(client: httpx.AsyncClient) -> None:
    """Garbage under `gzip`, or `br` we never asked for, raise httpx.DecodingError like httpx."""

    def sender(encoding: str) -> Handler:
        async def handle(_request: Request, writer: Writer) -> None:
            head = {"Content-Encoding": encoding, "Content-Length": "9"}
            writer.write(response_head(200, head) + b"not gzip!")
            await writer.drain()

        return handle

    async with serve({"/gzip": sender("gzip"), "/br": sender("br")}) as server:
        for path in ("/gzip", "/br"):
            async with client.stream("GET", f"{server.base_url}{path}") as response:
                with pytest.raises(httpx.DecodingError):
                    await read_capped(response, 100)


# --- health streaming a GiB ---


async def test_a_health_body_streaming_a_gib_fails_at_the_cap(client: httpx.AsyncClient) -> None:
    """A 200 /health sending 1 GiB slowly: failed once 64 KiB arrived, long before the timeout."""
    handle, sent = plain(200, GIB, delay=0.01)
    async with serve({"/health": handle}) as server:
        started = time.monotonic()
        result = await check_health(
            client, "decode", f"{server.base_url}/health", timeout_seconds=DEADLINE
        )
    assert time.monotonic() - started < DEADLINE
    assert (result.ok, result.reason, result.status_code) == (False, ProbeFailure.MALFORMED, 200)
    assert "exceeds the 64 KiB cap" in result.detail
    assert sent.bytes < 8 * MIB


# --- SSE ---


def sse(first: bytes, then: Callable[[], bytes]) -> Handler:
    """A 200 event stream sending `first`, then `then()` until the client hangs up (<= 1 GiB)."""

    async def handle(_request: Request, writer: Writer) -> None:
        head = {"Content-Type": "text/event-stream", "Connection": "close"}
        writer.write(response_head(200, head) + first)
        await writer.drain()
        await write_forever(writer, Sent(), then, total=GIB)

    return handle


async def _probe_against(client: httpx.AsyncClient, handle: Handler) -> tuple[float, ProbeResult]:
    async with serve({"/v1/completions": handle}) as server:
        group = group_for(server.base_url, timeout_seconds=DEADLINE, stream_idle_seconds=DEADLINE)
        started = time.monotonic()
        result = await run_completion_probe(client, group, api_key=None)
    return time.monotonic() - started, result


async def test_an_endless_sse_line_is_cut_at_the_cap(client: httpx.AsyncClient) -> None:
    """`data: xxxx…` without a newline: malformed once the line passes 1 MiB, not buffered on."""
    took, result = await _probe_against(client, sse(b"data: ", lambda: CHUNK))
    assert took < DEADLINE
    assert result.reason == ProbeFailure.MALFORMED
    assert "event stream line exceeds the 1 MiB cap" in result.detail
    assert result.abort_sent


async def test_an_endless_stream_of_comments_stops_at_the_body_cap(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keep-alive comments forever: malformed at the whole-stream cap (here lowered to 1 MiB)."""
    monkeypatch.setattr(completion, "STREAM_MAX_BYTES", MIB)
    took, result = await _probe_against(client, sse(b"", lambda: b": keep-alive\n" * 4096))
    assert took < DEADLINE
    assert result.reason == ProbeFailure.MALFORMED
    assert "event stream body exceeds the 1 MiB cap" in result.detail


async def test_a_deeply_nested_event_is_malformed(client: httpx.AsyncClient) -> None:
    """An event nested past the JSON parser's recursion limit is a malformed stream, not a crash."""
    deep = b"data: " + b"[" * 200_000 + b"]" * 200_000 + b"\n\n"

    async def handle(_request: Request, writer: Writer) -> None:
        head = {"Content-Type": "text/event-stream", "Connection": "close"}
        writer.write(response_head(200, head) + deep)
        await writer.drain()

    _took, result = await _probe_against(client, handle)
    assert result.reason == ProbeFailure.MALFORMED
    assert "nested too deeply" in result.detail


@given(
    text=st.text(alphabet="ab\r\n\x0b\u2028:", max_size=40),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=6),
)
def test_lines_split_as_httpx_splits_them(text: str, cuts: list[int]) -> None:
    """Under the cap, the capped splitter yields exactly httpx's aiter_lines() lines."""
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    parts = [text[a:b] for a, b in itertools.pairwise(bounds)]
    ours, theirs = _LineSplitter(1000), LineDecoder()
    got = [line for part in parts for line in ours.feed(part)] + ours.flush()
    want = [line for part in parts for line in theirs.decode(part)] + theirs.flush()
    assert got == want


def test_a_line_over_the_cap_raises_as_soon_as_it_is_seen() -> None:
    """The cap is checked on the unfinished line, piece by piece."""
    splitter = _LineSplitter(10)
    assert splitter.feed("ok\n01234") == ["ok"]
    with pytest.raises(CapExceeded, match="line exceeds the 10 bytes cap"):
        splitter.feed("567890")


# --- JSON replies ---


async def test_nested_json_from_loads_and_workers_is_a_recorded_failure(
    client: httpx.AsyncClient,
) -> None:
    """/v1/loads and router /workers nested 100 000 deep: a failed fetch, not a RecursionError."""
    deep = b"[" * 100_000 + b"]" * 100_000

    async def nested(_request: Request, writer: Writer) -> None:
        await write_full(writer, 200, deep, content_type="application/json")

    async def ok(_request: Request, writer: Writer) -> None:
        await write_full(writer, 200, b'{"status": "ready"}', content_type="application/json")

    async with serve({"/v1/loads": nested, "/workers": nested, "/readiness": ok}) as server:
        loads = await fetch_loads(client, Role.DECODE, server.base_url, timeout_seconds=DEADLINE)
        step = RestartStep(
            role=Role.ROUTER,
            unit="r.service",
            ready_url=f"{server.base_url}/readiness",
            ready_timeout_seconds=DEADLINE,
            expect_workers=("http://p", "http://d"),
        )
        check = await HttpReadiness(client, attempt_timeout_seconds=DEADLINE).check(step)
    assert (loads.ok, loads.error) == (False, ScrapeFailure.NOT_PROMETHEUS)
    assert not check.ok
    assert "nested too deeply" in check.detail


async def test_oversize_loads_and_workers_are_refused(client: httpx.AsyncClient) -> None:
    """/v1/loads and /workers past their 1 MiB caps: refused, with the cap named for /workers."""
    loads_handle, loads_sent = plain(200, GIB, content_type="application/json")
    workers_handle, _ = plain(200, GIB, content_type="application/json")

    async def ok(_request: Request, writer: Writer) -> None:
        await write_full(writer, 200, b"{}", content_type="application/json")

    routes = {"/v1/loads": loads_handle, "/workers": workers_handle, "/readiness": ok}
    async with serve(routes) as server:
        loads = await fetch_loads(client, Role.DECODE, server.base_url, timeout_seconds=DEADLINE)
        step = RestartStep(
            role=Role.ROUTER,
            unit="r.service",
            ready_url=f"{server.base_url}/readiness",
            ready_timeout_seconds=DEADLINE,
            expect_workers=("http://p",),
        )
        check = await HttpReadiness(client, attempt_timeout_seconds=DEADLINE).check(step)
    assert loads.error == ScrapeFailure.PAYLOAD_TOO_LARGE
    assert loads_sent.bytes < 20 * MIB
    assert not check.ok
    assert "exceeds the 1 MiB cap" in check.detail


# --- parsing off the loop ---


async def test_a_big_metrics_page_is_parsed_off_the_event_loop(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A page over 256 KiB is parsed in a worker thread; a small one on the loop as before."""
    threads: list[int] = []

    def spy(text: str, role: Role, scraped_at: float) -> MetricsSnapshot:
        threads.append(threading.get_ident())
        return extract_snapshot(text, role, scraped_at=scraped_at)

    monkeypatch.setattr(scrape, "extract_snapshot", spy)
    line = b'sglang:num_running_reqs{model_name="m",engine_type="unified"} 1.0\n'
    big = line * (PARSE_ON_LOOP_MAX_BYTES // len(line) + 10)

    async def page(body: bytes) -> Handler:
        async def handle(_request: Request, writer: Writer) -> None:
            await write_full(writer, 200, body)

        return handle

    routes = {"/big": await page(big), "/small": await page(line)}
    async with serve(routes) as server:
        for path in ("/big", "/small"):
            result = await scrape_metrics(
                client, Role.DECODE, f"{server.base_url}{path}", timeout_seconds=DEADLINE
            )
            assert result.snapshot.ok, result.snapshot.detail
    loop_thread = threading.get_ident()
    assert threads[0] != loop_thread
    assert threads[1] == loop_thread


async def test_parse_sized_runs_big_parses_in_a_thread() -> None:
    """The threshold decides where `parse` runs; exceptions come back to the caller."""
    here = threading.get_ident()
    assert await parse_sized(lambda _: threading.get_ident(), b"", 10) == here
    assert await parse_sized(lambda _: threading.get_ident(), b"", 10 * MIB) != here
    with pytest.raises(RecursionError):
        await parse_sized(json.loads, "[" * 100_000 + "]" * 100_000, 10 * MIB)


# --- a probe that raises ---


async def test_a_probe_that_raises_is_a_counted_failure_with_its_class(
    client: httpx.AsyncClient,
) -> None:
    """A router URL with a tab makes httpx raise InvalidURL: an internal_error probe result."""
    group = group_for("http://127.0.0.1:9")
    router = group.router.model_copy(update={"url": "http://127.0.0.1:9/a\tb"})
    group = group.model_copy(update={"router": router})
    observer = GroupObserver(group, client, observe_loads=False, deadline_seconds=DEADLINE)
    observation = (await observer.observe()).observation
    (probe,) = observation.probes
    assert (probe.ok, probe.kind, probe.reason) == (
        False,
        ProbeKind.COMPLETION,
        ProbeFailure.INTERNAL_ERROR,
    )
    assert "InvalidURL" in probe.detail
    readiness = next(h for h in observation.health if h.target == Role.ROUTER.value)
    assert readiness.reason == ProbeFailure.INTERNAL_ERROR
    assert "InvalidURL" in readiness.detail
    assert observer.internal_errors == 2


BIG = b"x" * (PARSE_ON_LOOP_MAX_BYTES + 1)


async def test_a_busy_parse_slot_refuses_and_counts() -> None:
    """While one parse holds a target's slot, another is refused (not queued) and counted;
    bodies small enough for the loop never need the slot."""
    slot = ParseSlot()
    release = threading.Event()
    running = asyncio.create_task(
        parse_sized(lambda d: release.wait(60) and len(d), BIG, len(BIG), slot)
    )
    try:
        async with asyncio.timeout(30):
            while not slot.busy:
                await asyncio.sleep(0.01)
        with pytest.raises(ParseBusy, match=r"still running \(1 refused so far\)"):
            await parse_sized(len, BIG, len(BIG), slot)
        assert slot.refused == 1
        assert await parse_sized(len, b"small", 5, slot) == 5
    finally:
        release.set()
    assert await running == len(BIG)
    assert not slot.busy
    assert await parse_sized(len, BIG, len(BIG), slot) == len(BIG)


async def test_big_parses_of_different_targets_run_one_at_a_time() -> None:
    """Two targets' big parses never overlap (bounded.PARSES_AT_ONCE): the second starts only
    once the first has ended, so eight 16 MiB pages never sit in a parse side by side."""
    assert PARSES_AT_ONCE == 1
    first_started, second_started = threading.Event(), threading.Event()

    def first(data: bytes) -> bool:
        first_started.set()
        # Generous: long enough for the second to start, were it allowed to; the result never
        # depends on the machine's speed when it is not.
        return second_started.wait(3.0)

    def second(data: bytes) -> int:
        second_started.set()
        return len(data)

    running = asyncio.create_task(parse_sized(first, BIG, len(BIG), ParseSlot()))
    async with asyncio.timeout(30):
        while not first_started.is_set():
            await asyncio.sleep(0.01)
    assert await parse_sized(second, BIG, len(BIG), ParseSlot()) == len(BIG)
    assert await running is False  # the second had not started while the first ran


async def test_a_parse_that_raises_or_cannot_start_frees_its_slot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The slot is the thread's to free whatever happens: an exception reaches the caller, a
    thread that could not start frees it at once."""
    slot = ParseSlot()

    def broken(data: bytes) -> int:
        raise ValueError("not a page")

    with pytest.raises(ValueError, match="not a page"):
        await parse_sized(broken, BIG, len(BIG), slot)
    assert not slot.busy

    def no_thread(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        await parse_sized(len, BIG, len(BIG), slot)
    assert not slot.busy
