"""Did the demo's story happen? Follows the log events and says what is missing, if anything."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from demo.logevents import LogEvent


@dataclass
class Story:
    """The milestones seen so far (unix times; None = not yet)."""

    acting: bool  # False: the watchdog runs with --dry-run
    started_at: float | None = None
    healthy_at: float | None = None
    fault_at: float | None = None
    detected_at: float | None = None
    verdict: str = ""
    incident: str = ""
    incident_path: Path | None = None
    restart_failed: str = ""
    sequence_done_at: float | None = None
    verified_at: float | None = None
    verification_failed_at: float | None = None

    def observe(self, event: LogEvent) -> None:
        """Fold in one log event."""
        name = event.name
        if name == "watchdog_started":
            self.started_at = event.at
        elif name == "state_changed" and event.get("new") == "healthy" and self.healthy_at is None:
            self.healthy_at = event.at
        elif name == "stall_detected" and self.detected_at is None and self.fault_at is not None:
            self.detected_at = event.at
            self.verdict = str(event.get("verdict", ""))
        elif name == "evidence_captured" and event.get("incident") and not self.incident:
            self.incident = str(event.get("incident"))
            self.incident_path = Path(str(event.get("path")))
        elif name == "unit_restart_finished" and not event.get("ok") and not self.restart_failed:
            self.restart_failed = f"{event.get('unit')}: {event.get('phase')}"
        elif name in ("restart_sequence_finished", "restart_skipped_dry_run"):
            if self.sequence_done_at is None and (event.get("ok", True) or event.get("dry_run")):
                self.sequence_done_at = event.at
        elif name == "verification_passed" and self.verified_at is None:
            self.verified_at = event.at
        elif name == "verification_failed" and self.verification_failed_at is None:
            self.verification_failed_at = event.at

    def note_fault(self, at: float) -> None:
        """The demo injected the stall at `at`."""
        self.fault_at = at

    @property
    def report_path(self) -> Path | None:
        """The incident's report.md, once an incident was opened."""
        return None if self.incident_path is None else self.incident_path / "report.md"

    def missing(self) -> list[str]:
        """Why the story did not happen (empty when it did); verification is required only when
        the watchdog acts (a dry run cannot fix the stall it found)."""
        problems = []
        if self.started_at is None:
            problems.append("the watchdog never logged watchdog_started")
        elif self.healthy_at is None:
            problems.append("the watchdog never called the stack healthy before the fault")
        if self.fault_at is None:
            problems.append("the transfer stall was never injected")
        elif self.detected_at is None:
            problems.append("no stall_detected after the transfer stall was injected")
        elif not self.incident:
            problems.append("no incident was opened (evidence_captured with an incident id)")
        if self.detected_at is not None and self.sequence_done_at is None:
            problems.append(
                f"the co-restart did not complete ({self.restart_failed})"
                if self.restart_failed
                else "the co-restart sequence did not finish"
            )
        if self.acting and self.detected_at is not None and self.verified_at is None:
            problems.append(
                "verification failed after the co-restart"
                if self.verification_failed_at is not None
                else "no verification_passed after the co-restart"
            )
        return problems
