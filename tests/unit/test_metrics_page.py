"""The /metrics page is rendered at start and then at most once per daemon cycle, by the first
scrape after the cycle's refresh, never per scrape: a flood of scrapes cannot take the GIL from
detection, and a cycle nobody scrapes renders nothing."""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, exposition
from prometheus_client.openmetrics import exposition as openmetrics

from tests.unit.rawhttp import refused_url
from tests.unit.stall_once import stall_once
from tests.unit.test_app import NO_BUS, StopAfter, write_config
from tests.unit.test_metrics import raw_get
from watchdog.config import load_config
from watchdog.run import cycle
from watchdog.run import metrics as metrics_module
from watchdog.run.daemon import run_daemon
from watchdog.run.metrics import WatchdogMetrics, serve_metrics

SCRAPES = 40


def _counting(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> list[int]:
    """Replace `module.name` by a wrapper that counts its calls (one list item per call)."""
    real: Callable[..., bytes] = getattr(module, name)
    calls: list[int] = []

    def spy(*args: object, **kwargs: object) -> bytes:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


def _get(port: int, *headers: str, target: str = "/metrics") -> bytes:
    head = "".join(f"{h}\r\n" for h in headers)
    return raw_get(port, f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1\r\n{head}\r\n".encode())


async def test_scrapes_serve_the_cached_page_until_a_refresh(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Forty scrapes render the registry not once (the page was rendered at start); a value set
    meanwhile appears only after refresh(), whose next scrape renders once for all forty."""
    calls = _counting(monkeypatch, exposition, "generate_latest")
    registry = CollectorRegistry()
    metrics = WatchdogMetrics(registry, groups=["g"])
    server = await serve_metrics(registry, "127.0.0.1:0")
    try:
        assert len(calls) == 1  # at start
        metrics.count_refusal("g", "host_unreachable")
        answers = [await asyncio.to_thread(_get, server.port) for _ in range(SCRAPES)]
        assert len(calls) == 1
        assert all(a.startswith(b"HTTP/1.1 200 OK\r\n") for a in answers)
        assert b'reason="host_unreachable"} 1.0' not in answers[-1]  # rendered before the count
        server.refresh()
        server.refresh()
        assert len(calls) == 1  # a refresh nobody scrapes renders nothing
        after = [await asyncio.to_thread(_get, server.port) for _ in range(SCRAPES)]
        assert all(b'reason="host_unreachable"} 1.0' in a for a in after)
        assert len(calls) == 2
    finally:
        server.close()


async def test_variants_are_rendered_once_per_refresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """OpenMetrics, gzip and name[] answers are produced once per rendering, however many
    scrapes ask for them."""
    calls = _counting(monkeypatch, openmetrics, "generate_latest")
    registry = CollectorRegistry()
    WatchdogMetrics(registry, groups=["g"])
    server = await serve_metrics(registry, "127.0.0.1:0")
    accept = "Accept: application/openmetrics-text; version=1.0.0"
    try:
        for _ in range(SCRAPES):
            om = await asyncio.to_thread(_get, server.port, accept)
            zipped = await asyncio.to_thread(_get, server.port, "Accept-Encoding: gzip")
        assert len(calls) == 1
        assert b"Content-Type: application/openmetrics-text" in om
        assert om.rstrip().endswith(b"# EOF")
        head, _, body = zipped.partition(b"\r\n\r\n")
        assert b"Content-Encoding: gzip" in head
        assert b"sglang_watchdog_build_info" in gzip.decompress(body)
        server.refresh()
        await asyncio.to_thread(_get, server.port, accept)
        assert len(calls) == 2
    finally:
        server.close()


def test_distinct_filters_beyond_the_cap_get_the_default_page() -> None:
    """A scraper varying name[] cannot make the listener render without bound: past
    metrics_module.MAX_PAGE_VARIANTS per rendering, the full default page answers (a superset, uncompressed)."""
    registry = CollectorRegistry()
    WatchdogMetrics(registry, groups=["g"])
    page = metrics_module.MetricsPage(registry)
    served = [
        page.serve("", (f"name_{n}",), gzipped=True)
        for n in range(metrics_module.MAX_PAGE_VARIANTS + 5)
    ]
    assert all(s is not None for s in served)
    filtered = [s for s in served if s is not None and s.gzipped]
    default = [s for s in served if s is not None and not s.gzipped]
    assert len(filtered) == metrics_module.MAX_PAGE_VARIANTS
    assert len(default) == 5
    assert all(b"sglang_watchdog_build_info" in s.body for s in default)
    page.refresh()
    again = page.serve("", ("name_0",), gzipped=True)
    assert again is not None
    assert again.gzipped


def test_a_collector_that_raises_gives_500_and_the_next_refresh_recovers() -> None:
    """Rendering errors are the scraper's 500, never the daemon's exception."""
    registry = CollectorRegistry()
    broken = True

    class Flaky:
        def collect(self) -> list[object]:
            if broken:
                raise RuntimeError("collector bug")
            return []

    registry.register(Flaky())  # type: ignore[arg-type]
    page = metrics_module.MetricsPage(registry)
    assert page.serve("", (), gzipped=False) is None
    assert metrics_module.metrics_response(page, b"GET / HTTP/1.1\r\n\r\n").startswith(
        b"HTTP/1.1 500 "
    )
    broken = False
    page.refresh()
    assert page.serve("", (), gzipped=False) is not None


async def test_the_daemon_refreshes_the_page_after_each_cycle(tmp_path: Path) -> None:
    """After the daemon's cycles the served page counts every one of them: it was rendered after
    the last cycle, not left as rendered at start."""
    config = load_config(write_config(tmp_path, refused_url(), cycle_seconds=0.05))
    registry = CollectorRegistry()
    daemon = StopAfter(config, dry_run=True, registry=registry, bus_address=NO_BUS)
    daemon.limit = 3
    assert await run_daemon(daemon) == 0
    server = daemon.metrics_server
    assert server is not None
    served = server.page.serve("", (), gzipped=False)
    assert served is not None
    count = f"sglang_watchdog_cycle_duration_seconds_count {float(daemon.cycles)}"
    assert count.encode() in served.body


async def test_a_state_change_refreshes_the_page_before_the_co_restart_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a co-restart runs (its cycle not over yet), scrapes already show `restarting`."""
    seen: list[bytes] = []

    async def capture_during_the_action(*args: object, **kwargs: object) -> None:
        assert daemon.metrics_server is not None
        served = daemon.metrics_server.page.serve("", (), gzipped=False)
        assert served is not None
        seen.append(served.body)
        raise RuntimeError("no evidence in this test")

    stall_once(monkeypatch)
    monkeypatch.setattr(cycle, "capture_evidence", capture_during_the_action)
    config = load_config(write_config(tmp_path, refused_url(), cycle_seconds=0.05))
    daemon = StopAfter(config, dry_run=True, registry=CollectorRegistry(), bus_address=NO_BUS)
    assert await run_daemon(daemon) == 0
    (page,) = seen
    assert b'sglang_watchdog_state{group="g1",state="restarting"} 1.0' in page
    # The page is refreshed once the decision's metrics are all set: its stall is counted.
    assert b'sglang_watchdog_stalls_detected_total{group="g1",kind="silent_stall"} 1.0' in page
