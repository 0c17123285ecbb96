"""The storm alert's life (watchdog/run/stormalert.py) against a fake Alertmanager: posted when a
storm is declared, resolved when it ends, a storm declared while the last one's alert is being
resolved posted after that resolve, and nothing left running at shutdown. Waits are on what the
fake Alertmanager received, under generous deadlines; nothing depends on speed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from tests.alertmanager_support import (
    FakeAlertmanager,
    FakeClock,
    config_with_alertmanager,
    wait_for,
)
from watchdog.act.alertmanager import AlertmanagerClient, GroupAlerts, rfc3339
from watchdog.decide.fleet import Storm, Suspect
from watchdog.run.stormalert import StormAlert

URL = "http://alertmanager.test:9093"


def _storm(groups: tuple[str, ...], started_at: float) -> Storm:
    return Storm(
        started_at=started_at,
        groups=groups,
        total=4,
        suspects=(Suspect("host", "10.0.0.1", groups),),
        acted=groups[:1],
        held=groups[1:],
    )


def _posts(am: FakeAlertmanager, clock: FakeClock) -> list[tuple[str, bool]]:
    """(groups annotation, still active) of every posted storm alert, in order."""
    posted: list[dict[str, Any]] = [
        a for a in am.alerts if a["labels"]["alertname"] == "SGLangWatchdogStorm"
    ]
    now = rfc3339(clock())  # a renewal ends silence_seconds ahead, a resolve at the moment
    return [(a["annotations"]["groups"], a["endsAt"] > now) for a in posted]


async def test_a_storm_is_posted_resolved_and_the_next_posted_after_that_resolve(
    tmp_path: Path,
) -> None:
    """Storm A posted, then ended and storm B declared in the same turn: A's resolve reaches
    Alertmanager before B's post (same labels: the other order would end B's alert); B's end
    resolves it; close() leaves nothing running."""
    am = FakeAlertmanager()
    clock = FakeClock()
    config = config_with_alertmanager(tmp_path, URL)
    assert config.alertmanager is not None
    current: list[Storm | None] = [None]
    errors: list[int] = []
    async with httpx.AsyncClient(transport=am.transport()) as http:
        client = AlertmanagerClient(config.alertmanager, http, clock=clock)
        follower = StormAlert(
            GroupAlerts(client, dry_run=False), lambda: current[0], lambda: errors.append(1)
        )
        a = _storm(("f0", "f1", "f2"), clock())
        current[0] = a
        follower.declared(a)
        follower.declared(a)  # declared again while followed: one alert, not two
        await wait_for(lambda: len(_posts(am, clock)) == 1, "storm A posted")
        assert _posts(am, clock) == [("f0, f1, f2", True)]

        clock.advance(1)
        follower.ended()
        b = _storm(("f1", "f3", "f4"), clock())
        current[0] = b
        follower.declared(b)
        await wait_for(lambda: len(_posts(am, clock)) == 3, "A resolved and B posted")
        assert _posts(am, clock)[1:] == [("f0, f1, f2", False), ("f1, f3, f4", True)]

        clock.advance(1)
        follower.ended()
        await wait_for(lambda: len(_posts(am, clock)) == 4, "storm B resolved")
        assert _posts(am, clock)[3] == ("f1, f3, f4", False)
        await follower.close()
    assert errors == []


async def test_close_stops_a_storm_alert_still_followed(tmp_path: Path) -> None:
    """Shutdown while a storm lasts: the task is stopped, nothing resolves the alert (it lapses
    by itself after silence_seconds), nothing raises."""
    am = FakeAlertmanager()
    clock = FakeClock()
    config = config_with_alertmanager(tmp_path, URL)
    assert config.alertmanager is not None
    async with httpx.AsyncClient(transport=am.transport()) as http:
        client = AlertmanagerClient(config.alertmanager, http, clock=clock)
        follower = StormAlert(GroupAlerts(client, dry_run=False), lambda: None, lambda: None)
        follower.declared(_storm(("f0", "f1", "f2"), clock()))
        await wait_for(lambda: len(_posts(am, clock)) == 1, "storm posted")
        await follower.close()
    assert _posts(am, clock) == [("f0, f1, f2", True)]
