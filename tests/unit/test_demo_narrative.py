"""The demo's terminal story: canned watchdog log lines → short narrative lines; the story check."""

from __future__ import annotations

from demo.logevents import LogEvent, parse_log_line, parse_timestamp
from demo.narrative import Narrator, stall_summary
from demo.story import Story

T0 = parse_timestamp("2026-11-29T08:31:00.000000Z") or 0.0

# Real lines from a sandbox run of the demo (reasons shortened).
STALL = (
    '{"group": "demo", "verdict": "silent_stall", "reasons": [{"code": "probe_failures", '
    '"message": "7 consecutive probe failures (threshold 3)", "consecutive": 7, "multiround": 0, '
    '"threshold": 3}, {"code": "no_progress", "message": "progress counters flat for 8s as last '
    'read", "flat_seconds": 8.083, "threshold_seconds": 8.0}, {"code": "work_pending", "message": '
    '"work pending: ...", "probes_in_flight": 2, "prefill_http_requests_active": 24.0, '
    '"prefill_inflight_queue": 15.0, "decode_http_requests_active": 19.0}, {"code": '
    '"worker_health", "message": "worker /health: prefill ok, decode ok", "prefill": "ok", '
    '"decode": "ok"}], "event": "stall_detected", "level": "error", '
    '"timestamp": "2026-11-29T08:31:24.100000Z"}'
)
EVIDENCE_ITEMS = (
    '{"group": "demo", "duration_seconds": 0.077, "items": 22, "unavailable": ["gpu"], '
    '"drift": 0, "event": "evidence_captured", "level": "info", '
    '"timestamp": "2026-11-29T08:31:25.000000Z"}'
)
EVIDENCE_INCIDENT = (
    '{"group": "demo", "incident": "20261129T083127Z-demo-transfer_stall", "path": '
    '"/srv/demo-output/state/incidents/20261129T083127Z-demo-transfer_stall", '
    '"event": "evidence_captured", "level": "info", "timestamp": "2026-11-29T08:31:25.010000Z"}'
)
RESTART_STARTED = (
    '{"group": "demo", "role": "prefill", "unit": "sglang-demo-prefill.service", '
    '"ready_timeout_seconds": 30.0, "event": "unit_restart_started", "level": "info", '
    '"timestamp": "2026-11-29T08:31:25.100000Z"}'
)
RESTART_FINISHED = (
    '{"group": "demo", "role": "prefill", "unit": "sglang-demo-prefill.service", "ok": true, '
    '"phase": "ready", "detail": "GET http://127.0.0.1:32931/health -> 200", '
    '"duration_seconds": 1.103, "event": "unit_restart_finished", "level": "info", '
    '"timestamp": "2026-11-29T08:31:26.200000Z"}'
)
SEQUENCE_DONE = (
    '{"group": "demo", "trigger": "silent_stall", "ok": true, "dry_run": false, '
    '"interrupted": false, "duration_seconds": 4.1, "event": "restart_sequence_finished", '
    '"level": "info", "timestamp": "2026-11-29T08:31:29.200000Z"}'
)
VERIFIED = (
    '{"group": "demo", "reasons": [{"code": "verification", "message": "5/5 consecutive probe '
    'successes, 4s of 30s", "successes": 5, "required": 5}, {"code": "resolved", "message": '
    '"the co-restart helped: incident resolved"}], "event": "verification_passed", '
    '"level": "info", "timestamp": "2026-11-29T08:31:33.300000Z"}'
)


def probe_failed(second: int) -> str:
    """A probe_failed line at 08:31:<second>."""
    return (
        '{"group": "demo", "kind": "completion", "reason": "timeout_before_headers", '
        '"detail": "no headers within 2 s (ReadTimeout)", "event": "probe_failed", '
        f'"level": "warning", "timestamp": "2026-11-29T08:31:{second:02d}.000000Z"}}'
    )


def event(line: str) -> LogEvent:
    """The parsed line (which must parse)."""
    parsed = parse_log_line(line)
    assert parsed is not None
    return parsed


def test_parse_log_line_takes_the_stamp_and_skips_non_json() -> None:
    """A JSON line becomes an event at its own timestamp; anything else is skipped."""
    parsed = event(RESTART_STARTED)
    assert parsed.name == "unit_restart_started"
    assert round(parsed.at - T0, 3) == 25.1
    assert parsed.get("unit") == "sglang-demo-prefill.service"
    assert parse_log_line("Traceback (most recent call last):") is None
    assert parse_log_line('{"no": "event"}') is None
    assert parse_log_line('{"event": "x"}', received_at=5.0) == LogEvent("x", 5.0, {})


def test_stall_line_names_verdict_failures_flat_counters_and_pending() -> None:
    """The stall line carries the verdict, the failure streak, the flat time and pending work."""
    assert stall_summary(event(STALL)) == (
        "silent_stall (7 consecutive probe failures, counters flat 8 s, 24 requests pending)"
    )
    lines = Narrator(T0).narrate(event(STALL))
    assert lines == [
        "t+ 24.1s  STALL DETECTED: silent_stall (7 consecutive probe failures, counters flat 8 s, "
        "24 requests pending)",
        "            (worker /health: prefill ok, decode ok; /health alone sees nothing wrong)",
    ]


def test_only_the_first_probe_failure_of_a_streak_is_told() -> None:
    """A stall fails a probe every second; the story shows the first and the count later."""
    narrator = Narrator(T0)
    told = [line for s in (21, 22, 23) for line in narrator.narrate(event(probe_failed(s)))]
    assert told == [
        "t+ 21.0s  probe failed: timeout_before_headers (no headers within 2 s (ReadTimeout))"
    ]
    assert narrator.failure_streak == 3


def test_evidence_restart_steps_and_verification() -> None:
    """Evidence names the incident, each unit restart is a line, verification gives the count."""
    narrator = Narrator(T0)
    lines = [
        line
        for raw in (
            EVIDENCE_ITEMS,
            EVIDENCE_INCIDENT,
            RESTART_STARTED,
            RESTART_FINISHED,
            SEQUENCE_DONE,
            VERIFIED,
        )
        for line in narrator.narrate(event(raw))
    ]
    assert lines == [
        "t+ 25.0s  evidence captured (22 items in 0.1 s) → incident "
        "20261129T083127Z-demo-transfer_stall",
        "t+ 25.1s  restarting sglang-demo-prefill.service ...",
        "t+ 26.2s    ... sglang-demo-prefill.service ready after 1.1 s",
        "t+ 29.2s  co-restart done in 4.1 s; verifying with probes",
        "t+ 33.3s  verification passed (5/5 probes): incident resolved",
    ]


def test_evidence_in_one_line() -> None:
    """An evidence_captured line with both the incident and the item count is told at once."""
    line = (
        '{"group": "demo", "incident": "20261129T084255Z-demo-transfer_stall", "path": "/x", '
        '"duration_seconds": 2.002, "items": 22, "unavailable": ["gpu"], "event": '
        '"evidence_captured", "level": "info", "timestamp": "2026-11-29T08:31:25.000000Z"}'
    )
    assert Narrator(T0).narrate(event(line)) == [
        "t+ 25.0s  evidence captured (22 items in 2.0 s) → incident "
        "20261129T084255Z-demo-transfer_stall"
    ]


def test_events_outside_the_story_are_silent() -> None:
    """Events the story does not need (here a scrape detail) print nothing."""
    line = '{"event": "scrape_failed", "timestamp": "2026-11-29T08:31:01Z"}'
    assert Narrator(T0).narrate(event(line)) == []


def _story(lines: list[str], *, acting: bool, fault: bool = True) -> Story:
    story = Story(acting=acting)
    started = '{"event": "watchdog_started", "timestamp": "2026-11-29T08:31:01Z"}'
    healthy = (
        '{"event": "state_changed", "old": "warming", "new": "healthy", '
        '"timestamp": "2026-11-29T08:31:02Z"}'
    )
    for raw in [started, healthy]:
        story.observe(event(raw))
    if fault:
        story.note_fault(T0 + 20)
    for raw in lines:
        story.observe(event(raw))
    return story


def test_story_complete_with_detection_restart_and_verification() -> None:
    """Detection, an incident, a finished co-restart and verification make the whole story."""
    story = _story(
        [STALL, EVIDENCE_INCIDENT, RESTART_FINISHED, SEQUENCE_DONE, VERIFIED], acting=True
    )
    assert story.missing() == []
    assert story.verified_at is not None
    assert story.report_path is not None
    assert story.report_path.name == "report.md"


def test_story_says_what_is_missing() -> None:
    """No detection after the fault is named; an acting run also needs verification."""
    assert _story([], acting=True).missing() == [
        "no stall_detected after the transfer stall was injected"
    ]
    assert _story([STALL, EVIDENCE_INCIDENT, SEQUENCE_DONE], acting=True).missing() == [
        "no verification_passed after the co-restart"
    ]
    assert _story([STALL, EVIDENCE_INCIDENT, SEQUENCE_DONE], acting=False).missing() == []
    assert "never injected" in _story([], acting=True, fault=False).missing()[0]
