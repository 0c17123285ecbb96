"""Alert rules and dashboard PromQL checked by promtool (Debian package: prometheus)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

import pytest

from tests.unit.metric_contract import exposed_sample_names, referenced_metric_names

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "configs" / "prometheus-alerts.yml"
ALERT_TESTS = ROOT / "tests" / "promtool" / "alerts_test.yml"
DASHBOARD = ROOT / "configs" / "grafana-dashboard.json"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool is not installed (apt-get install prometheus; .ci/run installs it)",
)
EXPECTED_ALERTS = {
    "SGLangWatchdogDown",
    "SGLangWatchdogLoopStuck",
    "SGLangWatchdogHeld",
    "SGLangStallDetected",
    "SGLangTransferFailuresRising",
    "SGLangDecodeOnlyRestart",
}
# Grafana's variables, replaced by values Prometheus accepts. Temporary rule and test files are
# written as JSON, which is YAML too (no YAML library needed).
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$group": ".*"}


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    """Run promtool with a timeout, returning its exit status and output."""
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *args], capture_output=True, text=True, check=False, timeout=120
    )


def test_alert_set_and_metric_names() -> None:
    """The README's alerts exist, and the rules file uses only metrics the watchdog exposes."""
    text = ALERTS.read_text(encoding="utf-8")
    assert set(re.findall(r"^\s+- alert: (\S+)$", text, re.MULTILINE)) == EXPECTED_ALERTS
    unknown = referenced_metric_names(text) - exposed_sample_names()
    assert not unknown, sorted(unknown)


def test_every_alert_is_unit_tested() -> None:
    """tests/promtool/alerts_test.yml evaluates every alert, both firing and not firing."""
    cases = re.findall(
        r"alertname: (\S+)\n\s+exp_alerts:(.*)$",
        ALERT_TESTS.read_text(encoding="utf-8"),
        re.MULTILINE,
    )
    firing = {name for name, rest in cases if rest.strip() != "[]"}
    silent = {name for name, rest in cases if rest.strip() == "[]"}
    assert firing == EXPECTED_ALERTS
    assert silent == EXPECTED_ALERTS


@needs_promtool
def test_alert_rules_are_valid() -> None:
    """`promtool check rules` accepts the alert rules."""
    completed = promtool("check", "rules", str(ALERTS))
    assert completed.returncode == 0, completed.stdout + completed.stderr


@needs_promtool
def test_alert_rules_unit_tests_pass() -> None:
    """`promtool test rules` passes: each alert fires and stays quiet where it should."""
    completed = promtool("test", "rules", str(ALERT_TESTS))
    assert completed.returncode == 0, completed.stdout + completed.stderr


def _substituted(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return expr


def dashboard_exprs() -> list[str]:
    """Every PromQL expression of the dashboard, with Grafana's variables replaced by values."""
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    exprs = []
    for panel in dashboard["panels"]:
        exprs += [target["expr"] for target in panel.get("targets", [])]
    exprs += [a["expr"] for a in dashboard["annotations"]["list"] if "expr" in a]
    return [_substituted(expr) for expr in exprs]


def panel_expr(title: str) -> str:
    """The one query of the dashboard panel titled `title`, Grafana's variables replaced."""
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    (panel,) = [p for p in dashboard["panels"] if p["title"] == title]
    (target,) = panel["targets"]
    return _substituted(target["expr"])


def promtool_test(
    tmp_path: Path, series: Mapping[str, str], expr: str, expected: Mapping[str, float]
) -> None:
    """Evaluate `expr` over `series` (one sample a minute) at 10 minutes with `promtool test
    rules` and require exactly the `expected` samples (labels: value)."""
    tests = {
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": s, "values": v} for s, v in series.items()],
                "promql_expr_test": [
                    {
                        "expr": expr,
                        "eval_time": "10m",
                        "exp_samples": [
                            {"labels": labels, "value": value} for labels, value in expected.items()
                        ],
                    }
                ],
            }
        ]
    }
    path = tmp_path / "expr_test.yml"
    path.write_text(json.dumps(tests))
    completed = promtool("test", "rules", str(path))
    assert completed.returncode == 0, completed.stdout + completed.stderr


@needs_promtool
def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    """Every dashboard query (Grafana variables substituted) parses as PromQL."""
    rules = [
        {"record": f"dashboard:query_{index}", "expr": expr}
        for index, expr in enumerate(dashboard_exprs())
    ]
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))
    completed = promtool("check", "rules", str(path))
    assert completed.returncode == 0, completed.stdout + completed.stderr


@needs_promtool
def test_state_timeline_query_yields_one_code_per_group(tmp_path: Path) -> None:
    """The state timeline's query turns the state gauges into one series per group: its state code."""
    state_expr = panel_expr("State per group")
    series = []
    for group, current in (("a", "healthy"), ("b", "held")):
        for state in ("warming", "healthy", "held"):
            value = "1x5" if state == current else "0x5"
            series.append(
                {
                    "series": f'sglang_watchdog_state{{group="{group}",state="{state}"}}',
                    "values": value,
                }
            )
    tests = {
        "tests": [
            {
                "interval": "1m",
                "input_series": series,
                "promql_expr_test": [
                    {
                        "expr": state_expr,
                        "eval_time": "2m",
                        "exp_samples": [
                            {"labels": '{group="a"}', "value": 2},
                            {"labels": '{group="b"}', "value": 8},
                        ],
                    }
                ],
            }
        ]
    }
    path = tmp_path / "state_test.yml"
    path.write_text(json.dumps(tests))
    completed = promtool("test", "rules", str(path))
    assert completed.returncode == 0, completed.stdout + completed.stderr


@needs_promtool
def test_fleet_groups_by_state_counts_the_groups_in_each_state(tmp_path: Path) -> None:
    """The Fleet row's state query counts the groups in each state, 0 for a state none is in."""
    series = {
        f'sglang_watchdog_state{{group="{group}",state="{state}"}}': (
            "1x10" if state == current else "0x10"
        )
        for group, current in (("a", "healthy"), ("b", "held"), ("c", "healthy"))
        for state in ("healthy", "held", "warming")
    }
    expected = {'{state="healthy"}': 2, '{state="held"}': 1, '{state="warming"}': 0}
    promtool_test(tmp_path, series, panel_expr("Groups by state"), expected)


@needs_promtool
def test_fleet_restarts_and_refusals_sum_over_groups(tmp_path: Path) -> None:
    """The Fleet row adds every group's co-restarts per result and refusals per reason: one
    series per result or reason, none per group (5 minutes of a steady rate per minute)."""
    restarts = {
        'sglang_watchdog_restarts_total{group="a",result="done"}': "0+1x10",
        'sglang_watchdog_restarts_total{group="b",result="done"}': "0+2x10",
        'sglang_watchdog_restarts_total{group="b",result="failed"}': "0+1x10",
    }
    expected = {'{result="done"}': 15, '{result="failed"}': 5}
    promtool_test(tmp_path, restarts, panel_expr("Co-restarts across the fleet"), expected)
    refusals = {
        'sglang_watchdog_restart_refusals_total{group="a",reason="decode_only"}': "0+1x10",
        'sglang_watchdog_restart_refusals_total{group="b",reason="decode_only"}': "0+1x10",
        'sglang_watchdog_restart_refusals_total{group="b",reason="lock_held"}': "0+3x10",
    }
    expected = {'{reason="decode_only"}': 10, '{reason="lock_held"}': 15}
    promtool_test(tmp_path, refusals, panel_expr("Refusals across the fleet"), expected)
