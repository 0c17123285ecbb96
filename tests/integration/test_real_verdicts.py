"""The real daemon's verdicts against a simulated stack with real SGLang 0.5.23 semantics.

Each test starts its own stack (pdsim with `compat=REAL_SGLANG`: a 1 s /health, aborts that are
counted PD failures, decode's waiting timeout) behind the real sglang-router with its retries on,
runs `watchdog --dry-run --log-format json` against it as a subprocess (bench/harness.py), waits
until the daemon calls the group healthy, then injects a condition and asserts on what the daemon
logged (`stall_detected` with its verdict, `restart_planned`, `restart_skipped_dry_run`) and on the
workers' /metrics. Nothing is shared between tests; every process is stopped by its PID.

The rules these exercise are in docs/decisions.md; the SGLang behaviours in docs/sglang.md §7.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from bench.harness import (
    COMPRESSED_TIMINGS,
    GroupTarget,
    LoadProfile,
    WatchdogProcess,
)
from bench.scenarios import OVERLOAD_DECODE_ARGS, OVERLOAD_LOAD
from bench.slowstack import HEALTHY_TIMEOUT_S, LIGHT_LOAD, RESTART_EVENTS, Run, wait_decision
from pdsim.stack import (
    REAL_SGLANG,
    ROUTER_REAL_HEALTH_ARGS,
    StackConfig,
    StackPorts,
    free_ports,
    http_get,
    start_stack,
)
from watchdog.configfile import Overrides, config_text, merge

pytestmark = pytest.mark.slow

FAILURE_COUNTERS = (
    "sglang:num_transfer_failed_reqs_total",
    "sglang:num_bootstrap_failed_reqs_total",
)
ABORTED = "sglang:num_aborted_requests_total"
GENERATED = "sglang:generation_tokens_total"
WORKER_COUNTERS = (*FAILURE_COUNTERS, ABORTED, GENERATED)

# The router's retries stay on (its default); its health checking is made fast, with a timeout
# a real 1 s /health meets, and its circuit breaker is off (pdsim.stack.ROUTER_REAL_HEALTH_ARGS).
ROUTER_ARGS = ROUTER_REAL_HEALTH_ARGS
assert "--disable-retries" not in ROUTER_ARGS


def timings(**stall: Any) -> Overrides:
    """bench's compressed cadence (health deadline 2 s, over a real /health's 1.00-1.05 s), with
    `stall` keys changed."""
    probe = COMPRESSED_TIMINGS["group"]["probe"]
    assert probe["health_timeout_seconds"] >= 2.0
    return merge(COMPRESSED_TIMINGS, {"group": {"stall": stall}})


@contextlib.asynccontextmanager
async def real_stack(
    tmp_path: Path,
    watchdog_timings: Overrides,
    *,
    decode_args: tuple[str, ...] = (),
    background: LoadProfile | None = LIGHT_LOAD,
    group_extra: Overrides | None = None,
) -> AsyncIterator[Run]:
    """A 0.5.23 stack and a dry-run daemon watching it, the group already called healthy;
    `run.t0` is set when the body may inject. `group_extra` goes over the group's table (e.g. a
    decode's `dp_size`). Everything is stopped by PID on the way out."""
    ports = StackPorts(*free_ports(5))
    (metrics_port,) = free_ports(1)
    config = StackConfig(
        compat=REAL_SGLANG,
        router_args=ROUTER_ARGS,
        decode_args=decode_args,
        worker_args=("--no-access-log",),
        ports=ports,
        log_dir=tmp_path / "stack",
    )
    stack = await asyncio.to_thread(start_stack, config)
    group = GroupTarget.of_stack("real", stack)
    own = {
        "watchdog": {
            "state_dir": str(tmp_path / "state"),
            "metrics_listen": f"127.0.0.1:{metrics_port}",
        },
        "group": [merge(group.overrides(), group_extra or {})],
    }
    config_path = tmp_path / "watchdog.toml"
    config_path.write_text(config_text(watchdog_timings, own))
    watchdog = WatchdogProcess(config_path, dry_run=True, log_path=tmp_path / "watchdog.log")
    run = Run(stack, watchdog)
    try:
        await watchdog.start()
        if background is not None:
            run.start_load(background)
        healthy = await watchdog.wait_for_event(
            lambda e: e.get("event") == "state_changed" and e.get("new") == "healthy",
            HEALTHY_TIMEOUT_S,
        )
        assert healthy is not None, f"never healthy:\n{watchdog.tail(40)}"
        run.t0 = time.time()
        yield run
    finally:
        await run.stop_loads()
        await watchdog.stop()
        await asyncio.to_thread(stack.stop)


# --------------------------------------------------------------------------- the tests


# bench's overload scenario: decode takes 2 requests at a time at 40 tokens/s, and 12 closed-loop
# clients generating 160 tokens (4 s each) keep ~10 in its prealloc queue, so a probe waits ~20 s
# for a slot: every probe times out (4 s) in the queue and is aborted by the daemon, and on 0.5.23
# each such abort is a counted bootstrap failure (docs/sglang.md §7.2). Tokens keep flowing:
# overload, never a stall.
OVERLOAD_WINDOW_S = 25.0


async def test_overload_with_aborted_probes_is_never_restarted(tmp_path: Path) -> None:
    """Overload with aborted probes is never restarted, though raw failures pass the old limit."""
    async with real_stack(
        tmp_path, timings(), decode_args=OVERLOAD_DECODE_ARGS, background=None
    ) as run:
        before = await run.worker_counters(WORKER_COUNTERS)
        run.start_load(OVERLOAD_LOAD)
        await asyncio.sleep(OVERLOAD_WINDOW_S)
        after = await run.worker_counters(WORKER_COUNTERS)
        restarts = run.all_events(RESTART_EVENTS)
    assert restarts == [], f"overload was restarted:\n{run.decisions_text()}"
    # The old detector counted raw failures: these rose by more than its threshold (5), so it
    # would have co-restarted a server that is only busy.
    raw_failures = max(
        sum(after[role][name] - before[role][name] for name in FAILURE_COUNTERS)
        for role in ("prefill", "decode")
    )
    assert raw_failures >= 5, (before, after)
    assert after["decode"][GENERATED] > before["decode"][GENERATED]
    assert "overloaded" in run.verdicts(), run.decisions_text()
    # The failures are the daemon's own aborts of probes that timed out in decode's queue.
    aborted = [
        e
        for e in run.events_after("probe_failed")
        if "abort_request sent" in str(e.get("detail", ""))
    ]
    assert len(aborted) >= 5, run.watchdog.tail(40)
    assert after["decode"][ABORTED] - before["decode"][ABORTED] >= 5, (before, after)


async def test_transfer_stall_is_a_silent_stall_well_before_the_waiting_timeout(
    tmp_path: Path,
) -> None:
    """A stalled KV transfer is a silent stall well before SGLang's own 300 s waiting timeout."""
    async with real_stack(tmp_path, timings()) as run:
        await asyncio.to_thread(run.stack.set_fault, "prefill", "transfer_stall")
        decision = await wait_decision(run, 40.0)
        rehearsed = await run.watchdog.wait_for_event(
            lambda e: e.get("event") == "restart_skipped_dry_run" and e["_at"] >= run.t0, 10.0
        )
        planned = run.events_after("restart_planned")
    assert decision is not None, f"no decision:\n{run.decisions_text()}"
    assert decision["verdict"] == "silent_stall", run.decisions_text()
    # SGLang's own waiting timeout is 300 s (the stack runs its default); the decision comes at
    # about probe timeout + no_progress_seconds (4 + 6 s here).
    assert decision["_at"] - run.t0 < 30.0, run.decisions_text()
    assert rehearsed is not None, run.decisions_text()
    assert [e["dry_run"] for e in planned] == [True], planned


async def test_seventy_percent_transfer_failures_behind_retries_are_acted_on(
    tmp_path: Path,
) -> None:
    """70 % transfer failures behind router retries are degraded_bootstrap within 30 s."""
    async with real_stack(tmp_path, timings()) as run:
        before = await run.worker_counters(WORKER_COUNTERS)
        await asyncio.to_thread(run.stack.set_fault, "prefill", "degraded_bootstrap", fraction=0.7)
        decision = await wait_decision(run, 40.0)
        after = await run.worker_counters(WORKER_COUNTERS)
    assert decision is not None, f"no decision:\n{run.decisions_text()}"
    assert decision["verdict"] == "degraded_bootstrap", run.decisions_text()
    assert decision["_at"] - run.t0 < 30.0, run.decisions_text()
    failed = max(
        sum(after[role][name] - before[role][name] for name in FAILURE_COUNTERS)
        for role in ("prefill", "decode")
    )
    assert failed >= 5, (before, after)


async def test_seventy_percent_failures_are_acted_on_by_their_share_alone(tmp_path: Path) -> None:
    """The same path with the probe and count rules out of reach (a probe-failure run and a
    failure count no window can hold): the failed share of attempted transfers alone acts, as it
    must where the router's retries hide the failures from probes."""
    out_of_reach = timings(probe_failures=1000, transfer_failures=100_000)
    async with real_stack(tmp_path, out_of_reach) as run:
        await asyncio.to_thread(run.stack.set_fault, "prefill", "degraded_bootstrap", fraction=0.7)
        decision = await wait_decision(run, 40.0)
        ok = sum(g.ok for g in run.loads.generators)
        failed = sum(g.failed for g in run.loads.generators)
    assert decision is not None, f"no decision:\n{run.decisions_text()}"
    assert decision["verdict"] == "degraded_bootstrap", run.decisions_text()
    assert decision["_at"] - run.t0 < 30.0, run.decisions_text()
    (transfer,) = [r for r in decision["reasons"] if r.get("code") == "transfer_failures"]
    assert transfer["attempts"] >= transfer["min_attempts"], transfer
    assert transfer["ratio"] >= transfer["ratio_threshold"], transfer
    # The router's retries hid most of the failures from the (non-streamed) clients.
    assert ok > failed, (ok, failed)


HEALTHY_WINDOW_S = 25.0
NEVER_ON_A_HEALTHY_STACK = frozenset(
    {"worker_unhealthy", "crash", "silent_stall", "degraded_bootstrap", "stall_suspected"}
)


async def test_healthy_stack_with_a_one_second_health_is_never_hung(tmp_path: Path) -> None:
    """Real SGLang's one-second /health on a healthy stack never reads as hung."""
    async with real_stack(tmp_path, timings()) as run:
        started = time.monotonic()
        status, _ = await asyncio.to_thread(http_get, run.stack.decode_url + "/health", 5.0)
        health_s = time.monotonic() - started
        await asyncio.sleep(HEALTHY_WINDOW_S)
        restarts = run.all_events(RESTART_EVENTS)
        served = sum(g.ok for g in run.loads.generators)
    assert restarts == [], run.decisions_text()
    wrong = NEVER_ON_A_HEALTHY_STACK.intersection(run.verdicts())
    assert not wrong, run.decisions_text()
    assert served > 0
    assert status == 200
    assert health_s >= 1.0  # real SGLang's /health: one poll period before its first look
