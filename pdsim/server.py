"""The HTTP API of one simulated SGLang server: what the router, the watchdog and tests call.

SGLang endpoints (`/health`, `/server_info`, `/model_info`, `/generate`, `/v1/completions`,
`/v1/chat/completions`, `/abort_request`, `/metrics`, `/v1/loads`) plus the test-only `/_sim/*`
control endpoints (faults, state, release of stuck transfers).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

from aiohttp import web

from pdsim.api import ParsedRequest, RequestError, ResponseShaper, parse_request
from pdsim.dp import DpRouter
from pdsim.engine import FAKE_BOOTSTRAP_HOST, Engine, Req
from pdsim.faults import FaultError, FaultSet, parse_fault_list
from pdsim.loads import SECTIONS, LoadStats, invalid_sections, load_row, response_body
from pdsim.metrics import SimMetrics, version_at_least

# Endpoints with AuthLevel.ADMIN_OPTIONAL among those pdsim serves
# (sglang/srt/entrypoints/http_server.py:1722-1723 @ 0.5.23: /abort_request).
ADMIN_OPTIONAL_PATHS = frozenset({"/abort_request"})
# Never checked: probes and scrapes (sglang/srt/utils/auth.py:98-106 @ 0.5.23), and pdsim's own
# test control.
AUTH_EXEMPT_PREFIXES = ("/health", "/ready", "/metrics", "/_sim")
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
NON_STREAM_DISCONNECT_CHECK_S = 4.0  # sglang/srt/managers/tokenizer_manager.py:1959-1975 @ 0.5.23
STREAM_DISCONNECT_CHECK_S = 0.2  # Starlette notices a disconnect while streaming at once
HEADERS_SENT_KEY = "pdsim_headers_sent"


def _auth_allowed(
    *,
    method: str,
    path: str,
    authorization: str | None,
    api_key: str | None,
    admin_api_key: str | None,
) -> bool:
    """decide_request_auth (sglang/srt/utils/auth.py:74-151 @ 0.5.23) for pdsim's endpoints:
    OPTIONS and probe/scrape paths pass; /abort_request (ADMIN_OPTIONAL) takes the admin key
    when one is set (the plain key is then refused), else the plain key; every other endpoint
    (NORMAL) takes the plain key when one is set and is open otherwise, even with an admin key."""
    if method == "OPTIONS" or path.startswith(AUTH_EXEMPT_PREFIXES):
        return True

    def bearer(expected: str) -> bool:
        if not authorization:
            return False
        parts = authorization.split(" ", 1)
        if len(parts) != 2 or parts[0].lower() != "bearer":
            return False
        return secrets.compare_digest(parts[1], expected)

    if path in ADMIN_OPTIONAL_PATHS:
        if admin_api_key:
            return bearer(admin_api_key)
        return bearer(api_key) if api_key else True
    return bearer(api_key) if api_key else True


async def _prepare(resp: web.StreamResponse, request: web.Request) -> None:
    """Send a stream's headers (and, on 0.5.9, leave http_requests_active then)."""
    await resp.prepare(request)
    leave = request.get(HEADERS_SENT_KEY)
    if leave is not None:
        leave()


@dataclass(frozen=True)
class ServerInfo:
    """Static facts about this server, as reported by /server_info and /model_info."""

    role: str
    version: str
    host: str
    port: int
    bootstrap_port: int | None
    tp_size: int
    model_name: str
    max_running: int
    decode_log_interval: int
    watchdog_timeout_s: float
    fault_file: str | None
    transfer_backend: str = "mooncake"
    legacy_streams: bool = False
    health_generation: bool = True
    enable_metrics: bool = True
    api_key: str | None = None
    admin_api_key: str | None = None


async def _hang_while(faults: FaultSet, kind: str) -> None:
    # Hangs last until the fault is cleared (or the process restarts), so tests can clean up.
    # Faults can be set from another process (a fault file), so poll rather than wait on an Event.
    while faults.active(kind):  # noqa: ASYNC110
        await asyncio.sleep(0.05)


def build_api_app(
    engine: Engine, faults: FaultSet, metrics: SimMetrics, info: ServerInfo
) -> web.Application:
    handlers = _Handlers(engine, faults, metrics, info)
    middlewares = []
    if info.api_key or info.admin_api_key:
        # Added only when a key is set (http_server.py:2886-2898 @ 0.5.23), outside the metrics.
        middlewares.append(handlers.api_key_auth)
    middlewares.append(handlers.http_metrics)
    app = web.Application(middlewares=middlewares)
    r = app.router
    r.add_get("/health", handlers.health)
    r.add_get("/health_generate", handlers.health)
    r.add_get("/server_info", handlers.server_info)
    r.add_get("/get_server_info", handlers.server_info)
    r.add_get("/model_info", handlers.model_info)
    r.add_get("/get_model_info", handlers.model_info)
    r.add_get("/v1/models", handlers.models)
    r.add_post("/generate", handlers.endpoint("generate"))
    r.add_post("/v1/completions", handlers.endpoint("completions"))
    r.add_post("/v1/chat/completions", handlers.endpoint("chat"))
    r.add_post("/abort_request", handlers.abort_request)
    if info.enable_metrics:
        # --enable-metrics is off by default: without it there is no /metrics route at all
        # (http_server.py:314-315 @ 0.5.23; arg_groups/fields/observability.py:70 default False).
        r.add_get("/metrics", handlers.metrics_endpoint)
    r.add_get("/v1/loads", handlers.loads)
    r.add_get("/_sim/state", handlers.sim_state)
    r.add_get("/_sim/fault", handlers.get_faults)
    r.add_post("/_sim/fault", handlers.set_faults)
    r.add_delete("/_sim/fault", handlers.clear_faults)
    r.add_delete("/_sim/fault/{kind}", handlers.clear_faults)
    r.add_post("/_sim/release", handlers.release)
    return app


class _Handlers:
    def __init__(
        self, engine: Engine, faults: FaultSet, metrics: SimMetrics, info: ServerInfo
    ) -> None:
        self.engine = engine
        self.faults = faults
        self.metrics = metrics
        self.info = info
        self.dp = DpRouter(engine.cfg.dp_size, info.version)

    @web.middleware
    async def api_key_auth(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """SGLang's API-key middleware: 401 {"error": "Unauthorized"}
        (sglang/srt/utils/auth.py:154-211 @ 0.5.23)."""
        if _auth_allowed(
            method=request.method,
            path=request.path,
            authorization=request.headers.get("Authorization"),
            api_key=self.info.api_key,
            admin_api_key=self.info.admin_api_key,
        ):
            return await handler(request)
        return web.json_response({"error": "Unauthorized"}, status=401)

    @web.middleware
    async def http_metrics(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if request.path.startswith("/_sim"):
            return await handler(request)
        resource = request.match_info.route.resource
        endpoint = resource.canonical if resource is not None else request.path
        method = request.method
        self.metrics.http_requests_total.labels(endpoint, method).inc()
        active = self.metrics.http_requests_active.labels(endpoint, method)
        active.inc()
        left = False

        def leave() -> None:
            nonlocal left
            if not left:
                left = True
                active.dec()

        if self.metrics.naming.http_active == "headers":
            # 0.5.9's BaseHTTPMiddleware: call_next returns once the response starts, so a
            # stream leaves the gauge with its headers (utils/common.py:1635-1658 @ 0.5.9).
            request[HEADERS_SENT_KEY] = leave
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            leave()
            self.metrics.http_responses_total.labels(endpoint, str(status), method).inc()

    # ----- health and info -----

    def _starting(self) -> bool:
        fault = self.faults.get("slow_start")
        if fault is None:
            return False
        elapsed = time.monotonic() - fault.set_at_monotonic
        return elapsed < float(fault.param("seconds"))

    async def health(self, request: web.Request) -> web.Response:
        await _hang_while(self.faults, "health_hang")
        if self._starting():
            return web.Response(status=503)
        if not self.info.health_generation and request.path == "/health":
            # sglang/srt/entrypoints/http_server.py:745-749 @ 0.5.23: a static 200.
            return web.Response(status=200)
        ok = await self.engine.health_check()
        return web.Response(status=200 if ok else 503)

    async def server_info(self, _request: web.Request) -> web.Response:
        state = await self.engine.internal_state()
        i = self.info
        # Never model_path or tokenizer_path: the router would try to download a tokenizer.
        return web.json_response(
            {
                "version": i.version,
                "served_model_name": i.model_name,
                "host": i.host,
                "port": i.port,
                "tp_size": i.tp_size,
                "dp_size": 1,
                "pp_size": 1,
                "disaggregation_mode": i.role,
                "disaggregation_bootstrap_port": i.bootstrap_port,
                "disaggregation_transfer_backend": i.transfer_backend,
                "enable_metrics": i.enable_metrics,
                "decode_log_interval": i.decode_log_interval,
                "watchdog_timeout": i.watchdog_timeout_s,
                "max_running_requests": i.max_running,
                "skip_tokenizer_init": True,
                "internal_states": [state],
                "pdsim": True,
            }
        )

    async def model_info(self, _request: web.Request) -> web.Response:
        return web.json_response(
            {
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": "pdsim",
                "architectures": ["PDSimForCausalLM"],
                "served_model_name": self.info.model_name,
            }
        )

    async def models(self, _request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.info.model_name,
                        "object": "model",
                        "created": int(self.engine.start_time),
                        "owned_by": "sglang",
                        "root": self.info.model_name,
                        "max_model_len": 131072,
                    }
                ],
            }
        )

    # ----- generation -----

    def endpoint(self, name: str) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handler(request: web.Request) -> web.StreamResponse:
            return await self.generate(request, name)

        return handler

    async def generate(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return web.json_response({"error": {"message": "invalid JSON body"}}, status=400)
        try:
            parsed = parse_request(endpoint, body)
        except RequestError as exc:
            return web.json_response({"error": {"message": str(exc)}}, status=400)
        if parsed.bootstrap_room is None and parsed.bootstrap_host != FAKE_BOOTSTRAP_HOST:
            return web.json_response(
                {"error": {"message": "bootstrap_room is required in PD disaggregation mode"}},
                status=400,
            )
        try:
            rank = self.dp.route(body)
        except RequestError as exc:
            return web.json_response({"error": {"message": str(exc)}}, status=400)
        req = self._make_req(parsed)
        req.dp_rank = rank
        if req.rid in self.engine.reqs or req.rid in self.engine.held:
            return web.json_response({"error": {"message": f"Duplicate rid {req.rid}"}}, status=400)
        if self.info.role == "decode" and self.faults.active("decode_hang_before_headers"):
            # Accepted, never answered: no headers, no body (the router waits
            # request-timeout-secs). The tokenizer knows the rid meanwhile (Engine.hold).
            self.engine.hold(req)
            try:
                await _hang_while(self.faults, "decode_hang_before_headers")
            finally:
                # A handler cancelled while hung takes its request with it.
                self.engine.held.pop(req.rid, None)
            self.engine.release_held(req)
        else:
            self.engine.submit(req)
        shaper = ResponseShaper(parsed, self.info.model_name)
        if not parsed.stream:
            return await self._respond_whole(request, req, shaper)
        return await self._respond_stream(request, req, shaper)

    def _make_req(self, parsed: ParsedRequest) -> Req:
        fake = parsed.bootstrap_host == FAKE_BOOTSTRAP_HOST
        return Req(
            rid=parsed.rid,
            prompt_tokens=parsed.prompt_tokens,
            max_new_tokens=parsed.max_new_tokens,
            stream=parsed.stream,
            room=parsed.bootstrap_room if parsed.bootstrap_room is not None else 0,
            bootstrap_host=parsed.bootstrap_host,
            bootstrap_port=parsed.bootstrap_port if parsed.bootstrap_port is not None else 8998,
            fake=fake,
        )

    async def _next_event(
        self, request: web.Request, req: Req, poll_s: float
    ) -> tuple[str, Any] | None:
        """The request's next event, or None once the client has gone (then it is aborted)."""
        if self.engine.cfg.legacy_aborts:
            # pdsim before: a disconnect was only noticed by a failed write.
            return await req.out.get()
        while True:
            try:
                return await asyncio.wait_for(req.out.get(), timeout=poll_s)
            except TimeoutError:
                transport = request.transport
                if transport is None or transport.is_closing():
                    self.engine.client_gone(req)
                    return None

    async def _respond_whole(
        self, request: web.Request, req: Req, shaper: ResponseShaper
    ) -> web.Response:
        n = 0
        while True:
            # A non-streamed request notices a disconnected client every 4 s
            # (sglang/srt/managers/tokenizer_manager.py:1959-1975 @ 0.5.23).
            event = await self._next_event(request, req, NON_STREAM_DISCONNECT_CHECK_S)
            if event is None:
                return web.Response(status=499)
            kind, value = event
            if kind == "token":
                n = value
                continue
            reason = value
            break
        status = reason.get("status_code")
        if reason["type"] == "abort" and status:
            # tokenizer_manager.py:1916-1921 @ 0.5.23: HTTPException(status, detail=message).
            return web.json_response(shaper.error_body(status, reason["message"]), status=status)
        return web.json_response(shaper.full(n, reason))

    async def _respond_stream(
        self, request: web.Request, req: Req, shaper: ResponseShaper
    ) -> web.StreamResponse:
        endpoint = shaper.p.endpoint
        modern = version_at_least(self.info.version, "0.5.9")
        if self.info.legacy_streams or (endpoint != "generate" and not modern):
            return await self._respond_stream_legacy(request, req, shaper)
        resp = web.StreamResponse(headers=SSE_HEADERS)
        first: tuple[str, Any] | None = None
        if endpoint == "generate":
            # /generate is a StreamingResponse over the tokenizer's generator: headers go out
            # before any token (sglang/srt/entrypoints/http_server.py:949-981 @ 0.5.23).
            await _prepare(resp, request)
        else:
            # OpenAI endpoints pull the first chunk before the 200 (serving_chat.py:2422-2439,
            # serving_completions.py:204-223 @ 0.5.23), so a client waits for it without headers.
            first = await self._next_event(request, req, STREAM_DISCONNECT_CHECK_S)
            if first is None:
                return resp
            await _prepare(resp, request)
        try:
            await self._write_stream(request, req, shaper, resp, first)
        except ConnectionResetError:
            self.engine.client_gone(req)
        return resp

    async def _write_stream(
        self,
        request: web.Request,
        req: Req,
        shaper: ResponseShaper,
        resp: web.StreamResponse,
        first: tuple[str, Any] | None,
    ) -> None:
        n = 0
        event = first
        while True:
            if event is None:
                event = await self._next_event(request, req, STREAM_DISCONNECT_CHECK_S)
                if event is None:
                    return
            kind, value = event
            event = None
            if kind == "token":
                payloads = shaper.chunks(n, value, None)
                n = value
            elif (
                shaper.p.endpoint != "generate"
                and value["type"] == "abort"
                and value.get("status_code")
            ):
                # A failure with a status code is an error event inside the 200 stream
                # (sglang/srt/entrypoints/openai/serving_chat.py:2564-2580 @ 0.5.23).
                payloads = [shaper.stream_error(value["status_code"], value["message"])]
            else:
                payloads = shaper.chunks(n, n, value)
            for payload in payloads:
                await resp.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
            if kind == "finish":
                await resp.write(b"data: [DONE]\n\n")
                return

    async def _respond_stream_legacy(
        self, request: web.Request, req: Req, shaper: ResponseShaper
    ) -> web.StreamResponse:
        # Headers go out with the first event, so a PD failure before any token is an HTTP error.
        event = await self._next_event(request, req, STREAM_DISCONNECT_CHECK_S)
        if event is None:
            return web.Response(status=499)
        kind, value = event
        if kind == "finish" and value["type"] == "abort" and value.get("status_code"):
            status = value["status_code"]
            return web.json_response(shaper.error_body(status, value["message"]), status=status)
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await _prepare(resp, request)
        n = 0
        try:
            while True:
                if kind == "token":
                    payloads = shaper.chunks(n, value, None)
                    n = value
                else:
                    payloads = shaper.chunks(n, n, value)
                for payload in payloads:
                    await resp.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
                if kind == "finish":
                    await resp.write(b"data: [DONE]\n\n")
                    break
                kind, value = await req.out.get()
        except ConnectionResetError:
            self.engine.client_gone(req)
        return resp

    async def abort_request(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except json.JSONDecodeError:
            body = {}
        rid = body.get("rid")
        self.engine.abort(str(rid) if rid else None, bool(body.get("abort_all", False)))
        return web.Response(status=200)

    # ----- metrics and loads -----

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        if self.faults.active("metrics_garbage"):
            headers, body = self.metrics.render(None, None, {})
            half = body[: len(body) // 2]
            garbage = (
                half + b'\nsglang:num_requests_total{model_name="pdsim" 12 garbage\n'
                b"# TYPE sglang:broken wat\n\x00\xff{{{\n"
            )
            return web.Response(body=garbage, headers={"Content-Type": "text/plain; version=0.0.4"})
        params = parse_qs(request.query_string)
        headers, body = self.metrics.render(
            request.headers.get("Accept"), request.headers.get("Accept-Encoding"), params
        )
        return web.Response(body=body, headers=dict(headers))

    async def loads(self, request: web.Request) -> web.Response:
        """/v1/loads in the version's generation (docs/sglang.md §7.6; pdsim/loads.py)."""
        naming = self.metrics.naming
        if not naming.has_v1_loads or self.faults.active("loads_absent"):
            # Added by PR #16976, first released in 0.5.9.
            raise web.HTTPNotFound()
        raw = request.query.get("include")
        include = {s.strip() for s in raw.split(",")} if raw else None
        invalid = invalid_sections(include or set())
        if invalid and naming.loads == "ipc":
            # GetLoadsReqInput.__post_init__ raises inside the handler's try: HTTPException 400
            # (managers/io_struct.py:1897-1905, entrypoints/v1_loads.py:152-158 @ 0.5.9), in
            # the ErrorResponse shape of entrypoints/http_server.py:380-405 @ 0.5.9.
            message = f"Invalid include sections: {invalid}. Valid options: {sorted(SECTIONS)}"
            return web.json_response(
                {"object": "error", "message": message, "type": "400", "param": None, "code": 400},
                status=400,
            )
        if invalid:
            # 0.5.16+: LoadSnapshot.to_dict raises *after* the try (v1_loads.py:140-141
            # @ 0.5.23), so the ValueError is Starlette's plain 500.
            return web.Response(status=500, text="Internal Server Error")
        stats: tuple[LoadStats, ...]
        if naming.loads == "ipc":
            stats = await self.engine.loads_ipc()
        else:
            stats = self.engine.loads_snapshot()
        # One row per DP rank (entrypoints/v1_loads.py:141-150 @ 0.5.23).
        rows = [load_row(naming, rank, include) for rank in stats]
        return web.json_response(response_body(naming, rows, self.info.tp_size))

    # ----- test control -----

    async def sim_state(self, _request: web.Request) -> web.Response:
        state = self.engine.sim_state()
        state["fault_file"] = self.info.fault_file
        state["ppid"] = os.getppid()
        return web.json_response(state)

    async def get_faults(self, _request: web.Request) -> web.Response:
        return web.json_response({"faults": self.faults.to_json()})

    async def set_faults(self, request: web.Request) -> web.Response:
        try:
            new = parse_fault_list(await request.json())
        except (FaultError, json.JSONDecodeError) as exc:
            return web.json_response({"error": str(exc)}, status=400)
        self.faults.set(new)
        self.engine.wake()
        return web.json_response({"faults": self.faults.to_json()})

    async def clear_faults(self, request: web.Request) -> web.Response:
        kind = request.match_info.get("kind") or request.query.get("kind")
        try:
            cleared = self.faults.clear(kind)
        except FaultError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        self.engine.wake()
        return web.json_response(
            {"cleared": [f.kind for f in cleared], "faults": self.faults.to_json()}
        )

    async def release(self, _request: web.Request) -> web.Response:
        released = self.engine.release_stuck()
        return web.json_response({"released": released})
