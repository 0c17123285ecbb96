"""The watchdog as a unit beside the real stack, as in production: read back through its JSON log.

The daemon runs inside the sandbox (its PID, mount and network namespace): it reaches the servers
on the namespace's loopback, reads their journal with journalctl and their processes in /proc,
and restarts them over the sandbox's system bus. Its log goes to a file the caller reads.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdsim.stack import REPO_ROOT
from realsglang.stack import RealSandbox
from sandbox.events import Event, matching_events, wait_until
from sandbox.namespace import UnitSpec
from watchdog.configfile import Overrides, config_text

WATCHDOG_BIN = REPO_ROOT / ".venv" / "bin" / "watchdog"

# Each daemon's own metrics listener, inside the namespace (above realsglang.stack's fixed ports).
_METRICS_PORTS = itertools.count(9470)

# The shipped soak (restart.soak_seconds 600, soak_probes 100) after every co-restart the real tier,
# demo and bench make would add ten minutes each to runs that measure detection and recovery; they
# act with a short soak instead (still past the first probes: a relapse would show), everything
# else at the shipped defaults. Merge it into `overrides` of a daemon that acts.
SHORT_SOAK_SECONDS = 60.0
SHORT_SOAK: Overrides = {
    "group": [{"restart": {"soak_probes": 10, "soak_seconds": SHORT_SOAK_SECONDS}}]
}


@dataclass
class WatchdogUnit:
    """One watchdog daemon as a unit of the real sandbox, for the group behind one router.

    The config is the shipped defaults plus the stack and a state dir (`overrides` on top): what a
    user runs is what is judged.
    """

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
            "watchdog": {
                "state_dir": str(self.state_dir),
                "journal_lines": 60,
                "metrics_listen": f"127.0.0.1:{next(_METRICS_PORTS)}",
            },
            "group": [self.real.stack.group_overrides(self.router)],
        }
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

    def exited(self) -> bool:
        """The unit is no longer running (it failed, or stopped after writing its log)."""
        state = self.real.sandbox.unit_property(self.unit, "ActiveState")
        # "inactive" also before the start job ran: only once the unit has written its log.
        return state == "failed" or (state == "inactive" and self.log_path.exists())

    def output(self) -> str:
        """Everything the daemon wrote so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def events(self, name: str | None = None, **match: Any) -> list[Event]:
        """Its log events so far, optionally only `name` with the given fields."""
        return matching_events(self.output(), name, **match)

    def wait_for_event(self, name: str, *, timeout_seconds: float, **match: Any) -> Event:
        """The first event `name` with the given fields; fails early if the daemon exited."""

        def found_or_exited() -> list[Event]:
            events = self.events(name, **match)
            if not events and self.exited():
                raise AssertionError(f"{self.unit} exited before {name}")
            return events

        try:
            found: list[Event] = wait_until(
                found_or_exited,
                timeout_seconds=timeout_seconds,
                what=f"{name} from {self.unit}",
                poll=0.5,
            )
        except AssertionError as exc:
            raise AssertionError(
                f"{exc}\n--- {self.unit} log tail:\n{self.output()[-4000:]}"
            ) from None
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

    def incident(self) -> tuple[dict[str, Any], Path]:
        """The one incident it opened: its summary.json and its directory."""
        (opened,) = self.events("incident_opened", group=self.group)
        path = Path(opened["path"])
        summary: dict[str, Any] = json.loads((path / "summary.json").read_text())
        return summary, path
