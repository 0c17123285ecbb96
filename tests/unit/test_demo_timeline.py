"""The demo's timeline picture: data gathered from a recording and log events, drawn as a PNG."""

from __future__ import annotations

import json
import struct
from datetime import UTC, datetime
from pathlib import Path

from demo.logevents import LogEvent, parse_log_lines
from demo.timeline import (
    Marker,
    build_timeline,
    client_rate,
    markers_from,
    render_timeline,
    restart_span_of,
    state_spans,
)
from demo.traffic import TrafficSample, completion_rate, waiting_at
from watchdog.model import (
    MetricsSnapshot,
    Observation,
    ProbeFailure,
    ProbeKind,
    ProbeResult,
    Role,
)
from watchdog.run.recording import Recorder, read_recording

T0 = 1_790_000_000.0
FAULT_AT = T0 + 20


def _probe(at: float) -> ProbeResult:
    stalled = FAULT_AT <= at < T0 + 30
    return ProbeResult(
        kind=ProbeKind.COMPLETION,
        target="router",
        ok=not stalled,
        reason=ProbeFailure.TIMEOUT_BEFORE_HEADERS if stalled else ProbeFailure.OK,
        started_at=at,
        duration_seconds=2.0 if stalled else 0.05,
    )


def _observation(second: int) -> Observation:
    at = T0 + second
    decode = MetricsSnapshot(
        role=Role.DECODE, scraped_at=at, ok=True, requests_total=float(min(second, 20) * 2)
    )
    return Observation(group="demo", at=at, probes=(_probe(at - 0.5),), metrics=(decode,))


def write_recording(path: Path, seconds: int = 45) -> None:
    """A recording of a stall from t+20 s to t+30 s, one cycle per second."""
    with path.open("w", encoding="utf-8") as handle:
        recorder = Recorder(handle, "demo", T0)
        for second in range(1, seconds):
            recorder.append(_observation(second))


def _line(event: str, at: float, **fields: object) -> str:
    stamp = datetime.fromtimestamp(at, UTC).isoformat().replace("+00:00", "Z")
    return json.dumps({"event": event, "timestamp": stamp, **fields})


def log_events() -> list[LogEvent]:
    """The log of a detected stall, a co-restart and a passed verification."""
    lines = [
        _line("watchdog_started", T0 + 1, dry_run=False, systemd=True),
        _line("state_changed", T0 + 2, old="warming", new="healthy", reasons=[]),
        _line("state_changed", T0 + 28, old="healthy", new="restarting", verdict="silent_stall"),
        _line("stall_detected", T0 + 28, verdict="silent_stall", reasons=[]),
        _line("evidence_captured", T0 + 28.5, incident="x", path="/tmp/x"),
        _line("unit_restart_started", T0 + 29, role="prefill", unit="p.service"),
        _line("unit_restart_started", T0 + 30, role="decode", unit="d.service"),
        _line("unit_restart_started", T0 + 31, role="router", unit="r.service"),
        _line("restart_sequence_finished", T0 + 33, ok=True, dry_run=False),
        _line("state_changed", T0 + 33, old="restarting", new="verifying", reasons=[]),
        _line("verification_passed", T0 + 38, reasons=[]),
        _line("state_changed", T0 + 38, old="verifying", new="healthy", reasons=[]),
        "Traceback (most recent call last):",
    ]
    return parse_log_lines(lines)


def traffic() -> list[TrafficSample]:
    """Two requests a second, hanging while the stall lasts."""
    samples = []
    for i in range(90):
        sent = T0 + 1 + i / 2
        stalled = FAULT_AT <= sent < T0 + 30
        ended = T0 + 31 if stalled else sent + 0.05
        samples.append(TrafficSample(sent, ended, ok=not stalled))
    return samples


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_png_from_recording_and_log(tmp_path: Path) -> None:
    """A recording plus log events and client traffic draw a 1200×700 PNG."""
    recording = tmp_path / "recording.jsonl"
    write_recording(recording)
    timeline = build_timeline(
        list(read_recording(recording)),
        log_events(),
        t0=T0,
        traffic=traffic(),
        extra_markers=[Marker(FAULT_AT, "transfer stall injected", "fault")],
        title="test",
    )
    out = render_timeline(timeline, tmp_path / "sub" / "timeline.png")
    assert out.stat().st_size > 2_000
    assert png_size(out) == (1200, 700)


def test_png_without_traffic_uses_the_decode_counter(tmp_path: Path) -> None:
    """Without client samples the completion rate comes from decode's num_requests_total."""
    recording = tmp_path / "recording.jsonl"
    write_recording(recording, seconds=10)
    timeline = build_timeline(list(read_recording(recording)), [], title="counter only")
    assert "decode" in timeline.rate_source
    assert {round(p.value) for p in timeline.rate} == {2}
    assert render_timeline(timeline, tmp_path / "t.png").stat().st_size > 0


def test_state_spans_follow_state_changes() -> None:
    """Each state lasts from its state_changed to the next one; the first is warming."""
    spans = state_spans(log_events(), end=T0 + 45)
    assert [(s.state, s.start - T0, s.end - T0) for s in spans] == [
        ("warming", 1, 2),
        ("healthy", 2, 28),
        ("restarting", 28, 33),
        ("verifying", 33, 38),
        ("healthy", 38, 45),
    ]


def test_markers_and_restart_span() -> None:
    """Detection, evidence and verification are labelled; unit restarts form one labelled span."""
    events = log_events()
    labelled = [m.label for m in markers_from(events) if m.label]
    assert labelled == ["stall detected: silent_stall", "evidence captured", "verification passed"]
    span = restart_span_of(events)
    assert span is not None
    assert (span.start - T0, span.end - T0) == (29, 33)
    assert span.label == "co-restart prefill → decode → router (4.0 s)"


def test_client_rate_and_waiting() -> None:
    """Completions per second drop to zero during the stall while the waiting requests pile up."""
    samples = traffic()
    assert completion_rate(samples, T0 + 15) == 2.0
    assert completion_rate(samples, T0 + 29) == 0.0
    assert waiting_at(samples, T0 + 29.9) == 18  # those sent in the last second are not counted
    assert waiting_at(samples, T0 + 15.02) == 0  # a 50 ms request in flight is not waiting
    rate = client_rate(samples, T0, T0 + 10)
    assert rate[0].at == T0 + 1 + 4  # the first full window after the first request
