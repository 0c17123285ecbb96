"""The watchdog's own cost: one group at default cadence, and 1 / 8 / 32 groups for scale.

Overhead: the daemon (dry-run) watches one healthy pdsim stack for a fixed time at the timings of
configs/example.toml; CPU seconds are utime + stime from /proc/PID/stat between the daemon's
`watchdog_started` event and the end (start-up imports are reported apart), peak RSS is VmHWM.
Scale: the same daemon with N groups against bench/recorded_endpoints.py (one process replaying
payloads recorded from a pdsim stack at TP=8); cycle time comes from the daemon's own
`sglang_watchdog_cycle_duration_seconds` histogram.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.harness import (
    DEFAULT_TIMINGS,
    REPO_ROOT,
    GroupTarget,
    WatchdogProcess,
    cpu_seconds,
    read_metrics,
    watchdog_config_toml,
)
from bench.recorded_endpoints import Recording, record
from bench.report import histogram_quantile
from bench.scenarios import start_tracked_stack, stop_tracked_stack
from pdsim.payloads import sglang_payload
from pdsim.stack import StackConfig, free_ports, pd_stack
from watchdog.configfile import Overrides

CYCLE = "sglang_watchdog_cycle_duration_seconds"
PROBES = "sglang_watchdog_probes_total"
SETTLE_SECONDS = 7.0  # one default cycle (5 s) and room for the warm-up decisions
# The daemon renders its /metrics page when it is scraped (at most once per cycle): a Prometheus
# scrapes it through the window as in production (15 s, a common scrape_interval), so its cost is
# in the numbers. Nothing scraping would make the page free and the number flattering.
PROMETHEUS_SCRAPE_SECONDS = 15.0
# Default-cadence router and workers: nothing compressed here, only a quick shutdown.
ROUTER_ARGS = ("--shutdown-grace-period-secs", "1")


async def _wait_started(watchdog: WatchdogProcess) -> float:
    event = await watchdog.wait_for_event(lambda e: e.get("event") == "watchdog_started", 30.0)
    if event is None:
        raise RuntimeError(f"the watchdog did not start:\n{watchdog.tail()}")
    return time.time()


@dataclass(frozen=True)
class _CycleCounts:
    """The daemon's cycle histogram and finished checks by kind, read at one moment."""

    buckets: dict[float, float]
    count: float
    total: float
    kinds: dict[str, int]

    def since(self, start: _CycleCounts | None) -> dict[str, Any]:
        """The statistics of the cycles run after `start` (all of them when None)."""
        if start is None:
            start = _CycleCounts({}, 0.0, 0.0, {})
        count = self.count - start.count
        buckets = {le: n - start.buckets.get(le, 0.0) for le, n in self.buckets.items()}
        kinds = {k: n - start.kinds.get(k, 0) for k, n in self.kinds.items()}
        return {
            "cycles": int(count),
            "cycle_mean_s": None if count == 0 else (self.total - start.total) / count,
            "cycle_p95_s": histogram_quantile(buckets, 0.95),
            "checks_by_kind": dict(sorted(kinds.items())),
        }


async def _cycle_counts(metrics_port: int) -> _CycleCounts | None:
    names = (CYCLE + "_bucket", CYCLE + "_sum", CYCLE + "_count", PROBES)
    samples = await read_metrics(f"http://127.0.0.1:{metrics_port}/metrics", names)
    if samples is None:
        return None
    buckets = {float(dict(k)["le"]): v for k, v in samples[CYCLE + "_bucket"].items()}
    # Finished checks and probes by kind: /health and /readiness checks per cycle show the
    # fetch cadences at work (observe/cadence.py).
    kinds: dict[str, int] = {}
    for labels, value in samples.get(PROBES, {}).items():
        kind = dict(labels).get("kind", "")
        kinds[kind] = kinds.get(kind, 0) + int(value)
    return _CycleCounts(
        buckets,
        sum(samples[CYCLE + "_count"].values()),
        sum(samples[CYCLE + "_sum"].values()),
        kinds,
    )


async def _run_daemon(
    groups: Sequence[GroupTarget],
    timings: Overrides,
    work_dir: Path,
    duration_seconds: float,
    launcher: Sequence[str] | None = None,
) -> dict[str, Any]:
    (metrics_port,) = free_ports(1)
    await asyncio.to_thread(work_dir.mkdir, parents=True, exist_ok=True)
    config_path = work_dir / "watchdog.toml"
    config_path.write_text(
        watchdog_config_toml(
            groups,
            timings,
            state_dir=work_dir / "state",
            metrics_listen=f"127.0.0.1:{metrics_port}",
        )
    )
    watchdog = WatchdogProcess(
        config_path, dry_run=True, log_path=work_dir / "watchdog.log", launcher=launcher
    )
    await watchdog.start()
    try:
        await _wait_started(watchdog)
        # Warm-up (every group's first cycles, its state change to healthy) is start-up too:
        # measured from one cycle on, the steady state.
        await asyncio.sleep(SETTLE_SECONDS)
        # Cycles, like CPU, are counted within the window: the due count is groups x window / 5 s.
        at_start = await _cycle_counts(metrics_port)
        started = time.time()
        startup_cpu = cpu_seconds(watchdog.pid) or 0.0
        scrapes = asyncio.create_task(_scrape_like_prometheus(metrics_port))
        await asyncio.sleep(duration_seconds)
        end_cpu = cpu_seconds(watchdog.pid)
        scrapes.cancel()
        scraped = await asyncio.gather(scrapes, return_exceptions=True)
        elapsed = time.time() - started
        watchdog.sample_cost()
        at_end = await _cycle_counts(metrics_port)
        stats = {"cycles": None} if at_end is None else at_end.since(at_start)
    finally:
        # A profiled daemon needs time to write its profile on the way out.
        await watchdog.stop(grace_seconds=10.0 if launcher is None else 120.0)
    if end_cpu is None:
        raise RuntimeError(f"the watchdog exited early:\n{watchdog.tail()}")
    cpu = end_cpu - startup_cpu
    return {
        "groups": len(groups),
        "duration_s": round(elapsed, 2),
        "startup_cpu_seconds": round(startup_cpu, 3),
        "cpu_seconds": round(cpu, 3),
        "cpu_core_fraction": cpu / elapsed,
        "peak_rss_mib": watchdog.peak_rss_mib,
        "internal_errors": sum(1 for e in watchdog.events if e.get("event") == "cycle_failed"),
        "stall_decisions": sum(1 for e in watchdog.events if e.get("event") == "stall_detected"),
        "command": watchdog.command,
        "prometheus_scrapes": _count_of(scraped),
        **stats,
    }


def _count_of(gathered: Sequence[int | BaseException]) -> int | None:
    (result,) = gathered
    return None if isinstance(result, BaseException) else result


async def _scrape_like_prometheus(metrics_port: int) -> int:
    """GET the daemon's /metrics every PROMETHEUS_SCRAPE_SECONDS from now; how many answered."""
    answered = 0
    try:
        while True:
            if await read_metrics(f"http://127.0.0.1:{metrics_port}/metrics", ()) is not None:
                answered += 1
            await asyncio.sleep(PROMETHEUS_SCRAPE_SECONDS)
    except asyncio.CancelledError:
        return answered


async def measure_overhead(work_dir: Path, duration_seconds: float = 60.0) -> dict[str, Any]:
    """One group, default cadence, healthy pdsim stack (its default flags, real router)."""
    config = StackConfig(router_args=ROUTER_ARGS, log_dir=work_dir / "stack")
    # Started in a thread: this runs beside the scenario runs and must not block their loop.
    stack = await asyncio.to_thread(start_tracked_stack, config)
    try:
        group = GroupTarget(
            "overhead",
            stack.prefill_url,
            stack.decode_url,
            stack.router_url,
            stack.router_metrics_url,
            bootstrap_port=stack.bootstrap_port,
        )
        result = await _run_daemon([group], DEFAULT_TIMINGS, work_dir, duration_seconds)
    finally:
        await asyncio.to_thread(stop_tracked_stack, stack)
    result["timings"] = "configs/example.toml defaults (cycle 5 s, probe period 5 s)"
    return result


def record_payloads(directory: Path) -> Recording:
    """Record a healthy pdsim stack at TP=8 into `directory`, with full-size worker /metrics.

    pdsim's TP=8 exposition has ~330 lines; a real SGLang 0.5.23 server at TP=8 has ~3000 (more
    histograms and labels), and parsing is most of a scrape's cost. So the worker /metrics bodies
    are the 3000-line payload built from real SGLang names that bench_scrape.py also uses.
    """
    config = StackConfig(tp_size=8, router_args=ROUTER_ARGS, log_dir=directory / "stack")
    with pd_stack(config) as stack:
        recording = record(
            stack.prefill_url, stack.decode_url, stack.router_url, stack.router_metrics_url
        )
    recording = replace(
        recording,
        prefill_metrics=sglang_payload("0.5.23", "prefill", tp=8),
        decode_metrics=sglang_payload("0.5.23", "decode", tp=8),
    )
    recording.save(directory)
    return recording


def _start_endpoints(recording_dir: Path, groups: int) -> tuple[subprocess.Popen[str], Any]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench.recorded_endpoints",
            "--recording",
            str(recording_dir),
            "--groups",
            str(groups),
        ],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        _stop(proc)
        raise RuntimeError("bench.recorded_endpoints exited before printing its ports")
    return proc, json.loads(line)["groups"]


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


async def measure_point(
    recording_dir: Path,
    count: int,
    point_dir: Path,
    duration_seconds: float,
    launcher: Sequence[str] | None = None,
) -> dict[str, Any]:
    """One scale point: the daemon watching `count` replayed groups (their server started here)."""
    proc, ports = await asyncio.to_thread(_start_endpoints, recording_dir, count)
    try:
        base = "http://127.0.0.1:"
        groups = [
            GroupTarget(
                f"g{i:02d}",
                f"{base}{p['prefill']}",
                f"{base}{p['decode']}",
                f"{base}{p['router']}",
                f"{base}{p['router_metrics']}/metrics",
            )
            for i, p in enumerate(ports)
        ]
        server_before = cpu_seconds(proc.pid) or 0.0
        point = await _run_daemon(groups, DEFAULT_TIMINGS, point_dir, duration_seconds, launcher)
        # The replaying server shares the machine; its load says how busy the CPUs were.
        server_cpu = (cpu_seconds(proc.pid) or 0.0) - server_before
        point["endpoints_cpu_seconds"] = round(server_cpu, 3)
        point["endpoints_cpu_core_fraction"] = server_cpu / max(point["duration_s"], 1e-9)
    finally:
        _stop(proc)
    return point


def median_point(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median CPU (the lower middle of an even count), with every run's CPU
    fraction in `cpu_core_fraction_runs` in the order run."""
    ranked = sorted(runs, key=lambda p: p["cpu_core_fraction"])
    return {
        **ranked[(len(ranked) - 1) // 2],
        "cpu_core_fraction_runs": [p["cpu_core_fraction"] for p in runs],
    }


async def measure_scale(
    work_dir: Path,
    group_counts: Sequence[int] = (1, 8, 32, 128),
    duration_seconds: float = 20.0,
    progress: Callable[[str], None] = print,
    repeats: int = 1,
) -> dict[str, Any]:
    """Cycle time, CPU and RSS of one daemon watching N recorded groups at default cadence:
    `repeats` points per count, the median by CPU kept (every run's CPU listed with it)."""
    recording_dir = work_dir / "recording"
    recording = await asyncio.to_thread(record_payloads, recording_dir)
    points = []
    for count in group_counts:
        runs = []
        for run in range(repeats):
            point = await measure_point(
                recording_dir, count, work_dir / f"groups-{count}-{run}", duration_seconds
            )
            runs.append(point)
            progress(
                f"scale {count} groups: cycle mean {point.get('cycle_mean_s')}, "
                f"CPU {100 * point['cpu_core_fraction']:.2f} % of a core"
            )
        points.append(median_point(runs))
    lines = recording.prefill_metrics.count("\n")
    return {
        "description": (
            f"One daemon, N groups, default cadence (cycle 5 s, probe every 5 s per group), "
            f"{duration_seconds:g} s per point"
            + (f", {repeats} points per count (the median by CPU shown)" if repeats > 1 else "")
            + ", against bench/recorded_endpoints.py: health, "
            "readiness, /v1/loads, router metrics and a streamed completion recorded from a "
            f"pdsim TP=8 stack, worker /metrics the {lines}-line SGLang 0.5.23 TP=8 payload of "
            "bench_scrape.py; CPU after start-up, as a share of one core."
        ),
        "points": points,
    }
