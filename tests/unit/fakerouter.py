"""A tiny aiohttp stand-in for router + workers that misbehaves on demand (probe classification tests).

It answers the three generation paths with SGLang-shaped event streams, /health, /readiness,
/abort_request and /v1/models, and records every request. `mode` picks the misbehaviour; handlers that hang wait
on `release`, which the fixture sets at teardown so nothing outlives the test.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer

from watchdog.config import GroupSection, parse_config

HANG_SECONDS = 60.0
GENERATION_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")


@dataclass
class Seen:
    """One request the fake saw."""

    path: str
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass
class FakeStack:
    """Mode, recorded requests and the release event of a running fake."""

    base_url: str = ""
    mode: str = "ok"
    text: str = "ok ok ok"
    seen: list[Seen] = field(default_factory=list)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    health_status: int = 200
    metrics_body: str = ""
    # The /v1/loads answer (JSON); empty: 404, as a server before 0.5.23.
    loads_body: str = ""
    # `mode` applies from this generation request on (1-based); earlier ones are answered "ok".
    mode_from_request: int = 1
    # Mode "late_headers": like an OpenAI stream on SGLang 0.5.23, headers wait for the first token.
    headers_delay_seconds: float = 0.0
    # Listed by /v1/models: smg registers a worker only once it has detected its backend there,
    # and routes /v1/* requests by model (docs/sglang.md §7.9).
    served_model: str = "pdsim"

    def requests_to(self, path: str) -> list[Seen]:
        """The recorded requests for one path."""
        return [s for s in self.seen if s.path == path]


def _chunk(path: str, cumulative: str, delta: str, finished: bool) -> dict[str, Any]:
    if path == "/generate":
        return {
            "text": cumulative,
            "meta_info": {
                "id": "x",
                "completion_tokens": len(cumulative.split()),
                "finish_reason": {"type": "length"} if finished else None,
            },
        }
    if path == "/v1/chat/completions":
        return {
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"content": delta}, "finish_reason": None}],
        }
    return {"object": "text_completion", "choices": [{"index": 0, "text": delta}]}


async def _sse(response: web.StreamResponse, payload: Any) -> None:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    await response.write(f"data: {data}\n\n".encode())


def group_for(base_url: str, *, path: str = "/v1/completions", **probe: Any) -> GroupSection:
    """A validated group whose three roles all point at `base_url`.

    The default timeouts are for fetches that must not time out: generous, so a machine whose
    cores are busy with other work cannot make them fire. A test of a timeout sets its own.
    """
    probe_section = {
        "path": path,
        "timeout_seconds": 30.0,
        "stream_idle_seconds": 10.0,
        "connect_timeout_seconds": 10.0,
        "health_timeout_seconds": 30.0,
        "scrape_timeout_seconds": 30.0,
        **probe,
    }
    data = {
        "group": [
            {
                "name": "fake",
                "prefill": {"unit": "p.service", "url": base_url},
                "decode": {"unit": "d.service", "url": base_url},
                "router": {"unit": "r.service", "url": base_url},
                "probe": probe_section,
            }
        ]
    }
    return parse_config(data, "<test>").group[0]


def make_app(stack: FakeStack) -> web.Application:  # noqa: C901, PLR0915  # the fake's handlers are closures over one stack
    """The aiohttp application behind a FakeStack."""

    async def generate(request: web.Request) -> web.StreamResponse:  # noqa: PLR0912  # a branch per mode
        body = await request.json()
        stack.seen.append(Seen(request.path, _headers(request), body))
        generations = sum(1 for s in stack.seen if s.path in GENERATION_PATHS)
        mode = stack.mode if generations >= stack.mode_from_request else "ok"
        if mode == "hang_before_headers":
            await _wait(stack)
            return web.Response(status=504)
        if mode == "http_500":
            return web.Response(status=500, text='{"error":"KV transfer failed"}')
        if mode == "http_error":
            return web.Response(
                status=503,
                text='{"error":"decode unavailable"}',
                headers={"x-smg-error-code": "decode_server_error"},
            )
        if mode == "echo_auth":
            # Like a proxy's 401 page that quotes the request: the credential comes back.
            auth = request.headers.get("Authorization", "")
            return web.Response(
                status=401,
                text=f'{{"error": "Unauthorized", "authorization": "{auth}"}} '
                f"rejected {auth.partition(' ')[2]}",
            )
        if mode == "late_headers":
            await asyncio.sleep(stack.headers_delay_seconds)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if mode == "malformed":
            await _sse(response, "{not json")
            await _sse(response, "[DONE]")
            return response
        if mode == "error_event":
            await _sse(response, {"error": {"message": "KV transfer failed", "code": 500}})
            await _sse(response, "[DONE]")
            return response
        if mode == "generate_abort":
            await _sse(
                response,
                {
                    "text": "",
                    "meta_info": {
                        "finish_reason": {
                            "type": "abort",
                            "message": "transfer failed",
                            "status_code": 500,
                        }
                    },
                },
            )
            await _sse(response, "[DONE]")
            return response
        text = "" if mode == "empty" else stack.text
        cumulative = ""
        words = text.split(" ") if text else [""]
        for index, word in enumerate(words):
            delta = word if index == 0 else f" {word}"
            cumulative += delta
            await _sse(response, _chunk(request.path, cumulative, delta, False))
            if mode == "stall_midstream":
                await _wait(stack)
                return response
            if mode == "trickle":
                await asyncio.sleep(0.4)
        if mode == "truncated":
            # Like the router forwarding a decode 5xx mid-stream: the body just ends.
            assert request.transport is not None
            request.transport.close()
            return response
        if request.path != "/generate":
            await _sse(response, {"choices": [], "usage": {"completion_tokens": len(words)}})
        await _sse(response, "[DONE]")
        return response

    async def health(request: web.Request) -> web.Response:
        stack.seen.append(Seen(request.path, _headers(request), {}))
        if stack.mode == "hang_health":
            await _wait(stack)
        return web.Response(status=stack.health_status, text="OK")

    async def abort(request: web.Request) -> web.Response:
        stack.seen.append(Seen(request.path, _headers(request), await request.json()))
        return web.json_response({"success": True})

    async def metrics(request: web.Request) -> web.Response:
        stack.seen.append(Seen(request.path, _headers(request), {}))
        if not stack.metrics_body:
            return web.Response(status=404, text="metrics disabled")
        return web.Response(text=stack.metrics_body, content_type="text/plain")

    async def loads(request: web.Request) -> web.Response:
        stack.seen.append(Seen(request.path, _headers(request), {}))
        if not stack.loads_body:
            return web.Response(status=404, text="Not Found")
        return web.Response(text=stack.loads_body, content_type="application/json")

    async def models(request: web.Request) -> web.Response:
        stack.seen.append(Seen(request.path, _headers(request), {}))
        model = {"id": stack.served_model, "object": "model", "owned_by": "sglang"}
        return web.json_response({"object": "list", "data": [model]})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/loads", loads)
    for path in GENERATION_PATHS:
        app.router.add_post(path, generate)
    app.router.add_get("/health", health)
    app.router.add_get("/readiness", health)
    app.router.add_post("/abort_request", abort)
    return app


def _headers(request: web.Request) -> dict[str, str]:
    return {k.lower(): v for k, v in request.headers.items()}


async def _wait(stack: FakeStack) -> None:
    try:
        async with asyncio.timeout(HANG_SECONDS):
            await stack.release.wait()
    except TimeoutError:
        pass


async def running_fake() -> AsyncIterator[FakeStack]:
    """Start a FakeStack on 127.0.0.1; stop it (releasing hung handlers) afterwards."""
    stack = FakeStack()
    server = TestServer(make_app(stack), host="127.0.0.1")
    await server.start_server()
    stack.base_url = str(server.make_url("")).rstrip("/")
    try:
        yield stack
    finally:
        stack.release.set()
        await server.close()


@contextlib.contextmanager
def fake_in_thread(metrics_body: str) -> Iterator[FakeStack]:
    """A fake stack served from its own thread and loop, for code under test that runs
    asyncio.run() itself (the CLI, the daemon entry point)."""
    ready = threading.Event()
    stop: list[asyncio.Event] = []
    holder: list[FakeStack] = []

    async def serve() -> None:
        stop.append(asyncio.Event())
        async for stack in running_fake():
            stack.metrics_body = metrics_body
            holder.append(stack)
            ready.set()
            await stop[0].wait()

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),))
    thread.start()
    ready.wait(timeout=30)
    try:
        yield holder[0]
    finally:
        loop.call_soon_threadsafe(stop[0].set)
        thread.join(timeout=30)
        loop.close()
