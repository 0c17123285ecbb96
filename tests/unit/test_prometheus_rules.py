"""Alert rules and dashboard PromQL checked by promtool (Debian package: prometheus)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
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


def dashboard_exprs() -> list[str]:
    """Every PromQL expression of the dashboard, with Grafana's variables replaced by values."""
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    exprs = []
    for panel in dashboard["panels"]:
        exprs += [target["expr"] for target in panel.get("targets", [])]
    exprs += [a["expr"] for a in dashboard["annotations"]["list"] if "expr" in a]
    for variable, value in GRAFANA_VARIABLES.items():
        exprs = [expr.replace(variable, value) for expr in exprs]
    return exprs


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
    (state_expr,) = [e for e in dashboard_exprs() if "sglang_watchdog_state{" in e]
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
