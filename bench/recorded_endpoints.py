"""Lightweight stand-ins for many PD groups: one aiohttp process replaying recorded payloads.

For the scale measurement the watchdog must watch 1, 8 or 32 groups without 32 simulated stacks
fighting for two cores. A recording (taken from a live pdsim stack at TP=8, so /metrics has the
size of a real 8-GPU server) is replayed on four ports per group: prefill, decode, router, router
metrics. Only what the watchdog reads is served: `/health`, `/readiness`, `/metrics`,
`/v1/loads` (its timestamps made live, else the watchdog would see a frozen scheduler loop),
`/server_info`, `/workers`, `/abort_request`, and the recorded streamed completion for every
`POST /v1/completions`, replayed event by event.

    python -m bench.recorded_endpoints --recording DIR --groups 8

prints one JSON line with the ports of every group, then serves until SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gzip
import json
import signal
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

FILES = {
    "prefill_metrics": "prefill-metrics.txt",
    "decode_metrics": "decode-metrics.txt",
    "router_metrics": "router-metrics.txt",
    "prefill_loads": "prefill-loads.json",
    "decode_loads": "decode-loads.json",
    "completion_stream": "completion-stream.txt",
}


@dataclass(frozen=True)
class Recording:
    """The payloads of one healthy, idle stack."""

    prefill_metrics: str
    decode_metrics: str
    router_metrics: str
    prefill_loads: str
    decode_loads: str
    completion_stream: str

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        for key, name in FILES.items():
            (directory / name).write_text(getattr(self, key))

    @classmethod
    def load(cls, directory: Path) -> Recording:
        return cls(**{key: (directory / name).read_text() for key, name in FILES.items()})


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        body: bytes = response.read()
    return body.decode()


def record(
    prefill_url: str, decode_url: str, router_url: str, router_metrics_url: str
) -> Recording:
    """Record the payloads from a live stack (a probe-like streamed completion included)."""
    body = json.dumps(
        {"model": "pdsim", "prompt": "Reply with the word ok.", "max_tokens": 4, "stream": True}
    ).encode()
    request = urllib.request.Request(
        router_url + "/v1/completions",
        data=body,
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        stream = response.read().decode()
    return Recording(
        prefill_metrics=_get(prefill_url + "/metrics"),
        decode_metrics=_get(decode_url + "/metrics"),
        router_metrics=_get(router_metrics_url),
        prefill_loads=_get(prefill_url + "/v1/loads?include=disagg"),
        decode_loads=_get(decode_url + "/v1/loads?include=disagg"),
        completion_stream=stream,
    )


def live_loads(recorded: str, now: float) -> dict[str, Any]:
    """The recorded /v1/loads answer with its timestamps set to `now` (number or ISO string)."""
    data: dict[str, Any] = json.loads(recorded)
    iso = datetime.datetime.fromtimestamp(now, datetime.UTC).isoformat()
    data["timestamp"] = iso
    for load in data.get("loads", []):
        if isinstance(load, dict) and "timestamp" in load:
            load["timestamp"] = iso if isinstance(load["timestamp"], str) else now
    return data


def _events(stream: str) -> list[bytes]:
    return [(chunk + "\n\n").encode() for chunk in stream.split("\n\n") if chunk.strip()]


def build_app(recording: Recording, role: str, peers: dict[str, str]) -> web.Application:
    """The app of one port: `role` is prefill, decode, router or router_metrics."""
    app = web.Application()
    events = _events(recording.completion_stream)

    async def ok(_: web.Request) -> web.Response:
        return web.Response(text="OK")

    # Encoded once: at 128 groups the server answers ~100 bodies of 467 kB every second, and it
    # shares the CPUs with the daemon it serves (bench/profile.md: its own CPU is reported apart).
    metrics_body = {
        "prefill": recording.prefill_metrics,
        "decode": recording.decode_metrics,
        "router_metrics": recording.router_metrics,
    }.get(role, "").encode()

    # A worker's page gzipped when the client accepts it, as SGLang's is: it mounts
    # prometheus_client's make_asgi_app (srt/utils/common.py:2845-2849 @ 0.5.23), which
    # compresses at gzip's default level whenever gzip is accepted (exposition.py:125-127 @
    # prometheus_client 0.26.0). The watchdog accepts gzip, so what it pays to inflate the page
    # is in the measurement. Compressed once, here, for the same reason as above.
    gzipped_body = gzip.compress(metrics_body) if role in ("prefill", "decode") else None

    async def metrics(request: web.Request) -> web.Response:
        if gzipped_body is not None and "gzip" in request.headers.get("Accept-Encoding", ""):
            return web.Response(
                body=gzipped_body,
                content_type="text/plain",
                charset="utf-8",
                headers={"Content-Encoding": "gzip"},
            )
        return web.Response(body=metrics_body, content_type="text/plain", charset="utf-8")

    async def loads(_: web.Request) -> web.Response:
        raw = recording.prefill_loads if role == "prefill" else recording.decode_loads
        return web.json_response(live_loads(raw, time.time()))

    async def server_info(_: web.Request) -> web.Response:
        return web.json_response({"disaggregation_mode": role, "version": "0.5.23"})

    async def workers(_: web.Request) -> web.Response:
        return web.json_response(
            {
                "workers": [
                    {"url": peers["prefill"], "worker_type": "prefill", "is_healthy": True},
                    {"url": peers["decode"], "worker_type": "decode", "is_healthy": True},
                ]
            }
        )

    async def completion(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in events:
            await response.write(event)
        await response.write_eof()
        return response

    async def abort(_: web.Request) -> web.Response:
        return web.json_response({})

    if role == "router_metrics":
        app.router.add_get("/metrics", metrics)
        return app
    app.router.add_get("/health", ok)
    app.router.add_get("/health_generate", ok)
    app.router.add_get("/readiness", ok)
    app.router.add_get("/liveness", ok)
    if role == "router":
        app.router.add_get("/workers", workers)
        app.router.add_post("/v1/completions", completion)
        return app
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/loads", loads)
    app.router.add_get("/server_info", server_info)
    app.router.add_get("/get_server_info", server_info)
    app.router.add_post("/abort_request", abort)
    return app


ROLES = ("prefill", "decode", "router", "router_metrics")


async def serve(
    recording: Recording, groups: int
) -> tuple[list[web.AppRunner], list[dict[str, int]]]:
    """Start 4 × `groups` listeners on free loopback ports; their runners and ports per group."""
    runners: list[web.AppRunner] = []
    ports: list[dict[str, int]] = []
    for _ in range(groups):
        group: dict[str, int] = {}
        peers: dict[str, str] = {}
        for role in ROLES:
            runner = web.AppRunner(build_app(recording, role, peers), access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            server = site._server  # aiohttp has no public accessor for the bound port
            assert server is not None
            group[role] = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
            runners.append(runner)
        peers["prefill"] = f"http://127.0.0.1:{group['prefill']}"
        peers["decode"] = f"http://127.0.0.1:{group['decode']}"
        ports.append(group)
    return runners, ports


async def _main(recording_dir: Path, groups: int) -> int:
    recording = Recording.load(recording_dir)
    runners, ports = await serve(recording, groups)
    print(json.dumps({"groups": ports}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    for runner in runners:
        await runner.cleanup()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--recording", type=Path, required=True, help="directory of a Recording")
    parser.add_argument("--groups", type=int, default=1)
    args = parser.parse_args(argv)
    return asyncio.run(_main(args.recording, args.groups))


if __name__ == "__main__":
    sys.exit(main())
