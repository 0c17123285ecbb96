"""Peak memory of the watchdog's readers against GiB-sized bodies, measured in a subprocess.

The readers run in a fresh interpreter (the test process's own high-water mark says nothing
about them) against hostile servers in this process; the child reports its VmHWM.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from tests.unit.rawhttp import serve
from tests.unit.test_bounded_reads import CHUNK, GIB, gzip_bomb, plain, sse

REPO = Path(__file__).resolve().parents[2]
MIB = 2**20
# The shipped unit runs under MemoryMax=1G; the readers must stay far below it.
PEAK_RSS_LIMIT_BYTES = 150 * MIB

CHILD = r"""
import asyncio, json, sys
import httpx
from watchdog.config import parse_config
from watchdog.model import Role
from watchdog.observe.probes.completion import run_completion_probe
from watchdog.observe.probes.health import check_health
from watchdog.observe.scrape import scrape_metrics

def vm_hwm() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")

async def main(base: str) -> None:
    group = parse_config({"group": [{
        "name": "g",
        "prefill": {"unit": "p.service", "url": base},
        "decode": {"unit": "d.service", "url": base},
        "router": {"unit": "r.service", "url": base},
        "probe": {"timeout_seconds": 60.0, "stream_idle_seconds": 30.0},
    }]}, "<child>").group[0]
    before = vm_hwm()
    async with httpx.AsyncClient(trust_env=False) as client:
        metrics = await scrape_metrics(client, Role.DECODE, f"{base}/metrics", timeout_seconds=60)
        bomb = await scrape_metrics(client, Role.DECODE, f"{base}/bomb", timeout_seconds=60)
        health = await check_health(client, "decode", f"{base}/health", timeout_seconds=60)
        probe = await run_completion_probe(client, group, api_key=None)
    print(json.dumps({
        "before": before,
        "peak": vm_hwm(),
        "metrics": [str(metrics.snapshot.error), len(metrics.raw or b"")],
        "bomb": [str(bomb.snapshot.error), len(bomb.raw or b"")],
        "health": [str(health.reason), health.status_code],
        "probe": [str(probe.reason), probe.detail],
    }))

asyncio.run(main(sys.argv[1]))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
async def test_peak_rss_under_gib_bodies_stays_under_150_mib() -> None:
    """1 GiB /metrics, a 1 GiB gzip bomb, a 1 GiB /health and an endless SSE line: < 150 MiB."""
    metrics, metrics_sent = plain(200, GIB, declare=False)
    bomb, _ = gzip_bomb()
    health, _ = plain(200, GIB)
    routes = {
        "/metrics": metrics,
        "/bomb": bomb,
        "/health": health,
        "/v1/completions": sse(b"data: ", lambda: CHUNK),
    }
    async with serve(routes) as server:
        child = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            CHILD,
            server.base_url,
            cwd=REPO,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            out, err = await asyncio.wait_for(child.communicate(), timeout=300)
        finally:
            if child.returncode is None:
                child.kill()
                await child.wait()
    assert child.returncode == 0, err.decode()
    report = json.loads(out)
    assert report["metrics"] == ["payload_too_large", 16 * MIB]
    assert report["bomb"] == ["payload_too_large", 16 * MIB]
    assert report["health"] == ["malformed", 200]
    assert report["probe"][0] == "malformed"
    assert "line exceeds the 1 MiB cap" in report["probe"][1]
    assert metrics_sent.bytes < 40 * MIB
    assert report["peak"] < PEAK_RSS_LIMIT_BYTES, (report["before"], report["peak"])
