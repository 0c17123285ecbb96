"""configs/grafana-dashboard.json: structure, variables, and PromQL that uses only contract metrics."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.unit.metric_contract import exposed_sample_names, referenced_metric_names
from watchdog.model import State

DASHBOARD = Path(__file__).resolve().parents[2] / "configs" / "grafana-dashboard.json"
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
# Series without a group label: the watchdog process itself.
PROCESS_WIDE = {
    "sglang_watchdog_cycle_duration_seconds_bucket",
    "sglang_watchdog_internal_errors_total",
    "sglang_watchdog_build_info",
}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    """The dashboard JSON as committed."""
    data: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return data


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel of the dashboard, the ones nested in collapsed rows included."""
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def dashboard_exprs(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression: panel targets and annotation queries."""
    exprs = [t["expr"] for p in panels(dashboard) for t in p.get("targets", [])]
    exprs += [a["expr"] for a in dashboard["annotations"]["list"] if "expr" in a]
    return exprs


def test_dashboard_basics(dashboard: dict[str, Any]) -> None:
    """A current schema, a stable uid, and unique panel ids."""
    assert dashboard["schemaVersion"] >= 36
    assert dashboard["uid"] == "sglang-watchdog"
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids))


def test_template_variables(dashboard: dict[str, Any]) -> None:
    """A DS_PROMETHEUS datasource variable and a multi-value group variable from the state metric."""
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    group = variables["group"]
    assert group["type"] == "query"
    assert group["multi"]
    assert group["includeAll"]
    assert group["definition"] == "label_values(sglang_watchdog_state, group)"
    assert group["datasource"] == DATASOURCE


def test_every_query_uses_the_datasource_variable(dashboard: dict[str, Any]) -> None:
    """Panels and their targets all point at ${DS_PROMETHEUS}, so an import picks one datasource."""
    for panel in panels(dashboard):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == DATASOURCE, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]


def test_exprs_use_only_contract_metrics(dashboard: dict[str, Any]) -> None:
    """Every sglang_watchdog_* name in a query is one the watchdog exposes (renames are caught)."""
    exposed = exposed_sample_names()
    for expr in dashboard_exprs(dashboard):
        unknown = referenced_metric_names(expr) - exposed
        assert not unknown, f"{sorted(unknown)} in {expr!r}"


def test_per_group_queries_follow_the_group_variable(dashboard: dict[str, Any]) -> None:
    """Every query on a per-group series is filtered by $group."""
    for expr in dashboard_exprs(dashboard):
        if referenced_metric_names(expr) - PROCESS_WIDE:
            assert 'group=~"$group"' in expr, expr


def test_the_issue_panels_are_there(dashboard: dict[str, Any]) -> None:
    """State timeline, probe latency and TTFT, transfer failures, restarts, refusals and budget."""
    used = set().union(*(referenced_metric_names(e) for e in dashboard_exprs(dashboard)))
    assert {
        "sglang_watchdog_state",
        "sglang_watchdog_probe_duration_seconds_bucket",
        "sglang_watchdog_probe_ttft_seconds_bucket",
        "sglang_watchdog_observed_transfer_failed_total",
        "sglang_watchdog_restarts_total",
        "sglang_watchdog_restart_refusals_total",
        "sglang_watchdog_restart_budget_remaining",
    } <= used
    assert any(p["type"] == "state-timeline" for p in panels(dashboard))


def test_state_timeline_maps_every_state(dashboard: dict[str, Any]) -> None:
    """The state timeline's codes cover every State, and each code's query picks that state."""
    (panel,) = [p for p in panels(dashboard) if p["type"] == "state-timeline"]
    (mapping,) = panel["fieldConfig"]["defaults"]["mappings"]
    names = {code: option["text"] for code, option in mapping["options"].items()}
    assert sorted(names.values()) == sorted(s.value for s in State)
    expr = panel["targets"][0]["expr"]
    for code, name in names.items():
        assert re.search(rf'state="{name}"\}} == 1\) \* {code}\b', expr), name


def fleet_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """The panels of the Fleet row: those after it, up to the next row."""
    top: list[dict[str, Any]] = dashboard["panels"]
    assert top[0]["type"] == "row"
    following = top[1:]
    end = next((i for i, p in enumerate(following) if p["type"] == "row"), len(following))
    return following[:end]


def test_the_fleet_row_comes_first_with_states_restarts_and_refusals(
    dashboard: dict[str, Any],
) -> None:
    """A Fleet row at the top sums every group: how many groups are in each state, and the
    co-restarts by result and refusals by reason of all groups together, not one line each."""
    row = dashboard["panels"][0]
    assert (row["title"], row["gridPos"]["y"]) == ("Fleet", 0)
    assert all(p["gridPos"]["y"] > 0 for p in dashboard["panels"][1:])
    exprs = {p["title"]: [t["expr"] for t in p["targets"]] for p in fleet_panels(dashboard)}
    assert exprs == {
        "Groups by state": ['sum by (state) (sglang_watchdog_state{group=~"$group"})'],
        "Co-restarts across the fleet": [
            'sum by (result) (increase(sglang_watchdog_restarts_total{group=~"$group"}'
            "[$__rate_interval]))"
        ],
        "Refusals across the fleet": [
            'sum by (reason) (increase(sglang_watchdog_restart_refusals_total{group=~"$group"}'
            "[$__rate_interval]))"
        ],
    }
