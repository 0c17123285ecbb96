"""End to end: the real daemon's Alertmanager silence through a real co-restart, against a real
systemd (the sandbox) and a real Alertmanager (Debian's prometheus-alertmanager on 127.0.0.1).

A transfer stall is injected; the daemon silences the group before its first restart step,
renews the silence through the sequence and the soak (its lifetime is shorter than both), and
expires it once verification passed. Waits are generous bounds, never claims about speed.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from pdsim.stack import http_json
from sandbox.namespace import skip_reason
from sandbox.pdsandbox import PdSandbox
from tests.alertmanager_support import real_alertmanager
from tests.e2e.daemon import TIMINGS, DaemonProcess, DaemonSetup
from tests.sandbox.fixtures import clear_runtime_faults
from watchdog.configfile import merge

# Silences read the decision and the restart outcome, not the router: sglang-router only.
pytestmark = [
    pytest.mark.router_agnostic,
    pytest.mark.sandbox,
    pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or ""),
]

GROUP = "sbx"
# A soak of at least 6 s and a silence of 4 s (the least the 0.5 s cycle and 1 s timeout allow):
# renewed at 2 s left, the silence must be renewed during the soak to last through it.
SOAK = {"group": {"restart": {"soak_probes": 6, "soak_seconds": 6.0}}}
SILENCE = {"silence_seconds": 4.0, "timeout_seconds": 1.0}


@pytest.fixture
def pd(pd_serving: PdSandbox) -> Iterator[PdSandbox]:
    """The module's stack, serving; faults set at run time are cleared afterwards."""
    yield pd_serving
    clear_runtime_faults(pd_serving)


def _at(event: dict[str, Any]) -> datetime:
    return datetime.fromisoformat(str(event["timestamp"]).replace("Z", "+00:00"))


def test_the_daemon_silences_the_group_through_a_real_co_restart(
    pd: PdSandbox, tmp_path: Path
) -> None:
    """Silence active (our matchers) before the first restart step, renewed during the soak,
    expired after verification passed; the incident names it."""
    with real_alertmanager(tmp_path) as am:
        timings = merge(TIMINGS, {**SOAK, "alertmanager": {"url": am.url, **SILENCE}})
        setup = DaemonSetup.write(pd.stack, pd.sandbox.share_dir, "alertmanager", timings)
        with DaemonProcess(setup, pd.env) as daemon:
            daemon.wait_for_event("state_changed", new="healthy", timeout_seconds=60.0)
            http_json("POST", pd.stack.url("prefill") + "/_sim/fault", {"kind": "transfer_stall"})
            daemon.wait_for_event("verification_passed", timeout_seconds=120.0)
            daemon.wait_for_event("silence_expired", timeout_seconds=30.0)
            assert daemon.stop() == 0
        events = daemon.events()
        silences = [s for s in am.silences() if s["createdBy"] == "sglang-watchdog"]

    names = [e["event"] for e in events]
    assert "alertmanager_failed" not in names, [e for e in events if "alertmanager" in e["event"]]
    (created,) = daemon.events("silence_created")
    first_step = daemon.events("unit_restart_started")[0]
    # Before the first restart step: in the log's order, and by Alertmanager's own clock.
    assert names.index("silence_created") < names.index("unit_restart_started")
    by_id = {s["id"]: s for s in silences}
    first = by_id[created["silence"]]
    assert first["matchers"] == [
        {"name": "group", "value": GROUP, "isRegex": False, "isEqual": True}
    ]
    assert datetime.fromisoformat(first["startsAt"].replace("Z", "+00:00")) <= _at(first_step)
    assert created["incident"] in first["comment"]
    # Renewed while the soak ran (it lives 4 s; the soak alone takes at least 6).
    soak = _at(daemon.events("soak_started")[0])
    passed = _at(daemon.events("verification_passed")[0])
    assert any(soak <= _at(e) <= passed for e in daemon.events("silence_extended"))
    # Expired after verification passed, and not before.
    expired = daemon.events("silence_expired")[0]
    assert names.index("verification_passed") < names.index("silence_expired")
    assert "verification_passed" in expired["why"]
    assert {s["status"]["state"] for s in silences} == {"expired"}
    assert by_id[expired["silence"]]["matchers"] == first["matchers"]
    summary = Path(setup.state_dir, "incidents", created["incident"], "summary.json").read_text()
    assert created["silence"] in summary


# One co-restart allowed, and a soak long enough for the stall to come back inside it.
HELD_TIMINGS = merge(
    TIMINGS,
    {"group": {"restart": {"max_restarts": 1, "soak_probes": 30, "soak_seconds": 90.0}}},
)


def test_a_held_group_alerts_through_alertmanager_with_its_incident(
    pd: PdSandbox, tmp_path: Path
) -> None:
    """The stall returns inside the soak with the budget spent: the group is held, its silence
    expired (its alerts must reach a person), and SGLangWatchdogHeld fires with the incident."""
    with real_alertmanager(tmp_path) as am:
        timings = merge(HELD_TIMINGS, {"alertmanager": {"url": am.url, **SILENCE}})
        setup = DaemonSetup.write(pd.stack, pd.sandbox.share_dir, "alertmanager-held", timings)
        with DaemonProcess(setup, pd.env) as daemon:
            daemon.wait_for_event("state_changed", new="healthy", timeout_seconds=60.0)
            fault = {"kind": "transfer_stall"}
            http_json("POST", pd.stack.url("prefill") + "/_sim/fault", fault)
            daemon.wait_for_event("soak_started", timeout_seconds=120.0)
            http_json("POST", pd.stack.url("prefill") + "/_sim/fault", fault)  # it returns
            daemon.wait_for_event("alert_posted", timeout_seconds=120.0)
            assert daemon.stop() == 0
        alerts = [a for a in am.alerts() if a["labels"]["alertname"] == "SGLangWatchdogHeld"]
        silences = [s for s in am.silences() if s["createdBy"] == "sglang-watchdog"]

    (created,) = daemon.events("silence_created")
    incident = created["incident"]
    (alert,) = alerts
    assert alert["labels"] == {
        "alertname": "SGLangWatchdogHeld",
        "group": GROUP,
        "severity": "critical",
    }
    assert alert["annotations"]["incident"] == incident
    assert alert["annotations"]["report"] == str(
        Path(setup.state_dir, "incidents", incident, "report.md")
    )
    (expired,) = daemon.events("silence_expired")
    assert expired["why"].startswith("held")
    assert {s["status"]["state"] for s in silences} == {"expired"}
    names = [e["event"] for e in daemon.events()]
    assert names.index("budget_exhausted") < names.index("alert_posted")
