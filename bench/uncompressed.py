"""The uncompressed run: the shipped defaults at real cadence, faults and the hardest benign loads.

The main suite divides every time by ~5 so it fits; its latencies say little about what an
operator of configs/example.toml gets. Here the daemon runs with config.py's defaults (nothing
overridden), SGLang's and the router's own timeouts are their documented defaults, and the pause
lasts 25 s of wall clock. Two silent faults (transfer stall, mid-stream decode stall) measure the
detection latency; three benign loads (overload with aborted probes, long generations, a 25 s
pause) count false restarts. All runs of one repetition go side by side on their own stacks.

    python -m bench.run --only uncompressed       # this suite alone, results in results.md

It also states what the watchdog costs the served system at the defaults (probe_cost()).
"""

from __future__ import annotations

import asyncio
import signal
from dataclasses import replace
from typing import Any

from bench.baselines import BaselineTimings
from bench.harness import DEFAULT_TIMINGS, LoadProfile, timing_values
from bench.scenarios import (
    RunContext,
    RunSettings,
    Scenario,
    _signal,
    scenario_named,
)
from watchdog.config import ProbeSection

NAME = "uncompressed"

# SGLang's documented defaults: /health timeout 20 s, scheduler watchdog 300 s, PD bootstrap and
# waiting 300 s, idle gauge refresh 30 s (the main suite divides them by 5).
WORKER_ARGS: tuple[str, ...] = (
    "--health-timeout-s", "20",
    "--watchdog-timeout", "300",
    "--bootstrap-timeout-s", "300",
    "--waiting-timeout-s", "300",
    "--idle-report-s", "30",
    "--no-access-log",
)  # fmt: skip

# The router's documented defaults (docs/sglang.md §4); only the shutdown grace is shortened.
ROUTER_ARGS: tuple[str, ...] = (
    "--health-check-interval-secs", "60",
    "--health-check-timeout-secs", "5",
    "--health-failure-threshold", "3",
    "--health-success-threshold", "2",
    "--cb-timeout-duration-secs", "60",
    "--cb-window-duration-secs", "120",
    "--retry-max-backoff-ms", "30000",
    "--request-timeout-secs", "1800",
    "--shutdown-grace-period-secs", "1",
)  # fmt: skip

PAUSE_SECONDS = 25.0


async def inject_pause_25s(ctx: RunContext) -> None:
    pid = ctx.stack.pids["decode"]
    _signal(pid, signal.SIGSTOP)
    ctx.undo.append(lambda: _signal(pid, signal.SIGCONT))
    await asyncio.sleep(PAUSE_SECONDS)
    _signal(pid, signal.SIGCONT)


async def inject_long_generations(ctx: RunContext) -> None:
    # 24000 tokens at 200 tokens/s: 120 s each, longer than the window.
    ctx.start_load(LoadProfile(clients=4, max_tokens=24000, think_seconds=0.0, timeout_seconds=300))


def scenarios() -> tuple[Scenario, ...]:
    """The suite, built from the main suite's scenarios with real-cadence windows."""
    overload = scenario_named("overload_aborted_probes")
    return (
        replace(scenario_named("transfer_stall"), observe_seconds=60),
        replace(scenario_named("decode_stall_midstream"), observe_seconds=60),
        replace(
            overload,
            how=overload.how.replace("times out (4 s)", "times out (12 s, the default)"),
            observe_seconds=90,
        ),
        replace(
            scenario_named("long_generations"),
            how=(
                "4 clients generating 24000 tokens at 200 tokens/s (120 s each, longer than the "
                "90 s window): in flight for 10x the probe timeout while tokens advance"
            ),
            inject=inject_long_generations,
            observe_seconds=90,
        ),
        Scenario(
            "pause_25s",
            "benign",
            "single 25 s pause",
            f"SIGSTOP of decode for {PAUSE_SECONDS:g} s of wall clock, then SIGCONT: /health, "
            "scrapes and probes of decode all time out meanwhile",
            inject_pause_25s,
            observe_seconds=60,
        ),
    )


def settings(base: RunSettings) -> RunSettings:
    """The main suite's settings at real cadence: default timings, SGLang's and the router's."""
    return replace(
        base,
        work_dir=base.work_dir.parent / "uncompressed",
        timings=DEFAULT_TIMINGS,
        baseline_timings=BaselineTimings(compression=1.0),
        worker_args=WORKER_ARGS,
        router_args=ROUTER_ARGS,
        # Warm-up at the default cadence: a few 5 s cycles and probes, not a few 0.5 s ones.
        healthy_timeout_seconds=180.0,
        settle_seconds=5.0,
    )


def probe_cost() -> dict[str, Any]:
    """What one group's watchdog adds to the served system at the defaults, from the config.

    Completion probes: one per period, max_tokens generated each. Multi-round probes: one per
    multiround_every_seconds, multiround_rounds completions of max_tokens each. Per cycle while
    anything is in doubt, else each on its cadence (`[group.probe]` *_every_cycles): /health of
    prefill and decode and /readiness of the router, /metrics of prefill and decode, the
    router's /metrics, /v1/loads of prefill and decode. Aborts only follow timed-out probes
    (none when healthy).
    """
    t = timing_values(DEFAULT_TIMINGS)
    period = t["period_seconds"]
    every = t["multiround_every_seconds"]
    rounds = t["multiround_rounds"]
    max_tokens = t["max_tokens"]
    cycle = t["cycle_seconds"]
    multiround_rate = rounds / every if every > 0 else 0.0
    generation_rate = 1 / period + multiround_rate  # completions through the router per second
    return {
        "period_seconds": period,
        "max_tokens": max_tokens,
        "multiround_every_seconds": every,
        "multiround_rounds": rounds,
        "cycle_seconds": cycle,
        "generation_requests_per_second": generation_rate,
        "generated_tokens_per_hour": 3600 * generation_rate * max_tokens,
        "health_requests_per_second": 3 / cycle,
        "scrape_requests_per_second": 3 / cycle,
        "loads_requests_per_second": 2 / cycle,
        "http_requests_per_second": generation_rate + 8 / cycle,
        "calm": _calm_rates(cycle, generation_rate),
    }


def _calm_rates(cycle: float, generation_rate: float) -> dict[str, float]:
    """The same requests per second while nothing is in doubt, each on its default cadence."""
    every = {name: _default(name) for name in _CADENCES}
    health = 3 / (cycle * every["health_every_cycles"])
    scrapes = 2 / (cycle * every["metrics_every_cycles"]) + 1 / (
        cycle * every["router_metrics_every_cycles"]
    )
    loads = 2 / (cycle * every["loads_every_cycles"])
    return {
        "health_requests_per_second": health,
        "scrape_requests_per_second": scrapes,
        "loads_requests_per_second": loads,
        "http_requests_per_second": generation_rate + health + scrapes + loads,
        **{name: float(value) for name, value in every.items()},
    }


_CADENCES = (
    "health_every_cycles",
    "metrics_every_cycles",
    "router_metrics_every_cycles",
    "loads_every_cycles",
)


def _default(name: str) -> int:
    default = ProbeSection.model_fields[name].default
    assert isinstance(default, int), name
    return default
