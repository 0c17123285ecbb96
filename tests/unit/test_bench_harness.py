"""The benchmark harness's pure parts: generated configs, log parsing, run summaries, payloads."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

from bench import uncompressed
from bench.harness import (
    COMPRESSED_TIMINGS,
    DEFAULT_TIMINGS,
    GroupTarget,
    parse_log_line,
    summarize_events,
    timing_values,
    watchdog_config_toml,
)
from bench.recorded_endpoints import live_loads
from bench.run import merge_partial, selection
from bench.scenarios import BASELINE_TIMINGS, SCENARIOS, RunSettings
from watchdog.config import parse_config

GROUP = GroupTarget(
    "bench",
    "http://127.0.0.1:30000",
    "http://127.0.0.1:30002",
    "http://127.0.0.1:30001",
    "http://127.0.0.1:29000/metrics",
)


def test_compressed_config_is_valid_and_carries_the_timings(tmp_path: Path) -> None:
    """The bench's config passes the daemon's own strict validation with the compressed values."""
    text = watchdog_config_toml(
        [GROUP], COMPRESSED_TIMINGS, state_dir=tmp_path, metrics_listen="127.0.0.1:9999"
    )
    config = parse_config(tomllib.loads(text), "bench.toml")
    group = config.group[0]
    compressed = timing_values(COMPRESSED_TIMINGS)
    assert config.watchdog.cycle_seconds == compressed["cycle_seconds"] == 0.5
    assert group.probe.timeout_seconds == compressed["timeout_seconds"] == 4
    assert group.probe.multiround_every_seconds == 0
    assert group.stall.no_progress_seconds == compressed["no_progress_seconds"] == 6
    assert group.router.metrics_url == "http://127.0.0.1:29000/metrics"


def test_default_config_with_many_groups_has_unique_units(tmp_path: Path) -> None:
    """32 groups at default cadence validate: names and made-up unit names do not collide."""
    groups = [
        GroupTarget(f"g{i:02d}", GROUP.prefill_url, GROUP.decode_url, GROUP.router_url)
        for i in range(32)
    ]
    text = watchdog_config_toml(
        groups, DEFAULT_TIMINGS, state_dir=tmp_path, metrics_listen="127.0.0.1:9999"
    )
    config = parse_config(tomllib.loads(text), "scale.toml")
    assert len(config.group) == 32
    assert config.watchdog.cycle_seconds == 5


def test_log_line_time_comes_from_the_log_stamp() -> None:
    """The ISO UTC timestamp of a JSON line wins over the time the bench read it."""
    line = json.dumps({"event": "stall_detected", "timestamp": "2026-01-01T00:00:10.500000Z"})
    event = parse_log_line(line, received_at=99.0)
    assert event["_at"] == 1767225610.5
    assert parse_log_line("not json", received_at=99.0) == {
        "event": "_raw",
        "text": "not json",
        "_at": 99.0,
    }


def ev(name: str, at: float, **fields: object) -> dict[str, object]:
    """A parsed log event."""
    return {"event": name, "_at": at, **fields}


def test_summary_measures_the_first_decision_after_injection() -> None:
    """Decisions before t0 are counted apart; latency is from t0 to the first later decision."""
    events = [
        ev("state_changed", 1.0, old="warming", new="healthy", verdict="ok"),
        ev("stall_detected", 5.0, verdict="silent_stall"),
        ev("state_changed", 17.0, old="healthy", new="stalled", verdict="silent_stall"),
        ev("stall_detected", 17.0, verdict="silent_stall"),
        ev("restart_skipped_dry_run", 17.1),
        ev("stall_detected", 30.0, verdict="silent_stall"),
    ]
    outcome = summarize_events(events, t0=10.0)
    assert outcome.decision_after_s == 7.0
    assert outcome.decision_verdict == "silent_stall"
    assert outcome.decisions_total == 3
    assert outcome.decisions_before_t0 == 1
    assert outcome.dry_run_restarts == 1
    assert outcome.alert_after_s == 7.0
    assert outcome.states == ("healthy", "stalled")


def test_summary_reports_alerts_without_decisions() -> None:
    """An alert (degraded state) without a restart decision leaves the decision latency empty."""
    events = [
        ev("state_changed", 12.0, old="healthy", new="degraded", verdict="worker_unhealthy"),
        ev("alert", 12.0, verdict="worker_unhealthy"),
    ]
    outcome = summarize_events(events, t0=10.0)
    assert outcome.decision_after_s is None
    assert outcome.alert_after_s == 2.0
    assert outcome.alert_verdict == "worker_unhealthy"
    assert outcome.alerts_total == 2


def test_recorded_loads_get_live_timestamps() -> None:
    """Replayed /v1/loads answers carry the current time, so the scheduler never looks frozen."""
    recorded = json.dumps(
        {"timestamp": "2020-01-01T00:00:00+00:00", "loads": [{"timestamp": 1.0, "dp_rank": 0}]}
    )
    data = live_loads(recorded, now=1767225600.0)
    assert data["loads"][0]["timestamp"] == 1767225600.0
    assert data["timestamp"].startswith("2026-01-01T00:00:00")
    assert data["loads"][0]["dp_rank"] == 0


def test_fault_windows_leave_room_for_every_baseline_to_fire() -> None:
    """Faults are watched longer than the compressed Prometheus rule needs to fire."""
    timings = BASELINE_TIMINGS.compressed()
    needed = (
        timings.rule_range_seconds + timings.rule_for_seconds + 2 * timings.scrape_interval_seconds
    )
    faults = [s for s in SCENARIOS if s.kind == "fault"]
    assert faults
    assert all(s.observe_seconds >= needed for s in faults)
    assert len({s.name for s in SCENARIOS}) == len(SCENARIOS)


def test_only_selects_scenarios_and_suites() -> None:
    """`--only uncompressed` runs that suite alone (a partial run); scenario names as before."""
    scenarios, suites, partial = selection("uncompressed")
    assert (scenarios, suites, partial) == ([], {"uncompressed"}, True)
    scenarios, suites, partial = selection("transfer_stall")
    assert [s.name for s in scenarios] == ["transfer_stall"]
    assert suites == {"scale"}
    assert not partial
    scenarios, suites, partial = selection(None)
    assert len(scenarios) == len(SCENARIOS)
    assert suites == {"uncompressed", "scale"}


def test_partial_run_replaces_only_its_sections(tmp_path: Path) -> None:
    """A partial benchmark run replaces only the sections it ran and keeps the others."""
    previous = tmp_path / "results.json"
    previous.write_text(json.dumps({"scenarios": ["kept"], "uncompressed": {}, "scale": {"a": 1}}))
    new = {
        "generated_at": "now",
        "command": "python -m bench.run --only uncompressed",
        "wall_seconds": 120.0,
        "machine": {"git": "abc"},
        "scenarios": [],
        "uncompressed": {"scenarios": ["new"]},
        "scale": {},
        "scrape_parser": {},
    }
    merged = merge_partial(new, {"uncompressed"}, previous)
    assert merged["scenarios"] == ["kept"]
    assert merged["scale"] == {"a": 1}
    assert merged["uncompressed"] == {"scenarios": ["new"]}
    assert "replaced the sections uncompressed" in merged["updates"][0]


def test_uncompressed_suite_runs_at_the_defaults(tmp_path: Path) -> None:
    """Default timings and SGLang's own timeouts; two faults and the three hardest benign loads."""
    suite = uncompressed.scenarios()
    assert [s.name for s in suite] == [
        "transfer_stall",
        "decode_stall_midstream",
        "overload_aborted_probes",
        "long_generations",
        "pause_25s",
    ]
    assert [s.kind for s in suite].count("fault") == 2
    settings = uncompressed.settings(RunSettings(work_dir=tmp_path / "runs"))
    assert settings.timings == DEFAULT_TIMINGS
    assert "20" in settings.worker_args  # SGLang's 20 s health timeout, not the compressed 4 s
    # Every fault window leaves room beyond the 30 s detection bound.
    assert all(s.observe_seconds >= 60 for s in suite)
