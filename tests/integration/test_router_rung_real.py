"""The router rung against pdsim behind the real router: a wedged router is restarted alone.

The router is wedged as bench's `router_wedge` scenario does it (SIGSTOP: connects succeed, nothing
answers); the workers stay healthy, so the daemon's direct PD probes (a prefill and a decode asked
directly with the same bootstrap fields) pass while router probes fail. The dry-run daemon must
call it `router_wedge` and plan the router alone. A transfer stall fails the direct probes too and
keeps the full co-restart. Every process is stopped by its PID.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bench.harness import GroupTarget, WatchdogProcess
from pdsim.stack import REAL_SGLANG, StackConfig, StackPorts, free_ports, start_stack
from tests.integration.test_real_verdicts import (
    HEALTHY_TIMEOUT_S,
    LIGHT_LOAD,
    ROUTER_ARGS,
    Run,
    timings,
    wait_decision,
)
from watchdog.configfile import config_text

pytestmark = pytest.mark.slow


@contextlib.asynccontextmanager
async def stack_with_bootstrap_port(tmp_path: Path) -> AsyncIterator[Run]:
    """A 0.5.23 stack and a dry-run daemon that knows the prefill's bootstrap port (which the
    direct probes hand to decode), the group already called healthy."""
    ports = StackPorts(*free_ports(5))
    (metrics_port,) = free_ports(1)
    config = StackConfig(
        compat=REAL_SGLANG,
        router_args=ROUTER_ARGS,
        worker_args=("--no-access-log",),
        ports=ports,
        log_dir=tmp_path / "stack",
    )
    stack = await asyncio.to_thread(start_stack, config)
    target = GroupTarget(
        name="real",
        prefill_url=stack.prefill_url,
        decode_url=stack.decode_url,
        router_url=stack.router_url,
        router_metrics_url=stack.router_metrics_url,
    )
    group = target.overrides()
    group["prefill"]["bootstrap_port"] = ports.bootstrap
    own = {
        "watchdog": {
            "state_dir": str(tmp_path / "state"),
            "metrics_listen": f"127.0.0.1:{metrics_port}",
        },
        "group": [group],
    }
    config_path = tmp_path / "watchdog.toml"
    config_path.write_text(config_text(timings(), own))
    watchdog = WatchdogProcess(config_path, dry_run=True, log_path=tmp_path / "watchdog.log")
    run = Run(stack, watchdog)
    try:
        await watchdog.start()
        run.start_load(LIGHT_LOAD)
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


async def test_wedged_router_with_healthy_workers_plans_the_router_alone(tmp_path: Path) -> None:
    async with stack_with_bootstrap_port(tmp_path) as run:
        pid = run.stack.pids["router"]
        os.kill(pid, signal.SIGSTOP)
        try:
            decision = await wait_decision(run, 40.0)
            rehearsed = await run.watchdog.wait_for_event(
                lambda e: e.get("event") == "restart_skipped_dry_run" and e["_at"] >= run.t0,
                10.0,
            )
            planned = run.events_after("restart_planned")
            direct = [
                e
                for e in run.watchdog.events
                if e.get("event") == "probe_failed" and e.get("kind") == "direct"
            ]
        finally:
            os.kill(pid, signal.SIGCONT)
    assert decision is not None, f"no decision:\n{run.decisions_text()}"
    assert decision["verdict"] == "router_wedge", run.decisions_text()
    codes = [r.get("code") for r in decision.get("reasons", [])]
    assert "router_wedge" in codes, decision
    assert rehearsed is not None, run.decisions_text()
    assert planned, run.decisions_text()
    assert planned[0]["rung"] == "router", planned[0]
    assert planned[0]["sequence"] == ["sglang-real-router.service"], planned[0]
    assert planned[0]["dry_run"] is True
    assert direct == [], direct  # the workers answered every direct probe


async def test_transfer_stall_fails_direct_probes_and_keeps_the_full_co_restart(
    tmp_path: Path,
) -> None:
    async with stack_with_bootstrap_port(tmp_path) as run:
        await asyncio.to_thread(run.stack.set_fault, "prefill", "transfer_stall")
        decision = await wait_decision(run, 40.0)
        await run.watchdog.wait_for_event(
            lambda e: e.get("event") == "restart_skipped_dry_run" and e["_at"] >= run.t0, 10.0
        )
        planned = run.events_after("restart_planned")
        direct = [
            e
            for e in run.events_after("probe_failed")
            if e.get("kind") == "direct" and e["_at"] >= run.t0
        ]
    assert decision is not None, f"no decision:\n{run.decisions_text()}"
    assert decision["verdict"] == "silent_stall", run.decisions_text()
    assert planned, run.decisions_text()
    assert planned[0]["rung"] == "full"
    assert len(planned[0]["sequence"]) == 3
    assert direct, "the direct probes should have failed too"
