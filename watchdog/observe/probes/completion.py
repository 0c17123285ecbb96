"""The end-to-end probe: one tiny streamed completion through the router, classified by what broke.

The router and workers answer /health with 200 during a PD stall; only a real request with a
client-side deadline sees it (docs/sglang.md §1). The whole exchange runs under
`asyncio.timeout` because httpx has no total timeout: its read timeout restarts with every chunk,
so a trickling stream would never trip it. The connect phase has its own httpx timeout and each
gap between chunks its own timer (`stream_idle_seconds`), which tells the failure classes apart;
the wait for headers has the whole deadline, as OpenAI streams send them with the first token.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from watchdog.clock import Clock
from watchdog.config import GroupSection, ProbeSection
from watchdog.errors import ConfigError
from watchdog.model import ProbeFailure, ProbeKind, ProbeResult
from watchdog.observe.bounded import ACCEPT_ENCODING, CapExceeded, aiter_lines_capped, read_into
from watchdog.observe.probes import (
    abort_request,
    auth_headers,
    load_admin_api_key,
    new_request_id,
    transport_failure,
    worker_urls,
)
from watchdog.observe.probes.tally import stream_count
from watchdog.observe.transport import describe

Message = Mapping[str, str]

_MAX_TEXT_CHARS = 65536  # generated text kept for the regex check; max_tokens keeps it tiny anyway
_MAX_ERROR_BODY_BYTES = 2048  # of a non-2xx answer, kept for the detail (first 300 characters)
# One SSE line: an event is one JSON object of a few hundred bytes (/generate repeats the text so
# far, still a few KiB at probe sizes). A line that never ends is cut here, not buffered whole.
SSE_LINE_MAX_CHARS = 2**20
# The whole stream: a probe asks for max_tokens (default 4) tokens, a healthy stream is a few KiB.
# Only the current line is held in memory; this bounds the work one probe can be made to do.
STREAM_MAX_BYTES = 64 * 2**20
# Failures after which the request may still sit in a worker queue: abort it there by rid.
_ABORT_ON = frozenset(
    {ProbeFailure.TIMEOUT_BEFORE_HEADERS, ProbeFailure.STALLED_MIDSTREAM, ProbeFailure.MALFORMED}
)


class _StreamError(Exception):
    """The stream said something a healthy server never says; carries the classification."""

    def __init__(self, reason: ProbeFailure, detail: str, status_code: int | None = None) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
        self.status_code = status_code


@dataclass(frozen=True, slots=True)
class Exchange:
    """One streamed request's result plus the text it produced (the multi-round probe needs it)."""

    result: ProbeResult
    text: str


def request_body(
    probe: ProbeSection,
    request_id: str,
    *,
    prompt: str | None = None,
    messages: Sequence[Message] | None = None,
    path: str | None = None,
) -> dict[str, Any]:
    """The JSON body for `path` (default: the configured one): temperature 0, streamed, our rid."""
    path = path or probe.path
    text = prompt if prompt is not None else probe.prompt
    if path == "/generate":
        return {
            "text": text,
            "sampling_params": {"max_new_tokens": probe.max_tokens, "temperature": 0},
            "stream": True,
            "rid": request_id,
        }
    body: dict[str, Any] = {
        "model": probe.model,
        "max_tokens": probe.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "rid": request_id,
    }
    if path == "/v1/chat/completions":
        body["messages"] = (
            [dict(m) for m in messages] if messages else [{"role": "user", "content": text}]
        )
    else:
        body["prompt"] = text
    return body


class _StreamReader:
    """Accumulates SSE events of one response into text, token count and time to first token."""

    def __init__(self, path: str, started_mono: float) -> None:
        self.path = path
        self.started_mono = started_mono
        self.text = ""
        self.cumulative = ""  # /generate streams the whole text so far in every event
        self.events_with_text = 0
        self.usage_tokens: int | None = None
        self.ttft_seconds: float | None = None
        self.done = False
        self.count = stream_count()  # the running probe's own-token tally (probes/tally.py)

    def feed(self, data: str) -> None:
        """One SSE `data:` payload; raises _StreamError for malformed or error events."""
        if data.strip() == "[DONE]":
            self.done = True
            return
        try:
            event = json.loads(data)
        except ValueError:
            raise _StreamError(
                ProbeFailure.MALFORMED, f"event is not JSON: {data[:120]!r}"
            ) from None
        except RecursionError:  # valid JSON nested deeper than the parser goes
            raise _StreamError(
                ProbeFailure.MALFORMED, f"event nested too deeply: {data[:120]!r}"
            ) from None
        if not isinstance(event, dict):
            raise _StreamError(ProbeFailure.MALFORMED, f"event is not an object: {data[:120]!r}")
        error = event.get("error")
        if error is not None:
            # SGLang reports failures inside a 200 stream as {"error": {"message", "code"}}.
            code = error.get("code") if isinstance(error, dict) else None
            message = error.get("message") if isinstance(error, dict) else error
            status = code if isinstance(code, int) and not isinstance(code, bool) else None
            raise _StreamError(ProbeFailure.HTTP_ERROR, f"error event: {message}", status)
        delta = self._delta(event)
        if delta:
            if self.ttft_seconds is None:
                self.ttft_seconds = time.monotonic() - self.started_mono
            self.events_with_text += 1
            if len(self.text) < _MAX_TEXT_CHARS:
                self.text += delta[: _MAX_TEXT_CHARS - len(self.text)]
        self.count.update(self.tokens)

    def _delta(self, event: dict[str, Any]) -> str:
        if self.path == "/generate":
            return self._generate_delta(event)
        usage = event.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.usage_tokens = usage["completion_tokens"]
        choices = event.get("choices")
        if choices is None and usage is not None:
            return ""  # the usage-only final chunk
        if not isinstance(choices, list):
            raise _StreamError(ProbeFailure.MALFORMED, "event has no choices list")
        if not choices:
            return ""
        choice = choices[0]
        if not isinstance(choice, dict):
            raise _StreamError(ProbeFailure.MALFORMED, "choices[0] is not an object")
        if self.path == "/v1/chat/completions":
            delta = choice.get("delta")
            if not isinstance(delta, dict):
                raise _StreamError(ProbeFailure.MALFORMED, "choices[0].delta is not an object")
            # Reasoning models stream their thinking first: it is generated output all the same.
            parts = [delta.get("reasoning_content"), delta.get("content")]
        else:
            parts = [choice.get("text")]
        if any(p is not None and not isinstance(p, str) for p in parts):
            raise _StreamError(ProbeFailure.MALFORMED, "generated text is not a string")
        return "".join(p for p in parts if p)

    def _generate_delta(self, event: dict[str, Any]) -> str:
        text = event.get("text")
        if not isinstance(text, str):
            raise _StreamError(ProbeFailure.MALFORMED, "/generate event has no text string")
        meta = event.get("meta_info")
        if isinstance(meta, dict):
            finish = meta.get("finish_reason")
            if isinstance(finish, dict) and finish.get("type") == "abort":
                # A PD failure surfaces as an aborted request carrying an HTTP status code.
                status = finish.get("status_code")
                raise _StreamError(
                    ProbeFailure.HTTP_ERROR,
                    f"request aborted: {finish.get('message', '')}",
                    status if isinstance(status, int) else None,
                )
            tokens = meta.get("completion_tokens")
            if isinstance(tokens, int) and not isinstance(tokens, bool):
                self.usage_tokens = tokens
        delta = text[len(self.cumulative) :] if text.startswith(self.cumulative) else text
        self.cumulative = text
        return delta

    @property
    def tokens(self) -> int:
        """Tokens generated: the server's count when it sent one, else events that carried text."""
        return self.usage_tokens if self.usage_tokens is not None else self.events_with_text


async def _idle_bounded(
    lines: AsyncIterator[str], idle_seconds: float
) -> AsyncGenerator[str, None]:
    """`lines`, failing with STALLED_MIDSTREAM when the next one takes over `idle_seconds`."""
    while True:
        try:
            async with asyncio.timeout(idle_seconds):
                line = await anext(lines)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise _StreamError(
                ProbeFailure.STALLED_MIDSTREAM,
                f"stream idle for more than {idle_seconds:g} s",
            ) from None
        yield line


async def _read_events(
    response: httpx.Response, reader: _StreamReader, idle_seconds: float
) -> None:
    capped = aiter_lines_capped(
        response, max_line_chars=SSE_LINE_MAX_CHARS, max_body_bytes=STREAM_MAX_BYTES
    )
    try:
        async with contextlib.aclosing(_idle_bounded(capped, idle_seconds)) as lines:
            await _feed_lines(lines, reader)
    except CapExceeded as exc:
        raise _StreamError(ProbeFailure.MALFORMED, f"event stream {exc}") from None
    finally:
        await capped.aclose()


async def _feed_lines(lines: AsyncIterator[str], reader: _StreamReader) -> None:
    data_lines: list[str] = []
    async for line in lines:
        if line == "":
            if data_lines:
                reader.feed("\n".join(data_lines))
                data_lines = []
                if reader.done:
                    return
            continue
        if line.startswith(":"):
            continue  # SSE comment (keep-alive)
        field, _, value = line.partition(":")
        if field == "data":
            data_lines.append(value[1:] if value.startswith(" ") else value)
    if data_lines:
        reader.feed("\n".join(data_lines))


async def _error_body(response: httpx.Response) -> str:
    body = bytearray()
    with contextlib.suppress(
        httpx.HTTPError
    ):  # the status code is the finding, the body a courtesy
        await read_into(response, body, _MAX_ERROR_BODY_BYTES)
    return body.decode("utf-8", errors="replace").strip()


class _Answer:
    """What the router's answer showed before the exchange ended, however it ended: whether its
    headers came (a deadline past them is a stall, not a wait for headers), its status, its
    error code. Set as the exchange goes, so a failure keeps what it had seen."""

    def __init__(self) -> None:
        self.headers_received = False
        self.status_code: int | None = None
        self.error_code: str | None = None


def _stream_timeout(probe: ProbeSection) -> httpx.Timeout:
    # The wait for headers is bounded by the whole probe's deadline, not stream_idle_seconds: OpenAI
    # streams on SGLang 0.5.23 hold their headers until the first token (docs/sglang.md §7.7), so
    # that wait is time to first token. Gaps between chunks get stream_idle_seconds (_idle_bounded).
    return httpx.Timeout(
        connect=probe.connect_timeout_seconds,
        read=probe.timeout_seconds,
        write=probe.connect_timeout_seconds,
        pool=probe.connect_timeout_seconds,
    )


def _stream_headers(request_id: str, api_key: str | None) -> dict[str, str]:
    return {
        "Accept": "text/event-stream",
        **ACCEPT_ENCODING,
        "x-request-id": request_id,
        **auth_headers(api_key),
    }


async def stream_exchange(
    client: httpx.AsyncClient,
    group: GroupSection,
    body: Mapping[str, Any],
    *,
    kind: ProbeKind,
    request_id: str,
    api_key: str | None,
    clock: Clock = time.time,
    path: str | None = None,
    url: str | None = None,
    abort_urls: Sequence[str] | None = None,
    target: str = "router",
) -> Exchange:
    """POST `body` to the router, read the stream, classify; abort on the workers when stuck.

    `url` (default: the router's `path`), `abort_urls` (default: every worker) and `target` let
    direct probes send to a worker and abort only on their pair.
    """
    probe = group.probe
    path = path or probe.path
    url = url or f"{group.router.url}{path}"
    headers = _stream_headers(request_id, api_key)
    started_at = clock()
    started_mono = time.monotonic()
    reader = _StreamReader(path, started_mono)
    answer = _Answer()
    reason, detail = await _post_and_read(
        client, url, body, headers=headers, probe=probe, reader=reader, answer=answer
    )
    if reason == ProbeFailure.OK:
        reason, detail = _judge_output(reader, probe)
    duration = time.monotonic() - started_mono
    # Only a request that may still sit in a worker queue is aborted there (by its rid).
    abort_sent = reason in _ABORT_ON and not reader.done
    if abort_sent:
        aborted = await _abort(client, group, request_id, api_key, abort_urls)
        detail = f"{detail}; {aborted}"
    result = ProbeResult(
        kind=kind,
        target=target,
        ok=reason == ProbeFailure.OK,
        reason=reason,
        started_at=started_at,
        duration_seconds=duration,
        ttft_seconds=reader.ttft_seconds,
        tokens=reader.tokens,
        status_code=answer.status_code,
        error_code=answer.error_code,
        request_id=request_id,
        detail=detail,
        abort_sent=abort_sent,
    )
    return Exchange(result, reader.text)


async def _post_and_read(
    client: httpx.AsyncClient,
    url: str,
    body: Mapping[str, Any],
    *,
    headers: Mapping[str, str],
    probe: ProbeSection,
    reader: _StreamReader,
    answer: _Answer,
) -> tuple[ProbeFailure, str]:
    """The request and its stream under the probe's deadline; OK when the stream was read to
    its end (its content is judged after), else the failure class and its detail."""
    reason, detail = ProbeFailure.OK, ""
    try:
        async with asyncio.timeout(probe.timeout_seconds):
            async with client.stream(
                "POST", url, json=dict(body), headers=headers, timeout=_stream_timeout(probe)
            ) as response:
                answer.headers_received = True
                answer.status_code = response.status_code
                answer.error_code = response.headers.get("x-smg-error-code")
                if not 200 <= response.status_code < 300:
                    reason = ProbeFailure.HTTP_ERROR
                    detail = f"HTTP {response.status_code}: {await _error_body(response)}"[:300]
                else:
                    await _read_events(response, reader, probe.stream_idle_seconds)
    except TimeoutError:
        reason, detail = _past_deadline(probe, reader, headers_received=answer.headers_received)
    except _StreamError as exc:
        reason, detail = exc.reason, exc.detail
        if exc.status_code is not None:
            answer.status_code = exc.status_code
    except httpx.TransportError as exc:
        reason, detail = _transport_failed(exc, url, probe, answer.headers_received)
    except httpx.HTTPError as exc:
        reason, detail = ProbeFailure.CONNECT_ERROR, describe(exc)
    return reason, detail


def _past_deadline(
    probe: ProbeSection, reader: _StreamReader, *, headers_received: bool
) -> tuple[ProbeFailure, str]:
    """The whole probe's deadline passed: a stall when the headers had come, else no headers."""
    reason = (
        ProbeFailure.STALLED_MIDSTREAM if headers_received else ProbeFailure.TIMEOUT_BEFORE_HEADERS
    )
    detail = f"no complete answer within the {probe.timeout_seconds:g} s deadline" + (
        f" ({reader.tokens} tokens received)" if headers_received else " (no headers)"
    )
    return reason, detail


def _transport_failed(
    exc: httpx.TransportError, url: str, probe: ProbeSection, headers_received: bool
) -> tuple[ProbeFailure, str]:
    """httpx's own timeouts and connection errors, classified by the phase they cut."""
    reason = transport_failure(exc, headers_received=headers_received)
    detail = describe(exc)
    if reason == ProbeFailure.CONNECT_REFUSED:
        detail = f"{url}: connection refused ({detail})"
    elif reason == ProbeFailure.CONNECT_ERROR:
        detail = f"{url}: {detail}"
    elif reason == ProbeFailure.STALLED_MIDSTREAM:
        detail = f"stream idle for more than {probe.stream_idle_seconds:g} s ({detail})"
    elif reason == ProbeFailure.TIMEOUT_BEFORE_HEADERS:
        detail = f"no headers within {probe.timeout_seconds:g} s ({detail})"
    return reason, detail


async def _abort(
    client: httpx.AsyncClient,
    group: GroupSection,
    request_id: str,
    api_key: str | None,
    urls: Sequence[str] | None = None,
) -> str:
    """Abort the probe on `urls` (every worker), with the admin key when one is configured."""
    note = ""
    try:
        admin_key = load_admin_api_key(group.probe)
    except ConfigError as exc:
        # Readable at startup (config validation) but not now: try with the API key all the same.
        admin_key, note = None, f" (admin key not sent: {exc.issues[0].reason})"
    summary = await abort_request(
        client,
        worker_urls(group) if urls is None else urls,
        request_id,
        api_key=api_key,
        admin_api_key=admin_key,
    )
    return f"abort_request sent: {summary}{note}"


def _judge_output(reader: _StreamReader, probe: ProbeSection) -> tuple[ProbeFailure, str]:
    if not reader.done:
        # A decode 5xx on a streaming request reaches the client as a truncated event stream.
        return ProbeFailure.MALFORMED, f"stream ended without [DONE] ({reader.tokens} tokens)"
    if not reader.text:
        return ProbeFailure.EMPTY_OUTPUT, "the stream finished without generating any text"
    if not probe.expect_matches(reader.text):
        return (
            ProbeFailure.UNEXPECTED_OUTPUT,
            f"output {reader.text[:80]!r} does not match {probe.expect_regex!r}",
        )
    return ProbeFailure.OK, ""


async def run_completion_probe(
    client: httpx.AsyncClient,
    group: GroupSection,
    *,
    api_key: str | None,
    clock: Clock = time.time,
) -> ProbeResult:
    """One streamed completion through the router with the configured path and prompt."""
    request_id = new_request_id(group.name, "completion")
    body = request_body(group.probe, request_id)
    exchange = await stream_exchange(
        client,
        group,
        body,
        kind=ProbeKind.COMPLETION,
        request_id=request_id,
        api_key=api_key,
        clock=clock,
    )
    return exchange.result
