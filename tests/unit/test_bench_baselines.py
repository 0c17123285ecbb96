"""The baseline detectors of the benchmark: k8s-style probes, PromQL increase(), the alert rule."""

from __future__ import annotations

import pytest

from bench.baselines import (
    BaselineSet,
    BaselineTimings,
    ConsecutiveFailures,
    CounterTotal,
    PrometheusRule,
    Scrape,
    increase,
    parse_samples,
    scrape_from_text,
)

TOTAL = (("engine_type", "decode"), ("model_name", "m"))
ACTIVE_GEN = (("endpoint", "/generate"), ("method", "POST"))
ACTIVE_METRICS = (("endpoint", "/metrics"), ("method", "GET"))


def scrape(at: float, requests: float, active: float = 0.0, scrape_active: float = 1.0) -> Scrape:
    """A decode scrape: one requests_total series, active /generate plus the scrape itself."""
    return Scrape(at, True, {TOTAL: requests}, {ACTIVE_GEN: active, ACTIVE_METRICS: scrape_active})


def test_probe_fires_after_threshold_consecutive_failures() -> None:
    """Three failures in a row fire once; the count then starts over like a restarted container."""
    probe = ConsecutiveFailures(3)
    assert [probe.observe(ok, t) for t, ok in enumerate([False, False, False])] == [
        False,
        False,
        True,
    ]
    assert probe.fired_at == [2]
    assert probe.failures == 0


def test_probe_success_resets_the_failure_count() -> None:
    """A single success between failures keeps the probe from firing."""
    probe = ConsecutiveFailures(3)
    for t, ok in enumerate([False, False, True, False, False]):
        probe.observe(ok, t)
    assert probe.fired_at == []


def test_increase_of_a_flat_counter_is_zero() -> None:
    """Unchanged samples give an increase of exactly 0 (what the rule compares with)."""
    assert increase([(1.0, 5.0), (4.0, 5.0), (7.0, 5.0)], 0.0, 10.0) == 0.0


def test_increase_needs_two_samples_in_the_window() -> None:
    """With fewer than two samples in (start, end] PromQL returns no value."""
    assert increase([(1.0, 5.0), (20.0, 6.0)], 10.0, 25.0) is None


def test_increase_extrapolates_to_the_window_edges() -> None:
    """Samples 3 s apart covering 6 s of a 12 s window extrapolate by at most 1.1 intervals."""
    value = increase([(3.0, 10.0), (6.0, 13.0), (9.0, 16.0)], 0.0, 12.0)
    # sampled 6 s; 3 s to each edge >= 1.1 * 3 s? no: 3 < 3.3, so both edges extrapolate fully.
    assert value == pytest.approx(6.0 * 12.0 / 6.0)


def test_increase_counts_a_reset_as_new_increase() -> None:
    """A counter that drops (process restart) contributes its new value, never a negative."""
    value = increase([(1.0, 10.0), (2.0, 12.0), (3.0, 1.0)], 0.5, 3.0)
    assert value is not None
    assert value > 0


def test_rule_fires_after_for_duration_of_flat_counter_with_active_requests() -> None:
    """Flat requests_total while /generate requests are active: pending, then firing after for."""
    rule = PrometheusRule(range_seconds=12.0, for_seconds=12.0)
    fired = []
    for t in range(0, 60, 3):
        requests = float(t) if t < 15 else 15.0  # completions stop at t=15
        rule.record("decode", scrape(float(t), requests, active=2.0))
        if rule.evaluate(float(t)):
            fired.append(t)
    # The last rise is between the samples at 12 and 15, so (t-12, t] is flat from t=24:
    # pending from 24, firing 12 s later.
    assert fired[0] == 36
    assert rule.fired_at == [36.0]


def test_rule_ignores_the_scrape_itself_as_an_active_request() -> None:
    """An idle server (only the /metrics request active) never fires the corrected rule."""
    rule = PrometheusRule(range_seconds=12.0, for_seconds=12.0)
    literal = PrometheusRule(range_seconds=12.0, for_seconds=12.0, count_scrape_as_active=True)
    for t in range(0, 60, 3):
        for r in (rule, literal):
            r.record("decode", scrape(float(t), 7.0, active=0.0))
            r.evaluate(float(t))
    assert rule.fired_at == []
    # Flat as soon as two samples are in the window (t=3), firing 12 s later.
    assert literal.fired_at == [15.0]


def test_rule_resets_pending_when_completions_resume() -> None:
    """A flat stretch shorter than range + for never fires."""
    rule = PrometheusRule(range_seconds=12.0, for_seconds=12.0)
    values = [0, 1, 2, 3, 3, 3, 3, 3, 3, 3, 4, 5, 6, 7, 8]
    for i, v in enumerate(values):
        rule.record("decode", scrape(3.0 * i, float(v), active=1.0))
        rule.evaluate(3.0 * i)
    assert rule.fired_at == []


def test_rule_is_silent_while_the_target_cannot_be_scraped() -> None:
    """A failed scrape is a stale marker: no instant vector, no alert."""
    rule = PrometheusRule(range_seconds=12.0, for_seconds=0.0)
    rule.record("decode", scrape(0.0, 5.0, active=1.0))
    rule.record("decode", scrape(3.0, 5.0, active=1.0))
    rule.record("decode", Scrape(6.0, False))
    assert rule.evaluate(6.0) is False


def test_rule_without_requests_series_never_fires() -> None:
    """Before the first completion the counter series does not exist: sum() of nothing is empty."""
    rule = PrometheusRule(range_seconds=12.0, for_seconds=0.0)
    for t in (0.0, 3.0, 6.0):
        rule.record("decode", Scrape(t, True, {}, {ACTIVE_GEN: 3.0}))
    assert rule.evaluate(6.0) is False


def test_parse_samples_reads_labels_and_values() -> None:
    """Only the wanted names are kept, keyed by their sorted label pairs."""
    text = (
        "# HELP sglang:num_requests_total x\n"
        'sglang:num_requests_total{model_name="m",engine_type="decode"} 12.0\n'
        'sglang:http_requests_active{endpoint="/metrics",method="GET"} 1.0\n'
        "sglang:other 3\n"
    )
    samples = parse_samples(text, ("sglang:num_requests_total", "sglang:http_requests_active"))
    assert samples["sglang:num_requests_total"] == {TOTAL: 12.0}
    assert samples["sglang:http_requests_active"] == {ACTIVE_METRICS: 1.0}
    assert scrape_from_text(1.0, text).requests_total == {TOTAL: 12.0}


def test_counter_total_survives_restarts() -> None:
    """A counter that drops to a new process's value keeps counting from there."""
    served = CounterTotal()
    for value in (5.0, 9.0, 2.0, 4.0):
        served.update(value)
    assert served.total == 9.0 + 4.0


def test_compressed_timings_divide_periods_but_not_thresholds() -> None:
    """Compression divides periods and windows; the failure threshold and k8s timeout stay."""
    t = BaselineTimings(compression=5.0).compressed()
    assert (t.k8s_period_seconds, t.scrape_interval_seconds) == (2.0, 3.0)
    assert (t.rule_range_seconds, t.rule_for_seconds) == (12.0, 12.0)
    assert (t.k8s_failure_threshold, t.k8s_timeout_seconds) == (3, 1.0)


def test_baseline_set_reports_every_baseline_by_name() -> None:
    """fired_at() names all four baselines, k8s merged over both workers in time order."""
    baselines = BaselineSet.create(BaselineTimings())
    baselines.k8s["decode"].fired_at.append(5.0)
    baselines.k8s["prefill"].fired_at.append(2.0)
    fired = baselines.fired_at()
    assert fired["k8s_liveness"] == [2.0, 5.0]
    assert set(fired) == {
        "k8s_liveness",
        "router_health",
        "prometheus_rule",
        "prometheus_rule_literal",
    }
