"""Test support for Alertmanager silences and alerts.

- `FakeAlertmanager`: the four API v2 calls the watchdog makes, in memory, for httpx.MockTransport;
  every request is kept, and `fail` turns any of them into an error.
- `RealAlertmanager`: Debian's prometheus-alertmanager on 127.0.0.1 (a free port, a temporary
  storage path, no cluster port), stopped by its PID; skipped where it is not installed.
- `Harness`: the daemon's CycleRunner for one group, driven by a scripted decide(), with a
  restarter that calls back when its first step starts (where a test looks at Alertmanager).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
from prometheus_client import CollectorRegistry

from pdsim.stack import free_ports, http_get
from tests.unit import configs, evidence_helpers
from watchdog.act.alertmanager import AlertmanagerClient, GroupAlerts
from watchdog.config import Config
from watchdog.configfile import build_config
from watchdog.decide import Decision, GroupState, Verdict, initial_state
from watchdog.evidence.incident import IncidentStore
from watchdog.model import (
    Action,
    Observation,
    RestartOutcome,
    RestartPlan,
    State,
    StepResult,
)
from watchdog.observe.observer import GroupObserver, ObservedCycle
from watchdog.run import cycle
from watchdog.run.cycle import CycleRunner, GroupRuntime
from watchdog.run.metrics import WatchdogMetrics

ALERTMANAGER_BIN = "/usr/bin/prometheus-alertmanager"
MISSING_ALERTMANAGER = (
    "prometheus-alertmanager is not installed (Debian package: prometheus-alertmanager)"
)
GROUP = "g1"


class FakeClock:
    """A clock the test moves; starts at the real time (Alertmanager compares with its own)."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move the clock on."""
        self.now += seconds


class FakeAlertmanager:
    """Silences by id and posted alerts, as API v2 keeps them; every request recorded."""

    def __init__(self) -> None:
        self.silences: dict[str, dict[str, Any]] = {}
        self.alerts: list[dict[str, Any]] = []
        self.requests: list[httpx.Request] = []
        # Return a response (or raise) to fail a request; None lets it through.
        self.fail: Callable[[httpx.Request], Awaitable[httpx.Response | None]] | None = None

    def transport(self) -> httpx.MockTransport:
        """A transport answering as this Alertmanager."""
        return httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        """One request, answered as Alertmanager 0.25 would (for what the watchdog sends)."""
        self.requests.append(request)
        if self.fail is not None:
            failed = await self.fail(request)
            if failed is not None:
                return failed
        path = request.url.path
        if request.method == "POST" and path == "/api/v2/silences":
            body = json.loads(request.content)
            silence_id = body.get("id") or str(uuid.uuid4())
            self.silences[silence_id] = {**body, "id": silence_id, "status": {"state": "active"}}
            return httpx.Response(200, json={"silenceID": silence_id})
        if request.method == "DELETE" and path.startswith("/api/v2/silence/"):
            found = self.silences.get(path.rsplit("/", 1)[1])
            if found is None:
                return httpx.Response(404, text="silence not found")
            found["status"] = {"state": "expired"}
            return httpx.Response(200)
        if request.method == "POST" and path == "/api/v2/alerts":
            self.alerts.extend(json.loads(request.content))
            return httpx.Response(200)
        return httpx.Response(404, text="not found")

    def active(self) -> list[dict[str, Any]]:
        """The silences not expired."""
        return [s for s in self.silences.values() if s["status"]["state"] == "active"]

    def bodies(self, method: str, path: str) -> list[Any]:
        """The JSON bodies of the requests `method path` so far."""
        return [
            json.loads(r.content) if r.content else None
            for r in self.requests
            if r.method == method and r.url.path == path
        ]


@dataclass
class RealAlertmanager:
    """A running prometheus-alertmanager; `url` is its base URL."""

    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def silences(self) -> list[dict[str, Any]]:
        """GET /api/v2/silences."""
        return cast(list[dict[str, Any]], self._get("/api/v2/silences"))

    def alerts(self) -> list[dict[str, Any]]:
        """GET /api/v2/alerts (active, silenced and inhibited ones alike)."""
        return cast(list[dict[str, Any]], self._get("/api/v2/alerts"))

    def _get(self, path: str) -> Any:
        status, body = http_get(self.url + path, timeout_s=10.0)
        assert status == 200, (path, status, body[:300])
        return json.loads(body)


@contextlib.contextmanager
def real_alertmanager(tmp_path: Path) -> Iterator[RealAlertmanager]:
    """prometheus-alertmanager on 127.0.0.1 with a minimal config; stopped by PID afterwards."""
    if shutil.which(ALERTMANAGER_BIN) is None:
        pytest.skip(MISSING_ALERTMANAGER)
    root = tmp_path / "alertmanager"
    (root / "data").mkdir(parents=True)
    config = root / "alertmanager.yml"
    config.write_text('route:\n  receiver: "null"\nreceivers:\n  - name: "null"\n')
    (port,) = free_ports(1)
    log_path = root / "alertmanager.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [
                ALERTMANAGER_BIN,
                f"--config.file={config}",
                f"--storage.path={root / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--cluster.listen-address=",
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    running = RealAlertmanager(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        _wait_ready(running)
        yield running
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


def _wait_ready(am: RealAlertmanager, timeout_seconds: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        if am.proc.poll() is not None:
            raise AssertionError(f"alertmanager exited: {am.log_path.read_text()[-2000:]}")
        with contextlib.suppress(OSError):
            status, _ = http_get(am.url + "/-/ready", timeout_s=2.0)
            if status == 200:
                return
        time.sleep(0.1)
    raise AssertionError(f"alertmanager not ready: {am.log_path.read_text()[-2000:]}")


def config_with_alertmanager(tmp_path: Path, url: str, **alertmanager: Any) -> Config:
    """One group `g1` with short cycles and an [alertmanager] section at `url`."""
    settings = {"url": url, "silence_seconds": 60.0, "timeout_seconds": 5.0, **alertmanager}
    return build_config(
        {
            "watchdog": {"state_dir": str(tmp_path / "state"), "cycle_seconds": 0.05},
            "alertmanager": settings,
            "group": [configs.group(GROUP)],
        }
    )


class RecordingRestarter:
    """Executes a plan by calling `at_first_step` (then every step is ready)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.plans: list[RestartPlan] = []
        self.at_first_step: Callable[[], Awaitable[None]] | None = None

    async def execute(self, plan: RestartPlan) -> RestartOutcome:
        """The plan 'done'; `at_first_step` runs where StopUnit of the first unit would."""
        self.plans.append(plan)
        started = self.clock()
        if self.at_first_step is not None:
            await self.at_first_step()
        steps = tuple(
            StepResult(role=s.role, unit=s.unit, ok=True, phase="ready", started_at=started)
            for s in plan.steps
        )
        return RestartOutcome(
            plan=plan, ok=True, dry_run=False, steps=steps, started_at=started,
            finished_at=self.clock(),
        )  # fmt: skip


class _StillObserver:
    """An observer whose every observation is empty: decide() is scripted."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock

    async def observe(self) -> ObservedCycle:
        return ObservedCycle(Observation(group=GROUP, at=self.clock()))

    def note_decision(self, *, healthy: bool) -> None:
        """The observer's fetch cadence follows decisions; an empty one has none to follow."""


# What each scripted cycle decides: the state it moves to, its verdict and its action.
Step = tuple[State, Verdict, Action]
CO_RESTART: Step = (State.RESTARTING, Verdict.SILENT_STALL, Action.CO_RESTART)
VERIFYING: Step = (State.VERIFYING, Verdict.VERIFYING, Action.NONE)
PASSED: Step = (State.HEALTHY, Verdict.VERIFICATION_PASSED, Action.NONE)
HELD: Step = (State.HELD, Verdict.BUDGET_EXHAUSTED, Action.NONE)
HEALTHY: Step = (State.HEALTHY, Verdict.OK, Action.NONE)


@dataclass
class Harness:
    """A CycleRunner for group g1 whose decide() follows `script`, one step per cycle."""

    runner: CycleRunner
    runtime: GroupRuntime
    restarter: RecordingRestarter
    registry: CollectorRegistry
    clock: FakeClock
    script: list[Step] = field(default_factory=list)

    def decide(
        self, state: GroupState, observation: Observation, group: Any, now: float
    ) -> Decision:
        """The next scripted step, from the state the runner holds."""
        new_state, verdict, action = self.script.pop(0)
        return Decision(replace(state, state=new_state, since=now), verdict, action, ())

    async def cycle(self, step: Step) -> Decision:
        """One cycle deciding `step`."""
        self.script.append(step)
        return await self.runner.run(self.runtime)

    def errors(self, operation: str) -> float | None:
        """alertmanager_errors_total{operation}."""
        return self.registry.get_sample_value(
            "sglang_watchdog_alertmanager_errors_total", {"operation": operation}
        )


def make_harness(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    config: Config,
    http: httpx.AsyncClient,
    *,
    dry_run: bool = False,
    clock: FakeClock | None = None,
) -> Harness:
    """The harness over `config`'s first group, talking to Alertmanager through `http`."""
    clock = clock or FakeClock()
    registry = CollectorRegistry()
    metrics = WatchdogMetrics(registry, groups=[GROUP])
    assert config.alertmanager is not None
    client = AlertmanagerClient(
        config.alertmanager, http, clock=clock, count_error=metrics.count_alertmanager_error
    )
    restarter = RecordingRestarter(clock)
    runner = CycleRunner(
        config.watchdog,
        metrics=metrics,
        incidents=IncidentStore(config.watchdog.state_dir, keep=10, max_mib=10, clock=clock),
        restarter=restarter,
        client=http,
        systemd=None,
        once=False,
        on_state_change=lambda: None,
        clock=clock,
        alerts=GroupAlerts(client, dry_run=dry_run),
    )
    runtime = GroupRuntime(
        config=config.group[0],
        observer=cast(GroupObserver, _StillObserver(clock)),
        scheduler=None,
        state=initial_state(clock()),
    )
    harness = Harness(runner, runtime, restarter, registry, clock)

    async def fake_evidence(*args: object, **kwargs: object) -> object:
        return evidence_helpers.evidence()

    monkeypatch.setattr(cycle, "decide", harness.decide)
    monkeypatch.setattr(cycle, "capture_evidence", fake_evidence)
    return harness


async def wait_for(predicate: Callable[[], bool], what: str, timeout_seconds: float = 30.0) -> None:
    """Until `predicate` holds (polled; the deadline is generous, never a speed assertion)."""
    async with asyncio.timeout(timeout_seconds):
        while not predicate():
            await asyncio.sleep(0.01)
    assert predicate(), what
