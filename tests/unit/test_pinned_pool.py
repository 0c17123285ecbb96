"""Pinned DP probes have a connection budget of their own: the worker's health check never waits.

A decode with dp_size 32 gets a round of 32 pinned probes, each holding a request open on the
decode and the first prefill for up to a probe timeout. Here two small HTTP servers on 127.0.0.1
hold every /generate until the test releases them, so the round's requests stay open; the health
check of the same decode, through the daemon's own client, must still get a connection.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.unit.test_probe_scheduler import FakeTime, Probes, run_until_parked, stop_scheduler
from watchdog.config import GroupSection, parse_config
from watchdog.observe.pool import PINNED_PROBES_AT_ONCE, make_client
from watchdog.observe.probes.health import check_health
from watchdog.observe.probes.scheduler import ProbeScheduler

DP_SIZE = 32
ROUND_AT = 1060.0  # FakeTime's T0 plus dp_probe_every_seconds: the first pinned round
DEADLINE_SECONDS = 30.0  # generous: only a broken run ever waits this long


class HoldingServer:
    """Answers /health at once and holds every /generate open until `release` is set."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.arrived = asyncio.Event()  # PINNED_PROBES_AT_ONCE generate requests are open
        self.open_generates = 0
        self.most_open = 0
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        self.release.set()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ", 2)[1]
                await reader.readexactly(_content_length(head))
                if path.startswith(b"/generate"):
                    await self._hold()
                    writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n")
                else:
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _hold(self) -> None:
        self.open_generates += 1
        self.most_open = max(self.most_open, self.open_generates)
        if self.open_generates >= PINNED_PROBES_AT_ONCE:
            self.arrived.set()
        try:
            await self.release.wait()
        finally:
            self.open_generates -= 1


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip())
    return 0


@pytest.fixture
async def servers() -> AsyncIterator[tuple[HoldingServer, HoldingServer]]:
    """A prefill and a decode that hold every request open until told to answer."""
    prefill, decode = HoldingServer(), HoldingServer()
    await prefill.start()
    await decode.start()
    yield prefill, decode
    await prefill.stop()
    await decode.stop()


def _group(prefill_port: int, decode_port: int) -> GroupSection:
    data: dict[str, Any] = {
        "group": [
            {
                "name": "g",
                "prefill": [{"unit": "p.service", "url": f"http://127.0.0.1:{prefill_port}"}],
                "decode": [
                    {
                        "unit": "d.service",
                        "url": f"http://127.0.0.1:{decode_port}",
                        "dp_size": DP_SIZE,
                    }
                ],
                "router": {"unit": "r.service", "url": "http://127.0.0.1:9"},
                "probe": {
                    "period_seconds": 5.0,
                    "multiround_every_seconds": 0,
                    "direct_every_seconds": 0,
                    "dp_probe_every_seconds": ROUND_AT - 1000.0,
                    "timeout_seconds": 120.0,
                    "connect_timeout_seconds": 60.0,
                },
            }
        ]
    }
    return parse_config(data, "<test>").group[0]


async def test_health_check_gets_a_connection_while_32_pinned_probes_hold_theirs(
    servers: tuple[HoldingServer, HoldingServer],
) -> None:
    """32 DP ranks' pinned probes held open on the decode leave its health check a connection."""
    prefill, decode = servers
    time = FakeTime(limit=ROUND_AT)
    async with make_client() as client:
        scheduler = ProbeScheduler(
            _group(prefill.port, decode.port),
            client,
            api_key=None,
            clock=time.clock,
            sleep=time.sleep,
            completion_probe=Probes(block=False).completion,
        )
        task = await run_until_parked(scheduler, time)
        try:
            assert scheduler.pinned_in_flight == DP_SIZE
            async with asyncio.timeout(DEADLINE_SECONDS):
                await decode.arrived.wait()
            health = await check_health(
                client,
                "decode",
                f"http://127.0.0.1:{decode.port}/health",
                timeout_seconds=DEADLINE_SECONDS / 3,
            )
            assert health.ok, health.detail
            assert decode.most_open <= PINNED_PROBES_AT_ONCE
            assert prefill.most_open <= PINNED_PROBES_AT_ONCE
        finally:
            decode.release.set()
            prefill.release.set()
            with contextlib.suppress(Exception):
                await stop_scheduler(task)
