"""Probes, scrapes and observations through the real sglang-router in front of simulated workers.

Every probe failure class is produced here by the real router: the simulated stack (pdsim/)
for the PD failures it models, and hand-written fake workers behind the same router for streams
the simulation never sends (malformed events, empty output, a stream cut short).
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdsim.stack import (
    PDStack,
    StackConfig,
    default_router,
    free_ports,
    router_command,
    stop_pid,
    wait_for_status,
)
from tests.pdsim.helpers import wait_until
from tests.unit.fakerouter import FakeStack, running_fake
from watchdog.config import GroupSection, parse_config
from watchdog.model import ProbeFailure, ProbeKind, ProbeResult, Role, ScrapeFailure
from watchdog.observe.observer import GroupObserver
from watchdog.observe.probes.completion import run_completion_probe
from watchdog.observe.probes.multiround import run_multiround_probe
from watchdog.observe.probes.scheduler import ProbeScheduler
from watchdog.observe.scrape import scrape_metrics

TP = 8
# The router under test (PDSIM_ROUTER); where the two differ, the expectation names the router.
ROUTER = default_router()


@pytest.fixture(scope="module")
def pdsim_config() -> StackConfig:
    """TP=8, so failure counters exist on eight ranks; no decode reports that would unfreeze gauges."""
    return StackConfig(tp_size=TP, decode_args=("--decode-log-interval", "100000"))


def group_of(
    prefill_url: str,
    decode_url: str,
    router_url: str,
    router_metrics_url: str | None = None,
    **probe: Any,
) -> GroupSection:
    """A validated group for a stack, with short probe timeouts (tests wait for them)."""
    settings = {
        # The served model's name: smg routes /v1/* requests by their model and answers any other
        # name 503 no_available_workers; sglang-router 0.3.2 ignores it (docs/sglang.md §7.9).
        "model": "pdsim",
        "timeout_seconds": 3.0,
        "stream_idle_seconds": 1.0,
        # Connecting to loopback succeeds or is refused at once: a connect timeout here only
        # fires on a starved machine, and no test waits for one.
        "connect_timeout_seconds": 10.0,
        "health_timeout_seconds": 2.0,
        "scrape_timeout_seconds": 2.0,
        **probe,
    }
    router: dict[str, Any] = {"unit": "r.service", "url": router_url}
    if router_metrics_url:
        router["metrics_url"] = router_metrics_url
    data = {
        "group": [
            {
                "name": "sim",
                "prefill": {"unit": "p.service", "url": prefill_url},
                "decode": {"unit": "d.service", "url": decode_url},
                "router": router,
                "probe": settings,
            }
        ]
    }
    return parse_config(data, "<test>").group[0]


def stack_group(stack: PDStack, **probe: Any) -> GroupSection:
    """The group of the simulated stack."""
    return group_of(
        stack.prefill_url, stack.decode_url, stack.router_url, stack.router_metrics_url, **probe
    )


@pytest.fixture
async def client(pd_stack: PDStack) -> AsyncIterator[httpx.AsyncClient]:
    """The watchdog's client; the shared stack is left without faults or stuck requests."""
    async with httpx.AsyncClient(trust_env=False) as c:
        yield c
    for role in ("prefill", "decode"):
        await asyncio.to_thread(pd_stack.clear_faults, role)
        await asyncio.to_thread(pd_stack.release_stuck, role)


def aborted_rids(stack: PDStack, role: str) -> list[str]:
    """The request ids a simulated worker received /abort_request for."""
    return list(stack.sim_state(role)["aborted_rids"])


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate"])
async def test_healthy_stack_passes(
    pd_stack: PDStack, client: httpx.AsyncClient, path: str
) -> None:
    """Through the router, each path streams tokens: ok with TTFT and the token count."""
    result = await run_completion_probe(client, stack_group(pd_stack, path=path), api_key=None)
    assert result.ok, result.detail
    assert result.ttft_seconds is not None
    assert result.tokens == 4


async def test_observation_of_a_healthy_stack(pd_stack: PDStack, client: httpx.AsyncClient) -> None:
    """One observation: probe, health, three scrapes (router included), live loads with a clock."""
    # A request finished first: decode's request counter is absent from its page until one has
    # (the observation's own probe runs beside its scrapes). Without it the test passed only
    # after another test of the module had sent one.
    warm = await run_completion_probe(client, stack_group(pd_stack), api_key=None)
    assert warm.ok, warm.detail
    cycle = await GroupObserver(stack_group(pd_stack), client).observe()
    obs = cycle.observation
    assert [p.ok for p in obs.probes] == [True]
    assert all(h.ok for h in obs.health)
    assert [m.role for m in obs.metrics] == [Role.PREFILL, Role.DECODE, Role.ROUTER]
    assert all(m.ok and m.malformed_lines == 0 for m in obs.metrics)
    decode = obs.metrics_for(Role.DECODE)
    assert decode is not None
    assert decode.requests_total is not None
    assert decode.realtime_tokens_total is not None
    router = obs.metrics_for(Role.ROUTER)
    assert router is not None
    assert router.workers_unhealthy == 0
    assert all(x.ok and x.timestamp is not None for x in obs.loads)
    assert cycle.raw_metrics[Role.PREFILL]


async def test_unexpected_output(pd_stack: PDStack, client: httpx.AsyncClient) -> None:
    """A correct-looking stream whose text misses expect_regex is unexpected_output."""
    group = stack_group(pd_stack, expect_regex="^definitely not$")
    result = await run_completion_probe(client, group, api_key=None)
    assert result.reason == ProbeFailure.UNEXPECTED_OUTPUT


async def test_decode_hang_before_headers_is_aborted(
    pd_stack: PDStack, client: httpx.AsyncClient
) -> None:
    """A decode that never answers: timeout_before_headers, and both workers take the abort.

    Aborts match only requests a worker has (docs/sglang.md §7.2): prefill holds the request in
    its bootstrap queue, and the hung decode's tokenizer registered the rid before the request
    reached its scheduler, so the abort is a real match on both."""
    await asyncio.to_thread(pd_stack.set_fault, "decode", "decode_hang_before_headers")
    result = await run_completion_probe(client, stack_group(pd_stack), api_key=None)
    assert result.reason == ProbeFailure.TIMEOUT_BEFORE_HEADERS
    assert result.request_id in await asyncio.to_thread(aborted_rids, pd_stack, "prefill")
    assert result.request_id in await asyncio.to_thread(aborted_rids, pd_stack, "decode")


async def test_transfer_stall_is_aborted(pd_stack: PDStack, client: httpx.AsyncClient) -> None:
    """A KV transfer that never completes (everything says 200): timeout_before_headers + abort."""
    await asyncio.to_thread(pd_stack.set_fault, "prefill", "transfer_stall")
    group = stack_group(pd_stack, timeout_seconds=1.5, stream_idle_seconds=1.5)
    result = await run_completion_probe(client, group, api_key=None)
    assert result.reason == ProbeFailure.TIMEOUT_BEFORE_HEADERS
    assert result.request_id in await asyncio.to_thread(aborted_rids, pd_stack, "decode")
    health = await GroupObserver(group, client, observe_loads=False).observe()
    assert all(h.ok for h in health.observation.health)  # /health never sees the transfer path


async def test_decode_stall_midstream_is_aborted(
    pd_stack: PDStack, client: httpx.AsyncClient
) -> None:
    """Two tokens, then nothing: stalled_midstream with the first token's TTFT, then the abort."""
    await asyncio.to_thread(pd_stack.set_fault, "decode", "decode_stall_midstream", after_tokens=2)
    result = await run_completion_probe(client, stack_group(pd_stack), api_key=None)
    assert result.reason == ProbeFailure.STALLED_MIDSTREAM
    assert result.status_code == 200
    assert result.ttft_seconds is not None
    assert result.tokens == 2
    assert result.request_id in await asyncio.to_thread(aborted_rids, pd_stack, "decode")


async def test_degraded_bootstrap_is_http_error_and_counted_once_per_request(
    pd_stack: PDStack, client: httpx.AsyncClient
) -> None:
    """Failed handoffs give http_error; the failure counter grows per request, not per TP rank."""
    group = stack_group(pd_stack)
    before = await scrape_metrics(
        client, Role.PREFILL, f"{pd_stack.prefill_url}/metrics", timeout_seconds=2
    )
    await asyncio.to_thread(pd_stack.set_fault, "prefill", "degraded_bootstrap", fraction=1.0)
    result = await run_completion_probe(client, group, api_key=None)
    await asyncio.to_thread(pd_stack.clear_faults, "prefill")
    after = await scrape_metrics(
        client, Role.PREFILL, f"{pd_stack.prefill_url}/metrics", timeout_seconds=2
    )
    assert result.reason == ProbeFailure.HTTP_ERROR
    assert result.status_code is not None
    assert result.status_code >= 500
    grown = after.snapshot.transfer_failed - before.snapshot.transfer_failed
    # The router tries up to five times; each try fails once, on every one of the eight ranks.
    assert 1 <= grown <= 5


async def test_router_down_is_connect_refused(pd_stack: PDStack, client: httpx.AsyncClient) -> None:
    """With the router process gone, the probe is connect_refused."""
    await asyncio.to_thread(pd_stack.controller.stop, "router")
    try:
        result = await run_completion_probe(client, stack_group(pd_stack), api_key=None)
    finally:
        await asyncio.to_thread(pd_stack.restart, "router")
    assert result.reason == ProbeFailure.CONNECT_REFUSED
    assert "refused" in result.detail


async def test_decode_down_then_restarted_resets_counters(
    pd_stack: PDStack, client: httpx.AsyncClient
) -> None:
    """Decode gone: http_error with the router's error code; restarted: its counters reset."""
    group = stack_group(pd_stack)
    # Served before the restart, so the restarted decode's counters start visibly lower even when
    # this test runs first: failures it sees after the restart are finished requests too
    # (docs/sglang.md §7.3).
    for _ in range(3):
        warm = await run_completion_probe(client, group, api_key=None)
        assert warm.ok, warm.detail
    observer = GroupObserver(group, client)
    first = await observer.observe()
    assert first.observation.probes[0].ok
    await asyncio.to_thread(pd_stack.controller.stop, "decode")
    seen: list[str | None] = []

    async def router_says_no_decode() -> bool:
        result = await run_completion_probe(client, group, api_key=None)
        seen.append(result.error_code)
        if ROUTER == "smg":
            # smg answers 502 "PD disaggregation request failed" (its x-smg-error-code is that
            # message) until its health check marks the decode unhealthy, then no_available_workers.
            return result.error_code == "no_available_workers"
        return result.reason == ProbeFailure.HTTP_ERROR and result.error_code is not None

    try:
        await wait_until(router_says_no_decode, timeout_s=20, interval_s=0.2)
    finally:
        await asyncio.to_thread(pd_stack.restart, "decode")
    if ROUTER == "smg":
        assert set(seen) <= {"PD disaggregation request failed", "no_available_workers"}, seen
        assert seen[-1] == "no_available_workers"
    else:
        assert seen[-1] == "server_selection_failed"

    async def probe_passes() -> bool:
        return (await run_completion_probe(client, group, api_key=None)).ok

    try:
        await wait_until(probe_passes, timeout_s=20, interval_s=0.2)
        after = await observer.observe()
        delta = after.deltas_for(Role.DECODE)
        assert delta is not None
        assert delta.reset  # the restarted decode's counters started again from zero
        prefill = after.deltas_for(Role.PREFILL)
        assert prefill is not None
        assert not prefill.reset
    finally:
        # That was a decode-only restart: the simulated prefill now counts a second decode
        # incarnation and degrades its transfers, as SGLang's bootstrap state does (docs/sglang.md
        # §6). Co-restart so the module's later tests get a clean stack, not random KV failures.
        await pd_stack.aco_restart()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/generate"])
async def test_multiround_through_the_router(
    pd_stack: PDStack, client: httpx.AsyncClient, path: str
) -> None:
    """A three-round conversation passes, every round adding to the context."""
    result = await run_multiround_probe(
        client, stack_group(pd_stack, path=path, multiround_rounds=3), api_key=None
    )
    assert result.ok, result.detail
    assert result.kind == ProbeKind.MULTIROUND
    assert result.tokens == 12


async def test_garbage_metrics_and_hung_health_are_recorded(
    pd_stack: PDStack, client: httpx.AsyncClient
) -> None:
    """A half-garbage /metrics is parsed with the bad lines counted; a hung /health is a timeout."""
    await asyncio.to_thread(pd_stack.set_fault, "prefill", "metrics_garbage")
    await asyncio.to_thread(pd_stack.set_fault, "decode", "health_hang")
    obs = (await GroupObserver(stack_group(pd_stack), client).observe()).observation
    prefill = obs.metrics_for(Role.PREFILL)
    assert prefill is not None
    assert prefill.ok
    assert prefill.malformed_lines > 0
    decode_health = obs.health_for("decode")
    assert decode_health is not None
    assert decode_health.reason == ProbeFailure.TIMEOUT
    assert obs.probes[0].ok  # /health hanging says nothing about serving


async def test_scheduler_keeps_probing_through_a_stall(
    pd_stack: PDStack, client: httpx.AsyncClient
) -> None:
    """During a stall probes keep starting every period, at most max_in_flight at once, each aborted."""
    await asyncio.to_thread(pd_stack.set_fault, "prefill", "transfer_stall")
    group = stack_group(
        pd_stack,
        # A deadline 15 periods long: the loop, waking every period, sees two probes pending
        # long before either times out, however late a busy machine wakes it (at 1 s, two
        # starts and one timeout could fall between the wake-ups of a loaded run).
        period_seconds=0.2,
        timeout_seconds=3.0,
        stream_idle_seconds=3.0,
        max_in_flight=2,
        multiround_every_seconds=0,
        direct_on_failure=False,  # completion probes only: direct ones are tested elsewhere
    )
    scheduler = ProbeScheduler(group, client, api_key=None)
    results: list[ProbeResult] = []
    most_in_flight = 0

    async def three_failures_and_a_skip() -> bool:
        nonlocal most_in_flight
        most_in_flight = max(most_in_flight, scheduler.in_flight)
        results.extend(scheduler.drain_finished())
        return len(results) >= 3 and scheduler.skipped_starts > 0

    async with asyncio.TaskGroup() as tasks:
        runner = tasks.create_task(scheduler.run())
        try:
            await wait_until(three_failures_and_a_skip, timeout_s=120, interval_s=0.05)
        finally:
            runner.cancel()
    assert most_in_flight <= 2
    assert scheduler.skipped_starts > 0
    assert all(r.reason == ProbeFailure.TIMEOUT_BEFORE_HEADERS for r in results)
    aborted = set(await asyncio.to_thread(aborted_rids, pd_stack, "decode"))
    assert {r.request_id for r in results} <= aborted


@pytest.mark.parametrize(("version", "tp"), [("0.4.10", 2), ("0.5.5", 2)])
async def test_older_versions_scrape_with_aliases(
    pd_stack_factory: Any, version: str, tp: int
) -> None:
    """0.4.10 (`infight` typo) and 0.5.5 (prealloc) queues are read; /v1/loads is unsupported."""
    stack: PDStack = await asyncio.to_thread(
        pd_stack_factory, sglang_version=version, tp_size=tp, with_router=False
    )
    async with httpx.AsyncClient(trust_env=False) as client:
        group = group_of(stack.prefill_url, stack.decode_url, "http://127.0.0.1:9")
        cycle = await GroupObserver(group, client).observe()
    prefill = cycle.observation.metrics_for(Role.PREFILL)
    assert prefill is not None
    assert prefill.ok
    assert prefill.inflight_queue == 0.0
    assert prefill.bootstrap_queue == 0.0
    assert [x.error for x in cycle.observation.loads] == [ScrapeFailure.UNSUPPORTED] * 2


# --- Hand-written fake workers behind the real router, for streams the simulation never sends ---


class RouterProcess:
    """The real sglang-router in PD mode in front of two fake workers; stopped by PID."""

    def __init__(self, prefill: FakeStack, decode: FakeStack, log: Path) -> None:
        port, metrics_port, bootstrap_port = free_ports(3)
        self.url = f"http://127.0.0.1:{port}"
        argv = router_command(
            prefill_url=prefill.base_url,
            bootstrap_port=bootstrap_port,
            decode_url=decode.base_url,
            port=port,
            metrics_port=metrics_port,
        )
        with log.open("ab") as out:
            self.popen = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def stop(self) -> None:
        stop_pid(self.popen.pid)
        self.popen.wait(timeout=10)


@contextlib.asynccontextmanager
async def fakes_behind_router(log: Path) -> AsyncIterator[tuple[FakeStack, GroupSection]]:
    """(fake decode, group): a well-behaved fake prefill, a scriptable fake decode, the real
    router, its output in `log`; all stopped at the end."""
    async for prefill in running_fake():
        async for decode in running_fake():
            router = RouterProcess(prefill, decode, log)
            try:
                ready = await asyncio.to_thread(
                    wait_for_status, f"{router.url}/readiness", timeout_s=30
                )
                assert ready, log.read_text(errors="replace")[-2000:]
                yield decode, group_of(prefill.base_url, decode.base_url, router.url)
            finally:
                await asyncio.to_thread(router.stop)


@pytest.fixture
async def fake_behind_router(tmp_path: Path) -> AsyncIterator[tuple[FakeStack, GroupSection]]:
    """(fake decode, group): fakes_behind_router for one test."""
    async with fakes_behind_router(tmp_path / "router.log") as stack:
        yield stack


# A decode stream cut mid-way. smg ends the client's stream with
# `data: {"error": {"type": "stream_error", ...}}` and [DONE], which the probe reads as an error
# event (http_error). sglang-router 0.3.2 has already answered 200 and forwards the body as it
# comes; when that body fails, its HTTP server drops the client's connection. Whether the head and
# the first events left before that is a race inside the router (both seen on an idle machine and
# in CI, the router logging 200 either way): the client sees a stream cut without [DONE]
# (malformed), or a connection closed with no answer at all (connect_error, its detail httpx's
# "Server disconnected without sending a response"). docs/sglang.md §7.9.
TRUNCATED = {
    "sglang-router": frozenset({ProbeFailure.MALFORMED, ProbeFailure.CONNECT_ERROR}),
    "smg": frozenset({ProbeFailure.HTTP_ERROR}),
}[ROUTER]
BAD_STREAMS = [
    ("malformed", "/v1/completions", frozenset({ProbeFailure.MALFORMED})),
    ("truncated", "/v1/chat/completions", TRUNCATED),
    ("empty", "/v1/completions", frozenset({ProbeFailure.EMPTY_OUTPUT})),
    ("empty", "/v1/chat/completions", frozenset({ProbeFailure.EMPTY_OUTPUT})),
    ("empty", "/generate", frozenset({ProbeFailure.EMPTY_OUTPUT})),
    ("ok", "/generate", frozenset({ProbeFailure.OK})),
]

# How httpx words a connection the server closed after the request, before any response.
DROPPED_UNANSWERED = "RemoteProtocolError: Server disconnected without sending a response"


def _never_reached(result: ProbeResult) -> bool:
    """The probe's connection failed before the router took its request (not a router answer)."""
    return result.reason == ProbeFailure.CONNECT_ERROR and DROPPED_UNANSWERED not in result.detail


async def test_bad_streams_through_the_real_router(
    fake_behind_router: tuple[FakeStack, GroupSection],
) -> None:
    """What a decode streams reaches the probe through the router and is classified the same."""
    decode, group = fake_behind_router
    unexpected = []
    details: list[str] = []
    async with httpx.AsyncClient(trust_env=False) as client:
        for mode, path, expected in BAD_STREAMS:
            decode.mode = mode
            probe = group.probe.model_copy(update={"path": path})
            # What is classified here is what the router made of the decode's stream; a
            # connection that failed before the router took the request is not, so such an
            # attempt is retried, and kept in the details.
            for _attempt in range(3):
                result = await run_completion_probe(
                    client, group.model_copy(update={"probe": probe}), api_key=None
                )
                details.append(f"{mode} {path}: {result.reason} ({result.detail})")
                if not _never_reached(result):
                    break
            if result.reason not in expected or _never_reached(result):
                unexpected.append((mode, path, result.reason))
    assert unexpected == [], "\n".join(details)


# --- What each router forwards and retries (docs/sglang.md §7.9) ---

RID_PATHS = ("/v1/completions", "/v1/chat/completions", "/generate")


def _body(path: str, rid: str, *, stream: bool) -> dict[str, Any]:
    if path == "/generate":
        return {
            "text": "hi",
            "sampling_params": {"max_new_tokens": 3},
            "rid": rid,
            "stream": stream,
        }
    body: dict[str, Any] = {"model": "pdsim", "max_tokens": 3, "rid": rid, "stream": stream}
    if path == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    return body


async def test_which_paths_forward_the_rid(
    fake_behind_router: tuple[FakeStack, GroupSection],
) -> None:
    """Both routers forward `rid` on /v1/completions and /generate; on /v1/chat/completions
    sglang-router 0.3.2 drops it (the decode never sees it) and smg forwards it."""
    decode, group = fake_behind_router
    received = {}
    async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
        for path in RID_PATHS:
            rid = f"rid-{path.strip('/').replace('/', '-')}"
            response = await client.post(
                str(group.router.url).rstrip("/") + path,
                json=_body(path, rid, stream=False),
            )
            assert response.status_code == 200, response.text
            received[path] = decode.requests_to(path)[-1].body.get("rid") == rid
    chat_forwarded = {"sglang-router": False, "smg": True}[ROUTER]
    assert received == {
        "/v1/completions": True,
        "/v1/chat/completions": chat_forwarded,
        "/generate": True,
    }


async def test_chat_rid_reaches_the_simulated_decode(
    pd_stack: PDStack, client: httpx.AsyncClient
) -> None:
    """Through the router to pdsim: a chat response id is `chatcmpl-<rid>` only where the rid got
    through (smg); sglang-router 0.3.2 drops it and the decode makes up its own id."""
    body = _body("/v1/chat/completions", "chat-rid-1234", stream=False)
    response = await client.post(f"{pd_stack.router_url}/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    response_id = response.json()["id"]
    if ROUTER == "smg":
        assert response_id == "chatcmpl-chat-rid-1234"
    else:
        assert "chat-rid-1234" not in response_id


@pytest.mark.parametrize(
    ("mode", "status", "tries"),
    [
        # HTTP 200 whose first event is `data: {"error": ...}` (docs/sglang.md §7.7): passed on as is.
        ("error_event", 200, 1),
        # A 500 is retried: the first try and four retries (--retry-max-retries 5), then relayed.
        ("http_500", 500, 5),
    ],
)
async def test_error_stream_is_not_retried_and_a_500_is(
    fake_behind_router: tuple[FakeStack, GroupSection], mode: str, status: int, tries: int
) -> None:
    """Neither router retries an HTTP-200 error stream; both retry a 500 (same counts); the
    probe calls both http_error."""
    decode, group = fake_behind_router
    decode.mode = mode
    path = "/v1/completions"
    url = str(group.router.url).rstrip("/") + path
    async with httpx.AsyncClient(trust_env=False, timeout=20) as client:
        response = await client.post(url, json=_body(path, f"retry-{mode}", stream=True))
        assert response.status_code == status
        assert len(decode.requests_to(path)) == tries
        result = await run_completion_probe(client, group, api_key=None)
    assert result.reason == ProbeFailure.HTTP_ERROR, result.detail
    assert len(decode.requests_to(path)) == 2 * tries
