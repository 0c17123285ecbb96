"""A slow but serving decode behind the real router, watched by the real daemon.

Each `SlowRun` starts its own 0.5.23 stack (1 or 2 decodes, `/v1/loads` served or answering 404
as before 0.5.9), a dry-run daemon against it, waits until the daemon calls the group healthy,
then makes every decode slow (pdsim's `slow_decode` fault: `tokens_per_s` per running request)
and keeps its slots busy with closed-loop clients, so the daemon's probes wait in decode's queue
and time out there: a slow server, which the daemon must never restart. Several
runs go side by side (asyncio.gather): the stacks mostly sleep, a slow decode costs no CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness import (
    COMPRESSED_TIMINGS,
    GroupTarget,
    LoadProfile,
    WatchdogProcess,
    read_metrics,
)
from pdsim.stack import (
    REAL_SGLANG,
    ROUTER_REAL_HEALTH_ARGS,
    StackConfig,
    StackPorts,
    free_ports,
    start_stack,
)
from tests.integration.test_real_verdicts import HEALTHY_TIMEOUT_S, LIGHT_LOAD, Run
from watchdog.configfile import Overrides, config_text, merge

# pdsim.stack.ROUTER_FAST_ARGS: the router checks every worker's /health each second; the daemon
# is told so (router.health_check_interval_seconds), as an operator would.
ROUTER_HEALTH_INTERVAL_S = 1.0
assert ROUTER_REAL_HEALTH_ARGS[:2] == ("--health-check-interval-secs", "1")

# bench's compressed cadence, with the shipped /health deadline (5 s): a real /health answers once
# any output came out of the scheduler, which a decode stepping every 2 s gives within 1-2 s
# (pdsim.engine.Engine.health_check; docs/sglang.md §7.1).
TIMINGS: Overrides = merge(
    COMPRESSED_TIMINGS, {"group": {"probe": {"health_timeout_seconds": 5.0}}}
)
NO_PROGRESS_S = float(TIMINGS["group"]["stall"]["no_progress_seconds"])
CYCLE_S = float(TIMINGS["watchdog"]["cycle_seconds"])
ACT_VERDICTS = frozenset(
    {
        "silent_stall",
        "degraded_bootstrap",
        "router_wedge",
        "crash",
        "decode_only_restart",
        "failed_start",
        "verification_failed",
    }
)
RESTART_EVENTS = frozenset({"stall_detected", "restart_planned", "restart_skipped_dry_run"})


@dataclass(frozen=True)
class Slow:
    """One member of the family: the rate, the topology and what the daemon can read."""

    tokens_per_s: float  # per running request
    decodes: int
    loads: bool  # /v1/loads served (else 404, as before 0.5.9)
    slots: int  # --max-running-requests of each decode
    clients: int  # closed-loop clients per decode
    max_tokens: int  # per client request

    @property
    def name(self) -> str:
        where = "with" if self.loads else "without"
        return f"{self.tokens_per_s:g} tok/s, {self.decodes} decode(s), {where} /v1/loads"

    @property
    def load(self) -> LoadProfile:
        # A request takes max_tokens / tokens_per_s seconds; clients wait for all of it.
        seconds = self.max_tokens / self.tokens_per_s
        return LoadProfile(
            clients=self.clients * self.decodes,
            max_tokens=self.max_tokens,
            think_seconds=0.0,
            timeout_seconds=max(120.0, 4 * seconds),
        )


def decode_keys(decodes: int) -> list[str]:
    return ["decode"] + [f"decode{i + 1}" for i in range(1, decodes)]


@contextlib.asynccontextmanager
async def slow_stack(tmp_path: Path, slow: Slow) -> AsyncIterator[Run]:
    """A stack and a dry-run daemon, the group called healthy while decode is still fast;
    `run.t0` is set once decode is slow and its slots busy. Stopped by PID on the way out."""
    ports = StackPorts(*free_ports(5))
    (metrics_port,) = free_ports(1)
    config = StackConfig(
        compat=REAL_SGLANG,
        # Every slot of every decode busy: smg's default (cache-aware) sends most of the
        # clients' look-alike prompts to one decode, leaving the other half idle.
        router_args=(*ROUTER_REAL_HEALTH_ARGS, "--policy", "round_robin"),
        decode_args=("--max-running-requests", str(slow.slots)),
        # Prefill holds every stuck transfer of the stall family without running out of slots.
        # pdsim takes a second decode that talks to a running prefill for a replaced one (the
        # incident's stale transfer state) unless told it is not: two decodes run side by side.
        prefill_args=("--max-running-requests", "128", "--no-spontaneous-degrade"),
        worker_args=("--no-access-log",),
        ports=ports,
        log_dir=tmp_path / "stack",
        decodes=slow.decodes,
    )
    stack = await asyncio.to_thread(start_stack, config)
    decodes = decode_keys(slow.decodes)
    if not slow.loads:
        for key in ["prefill", *decodes]:
            await asyncio.to_thread(stack.set_fault, key, "loads_absent")
    target = GroupTarget(
        name="slow",
        prefill_url=stack.prefill_url,
        decode_url=stack.decode_url,
        router_url=stack.router_url,
        router_metrics_url=stack.router_metrics_url,
        bootstrap_port=stack.bootstrap_port,
    )
    group: dict[str, Any] = target.overrides()
    group["decode"] = [
        {"unit": f"sglang-slow-{key}.service", "url": stack.url(key)} for key in decodes
    ]
    group["router"]["health_check_interval_seconds"] = ROUTER_HEALTH_INTERVAL_S
    own = {
        "watchdog": {
            "state_dir": str(tmp_path / "state"),
            "metrics_listen": f"127.0.0.1:{metrics_port}",
        },
        "group": [group],
    }
    config_path = tmp_path / "watchdog.toml"
    config_path.write_text(config_text(TIMINGS, own))
    watchdog = WatchdogProcess(config_path, dry_run=True, log_path=tmp_path / "watchdog.log")
    run = Run(stack, watchdog)
    try:
        await watchdog.start()
        run.start_load(LIGHT_LOAD)
        healthy = await watchdog.wait_for_event(
            lambda e: e.get("event") == "state_changed" and e.get("new") == "healthy",
            HEALTHY_TIMEOUT_S,
        )
        assert healthy is not None, f"{slow.name}: never healthy:\n{watchdog.tail(40)}"
        await run.stop_loads()
        for key in decodes:
            await asyncio.to_thread(
                stack.set_fault, key, "slow_decode", tokens_per_s=slow.tokens_per_s
            )
        run.start_load(slow.load)
        run.t0 = time.time()
        yield run
    finally:
        await run.stop_loads()
        await watchdog.stop()
        await asyncio.to_thread(stack.stop)


def act_decisions(run: Run) -> list[dict[str, Any]]:
    """What the daemon decided to act on (or rehearsed, in dry-run) since `run.t0`."""
    return [
        e
        for e in run.watchdog.events
        if e["_at"] >= run.t0
        and (e.get("event") in RESTART_EVENTS or e.get("verdict") in ACT_VERDICTS)
    ]


async def decode_tokens(run: Run, decodes: int) -> float:
    """realtime_tokens_total over every decode: what its decode steps generated."""
    total = 0.0
    for key in decode_keys(decodes):
        samples = await read_metrics(
            run.stack.url(key) + "/metrics", ("sglang:realtime_tokens_total",)
        )
        assert samples is not None, f"{key} /metrics did not answer"
        total += sum(sum(series.values()) for series in samples.values())
    return total
