"""Statistics and the results.md / results.json / results.png writer of the benchmark."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from bench import overhead, report
from bench.harness import COMPRESSED_TIMINGS, DEFAULT_TIMINGS, timing_values
from bench.recovery import summarize_recovery
from bench.report import (
    benign_summary,
    cost_lines,
    fault_summary,
    histogram_quantile,
    latency_stats,
    percentile,
    recovery_rows,
    render_markdown,
    write_outputs,
)
from bench.uncompressed import probe_cost

BASELINES = ("k8s_liveness", "router_health", "prometheus_rule", "prometheus_rule_literal")


def run(
    rep: int,
    decision: float | None,
    *,
    before: int = 0,
    total: int | None = None,
    prom: float | None = None,
    alerts: int = 0,
) -> dict[str, Any]:
    """A raw run result as bench.scenarios.run_scenario returns it."""
    baselines: dict[str, dict[str, float | None]] = {
        name: {"first_after_s": None, "fired_before_t0": 0, "fires": 0} for name in BASELINES
    }
    if prom is not None:
        baselines["prometheus_rule"] = {"first_after_s": prom, "fired_before_t0": 0, "fires": 1}
    decisions = total if total is not None else (before + (decision is not None))
    return {
        "rep": rep,
        "window_s": 35.0,
        "probes_total": 30.0,
        "served_requests": 120.0,
        "before_fault": {"probes_total": 10.0, "served_requests": 50.0},
        "restarts_metric_dry_run": float(decisions),
        "watchdog": {
            "decision_after_s": decision,
            "decision_verdict": None if decision is None else "silent_stall",
            "alert_after_s": decision,
            "alert_verdict": None if decision is None else "silent_stall",
            "decisions_total": decisions,
            "decisions_before_t0": before,
            "alerts_total": alerts,
        },
        "baselines": baselines,
    }


def test_percentile_interpolates_like_numpy() -> None:
    """p95 of 1..5 lies 80 % of the way from the 4th to the 5th value; the median is the middle."""
    assert percentile([5.0, 1.0, 3.0, 2.0, 4.0], 95.0) == pytest.approx(4.8)
    assert percentile([1.0, 2.0, 3.0, 4.0], 50.0) == pytest.approx(2.5)
    assert percentile([], 50.0) is None


def test_latency_stats_count_runs_that_never_fired() -> None:
    """None values count as runs but not in the median; periods divide by the probe period."""
    stats = latency_stats([6.0, None, 8.0], unit_seconds=2.0)
    assert (stats["runs"], stats["detected"]) == (3, 2)
    assert stats["median_s"] == 7.0
    assert stats["median_periods"] == 3.5


def test_histogram_quantile_interpolates_within_a_bucket() -> None:
    """Like PromQL: the rank falls inside a bucket and is interpolated linearly."""
    buckets = {0.01: 50.0, 0.1: 90.0, 1.0: 100.0, float("inf"): 100.0}
    assert histogram_quantile(buckets, 0.5) == pytest.approx(0.01)
    assert histogram_quantile(buckets, 0.95) == pytest.approx(0.1 + 0.9 * 0.5)
    assert histogram_quantile({float("inf"): 0.0}, 0.5) is None


def test_fault_summary_compares_with_the_prometheus_rule() -> None:
    """Medians of detected runs, the speedup over the rule, and pre-fault decisions are reported."""
    runs = [run(0, 6.0, prom=24.0), run(1, 8.0, prom=30.0), run(2, None, before=1)]
    summary = fault_summary(runs, period_seconds=1.0)
    assert summary["watchdog"]["detected"] == 2
    assert summary["watchdog"]["median_s"] == 7.0
    assert summary["baselines"]["prometheus_rule"]["median_s"] == 27.0
    assert summary["speedup_vs_prometheus"] == pytest.approx(27.0 / 7.0, abs=0.01)
    assert summary["false_restarts_before_fault"] == 1
    assert summary["probe_share"] == pytest.approx(0.2)  # before the fault: 30 / 150


def test_benign_summary_counts_false_restarts_and_baseline_firings() -> None:
    """Every restart decision in a benign run is a false restart; baselines count runs fired."""
    runs = [run(0, None), run(1, None, total=2, alerts=1), run(2, None, prom=10.0)]
    summary = benign_summary(runs)
    assert summary["false_restarts"] == 2
    assert summary["runs_with_false_restart"] == 1
    assert summary["alerts"] == 1
    assert summary["baselines"]["prometheus_rule"]["runs_fired"] == 1
    assert summary["baselines"]["k8s_liveness"]["runs_fired"] == 0
    assert summary["probe_share"] == pytest.approx(0.25)


def results_doc() -> dict[str, Any]:
    """A complete results document with one fault and one benign scenario."""
    fault_runs = [run(i, 6.0 + i, prom=24.0 + i) for i in range(5)]
    benign_runs = [run(i, None) for i in range(5)]
    return {
        "generated_at": "2026-01-01 00:00 UTC",
        "command": "python -m bench.run",
        "wall_seconds": 600.0,
        "watchdog_command": "watchdog --log-format json --config CFG --dry-run",
        "machine": {
            "cpu_model": "test CPU",
            "usable_cpus": 2,
            "memory_gib": 4.0,
            "kernel": "6.0",
            "python": "3.11",
            "sglang_router": "0.3.2",
            "prometheus_client": "0.26.0",
            "sglang_watchdog": "0.1.0",
            "git": "abc1234",
        },
        "settings": {
            "reps": 5,
            "concurrency": 5,
            "compression": 5.0,
            "watchdog_timings": timing_values(COMPRESSED_TIMINGS),
            "default_watchdog_timings": timing_values(DEFAULT_TIMINGS),
            "baseline_timings": {
                "k8s_period_seconds": 2.0,
                "k8s_timeout_seconds": 1.0,
                "k8s_failure_threshold": 3,
                "scrape_interval_seconds": 3.0,
                "rule_range_seconds": 12.0,
                "rule_for_seconds": 12.0,
            },
        },
        "scenarios": [
            {
                "name": "transfer_stall",
                "kind": "fault",
                "title": "transfer stall",
                "how": "pdsim fault",
                "summary": fault_summary(fault_runs, 1.0),
                "runs": fault_runs,
            },
            {
                "name": "idle",
                "kind": "benign",
                "title": "idle",
                "how": "nothing",
                "summary": benign_summary(benign_runs),
                "runs": benign_runs,
            },
        ],
        "recovery": {"status": "not measured", "reason": "needs root"},
        "overhead": {
            "duration_s": 60.0,
            "cpu_seconds": 0.3,
            "cpu_core_fraction": 0.005,
            "peak_rss_mib": 45.0,
            "cycles": 12,
        },
        "scale": {
            "description": "scale",
            "points": [
                {
                    "groups": 1,
                    "cycle_mean_s": 0.01,
                    "cycle_p95_s": 0.02,
                    "cpu_core_fraction": 0.004,
                },
                {"groups": 8, "cycle_mean_s": 0.02, "cycle_p95_s": 0.04, "cpu_core_fraction": 0.02},
            ],
        },
        "scrape_parser": {},
        "notes": ["a note"],
    }


def test_markdown_has_the_tables_the_targets_and_the_command() -> None:
    """results.md names the command and machine, both tables, the targets and missing sandbox."""
    text = render_markdown(results_doc())
    assert "`python -m bench.run`" in text
    assert "test CPU" in text
    assert "| transfer stall (`transfer_stall`) | 8.0 / 9.8 s (8.0 / 9.8 periods)" in text
    assert "| idle (`idle`) | **0** (0/5)" in text
    assert "Not measured (needs root)" in text
    assert "| one group, default cadence: CPU | 0.5 % | < 1 % of a core | met |" in text
    assert "vs Prometheus rule, `transfer_stall`" in text


def test_write_outputs_writes_markdown_json_and_png(tmp_path: Path) -> None:
    """The three files appear; the JSON round-trips and the PNG is a PNG."""
    paths = write_outputs(results_doc(), tmp_path)
    assert [p.name for p in paths] == ["results.md", "results.json", "results.png"]
    assert json.loads((tmp_path / "results.json").read_text())["wall_seconds"] == 600.0
    assert (tmp_path / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_recovery_summary_separates_failed_verifications() -> None:
    """A failed verification counts apart from verified recoveries and is listed with its reasons."""
    runs = [
        {"fault": "transfer_stall", "detection_s": 6.0, "verdict": "silent_stall",
         "recovery_s": 16.0, "healthy_again_s": 16.0, "served_after": True},
        {"fault": "transfer_stall", "detection_s": 7.0, "verdict": "silent_stall",
         "recovery_s": None, "verification_failed_s": 15.0, "healthy_again_s": 17.0,
         "verification_failed_reasons": "transfer failures rose by 2", "served_after": True},
    ]  # fmt: skip
    summary = summarize_recovery(runs, period_seconds=1.0)["transfer_stall"]
    assert summary["recovery"]["detected"] == 1
    assert summary["healthy_again"]["median_s"] == 16.5
    assert summary["verification_failed"] == [
        {"after_s": 15.0, "reasons": "transfer failures rose by 2"}
    ]
    rows = "\n".join(recovery_rows({"status": "measured", "summary": {"transfer_stall": summary}}))
    assert "| `transfer_stall` | 2 | 6.5 / 7.0 s" in rows
    assert "verification failed 15.0 s after the fault: transfer failures rose by 2" in rows


def test_targets_need_every_run_to_detect() -> None:
    """A fault detected in only some runs misses the targets, and the table says how many missed."""
    doc = results_doc()
    runs = [run(0, 6.0, prom=24.0), run(1, None, prom=25.0)]
    doc["scenarios"][0]["summary"] = fault_summary(runs, 1.0)
    text = render_markdown(doc)
    assert (
        "| vs Prometheus rule, `transfer_stall` | 4.1x faster (medians), never in 1/2 runs" in text
    )
    assert (
        "6.0 s (6.0 periods), never in 1/2 runs | ≤ timeout + 2 periods = 6 s | **missed** |"
        in text
    )


def uncompressed_doc() -> dict[str, Any]:
    """The uncompressed suite's section: one fault over the 30 s bound in one run, one benign."""
    fault_runs = [run(0, 24.0), run(1, 33.0)]
    benign_runs = [run(0, None), run(1, None)]
    return {
        "wall_seconds": 300.0,
        "reps": 2,
        "concurrency": 2,
        "timings": timing_values(DEFAULT_TIMINGS),
        "scenarios": [
            {
                "name": "transfer_stall",
                "kind": "fault",
                "title": "transfer stall",
                "how": "pdsim fault",
                "summary": fault_summary(fault_runs, 5.0),
                "runs": fault_runs,
            },
            {
                "name": "pause_25s",
                "kind": "benign",
                "title": "single 25 s pause",
                "how": "SIGSTOP",
                "summary": benign_summary(benign_runs),
                "runs": benign_runs,
            },
        ],
        "cost": probe_cost(),
    }


def test_uncompressed_section_and_targets() -> None:
    """Its wall time, the 30 s bound per fault, false restarts per benign load, and the cost."""
    doc = results_doc()
    doc["uncompressed"] = uncompressed_doc()
    text = render_markdown(doc)
    assert "Wall time of this suite: **5.0 min**" in text
    assert "| transfer stall (`transfer_stall`) | fault | 28.5 / 32.5 s" in text
    assert "| single 25 s pause (`pause_25s`) | benign | – | – | **0** (0/2) |" in text
    assert (
        "| uncompressed, shipped defaults: detection p95, `transfer_stall` | 32.5 s | ≤ 30 s "
        "| **missed** |" in text
    )
    assert "| uncompressed, shipped defaults: false restarts, `pause_25s` | 0 | 0 | met |" in text
    assert "| all HTTP requests |" in text


def test_uncompressed_section_says_when_it_did_not_run() -> None:
    """The uncompressed section says it was not run rather than showing an empty table."""
    assert "Not measured: not run" in render_markdown(results_doc())


def test_probe_cost_follows_the_defaults() -> None:
    """A 4-token probe every 5 s plus 5 rounds every 300 s; 8 fetches per 5 s cycle."""
    cost = probe_cost()
    assert cost["generation_requests_per_second"] == pytest.approx(1 / 5 + 5 / 300)
    assert cost["generated_tokens_per_hour"] == pytest.approx(3600 * (1 / 5 + 5 / 300) * 4)
    assert cost["http_requests_per_second"] == pytest.approx(1 / 5 + 5 / 300 + 8 / 5)


def test_scale_targets_judge_32_groups_and_keeping_up() -> None:
    """The scale table judges the 32-group targets and whether 128 groups keep up with the cycle."""
    doc = results_doc()
    doc["scale"]["points"] = [
        {"groups": 32, "duration_s": 20.0, "cycles": 128, "cycle_mean_s": 0.1,
         "cycle_p95_s": 0.3, "cpu_core_fraction": 0.15, "cpu_seconds": 3.0},
        {"groups": 128, "duration_s": 20.0, "cycles": 400, "cycle_mean_s": 0.5,
         "cycle_p95_s": 2.0, "cpu_core_fraction": 0.6, "cpu_seconds": 12.0},
    ]  # fmt: skip
    text = render_markdown(doc)
    assert "| 32 groups: CPU | 15.0 % | ≤ 10 % of a core | **missed** |" in text
    assert "| 32 groups: mean cycle | 100.0 ms | ≤ 250 ms | met |" in text
    assert "| 32 groups: p95 cycle | 300.0 ms | ≤ 1000 ms | met |" in text
    assert "| 128 groups: keeps up with the 5 s cycle | 400 of 512 cycles due" in text
    assert "| **missed** |" in text.split("128 groups: keeps up")[1].splitlines()[0]
    assert "| 128 groups: CPU | 60.0 % | ≤ 35 % of a core | **missed** |" in text
    assert "128 groups: mean cycle" not in text


def test_scale_cycles_are_counted_within_the_window() -> None:
    """The cycles run and their statistics are those after the window's start, so they compare
    with the cycles due in it (warm-up cycles left out)."""
    start = overhead._CycleCounts(
        {0.05: 10.0, 0.1: 12.0, math.inf: 12.0}, 12.0, 0.6, {"completion": 12}
    )
    end = overhead._CycleCounts(
        {0.05: 30.0, 0.1: 32.0, math.inf: 32.0}, 32.0, 1.0, {"completion": 30}
    )
    window = end.since(start)
    assert window["cycles"] == 20
    assert window["cycle_mean_s"] == pytest.approx(0.4 / 20)
    assert window["checks_by_kind"] == {"completion": 18}
    assert window["cycle_p95_s"] == pytest.approx(
        histogram_quantile({0.05: 20.0, 0.1: 20.0, math.inf: 20.0}, 0.95)
    )
    assert end.since(None)["cycles"] == 32


def test_probe_cost_while_calm_follows_the_default_cadences() -> None:
    """Calm: /health + /readiness every 6th cycle, worker and router /metrics every 3rd,
    /v1/loads every cycle; both rates are in the traffic table, older results keep one."""
    calm = probe_cost()["calm"]
    assert calm["health_requests_per_second"] == pytest.approx(3 / 30)
    assert calm["scrape_requests_per_second"] == pytest.approx(3 / 15)
    assert calm["loads_requests_per_second"] == pytest.approx(2 / 5)
    lines = cost_lines(probe_cost())
    assert (
        "| /health + /readiness (3 per cycle of 5 s; calm: every 6 cycles) | 0.60 /s (0.10 /s calm) | 2160 (360 calm) |"
        in lines
    )
    older = {k: v for k, v in probe_cost().items() if k != "calm"}
    assert "| /v1/loads of prefill and decode (2 per cycle) | 0.40 /s | 1440 |" in cost_lines(older)


def test_markdown_keeps_the_hand_kept_history(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench/history.md is carried after the scale tables; none, nothing."""
    history = tmp_path / "history.md"
    monkeypatch.setattr(report, "HISTORY", history)
    assert "Between full runs" not in render_markdown(results_doc())
    history.write_text("### Between full runs\n\nmeasured by hand\n")
    text = render_markdown(results_doc())
    assert text.index("## Overhead and scale") < text.index("measured by hand")
    assert text.index("measured by hand") < text.index("## Targets")


def test_a_scale_point_measured_thrice_reports_its_median_and_every_run() -> None:
    """The median run by CPU stands for the count; the table lists every run's CPU."""
    runs = [
        {"groups": 128, "duration_s": 20.0, "cycles": 512, "cpu_core_fraction": f}
        for f in (0.30, 0.25, 0.40)
    ]
    point = overhead.median_point(runs)
    assert point["cpu_core_fraction"] == pytest.approx(0.30)
    assert point["cpu_core_fraction_runs"] == [0.30, 0.25, 0.40]
    doc = results_doc()
    doc["scale"]["points"] = [{**point, "cycle_mean_s": 0.02, "cycle_p95_s": 0.05}]
    text = render_markdown(doc)
    assert "| 30.0 % (runs 30.0, 25.0, 40.0 %) |" in text
    assert "| 128 groups: CPU | 30.0 % | ≤ 35 % of a core | met |" in text
