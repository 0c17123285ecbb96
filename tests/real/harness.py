"""The watchdog as a unit next to real SGLang, and a bounded load through the real routers.

The daemon runs inside the sandbox (its PID, mount and network namespace), as in production: it
reaches the servers on the namespace's loopback, reads their journal with journalctl and their
processes in /proc. Its JSON log goes to a file the test reads (tests/e2e/daemon.parse_events).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from realsglang.stack import RealSandbox, completion_body, http_post
from sandbox.namespace import UnitSpec
from sandbox.netns import join_netns
from tests.e2e.daemon import WATCHDOG_BIN, Event, parse_events, wait_until
from watchdog.configfile import Overrides, config_text

# Verdicts that are fine on a healthy or busy server (states the group may be in).
CALM_STATES = frozenset({"warming", "healthy", "overloaded"})


@dataclass
class WatchdogUnit:
    """One watchdog daemon as a unit of the real sandbox, for one router's group."""

    real: RealSandbox
    name: str
    router: str
    dry_run: bool = True
    overrides: Overrides = field(default_factory=dict)

    def __post_init__(self) -> None:
        root = self.real.sandbox.share_dir / self.name
        self.state_dir = root / "state"
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.config_path = root / "watchdog.toml"
        own = {
            "watchdog": {"state_dir": str(self.state_dir), "journal_lines": 60},
            "group": [self.real.stack.group_overrides(self.router)],
        }
        # The shipped defaults otherwise: what a user runs is what the real tier judges.
        self.config_path.write_text(config_text(own, self.overrides))
        self.unit = f"watchdog-{self.name}.service"

    @property
    def group(self) -> str:
        """The group's name in events and metrics."""
        return str(self.real.stack.group_overrides(self.router)["name"])

    @property
    def log_path(self) -> Path:
        """Where the unit's output goes."""
        return self.real.sandbox.logs_dir / f"{self.unit}.log"

    def start(self) -> None:
        """Add the unit and start it."""
        argv = [str(WATCHDOG_BIN), "--config", str(self.config_path), "--log-format", "json"]
        if self.dry_run:
            argv.append("--dry-run")
        spec = UnitSpec(
            name=self.unit,
            description=f"sglang-watchdog for {self.group}",
            exec_start=argv,
            working_directory=str(self.state_dir),
            timeout_stop_seconds=40,
            wanted=False,
        )
        self.real.sandbox.add_unit(spec, start=True)

    def stop(self) -> None:
        """Stop the unit and wait until it is gone."""
        box = self.real.sandbox
        box.queue_unit_job("StopUnit", self.unit, check=False)
        wait_until(
            lambda: box.unit_property(self.unit, "ActiveState") in ("inactive", "failed"),
            timeout_seconds=60.0,
            what=f"{self.unit} stopped",
            poll=0.5,
        )

    def events(self, name: str | None = None, **match: Any) -> list[Event]:
        """Its log events so far, optionally only `name` with the given fields."""
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return []
        return [
            e
            for e in parse_events(text)
            if (name is None or e.get("event") == name)
            and all(e.get(k) == v for k, v in match.items())
        ]

    def wait_for_event(self, name: str, *, timeout_seconds: float, **match: Any) -> Event:
        """The first event `name` with the given fields; the log tail in the failure."""
        try:
            found: list[Event] = wait_until(
                lambda: self.events(name, **match),
                timeout_seconds=timeout_seconds,
                what=f"{name} from {self.unit}",
                poll=0.5,
            )
        except AssertionError as exc:
            tail = (
                self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""
            )
            raise AssertionError(f"{exc}\n--- {self.unit} log tail:\n{tail}") from None
        return found[0]

    def states(self) -> list[str]:
        """Every state the group entered, in order."""
        return [e["new"] for e in self.events("state_changed")]

    def acted(self) -> list[Event]:
        """Decisions to act (stall_detected) and plans made (restart_planned)."""
        return self.events("stall_detected") + self.events("restart_planned")

    def alerts(self) -> list[Event]:
        """Alert-only verdicts."""
        return self.events("alert")


@dataclass
class LoadReport:
    """What a load run saw: completions by HTTP status (0: no answer in time)."""

    statuses: dict[int, int] = field(default_factory=dict)


@contextmanager
def load(
    real: RealSandbox,
    routers: list[str],
    *,
    concurrency: int,
    max_tokens: int,
    timeout_seconds: float = 120.0,
) -> Iterator[LoadReport]:
    """Completions through `routers` from `concurrency` threads in the sandbox's namespace, each
    sending one after another until the block ends (then each finishes its request in flight)."""
    report = LoadReport()
    stop = threading.Event()
    lock = threading.Lock()
    netns = real.sandbox.netns_path

    def worker(index: int) -> None:
        join_netns(netns)
        router = routers[index % len(routers)]
        body = completion_body(f"Load {index}: the quick brown fox", max_tokens)
        while not stop.is_set():
            # This thread is in the namespace already: no thread per request.
            status, _ = http_post(real.stack.url(router) + "/v1/completions", body, timeout_seconds)
            with lock:
                report.statuses[status] = report.statuses.get(status, 0) + 1
            if status != 200:
                time.sleep(1.0)

    threads = [
        threading.Thread(target=worker, args=(i,), name=f"load-{i}", daemon=True)
        for i in range(concurrency)
    ]
    for thread in threads:
        thread.start()
    try:
        yield report
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=timeout_seconds + 10)
