"""The watchdog's log events told as a story in the terminal, one short line per step that matters.

Probe failures come every second during a stall, so only the first of a streak is shown; the stall
line carries the count. Everything else of note (state changes, evidence, each restart step,
verification) gets its own line, prefixed with the time since the demo started.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from demo.logevents import LogEvent

DETAIL_CHARS = 90


def stamp(at: float, t0: float) -> str:
    """`t+ 24.1s` : the time since the demo started, aligned."""
    return f"t+{max(0.0, at - t0):5.1f}s"


def _reasons(event: LogEvent) -> list[Mapping[str, Any]]:
    reasons = event.get("reasons", [])
    return [r for r in reasons if isinstance(r, Mapping)] if isinstance(reasons, list) else []


def _reason(event: LogEvent, code: str) -> Mapping[str, Any] | None:
    return next((r for r in _reasons(event) if r.get("code") == code), None)


def _short(text: object, limit: int = DETAIL_CHARS) -> str:
    value = " ".join(str(text).split())
    return value if len(value) <= limit else value[: limit - 1] + "…"


def _arrow(units: object) -> str:
    return " → ".join(str(u) for u in units) if isinstance(units, list) else str(units)


def pending_requests(work_pending: Mapping[str, Any]) -> int | None:
    """Requests stuck in the servers: the larger in-flight HTTP gauge of prefill and decode."""
    values = [
        float(v)
        for k, v in work_pending.items()
        if k.endswith("http_requests_active") and isinstance(v, int | float)
    ]
    return round(max(values)) if values else None


def stall_summary(event: LogEvent) -> str:
    """`silent_stall (6 consecutive probe failures, counters flat 8 s, 12 requests pending)`."""
    parts = []
    failures = _reason(event, "probe_failures")
    if failures is not None and "consecutive" in failures:
        parts.append(f"{failures['consecutive']} consecutive probe failures")
    flat = _reason(event, "no_progress")
    if flat is not None and isinstance(flat.get("flat_seconds"), int | float):
        parts.append(f"counters flat {flat['flat_seconds']:.0f} s")
    work = _reason(event, "work_pending")
    pending = pending_requests(work) if work is not None else None
    if pending is not None:
        parts.append(f"{pending} requests pending")
    verdict = str(event.get("verdict", "stall"))
    if not parts:
        parts = [_short(r.get("message", "")) for r in _reasons(event)[:2]]
    return f"{verdict} ({', '.join(parts)})" if parts else verdict


class Narrator:
    """Turns log events into terminal lines; keeps the little state a readable story needs."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.failure_streak = 0
        self._evidence_items: tuple[int, float] | None = None

    def line(self, at: float, text: str) -> str:
        """One line of the story at time `at`."""
        return f"{stamp(at, self.t0)}  {text}"

    def narrate(self, event: LogEvent) -> list[str]:
        """The lines for one event (none for events that do not move the story)."""
        handler = getattr(self, f"_on_{event.name}", None)
        if handler is None:
            return []
        texts: Sequence[str] = handler(event)
        # The first line carries the time; any further ones continue it, aligned under the text.
        indent = " " * len(self.line(event.at, ""))
        return [self.line(event.at, t) if i == 0 else indent + t for i, t in enumerate(texts)]

    # --- one method per event name (the log contract, docs/architecture.md) ---------------------
    def _on_watchdog_started(self, event: LogEvent) -> list[str]:
        mode = "dry run: observes and plans, restarts nothing" if event.get("dry_run") else "acting"
        units = "units observed over D-Bus" if event.get("systemd") else "units not observed"
        listen = event.get("metrics_listen")
        metrics = f"; metrics on http://{listen}/metrics" if listen else ""
        return [f"watchdog started ({mode}; {units}{metrics})"]

    def _on_systemd_unavailable(self, event: LogEvent) -> list[str]:
        return ["watchdog: no system bus, so unit states are not observed"]

    def _on_state_changed(self, event: LogEvent) -> list[str]:
        new = str(event.get("new"))
        if new in ("healthy", "warming"):
            self.failure_streak = 0
        reasons = _reasons(event)
        why = f": {_short(reasons[0].get('message', ''))}" if reasons else ""
        if event.get("action") == "co_restart":
            why = f": {event.get('verdict')}"
        return [f"state {event.get('old')} → {new}{why}"]

    def _on_probe_failed(self, event: LogEvent) -> list[str]:
        self.failure_streak += 1
        if self.failure_streak > 1:
            return []
        # The detail's first clause says what happened; the rest (abort_request results) is noise.
        detail = str(event.get("detail") or "").split(";")[0]
        reason = event.get("reason")
        return [
            f"probe failed: {reason} ({_short(detail, 60)})"
            if detail
            else f"probe failed: {reason}"
        ]

    def _on_stall_detected(self, event: LogEvent) -> list[str]:
        lines = [f"STALL DETECTED: {stall_summary(event)}"]
        health = _reason(event, "worker_health")
        if health is not None:
            message = _short(health.get("message", ""))
            lines.append(f"  ({message}; /health alone sees nothing wrong)")
        return lines

    def _on_evidence_captured(self, event: LogEvent) -> list[str]:
        # One line with the incident id and what was captured, or (older daemons) two lines:
        # first what was captured, then the incident it went into.
        items = event.get("items")
        took = event.get("duration_seconds")
        if isinstance(items, int) and isinstance(took, int | float):
            self._evidence_items = (items, float(took))
        if event.get("incident") is None:
            return []
        extra = ""
        if self._evidence_items is not None:
            items, took = self._evidence_items
            extra = f" ({items} items in {took:.1f} s)"
        return [f"evidence captured{extra} → incident {event.get('incident')}"]

    def _on_restart_planned(self, event: LogEvent) -> list[str]:
        return [f"co-restart planned: {_arrow(event.get('sequence'))}"]

    def _on_restart_skipped_dry_run(self, event: LogEvent) -> list[str]:
        return [f"dry run: restart skipped (would restart {_arrow(event.get('sequence'))})"]

    def _on_unit_restart_started(self, event: LogEvent) -> list[str]:
        return [f"restarting {event.get('unit')} ..."]

    def _on_unit_restart_finished(self, event: LogEvent) -> list[str]:
        took = event.get("duration_seconds")
        after = f" after {took:.1f} s" if isinstance(took, int | float) else ""
        if event.get("ok"):
            return [f"  ... {event.get('unit')} {event.get('phase')}{after}"]
        return [
            f"  ... {event.get('unit')} FAILED in phase {event.get('phase')}{after}: "
            f"{_short(event.get('detail', ''))}"
        ]

    def _on_restart_sequence_finished(self, event: LogEvent) -> list[str]:
        if event.get("dry_run"):
            return []
        took = event.get("duration_seconds")
        after = f" in {took:.1f} s" if isinstance(took, int | float) else ""
        if event.get("ok"):
            return [f"co-restart done{after}; verifying with probes"]
        return [
            f"co-restart FAILED at {event.get('failed_step')} ({event.get('failed_phase')}: "
            f"{_short(event.get('failed_detail', ''))})"
        ]

    def _on_verification_passed(self, event: LogEvent) -> list[str]:
        self.failure_streak = 0
        check = _reason(event, "verification")
        counts = ""
        if check is not None and "successes" in check and "required" in check:
            counts = f" ({check['successes']}/{check['required']} probes)"
        return [f"verification passed{counts}: incident resolved"]

    def _on_verification_failed(self, event: LogEvent) -> list[str]:
        messages = "; ".join(str(r.get("message", "")) for r in _reasons(event)[:2])
        return [f"verification FAILED: {_short(messages)}"]

    def _on_restart_refused(self, event: LogEvent) -> list[str]:
        return [f"restart refused: {event.get('reason')} {_short(event.get('error', ''))}".rstrip()]

    def _on_budget_exhausted(self, event: LogEvent) -> list[str]:
        return ["restart budget exhausted: group held until an operator re-arms it"]

    def _on_decode_only_restart_detected(self, event: LogEvent) -> list[str]:
        return ["decode-only restart detected (decode restarted under a running prefill)"]

    def _on_config_drift(self, event: LogEvent) -> list[str]:
        return [f"config drift on {event.get('role')}: {_short(event.get('message', ''))}"]

    def _on_alert(self, event: LogEvent) -> list[str]:
        return [f"alert: {event.get('verdict')}"]

    def _on_cycle_failed(self, event: LogEvent) -> list[str]:
        return [f"watchdog internal error in a cycle: {_short(event.get('error', ''))}"]

    def _on_shutdown_requested(self, event: LogEvent) -> list[str]:
        return ["watchdog stopping (SIGTERM)"]

    def _on_watchdog_stopped(self, event: LogEvent) -> list[str]:
        return ["watchdog stopped"]
