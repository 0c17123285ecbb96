"""Peak memory of the watchdog's readers against GiB-sized bodies, measured in a subprocess.

The readers run in a fresh interpreter (the test process's own high-water mark says nothing
about them) against hostile servers in this process; the child reports its VmHWM.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.unit.rawhttp import serve
from tests.unit.rss_child import run_python
from tests.unit.test_bounded_reads import CHUNK, GIB, gzip_bomb, plain, sse

MIB = 2**20
# The shipped unit runs under MemoryMax=1G; the readers must stay far below it.
PEAK_RSS_LIMIT_BYTES = 150 * MIB
# One page in its parse, one being refused: a page is 16 MiB, its text as much again.
PARSE_PEAK_RSS_LIMIT_BYTES = 300 * MIB

CHILD = r"""
import asyncio, json, sys
import httpx
from watchdog.config import parse_config
from watchdog.model import Role
from watchdog.observe.probes.completion import run_completion_probe
from watchdog.observe.probes.health import check_health
from watchdog.observe.scrape import scrape_metrics
from tests.unit.rss_child import vm_hwm

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
        child = await run_python("-c", CHILD, server.base_url, timeout_seconds=300)
    assert child.returncode == 0, child.err.decode()
    report = json.loads(child.out)
    assert report["metrics"] == ["payload_too_large", 16 * MIB]
    assert report["bomb"] == ["payload_too_large", 16 * MIB]
    assert report["health"] == ["malformed", 200]
    assert report["probe"][0] == "malformed"
    assert "line exceeds the 1 MiB cap" in report["probe"][1]
    assert metrics_sent.bytes < 40 * MIB
    assert report["peak"] < PEAK_RSS_LIMIT_BYTES, (report["before"], report["peak"])


PARSE_CHILD = r"""
import asyncio, json, resource, sys, threading
from concurrent.futures import ThreadPoolExecutor
import httpx
from watchdog.model import Role
from watchdog.observe import scrape
from watchdog.observe.bounded import ParseSlot
from tests.unit.rss_child import vm_hwm

cycles, deadline, limit = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

# A page just under the 16 MiB cap whose parse outlasts any deadline: it holds the page's text
# until the end, as a parse slower than the observation deadline does.
release = threading.Event()
started = threading.Event()
real = scrape.extract_snapshot

def slow(text, role, *, scraped_at):
    started.set()
    release.wait()
    return real(text, role, scraped_at=scraped_at)

scrape.extract_snapshot = slow
line = b'sglang:num_running_reqs{model_name="m",tp_rank="%d"} 1.0\n'
parts, size = [], 0
while size < scrape.DEFAULT_MAX_BYTES - 64:
    parts.append(line % len(parts))
    size += len(parts[-1])
PAGE = b"".join(parts[:-1])

async def main() -> None:
    # The default executor of a host with 28 cores or more: min(32, cores + 4) threads.
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(32))
    slot = ParseSlot()
    outcomes: dict[str, int] = {}
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=PAGE))
    async with httpx.AsyncClient(transport=transport) as client:

        def scrape_once():
            return scrape.scrape_metrics(
                client, Role.DECODE, "http://t/metrics", timeout_seconds=600, parse_slot=slot
            )

        # The first cycle is abandoned once its parse has started (as at a deadline), whatever
        # the fetch took on this machine.
        first = asyncio.create_task(scrape_once())
        while not started.is_set():
            await asyncio.sleep(0.01)
        first.cancel()
        outcomes["abandoned"] = 1
        for _ in range(cycles - 1):
            try:
                async with asyncio.timeout(deadline):  # the observation deadline
                    result = await scrape_once()
                key = str(result.snapshot.error)
            except TimeoutError:
                key = "deadline"
            outcomes[key] = outcomes.get(key, 0) + 1
    print(json.dumps({"page": len(PAGE), "outcomes": outcomes, "peak": vm_hwm()}), flush=True)
    release.set()

asyncio.run(main())
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
async def test_parses_abandoned_at_the_deadline_do_not_pile_up_under_1_gib() -> None:
    """40 cycles scrape a page just under the 16 MiB cap whose parse outlasts the deadline, in a
    child limited to 1 GiB of address space (the unit's MemoryMax): one parse runs, the other
    cycles are refused before fetching, and the child lives with its peak far below the limit.
    (Without the slot each cycle left one more parse holding its page: 40 pages are > 1 GiB.)"""
    child = await run_python(
        "-c",
        PARSE_CHILD,
        "40",
        "5",  # seconds: what a cycle waits for a parse that never ends (without the slot)
        str(1024 * MIB),
        timeout_seconds=600,
        few_arenas=True,  # the child limits its own address space to 1 GiB
    )
    assert child.returncode == 0, child.err.decode()[-2000:]
    report = json.loads(child.out)
    assert 16 * MIB - 128 < report["page"] < 16 * MIB
    # Refused before any fetch while the first parse runs: no cycle waits for a deadline.
    assert report["outcomes"] == {"abandoned": 1, "parse_busy": 39}
    assert report["peak"] < PARSE_PEAK_RSS_LIMIT_BYTES, report["peak"]
