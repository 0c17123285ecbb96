"""The benchmark scenarios (faults and benign loads) and one run of one scenario on its own stack.

A run: start a fresh simulated PD stack (pdsim/, behind the real sglang-router) on free ports,
the real watchdog daemon in dry-run against it, and the baselines polling the same stack; wait until
the watchdog calls the group healthy; inject the fault (or start the benign condition) at `t0`;
observe for a fixed window; collect the watchdog's log and metrics and the baselines' firings;
stop everything by PID. Every run has its own stack, so runs can go side by side.

How each scenario is modelled, and why, is in its `how` text (results.md prints it).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import traceback
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import httpx

from bench.baselines import (
    BaselineSet,
    BaselineTargets,
    BaselineTimings,
    run_baselines,
    scrape_instance,
)
from bench.harness import (
    COMPRESSED_TIMINGS,
    COMPRESSION,
    GroupTarget,
    LoadProfile,
    Loads,
    WatchdogProcess,
    read_metrics,
    summarize_events,
    total,
    watchdog_config_toml,
)
from pdsim.stack import REAL_SGLANG, PDStack, StackConfig, StackPorts, free_ports, start_stack
from watchdog.configfile import Overrides

Kind = Literal["fault", "benign"]

# SGLang's own timeouts divided like the watchdog's (health check 20 s, scheduler watchdog 300 s,
# PD bootstrap / waiting 300 s, idle gauge refresh 30 s). Access logs off: they cost CPU only.
WORKER_ARGS: tuple[str, ...] = (
    "--health-timeout-s", "4",
    "--watchdog-timeout", "60",
    "--bootstrap-timeout-s", "60",
    "--waiting-timeout-s", "60",
    "--idle-report-s", "6",
    "--no-access-log",
)  # fmt: skip

# The router's documented defaults (docs/sglang.md §4), time-based ones divided by the compression:
# health check every 60 s → 12 s, timeout 5 s → 2 s (not 1 s: a real /health takes 1.00-1.05 s,
# docs/sglang.md §7.1), 3 failures / 2 successes, circuit breaker on
# (60 s → 12 s open, 120 s → 24 s window), retries on, request timeout 1800 s → 360 s. Only the
# shutdown grace period is shortened, so teardown does not wait for hung requests.
ROUTER_DEFAULT_ARGS: tuple[str, ...] = (
    "--health-check-interval-secs", "12",
    "--health-check-timeout-secs", "2",
    "--health-failure-threshold", "3",
    "--health-success-threshold", "2",
    "--cb-timeout-duration-secs", "12",
    "--cb-window-duration-secs", "24",
    "--retry-max-backoff-ms", "6000",
    "--request-timeout-secs", "360",
    "--shutdown-grace-period-secs", "1",
)  # fmt: skip

BASELINE_TIMINGS = BaselineTimings(compression=COMPRESSION)
BACKGROUND_LOAD = LoadProfile(clients=2, max_tokens=32, think_seconds=0.2, timeout_seconds=30.0)


@dataclass
class RunContext:
    """What an injection may touch: the stack, and undo actions run before teardown."""

    stack: PDStack
    load_router_url: str
    undo: list[Callable[[], None]] = field(default_factory=list)
    loads: Loads = field(default_factory=Loads)
    notes: dict[str, Any] = field(default_factory=dict)

    def start_load(self, profile: LoadProfile) -> None:
        """Start a closed-loop load generator (cancelled at the end of the run)."""
        self.loads.start(self.load_router_url, profile)

    async def stop_loads(self) -> None:
        await self.loads.stop()


Inject = Callable[[RunContext], Awaitable[None]]


@dataclass(frozen=True)
class Scenario:
    """One row of the results table."""

    name: str
    kind: Kind
    title: str
    how: str
    inject: Inject
    observe_seconds: float
    background_load: LoadProfile | None = BACKGROUND_LOAD
    decode_args: tuple[str, ...] = ()
    prefill_faults: tuple[Mapping[str, Any], ...] = ()
    decode_faults: tuple[Mapping[str, Any], ...] = ()
    watchdog_first: bool = False  # measure from the daemon's start (slow model load)
    # pdsim's compat opt-ins (pdsim/stack.py); None keeps the stack library's default.
    compat: frozenset[str] | None = None


# --------------------------------------------------------------------------- injections


async def _set_fault(ctx: RunContext, role: str, kind: str, **params: Any) -> None:
    await asyncio.to_thread(ctx.stack.set_fault, role, kind, **params)


async def inject_transfer_stall(ctx: RunContext) -> None:
    await _set_fault(ctx, "prefill", "transfer_stall")


async def inject_decode_only_restart(ctx: RunContext) -> None:
    # A planned decode-only restart (what an operator or a deploy does): SIGTERM, start again.
    await ctx.stack.arestart("decode")


async def inject_decode_stall_midstream(ctx: RunContext) -> None:
    await _set_fault(ctx, "decode", "decode_stall_midstream")


async def inject_collective_hang(ctx: RunContext) -> None:
    await _set_fault(ctx, "decode", "collective_hang")


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


async def inject_router_wedge(ctx: RunContext) -> None:
    # SIGSTOP: the listening sockets stay open, so connects succeed and nothing ever answers,
    # which is what a wedged router looks like from outside (no crash, no RST, no 5xx).
    pid = ctx.stack.pids["router"]
    _signal(pid, signal.SIGSTOP)
    ctx.undo.append(lambda: _signal(pid, signal.SIGCONT))


async def inject_decode_crash(ctx: RunContext) -> None:
    # systemd's Restart=on-failure with RestartSec=100ms, done by hand: SIGKILL decode, then start
    # the same command line again while prefill keeps running.
    popen = ctx.stack.controller.procs["decode"].popen
    assert popen is not None
    _signal(popen.pid, signal.SIGKILL)
    await asyncio.to_thread(popen.wait)
    await asyncio.sleep(0.1)
    await ctx.stack.arestart("decode")


async def inject_saturation(ctx: RunContext) -> None:
    # Decode runs --max-running-requests 8; 16 closed-loop clients keep 8 more in its queue.
    ctx.start_load(LoadProfile(clients=16, max_tokens=100, think_seconds=0.0, timeout_seconds=60))


async def inject_long_generations(ctx: RunContext) -> None:
    # 8000 tokens at 200 tokens/s: 40 s each, longer than the observation window, so no load
    # request finishes while they run (only the probes complete).
    ctx.start_load(LoadProfile(clients=4, max_tokens=8000, think_seconds=0.0, timeout_seconds=120))


# Decode takes 2 requests at a time at 40 tokens/s (OVERLOAD_DECODE_ARGS); 12 closed-loop clients
# generating 160 tokens (4 s each) keep ~10 in its prealloc queue, so a probe waits ~20 s for a
# slot, 5x the compressed probe timeout.
OVERLOAD_DECODE_ARGS: tuple[str, ...] = (
    "--max-running-requests",
    "2",
    "--decode-tokens-per-s",
    "40",
)
OVERLOAD_LOAD = LoadProfile(clients=12, max_tokens=160, think_seconds=0.0, timeout_seconds=120)


async def inject_overload(ctx: RunContext) -> None:
    ctx.start_load(OVERLOAD_LOAD)


async def inject_transfer_failures_70pct(ctx: RunContext) -> None:
    await _set_fault(ctx, "prefill", "degraded_bootstrap", fraction=0.7)


async def inject_pause(ctx: RunContext) -> None:
    pid = ctx.stack.pids["decode"]
    _signal(pid, signal.SIGSTOP)
    ctx.undo.append(lambda: _signal(pid, signal.SIGCONT))
    await asyncio.sleep(5.0)
    _signal(pid, signal.SIGCONT)


async def inject_nothing(ctx: RunContext) -> None:
    return None


async def inject_metrics_garbage(ctx: RunContext) -> None:
    await _set_fault(ctx, "prefill", "metrics_garbage")
    await _set_fault(ctx, "decode", "metrics_garbage")


SLOW_START_SECONDS = 10.0

SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "transfer_stall",
        "fault",
        "transfer stall (silent)",
        "pdsim fault `transfer_stall` on prefill: KV transfers enter Transferring and never leave; "
        "/health 200 everywhere, router /readiness 200, requests hang",
        inject_transfer_stall,
        observe_seconds=35,
    ),
    Scenario(
        "degraded_bootstrap",
        "fault",
        "degraded bootstrap after a decode-only restart",
        "decode restarted alone (SIGTERM + same command line) under a running prefill; pdsim's "
        "prefill then degrades for good: half the transfers fail on every TP rank",
        inject_decode_only_restart,
        observe_seconds=35,
    ),
    Scenario(
        "decode_stall_midstream",
        "fault",
        "decode stalls mid-stream",
        "pdsim fault `decode_stall_midstream` (after 2 tokens): HTTP 200, part of the stream, "
        "then silence; /health 200",
        inject_decode_stall_midstream,
        observe_seconds=35,
    ),
    Scenario(
        "collective_hang",
        "fault",
        "collective hang (scheduler loop blocked)",
        "pdsim fault `collective_hang` on decode: no tokens, /server_info hangs, /health 503 "
        "after the (compressed) 4 s health timeout",
        inject_collective_hang,
        observe_seconds=35,
    ),
    Scenario(
        "router_wedge",
        "fault",
        "router wedged",
        "SIGSTOP of the router process (SIGCONT at the end): connects succeed, nothing answers",
        inject_router_wedge,
        observe_seconds=35,
    ),
    Scenario(
        "decode_crash",
        "fault",
        "decode crash, restarted alone",
        "SIGKILL of decode, restarted alone after 100 ms as systemd's Restart= would, prefill "
        "kept running (no systemd here: the daemon cannot see unit start times; see recovery)",
        inject_decode_crash,
        observe_seconds=35,
    ),
    Scenario(
        "saturation_2x",
        "benign",
        "saturation at 2x capacity",
        "decode --max-running-requests 8, 16 closed-loop clients (100 tokens each, no think "
        "time) on top of the background load: requests queue, everything progresses",
        inject_saturation,
        observe_seconds=30,
        decode_args=("--max-running-requests", "8"),
    ),
    Scenario(
        "long_generations",
        "benign",
        "very long generations",
        "4 clients generating 8000 tokens (40 s each, longer than the window) at 200 tokens/s: "
        "in flight for 10x the probe timeout while tokens advance (10 min at production "
        "cadence would be 120 s here; the window sees 30 s of it)",
        inject_long_generations,
        observe_seconds=30,
        background_load=None,
    ),
    Scenario(
        "pause_5s",
        "benign",
        "single 5 s pause",
        "SIGSTOP of decode for 5 s (wall clock, not compressed: 1.25x the compressed probe "
        "timeout, i.e. a 25 s pause at production cadence), then SIGCONT",
        inject_pause,
        observe_seconds=25,
    ),
    Scenario(
        "idle",
        "benign",
        "idle (probes only)",
        "no client traffic at all: only the watchdog's probes and the baselines' polls",
        inject_nothing,
        observe_seconds=25,
        background_load=None,
    ),
    Scenario(
        "metrics_down",
        "benign",
        "metrics endpoint down, serving works",
        "pdsim fault `metrics_garbage` on both workers: /metrics answers a truncated exposition "
        "that no parser accepts, while completions keep working",
        inject_metrics_garbage,
        observe_seconds=25,
    ),
    Scenario(
        "slow_start",
        "benign",
        "slow model load at start",
        f"watchdog started first; prefill and decode answer /health 503 for "
        f"{SLOW_START_SECONDS:g} s each (pdsim `slow_start`, started one after the other as in "
        "the co-restart order), the router only after both",
        inject_nothing,
        observe_seconds=15,
        prefill_faults=({"kind": "slow_start", "seconds": SLOW_START_SECONDS},),
        decode_faults=({"kind": "slow_start", "seconds": SLOW_START_SECONDS},),
        watchdog_first=True,
    ),
    Scenario(
        "transfer_failures_70pct",
        "fault",
        "70 % transfer failures behind retries",
        "pdsim fault `degraded_bootstrap` (fraction 0.7) on prefill, real SGLang 0.5.23 "
        "semantics: 70 % of KV transfers fail on every TP rank; the router's default retries "
        "make most non-streamed client requests succeed anyway (streamed probes are not retried)",
        inject_transfer_failures_70pct,
        observe_seconds=35,
        compat=REAL_SGLANG,
    ),
    Scenario(
        "overload_aborted_probes",
        "benign",
        "overload with aborted probes",
        "real SGLang 0.5.23 semantics; decode --max-running-requests 2 at 40 tokens/s, 12 "
        "closed-loop clients (160 tokens each, no think time): a probe waits ~20 s in decode's "
        "queue, times out (4 s) and is aborted by the watchdog, and every such abort is a counted "
        "bootstrap failure on both workers, while tokens keep flowing",
        inject_overload,
        observe_seconds=30,
        decode_args=OVERLOAD_DECODE_ARGS,
        compat=REAL_SGLANG,
    ),
)


def scenario_named(name: str) -> Scenario:
    """The scenario called `name`; KeyError lists the known names."""
    for scenario in SCENARIOS:
        if scenario.name == name:
            return scenario
    raise KeyError(f"no scenario {name!r} (known: {', '.join(s.name for s in SCENARIOS)})")


# --------------------------------------------------------------------------- one run


@dataclass(frozen=True)
class RunSettings:
    """Knobs shared by all runs of a bench invocation."""

    work_dir: Path
    timings: Overrides = field(default_factory=lambda: COMPRESSED_TIMINGS)
    baseline_timings: BaselineTimings = BASELINE_TIMINGS
    window_scale: float = 1.0  # --quick shortens the observation windows
    healthy_timeout_seconds: float = 45.0
    settle_seconds: float = 3.0
    # SGLang's and the router's own timeouts, compressed like the watchdog's (bench/uncompressed.py
    # passes the documented defaults).
    worker_args: tuple[str, ...] = WORKER_ARGS
    router_args: tuple[str, ...] = ROUTER_DEFAULT_ARGS


WATCHDOG_COUNTERS = (
    "sglang_watchdog_probes_total",
    "sglang_watchdog_restarts_total",
    "sglang_watchdog_stalls_detected_total",
    "sglang_watchdog_internal_errors_total",
)


# Stacks started and not yet stopped: a run cancelled while its stack was starting in a thread
# would otherwise leak three processes; run.py stops whatever is left here on the way out.
ACTIVE_STACKS: dict[int, PDStack] = {}


def start_tracked_stack(config: StackConfig) -> PDStack:
    """start_stack, remembered in ACTIVE_STACKS until stop_tracked_stack."""
    stack = start_stack(config)
    ACTIVE_STACKS[id(stack)] = stack
    return stack


def stop_tracked_stack(stack: PDStack) -> None:
    """Stop a stack by its PIDs and forget it."""
    try:
        stack.stop()
    finally:
        ACTIVE_STACKS.pop(id(stack), None)


def stop_leftover_stacks() -> None:
    """Stop every stack still running (after an interrupt)."""
    for stack in list(ACTIVE_STACKS.values()):
        stop_tracked_stack(stack)


def _stack_config(
    scenario: Scenario, ports: StackPorts, log_dir: Path, settings: RunSettings
) -> StackConfig:
    config = StackConfig(
        worker_args=settings.worker_args,
        decode_args=scenario.decode_args,
        router_args=settings.router_args,
        prefill_faults=scenario.prefill_faults,
        decode_faults=scenario.decode_faults,
        log_dir=log_dir,
        ports=ports,
        ready_timeout_s=2 * SLOW_START_SECONDS + 30,
    )
    return config if scenario.compat is None else replace(config, compat=scenario.compat)


def _urls(ports: StackPorts) -> GroupTarget:
    base = "http://127.0.0.1:"
    return GroupTarget(
        name="bench",
        prefill_url=f"{base}{ports.prefill}",
        decode_url=f"{base}{ports.decode}",
        router_url=f"{base}{ports.router}",
        router_metrics_url=f"{base}{ports.router_metrics}/metrics",
        bootstrap_port=ports.bootstrap,
    )


async def run_scenario(scenario: Scenario, rep: int, settings: RunSettings) -> dict[str, Any]:  # noqa: PLR0915  # one scenario's script, step by step: splitting it hides the order
    """One repetition of one scenario; returns a JSON-ready result (with `error` on failure)."""
    run_dir = settings.work_dir / f"{scenario.name}-{rep}"
    run_dir.mkdir(parents=True, exist_ok=True)
    ports = StackPorts(*free_ports(5))
    (metrics_port,) = free_ports(1)
    group = _urls(ports)
    config_path = run_dir / "watchdog.toml"
    config_path.write_text(
        watchdog_config_toml(
            [group],
            settings.timings,
            state_dir=run_dir / "state",
            metrics_listen=f"127.0.0.1:{metrics_port}",
        )
    )
    # --record keeps every observation, so a surprising run can be replayed through the detector
    # (`watchdog replay`) without rerunning the bench.
    watchdog = WatchdogProcess(
        config_path,
        dry_run=True,
        log_path=run_dir / "watchdog.log",
        extra_args=("--record", str(run_dir / "observations.jsonl")),
    )
    baselines = BaselineSet.create(settings.baseline_timings.compressed())
    targets = BaselineTargets(group.prefill_url, group.decode_url, group.router_url)
    result: dict[str, Any] = {"scenario": scenario.name, "kind": scenario.kind, "rep": rep}
    stack: PDStack | None = None
    ctx: RunContext | None = None
    baseline_task: asyncio.Task[None] | None = None
    started = time.time()
    t0 = started
    try:
        # The daemon before the stack only for the slow start (its point is the daemon watching
        # a stack that is still loading); otherwise the stack first, so no probe is sent before
        # the stack listens. The baselines only once the stack listens: a kubelet would count a
        # start as failures.
        if scenario.watchdog_first:
            await watchdog.start()
        t0 = time.time()
        stack = await asyncio.to_thread(
            start_tracked_stack, _stack_config(scenario, ports, run_dir / "stack", settings)
        )
        result["stack_ready_after_s"] = time.time() - t0
        if not scenario.watchdog_first:
            await watchdog.start()
        baseline_task = asyncio.create_task(run_baselines(baselines, targets))
        ctx = RunContext(stack, group.router_url)
        if scenario.background_load is not None:
            ctx.start_load(scenario.background_load)
        healthy = await watchdog.wait_for_event(
            lambda e: e.get("event") == "state_changed" and e.get("new") == "healthy",
            settings.healthy_timeout_seconds,
        )
        if healthy is None and not scenario.watchdog_first:
            raise RuntimeError(
                f"the watchdog did not call the group healthy within "
                f"{settings.healthy_timeout_seconds:g} s:\n{watchdog.tail()}"
            )
        result["healthy_after_start_s"] = None if healthy is None else healthy["_at"] - started
        if not scenario.watchdog_first:
            await asyncio.sleep(settings.settle_seconds)
            # Probe share before the fault: afterwards serving stops and the ratio means nothing.
            result["before_fault"] = await _traffic(metrics_port, targets.decode_url)
            t0 = time.time()
            await scenario.inject(ctx)
        result["inject_seconds"] = time.time() - t0
        window = scenario.observe_seconds * settings.window_scale
        # A slow start is observed from the watchdog's start until `window` after serving began.
        window_start = t0 + (result["stack_ready_after_s"] if scenario.watchdog_first else 0.0)
        await asyncio.sleep(max(0.0, window_start + window - time.time()))
        result["window_s"] = time.time() - t0
        watchdog.sample_cost()
        result.update(await _collect(watchdog, baselines, targets, metrics_port, ctx))
    except Exception as exc:  # one broken run must not end the bench; it is reported
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()
    finally:
        if ctx is not None:
            await ctx.stop_loads()
            for undo in ctx.undo:
                undo()
        if baseline_task is not None:
            baseline_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await baseline_task
        await watchdog.stop()
        if stack is not None:
            await asyncio.to_thread(stop_tracked_stack, stack)
    result["t0"] = t0
    result["watchdog"] = summarize_events(watchdog.events, t0).__dict__
    result["watchdog"]["exit_code"] = watchdog.returncode
    result["watchdog_command"] = watchdog.command
    result["baselines"] = _baseline_results(baselines, t0)
    result["wall_s"] = time.time() - started
    return result


async def _collect(
    watchdog: WatchdogProcess,
    baselines: BaselineSet,
    targets: BaselineTargets,
    metrics_port: int,
    ctx: RunContext,
) -> dict[str, Any]:
    own = await read_metrics(f"http://127.0.0.1:{metrics_port}/metrics", WATCHDOG_COUNTERS)
    async with httpx.AsyncClient(trust_env=False) as client:
        for instance, url in (("prefill", targets.prefill_url), ("decode", targets.decode_url)):
            baselines.record_scrape(instance, await scrape_instance(client, url, 3.0))
    out: dict[str, Any] = {
        "served_requests": baselines.served["decode"].total,
        "load_ok": sum(g.ok for g in ctx.loads.generators),
        "load_failed": sum(g.failed for g in ctx.loads.generators),
    }
    if own is None:
        out["metrics_error"] = "the watchdog's metrics listener did not answer"
        return out
    probes = own["sglang_watchdog_probes_total"]
    out["probes_total"] = total(probes, kind="completion")
    out["probes_ok"] = total(probes, kind="completion", result="ok")
    out["restarts_metric_dry_run"] = total(own["sglang_watchdog_restarts_total"], result="dry_run")
    out["stalls_metric"] = total(own["sglang_watchdog_stalls_detected_total"])
    out["internal_errors_metric"] = total(own["sglang_watchdog_internal_errors_total"])
    return out


async def _traffic(metrics_port: int, decode_url: str) -> dict[str, float | None]:
    """Completion probes sent so far and requests decode finished so far."""
    own = await read_metrics(
        f"http://127.0.0.1:{metrics_port}/metrics", ("sglang_watchdog_probes_total",)
    )
    served = await read_metrics(decode_url + "/metrics", ("sglang:num_requests_total",))
    return {
        "probes_total": None
        if own is None
        else total(own["sglang_watchdog_probes_total"], kind="completion"),
        "served_requests": None
        if served is None
        else sum(served["sglang:num_requests_total"].values()),
    }


def _baseline_results(baselines: BaselineSet, t0: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, times in baselines.fired_at().items():
        after = [t - t0 for t in times if t >= t0]
        out[name] = {
            "first_after_s": after[0] if after else None,
            "fired_before_t0": sum(1 for t in times if t < t0),
            "fires": len(times),
        }
    return out
