"""Completion, multi-round and health probes against a misbehaving fake: every failure class."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import structlog

from tests.unit.fakerouter import FakeStack, group_for, running_fake
from tests.unit.rawhttp import refused_url
from watchdog.errors import ConfigError
from watchdog.model import ProbeFailure, ProbeKind, Role
from watchdog.observe.probes import load_api_key
from watchdog.observe.probes.completion import run_completion_probe
from watchdog.observe.probes.health import check_health, health_url
from watchdog.observe.probes.multiround import run_multiround_probe

PATHS = ["/v1/completions", "/v1/chat/completions", "/generate"]


@pytest.fixture
async def fake() -> AsyncIterator[FakeStack]:
    """A fake router + workers on 127.0.0.1."""
    async for stack in running_fake():
        yield stack


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    """An httpx client that ignores proxy settings of the environment."""
    async with httpx.AsyncClient(trust_env=False) as c:
        yield c


@pytest.mark.parametrize("path", PATHS)
async def test_successful_probe_per_path(
    fake: FakeStack, client: httpx.AsyncClient, path: str
) -> None:
    """A streamed answer passes: TTFT, tokens, and a temperature-0 body carrying our request id."""
    group = group_for(fake.base_url, path=path, expect_regex="^ok")
    result = await run_completion_probe(client, group, api_key=None, clock=lambda: 100.0)
    assert result.ok, result.detail
    assert result.reason == ProbeFailure.OK
    assert result.kind == ProbeKind.COMPLETION
    assert result.started_at == 100.0
    assert result.ttft_seconds is not None
    assert result.tokens == 3
    (seen,) = fake.requests_to(path)
    assert seen.body["rid"] == result.request_id == seen.headers["x-request-id"]
    assert seen.body["stream"] is True
    if path == "/generate":
        assert seen.body["sampling_params"] == {"max_new_tokens": 4, "temperature": 0}
    else:
        assert seen.body["temperature"] == 0
        assert seen.body["max_tokens"] == 4
    assert "authorization" not in {k.lower() for k in seen.headers}
    assert fake.requests_to("/abort_request") == []


async def test_request_ids_are_unique(fake: FakeStack, client: httpx.AsyncClient) -> None:
    """Every probe carries its own request id."""
    group = group_for(fake.base_url)
    ids = {(await run_completion_probe(client, group, api_key=None)).request_id for _ in range(3)}
    assert len(ids) == 3


async def test_connect_refused(client: httpx.AsyncClient) -> None:
    """Nothing listening on the router port: connect_refused, no abort attempted there."""
    group = group_for(refused_url())
    result = await run_completion_probe(client, group, api_key=None)
    assert not result.ok
    assert result.reason == ProbeFailure.CONNECT_REFUSED
    assert "abort_request" not in result.detail


async def test_timeout_before_headers_aborts_on_both_workers(
    fake: FakeStack, client: httpx.AsyncClient
) -> None:
    """No headers within the deadline: timeout_before_headers, then abort_request by rid."""
    fake.mode = "hang_before_headers"
    group = group_for(fake.base_url, timeout_seconds=2.0, stream_idle_seconds=1.0)
    result = await run_completion_probe(client, group, api_key=None)
    assert result.reason == ProbeFailure.TIMEOUT_BEFORE_HEADERS
    assert result.status_code is None
    aborts = fake.requests_to("/abort_request")
    assert len(aborts) == 2  # prefill and decode (both at the fake's URL)
    assert all(a.body == {"rid": result.request_id, "abort_all": False} for a in aborts)
    assert "abort_request sent" in result.detail


async def test_late_headers_wait_for_the_deadline_not_the_idle_limit(
    fake: FakeStack, client: httpx.AsyncClient
) -> None:
    """Headers held until the first token (OpenAI streams on 0.5.23) past stream_idle_seconds but
    within timeout_seconds: the probe passes; the idle limit bounds only gaps between chunks."""
    fake.mode = "late_headers"
    fake.headers_delay_seconds = 2.0
    # Neither limit may fire once the stream flows, so both leave room for a busy machine; the
    # idle limit is still well under the headers' delay.
    group = group_for(fake.base_url, timeout_seconds=30.0, stream_idle_seconds=1.0)
    result = await run_completion_probe(client, group, api_key=None)
    assert result.ok, result.detail
    assert result.ttft_seconds is not None
    assert result.ttft_seconds >= 2.0
    assert fake.requests_to("/abort_request") == []


async def test_headers_later_than_the_deadline_time_out_before_headers(
    fake: FakeStack, client: httpx.AsyncClient
) -> None:
    """Headers that would come after timeout_seconds: timeout_before_headers at the deadline."""
    fake.mode = "late_headers"
    fake.headers_delay_seconds = 5.0
    group = group_for(fake.base_url, timeout_seconds=0.8, stream_idle_seconds=0.3)
    result = await run_completion_probe(client, group, api_key=None)
    assert result.reason == ProbeFailure.TIMEOUT_BEFORE_HEADERS
    assert 0.7 <= result.duration_seconds < 4.0  # at the deadline, well before the headers
    assert len(fake.requests_to("/abort_request")) == 2


async def test_abort_sends_the_admin_key_when_configured(
    fake: FakeStack, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    """With admin_api_key_file, /abort_request carries the admin key; the probe the API key."""
    admin = tmp_path / "admin-key"
    admin.write_text("sk-admin\n")
    fake.mode = "hang_before_headers"
    group = group_for(
        fake.base_url, timeout_seconds=0.3, stream_idle_seconds=0.3, admin_api_key_file=str(admin)
    )
    result = await run_completion_probe(client, group, api_key="sk-api")
    assert result.reason == ProbeFailure.TIMEOUT_BEFORE_HEADERS
    (probe,) = fake.requests_to("/v1/completions")
    assert probe.headers["authorization"] == "Bearer sk-api"
    aborts = fake.requests_to("/abort_request")
    assert [a.headers["authorization"] for a in aborts] == ["Bearer sk-admin"] * 2
    assert "sk-admin" not in result.detail


async def test_abort_sends_the_api_key_without_an_admin_key(
    fake: FakeStack, client: httpx.AsyncClient
) -> None:
    """No admin key configured: /abort_request carries the API key, as SGLang then expects."""
    fake.mode = "hang_before_headers"
    group = group_for(fake.base_url, timeout_seconds=0.3, stream_idle_seconds=0.3)
    await run_completion_probe(client, group, api_key="sk-api")
    aborts = fake.requests_to("/abort_request")
    assert [a.headers["authorization"] for a in aborts] == ["Bearer sk-api"] * 2


async def test_deadline_before_headers(fake: FakeStack, client: httpx.AsyncClient) -> None:
    """The hard deadline, shorter than the idle limit, also gives timeout_before_headers."""
    fake.mode = "hang_before_headers"
    group = group_for(fake.base_url, timeout_seconds=0.3, stream_idle_seconds=0.3)
    result = await run_completion_probe(client, group, api_key=None)
    assert result.reason == ProbeFailure.TIMEOUT_BEFORE_HEADERS
    assert len(fake.requests_to("/abort_request")) == 2


async def test_stall_midstream_by_idle_limit(fake: FakeStack, client: httpx.AsyncClient) -> None:
    """Headers and one token, then silence past stream_idle_seconds: stalled_midstream + abort."""
    fake.mode = "stall_midstream"
    group = group_for(fake.base_url, timeout_seconds=5.0, stream_idle_seconds=0.3)
    result = await run_completion_probe(client, group, api_key=None)
    assert result.reason == ProbeFailure.STALLED_MIDSTREAM
    assert result.status_code == 200
    assert result.ttft_seconds is not None  # the first token did arrive
    assert len(fake.requests_to("/abort_request")) == 2


async def test_stall_midstream_by_deadline(fake: FakeStack, client: httpx.AsyncClient) -> None:
    """A stream that trickles (each gap under the idle limit) still hits the hard deadline."""
    fake.mode = "trickle"
    fake.text = " ".join(["ok"] * 10)
    group = group_for(fake.base_url, timeout_seconds=0.8, stream_idle_seconds=0.8)
    result = await run_completion_probe(client, group, api_key=None)
    assert result.reason == ProbeFailure.STALLED_MIDSTREAM
    assert "deadline" in result.detail
    assert len(fake.requests_to("/abort_request")) == 2


async def test_http_error_keeps_status_and_router_error_code(
    fake: FakeStack, client: httpx.AsyncClient
) -> None:
    """A 5xx from the router is http_error with its status and x-smg-error-code; no abort."""
    fake.mode = "http_error"
    result = await run_completion_probe(client, group_for(fake.base_url), api_key=None)
    assert result.reason == ProbeFailure.HTTP_ERROR
    assert result.status_code == 503
    assert result.error_code == "decode_server_error"
    assert "decode unavailable" in result.detail
    assert fake.requests_to("/abort_request") == []


@pytest.mark.parametrize(
    ("mode", "path", "reason", "status"),
    [
        ("malformed", "/v1/completions", ProbeFailure.MALFORMED, 200),
        ("truncated", "/v1/chat/completions", ProbeFailure.MALFORMED, 200),
        ("error_event", "/v1/completions", ProbeFailure.HTTP_ERROR, 500),
        ("generate_abort", "/generate", ProbeFailure.HTTP_ERROR, 500),
        ("empty", "/v1/completions", ProbeFailure.EMPTY_OUTPUT, 200),
        ("empty", "/v1/chat/completions", ProbeFailure.EMPTY_OUTPUT, 200),
        ("empty", "/generate", ProbeFailure.EMPTY_OUTPUT, 200),
    ],
)
async def test_bad_streams_are_classified(
    fake: FakeStack,
    client: httpx.AsyncClient,
    *,
    mode: str,
    path: str,
    reason: ProbeFailure,
    status: int,
) -> None:
    """Bad JSON, a cut stream, error events, PD aborts and no text each get their class."""
    fake.mode = mode
    result = await run_completion_probe(client, group_for(fake.base_url, path=path), api_key=None)
    assert not result.ok
    assert result.reason == reason, result.detail
    assert result.status_code == status


async def test_unexpected_output(fake: FakeStack, client: httpx.AsyncClient) -> None:
    """Text that does not match expect_regex is unexpected_output."""
    fake.text = "banana"
    group = group_for(fake.base_url, expect_regex=r"\bok\b")
    result = await run_completion_probe(client, group, api_key=None)
    assert result.reason == ProbeFailure.UNEXPECTED_OUTPUT
    assert "banana" in result.detail


async def test_api_key_is_sent_and_never_logged_or_reported(
    fake: FakeStack, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    """The key goes out as a Bearer token (probe and abort) but never into logs or results."""
    secret = "sk-very-secret-0123456789"
    key_file = tmp_path / "key"
    key_file.write_text(f"{secret}\n")
    group = group_for(fake.base_url, api_key_file=str(key_file), stream_idle_seconds=1.0)
    api_key = load_api_key(group.probe.api_key_file)
    assert api_key == secret
    fake.mode = "stall_midstream"
    with structlog.testing.capture_logs() as logs:
        result = await run_completion_probe(
            client, group_for(fake.base_url, stream_idle_seconds=0.2), api_key=api_key
        )
        ok_result = await run_multiround_probe(client, group, api_key=api_key, rounds=1)
    assert result.reason == ProbeFailure.STALLED_MIDSTREAM
    sent = [s.headers.get("authorization") for s in fake.seen if s.path != "/health"]
    assert sent
    assert all(h == f"Bearer {secret}" for h in sent)
    assert secret not in repr(logs)
    assert secret not in repr(result)
    assert secret not in repr(ok_result)


def test_api_key_file_problems_name_the_file(tmp_path: Path) -> None:
    """An empty key file is a config error naming the file, not the key."""
    assert load_api_key(None) is None
    empty = tmp_path / "empty"
    empty.write_text("  \n")
    with pytest.raises(ConfigError, match="empty"):
        load_api_key(empty)
    with pytest.raises(ConfigError, match="cannot read"):
        load_api_key(tmp_path / "missing")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_multiround_grows_the_context(
    fake: FakeStack, client: httpx.AsyncClient, path: str
) -> None:
    """Each round carries the whole conversation so far, previous answers included."""
    group = group_for(fake.base_url, path=path, multiround_rounds=3)
    result = await run_multiround_probe(client, group, api_key=None)
    assert result.ok, result.detail
    assert result.kind == ProbeKind.MULTIROUND
    assert result.tokens == 9
    seen = fake.requests_to(path)
    assert len(seen) == 3
    if path == "/v1/chat/completions":
        assert [len(s.body["messages"]) for s in seen] == [1, 3, 5]
        assert seen[2].body["messages"][1] == {"role": "assistant", "content": "ok ok ok"}
    else:
        prompts = [s.body["prompt"] for s in seen]
        assert len(prompts[0]) < len(prompts[1]) < len(prompts[2])
        assert prompts[2].startswith(prompts[1])
        assert "ok ok ok" in prompts[1]
    assert len({s.body["rid"] for s in seen}) == 3


async def test_multiround_reports_the_failing_round(
    fake: FakeStack, client: httpx.AsyncClient
) -> None:
    """A round that fails ends the probe with that round's class, number and request id."""
    fake.mode = "stall_midstream"
    fake.mode_from_request = 2
    group = group_for(fake.base_url, multiround_rounds=3, stream_idle_seconds=0.3)
    result = await run_multiround_probe(client, group, api_key=None)
    assert not result.ok
    assert result.reason == ProbeFailure.STALLED_MIDSTREAM
    assert result.detail.startswith("round 2/3:")
    assert result.request_id.endswith("-r2")
    assert result.tokens == 4  # three in round 1, the one token round 2 got before stalling
    assert len(fake.requests_to("/v1/completions")) == 2
    aborts = fake.requests_to("/abort_request")
    assert {a.body["rid"] for a in aborts} == {result.request_id}


@pytest.mark.parametrize(
    ("status", "ok", "reason"),
    [(200, True, ProbeFailure.OK), (503, False, ProbeFailure.HTTP_ERROR)],
)
async def test_health_and_readiness(
    fake: FakeStack, client: httpx.AsyncClient, status: int, ok: bool, reason: ProbeFailure
) -> None:
    """Workers get /health (kind health), the router /readiness (kind readiness)."""
    fake.health_status = status
    worker = await check_health(client, "decode", health_url_of(fake, "decode"), timeout_seconds=30)
    router = await check_health(client, "router", health_url_of(fake, "router"), timeout_seconds=30)
    assert (worker.kind, router.kind) == (ProbeKind.HEALTH, ProbeKind.READINESS)
    assert worker.ok is ok
    assert router.ok is ok
    assert worker.reason == reason
    assert worker.status_code == status
    assert {s.path for s in fake.seen} == {"/health", "/readiness"}


def health_url_of(fake: FakeStack, target: str) -> str:
    """The health URL of a role on the fake."""
    return health_url(Role(target), fake.base_url)


async def test_health_timeout_and_refused(fake: FakeStack, client: httpx.AsyncClient) -> None:
    """A hanging /health is a timeout, a closed port connect_refused; neither raises."""
    fake.mode = "hang_health"
    hung = await check_health(client, "prefill", f"{fake.base_url}/health", timeout_seconds=0.3)
    refused = await check_health(client, "prefill", f"{refused_url()}/health", timeout_seconds=30)
    assert hung.reason == ProbeFailure.TIMEOUT
    assert refused.reason == ProbeFailure.CONNECT_REFUSED
