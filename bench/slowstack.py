"""A slow but serving decode behind the real router, watched by the real daemon (dry-run).

Shared by bench/slow_decode.py and the integration tests (tests/integration/slowdecode.py and
test_real_verdicts.py import from here; bench never imports from tests/).

`slow_stack` starts its own 0.5.23 stack (1 or 2 decodes, `/v1/loads` served or answering 404
as before 0.5.9), a dry-run daemon against it with the given timings, waits until the daemon
calls the group healthy, then makes every decode slow (pdsim's `slow_decode` fault: `tokens_per_s`
per running request) and keeps its slots busy with closed-loop clients, so the daemon's probes
wait in decode's queue and time out there: a slow server, which the daemon must never restart.
Several go side by side (asyncio.gather): the stacks mostly sleep, a slow decode costs no CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.baselines import SeriesKey
from bench.harness import (
    GroupTarget,
    LoadGenerator,
    LoadProfile,
    Loads,
    WatchdogProcess,
    read_metrics,
)
from pdsim.stack import (
    REAL_SGLANG,
    ROUTER_REAL_HEALTH_ARGS,
    PDStack,
    StackConfig,
    StackPorts,
    free_ports,
    start_stack,
)
from watchdog.configfile import Overrides, config_text

# Before the injection: a light load, so the daemon sees progress and calls the group healthy.
LIGHT_LOAD = LoadProfile(clients=2, max_tokens=32, think_seconds=0.2, timeout_seconds=30.0)
# A bound, not a claim: three stacks and their daemons starting side by side on two busy cores
# took longer than 40 s to be seen healthy once.
HEALTHY_TIMEOUT_S = 180.0

# pdsim.stack.ROUTER_FAST_ARGS: the router checks every worker's /health each second (checks add
# no decode tokens: tests/conformance; this many of them is the hardest case for that claim).
ROUTER_HEALTH_INTERVAL_S = 1.0
assert ROUTER_REAL_HEALTH_ARGS[:2] == ("--health-check-interval-secs", "1")

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


@dataclass
class Run:
    """One stack, its watchdog and loads, and what a test or bench needs to read back."""

    stack: PDStack
    watchdog: WatchdogProcess
    loads: Loads = field(default_factory=Loads)
    t0: float = 0.0

    def start_load(self, profile: LoadProfile) -> LoadGenerator:
        return self.loads.start(self.stack.router_url, profile)

    async def stop_loads(self) -> None:
        await self.loads.stop()

    async def worker_counters(self, names: tuple[str, ...]) -> dict[str, dict[str, float]]:
        """role -> counter -> value, summed over label sets (the stacks run TP 1, so no request is
        counted on several ranks)."""
        out: dict[str, dict[str, float]] = {}
        for role, url in (("prefill", self.stack.prefill_url), ("decode", self.stack.decode_url)):
            samples = await read_counters(url + "/metrics", names, role)
            out[role] = {name: sum(series.values()) for name, series in samples.items()}
        return out

    def events_after(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.watchdog.events if e.get("event") == name and e["_at"] >= self.t0]

    def all_events(self, names: frozenset[str]) -> list[dict[str, Any]]:
        return [e for e in self.watchdog.events if e.get("event") in names]

    def verdicts(self) -> list[str]:
        """Every verdict the daemon logged (state changes, alerts, decisions)."""
        return [str(e["verdict"]) for e in self.watchdog.events if "verdict" in e]

    def decisions_text(self) -> str:
        """The decisions with their reasons, for assertion messages."""
        lines = [
            f"{e['_at'] - self.t0:+.1f}s {e.get('event')} {e.get('verdict', '')} "
            f"{[r.get('message') for r in e.get('reasons', [])]}"
            for e in self.watchdog.events
            if e.get("event") in {"stall_detected", "state_changed", "alert"}
        ]
        return "\n".join(lines) or "(no decisions logged)"


async def wait_decision(run: Run, timeout_s: float) -> dict[str, Any] | None:
    """The first `stall_detected` at or after `run.t0`, or None after `timeout_s`."""
    return await run.watchdog.wait_for_event(
        lambda e: e.get("event") == "stall_detected" and e["_at"] >= run.t0, timeout_s
    )


@dataclass(frozen=True)
class Slow:
    """One slow decode: the rate, the topology and what the daemon can read."""

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
    def total_tokens_per_s(self) -> float:
        """What every decode together generates for the clients with every slot busy."""
        return self.tokens_per_s * self.slots * self.decodes

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
async def slow_stack(tmp_path: Path, slow: Slow, timings: Overrides) -> AsyncIterator[Run]:
    """A stack and a dry-run daemon at `timings`, the group called healthy while decode is still
    fast; `run.t0` is set once decode is slow and its slots busy. Stopped by PID on the way out."""
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
    target = GroupTarget.of_stack("slow", stack)
    group: dict[str, Any] = target.overrides()
    group["decode"] = [
        {"unit": f"sglang-slow-{key}.service", "url": stack.url(key)} for key in decodes
    ]
    own = {
        "watchdog": {
            "state_dir": str(tmp_path / "state"),
            "metrics_listen": f"127.0.0.1:{metrics_port}",
        },
        "group": [group],
    }
    config_path = tmp_path / "watchdog.toml"
    config_path.write_text(config_text(timings, own))
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


# The harness's own reads of the workers' counters: what the scenario is checked against, so
# a loaded machine must slow them, never fail them (one 3 s read timed out on two busy cores).
READ_TIMEOUT_S = 30.0
READ_ATTEMPTS = 3


async def read_counters(
    url: str, names: tuple[str, ...], what: str
) -> dict[str, dict[SeriesKey, float]]:
    """The samples of `names` at `url`, asked up to READ_ATTEMPTS times; fails naming `what`."""
    for attempt in range(READ_ATTEMPTS):
        samples = await read_metrics(url, names, timeout_seconds=READ_TIMEOUT_S)
        if samples is not None:
            return samples
        if attempt + 1 < READ_ATTEMPTS:
            await asyncio.sleep(1.0)
    raise AssertionError(f"{what} /metrics did not answer {READ_ATTEMPTS} times")


async def decode_tokens(run: Run, decodes: int) -> float:
    """realtime_tokens_total over every decode: what its decode steps generated."""
    total = 0.0
    for key in decode_keys(decodes):
        samples = await read_counters(
            run.stack.url(key) + "/metrics", ("sglang:realtime_tokens_total",), key
        )
        total += sum(sum(series.values()) for series in samples.values())
    return total
