"""The real watchdog daemon as a subprocess (or a sandbox unit) for end-to-end tests.

`daemon_config_toml()` writes a config for a sandboxed PD stack with compressed timings;
`DaemonProcess` runs `.venv/bin/watchdog --config CFG --log-format json` against the sandbox's
bus, reads its JSON log lines and its metrics endpoint, and is always stopped by its PID;
`MetricsWatcher` polls the metrics endpoint from a thread, so the transient states of a co-restart
(restarting, verifying) are seen as they happen.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from prometheus_client.parser import text_string_to_metric_families

from pdsim.stack import HOST, REPO_ROOT, free_ports, http_get
from sandbox.events import Event, matching_events, wait_until
from sandbox.pdsandbox import PdSandbox
from sandbox.pdunits import PdStackUnits
from watchdog.act.plan import build_plan
from watchdog.act.restarters import open_restarter
from watchdog.config import load_config
from watchdog.configfile import Overrides, config_text

WATCHDOG_BIN = REPO_ROOT / ".venv" / "bin" / "watchdog"

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


# Compressed: a stall is detected in seconds, a co-restart verified in seconds. Only what differs
# from watchdog/config.py's defaults.
TIMINGS: Overrides = {
    "watchdog": {
        "cycle_seconds": 0.5,
        "shutdown_timeout_seconds": 5.0,
        "evidence_timeout_seconds": 3.0,
    },
    "group": {
        "probe": {
            "period_seconds": 1.0,
            "timeout_seconds": 3.0,
            "stream_idle_seconds": 2.0,
            "connect_timeout_seconds": 1.0,
            "health_timeout_seconds": 2.0,
            "scrape_timeout_seconds": 1.0,
            "multiround_every_seconds": 0.0,
        },
        "stall": {"no_progress_seconds": 5.0, "startup_timeout_seconds": 10.0},
        "restart": {
            "ready_timeout_seconds": 20.0,
            "verify_probes": 3,
            "verify_timeout_seconds": 20.0,
            # A short soak: verification passes within seconds (the soak's own test lengthens it).
            "soak_probes": 4,
            "soak_seconds": 2.0,
            # Long: one stall makes one attempt within a test, whatever its outcome.
            "backoff_seconds": 600.0,
        },
    },
}


def daemon_config_toml(
    stack: PdStackUnits, state_dir: Path, metrics_port: int, timings: Overrides = TIMINGS
) -> str:
    """A watchdog config for the sandboxed stack `stack` (one group, named like the stack)."""
    own = {
        "watchdog": {
            "state_dir": str(state_dir),
            "metrics_listen": f"{HOST}:{metrics_port}",
            "journal_lines": 20,
        },
        "group": [{**stack.group_overrides(), "probe": {"model": "pdsim"}}],
    }
    return config_text(timings, own)


@dataclass(frozen=True)
class DaemonSetup:
    """Where one daemon's config, state and log live, and its metrics port."""

    config_path: Path
    state_dir: Path
    log_path: Path
    metrics_port: int

    @property
    def metrics_url(self) -> str:
        """The daemon's own /metrics."""
        return f"http://{HOST}:{self.metrics_port}/metrics"

    @classmethod
    def write(
        cls, stack: PdStackUnits, base: Path, name: str, timings: Overrides = TIMINGS
    ) -> DaemonSetup:
        """A fresh state dir and config under `base/name` (so scenarios never share state)."""
        root = base / name
        state_dir = root / "state"
        state_dir.mkdir(parents=True, exist_ok=True)
        (metrics_port,) = free_ports(1)
        config_path = root / "watchdog.toml"
        config_path.write_text(daemon_config_toml(stack, state_dir, metrics_port, timings))
        return cls(config_path, state_dir, root / "watchdog.log", metrics_port)


def parse_samples(text: str) -> Samples:
    """Every sample of a Prometheus text exposition, keyed by (name, labels)."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def sample(samples: Samples, name: str, **labels: str) -> float | None:
    """One sample's value (None when the series does not exist)."""
    return samples.get((name, frozenset(labels.items())))


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of every series of `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, lbl), v in samples.items() if n == name and want <= lbl)


def current_state(samples: Samples, group: str) -> str | None:
    """The state whose sglang_watchdog_state series is 1 for `group`."""
    for (name, labels), value in samples.items():
        found = dict(labels)
        if name == "sglang_watchdog_state" and found.get("group") == group and value == 1:
            return found["state"]
    return None


def scrape(url: str) -> Samples | None:
    """The metrics at `url`, or None when nothing answers."""
    status, body = http_get(url, timeout_s=2.0)
    return parse_samples(body.decode()) if status == 200 else None


class DaemonProcess:
    """`watchdog --config CFG --log-format json [ARGS]` run against a sandbox's system bus."""

    def __init__(
        self, setup: DaemonSetup, env: Mapping[str, str], *args: str, name: str = "daemon"
    ) -> None:
        self.setup = setup
        self.name = name
        self._log = setup.log_path.open("ab")
        argv = [str(WATCHDOG_BIN), "--config", str(setup.config_path), "--log-format", "json"]
        self.proc = subprocess.Popen(
            [*argv, *args],
            cwd=REPO_ROOT,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        """The daemon's PID."""
        return self.proc.pid

    def output(self) -> str:
        """Everything the daemon wrote so far (appended across runs with the same setup)."""
        return self.setup.log_path.read_text(errors="replace")

    def events(self, name: str | None = None, **match: Any) -> list[Event]:
        """Log events so far, optionally only those called `name` with the given fields."""
        return matching_events(self.output(), name, **match)

    def wait_for_event(self, name: str, *, timeout_seconds: float, **match: Any) -> Event:
        """The first event `name` with the given fields; fails early if the daemon exits."""

        def found() -> Event | None:
            events = self.events(name, **match)
            if events:
                return events[0]
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"{self.name} exited with {self.proc.returncode} before {name}:\n"
                    f"{self.output()[-4000:]}"
                )
            return None

        try:
            result: Event = wait_until(found, timeout_seconds=timeout_seconds, what=name)
        except AssertionError as exc:
            raise AssertionError(
                f"{exc}\n--- {self.name} log tail:\n{self.output()[-4000:]}"
            ) from None
        return result

    def metrics(self) -> Samples | None:
        """The daemon's own metrics now (None while its listener is not up)."""
        return scrape(self.setup.metrics_url)

    def stop(self, sig: int = signal.SIGTERM, timeout_seconds: float = 30.0) -> int:
        """Signal the daemon by PID and wait for its exit code (SIGKILL if it does not exit)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=timeout_seconds)
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(
                    f"{self.name} did not exit within {timeout_seconds:g} s of signal {sig}:\n"
                    f"{self.output()[-4000:]}"
                ) from None
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL by PID and reap (teardown of a failed test)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self._log.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.kill()


@dataclass
class MetricsWatcher:
    """Polls a metrics URL from a thread and keeps every scrape (time, samples) until stopped."""

    url: str
    poll_seconds: float = 0.1
    scrapes: list[tuple[float, Samples]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Self:
        self._thread = threading.Thread(target=self._run, name="metrics-watcher", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            samples = scrape(self.url)
            if samples is not None:
                self.scrapes.append((time.time(), samples))
            self._stop.wait(self.poll_seconds)

    def states(self, group: str) -> list[str]:
        """The group's state as scraped, consecutive repeats collapsed."""
        out: list[str] = []
        for _, samples in list(self.scrapes):
            state = current_state(samples, group)
            if state is not None and (not out or out[-1] != state):
                out.append(state)
        return out

    def latest(self) -> Samples | None:
        """The newest scrape (None before the first)."""
        return self.scrapes[-1][1] if self.scrapes else None

    def first(self, predicate: Callable[[Samples], bool]) -> Samples | None:
        """The first scrape for which `predicate` holds."""
        return next((s for _, s in list(self.scrapes) if predicate(s)), None)


def is_subsequence(wanted: list[str], seen: list[str]) -> bool:
    """Whether `wanted` appears in `seen` in order (other items may come between)."""
    it = iter(seen)
    return all(item in it for item in wanted)


def restart_every_unit(pd: PdSandbox, setup: DaemonSetup, trigger: str) -> None:
    """Every unit of the stack restarted in order, as a test (not the daemon) does it."""

    async def run() -> None:
        group = load_config(setup.config_path).group[0]
        async with open_restarter(
            dry_run=False, bus_address=pd.sandbox.bus_address, poll_seconds=0.1
        ) as restarter:
            outcome = await restarter.execute(build_plan(group, trigger))
        assert outcome.ok, [f"{s.unit} {s.phase}: {s.detail}" for s in outcome.steps]

    asyncio.run(run())


def co_restart_stack(pd: PdSandbox, setup: DaemonSetup) -> None:
    """Bring the stack back with a plain co-restart (clean-up after an interrupted one)."""
    restart_every_unit(pd, setup, "test clean-up")
    pd.wait_until_serving(timeout_seconds=30.0)
