"""A remote host that cannot be reached: one alert per outage, a log line when it is back."""

from __future__ import annotations

import contextlib
from pathlib import Path
from urllib.parse import urlparse

from structlog.testing import capture_logs

from tests.unit.rawhttp import refused_url
from watchdog.act.hosts import HostUnreachable, UnitBuses
from watchdog.config import SshTarget
from watchdog.model import Observation, Role, UnitState
from watchdog.run.cycle import report_host_outages


def _target(tmp_path: Path) -> SshTarget:
    """A host on 127.0.0.1 where nothing listens."""
    port = urlparse(refused_url()).port or 0
    return SshTarget("wd", "127.0.0.1", port, tmp_path / "k", tmp_path / "known_hosts")


async def _down_buses(tmp_path: Path) -> UnitBuses:
    """UnitBuses whose one remote host (decode's) refused a connection attempt."""
    target = _target(tmp_path)
    buses = UnitBuses(None, {"d.service": target})
    with contextlib.suppress(HostUnreachable):
        await buses.hosts[target].ensure(wait=True)
    return buses


def _observation(*, decode_ok: bool, prefill_ok: bool = True) -> Observation:
    error = "ssh wd@127.0.0.1: the SSH connection was lost"
    units = (
        UnitState(Role.PREFILL, "p.service", ok=prefill_ok, error="" if prefill_ok else "bus"),
        UnitState(Role.DECODE, "d.service", ok=decode_ok, error="" if decode_ok else error),
    )
    return Observation(group="g", at=0.0, units=units)


async def test_an_unreachable_host_alerts_once_then_logs_its_return(tmp_path: Path) -> None:
    """An unreachable host alerts once per outage, then logs once when it is reachable again."""
    buses = await _down_buses(tmp_path)
    label = buses.host_label("d.service")
    with capture_logs() as logs:
        down = report_host_outages("g", _observation(decode_ok=False), buses, frozenset())
        again = report_host_outages("g", _observation(decode_ok=False), buses, down)
    assert down == again == frozenset({label})
    (alert,) = logs  # the second cycle of the same outage says nothing more
    assert alert["event"] == "alert"
    assert alert["log_level"] == "warning"
    assert alert["group"] == "g"
    assert alert["verdict"] == "monitoring_outage"
    (reason,) = alert["reasons"]
    assert reason["code"] == "host_unreachable"
    assert reason["host"] == label
    assert reason["units"] == ["d.service"]
    assert "the SSH connection was lost" in reason["message"]
    assert "no co-restart can start" in reason["message"]

    with capture_logs() as logs:
        back = report_host_outages("g", _observation(decode_ok=True), buses, again)
    assert back == frozenset()
    assert [(e["event"], e["host"]) for e in logs] == [("host_reachable_again", label)]
    await buses.close()


async def test_neither_a_local_units_failed_read_nor_a_first_attempt_is_an_outage(
    tmp_path: Path,
) -> None:
    """A local unit's failed read, or a host still on its first attempt, is no host outage."""
    buses = await _down_buses(tmp_path)
    with capture_logs() as logs:
        down = report_host_outages(
            "g", _observation(decode_ok=True, prefill_ok=False), buses, frozenset()
        )
    assert down == frozenset()
    # A host whose first attempt has not finished (the daemon's first cycle in a dry run) is not
    # known to be down: its failed read is not alerted.
    fresh = UnitBuses(None, {"d.service": _target(tmp_path)})
    with capture_logs() as more:
        down = report_host_outages("g", _observation(decode_ok=False), fresh, frozenset())
    assert down == frozenset()
    assert logs == more == []
    await buses.close()
    await fresh.close()
