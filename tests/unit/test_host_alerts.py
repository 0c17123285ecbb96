"""A remote host that cannot be reached: one alert per outage, a log line when it is back."""

from __future__ import annotations

from pathlib import Path

from structlog.testing import capture_logs

from watchdog.act.hosts import UnitBuses
from watchdog.config import SshTarget
from watchdog.model import Observation, Role, UnitState
from watchdog.run.cycle import report_host_outages

TARGET = SshTarget("wd", "10.0.0.12", 22, Path("/k"), Path("/known_hosts"))
LABEL = "wd@10.0.0.12:22"


def _observation(*, decode_ok: bool, prefill_ok: bool = True) -> Observation:
    error = "ssh wd@10.0.0.12:22: the SSH connection was lost"
    units = (
        UnitState(Role.PREFILL, "p.service", ok=prefill_ok, error="" if prefill_ok else "bus"),
        UnitState(Role.DECODE, "d.service", ok=decode_ok, error="" if decode_ok else error),
    )
    return Observation(group="g", at=0.0, units=units)


def test_an_unreachable_host_alerts_once_then_logs_its_return() -> None:
    buses = UnitBuses(None, {"d.service": TARGET})  # never connected: the host is down
    with capture_logs() as logs:
        down = report_host_outages("g", _observation(decode_ok=False), buses, frozenset())
        again = report_host_outages("g", _observation(decode_ok=False), buses, down)
    assert down == again == frozenset({LABEL})
    (alert,) = logs  # the second cycle of the same outage says nothing more
    assert alert["event"] == "alert"
    assert alert["log_level"] == "warning"
    assert alert["group"] == "g"
    assert alert["verdict"] == "monitoring_outage"
    (reason,) = alert["reasons"]
    assert reason["code"] == "host_unreachable"
    assert reason["host"] == LABEL
    assert reason["units"] == ["d.service"]
    assert "the SSH connection was lost" in reason["message"]
    assert "no co-restart can start" in reason["message"]

    with capture_logs() as logs:
        back = report_host_outages("g", _observation(decode_ok=True), buses, again)
    assert back == frozenset()
    assert [(e["event"], e["host"]) for e in logs] == [("host_reachable_again", LABEL)]


def test_a_local_units_failed_read_is_not_a_host_outage() -> None:
    buses = UnitBuses(None, {"d.service": TARGET})
    with capture_logs() as logs:
        down = report_host_outages(
            "g", _observation(decode_ok=True, prefill_ok=False), buses, frozenset()
        )
    assert down == frozenset()
    assert logs == []
