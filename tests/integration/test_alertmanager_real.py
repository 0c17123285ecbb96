"""The silence lifecycle and the held alert against a real Alertmanager (Debian's
prometheus-alertmanager on 127.0.0.1), through the daemon's CycleRunner: decide() is scripted, the
restarter records when its first step starts and looks at Alertmanager right there."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.alertmanager_support import (
    CO_RESTART,
    GROUP,
    HEALTHY,
    HELD,
    PASSED,
    VERIFYING,
    RealAlertmanager,
    RecordingRestarter,
    config_with_alertmanager,
    make_harness,
    real_alertmanager,
    wait_for,
)
from watchdog.act.alertmanager import AlertmanagerClient, GroupAlerts
from watchdog.act.plan import plan_for_request
from watchdog.commands import restart as restart_command
from watchdog.decide.fleet import Storm, Suspect
from watchdog.model import RestartOutcome, RestartPlan, Role, State
from watchdog.run.stormalert import StormAlert

OUR_MATCHERS = [{"name": "group", "value": GROUP, "isRegex": False, "isEqual": True}]


def _ours(am: RealAlertmanager) -> list[dict[str, Any]]:
    return [s for s in am.silences() if s["createdBy"] == "sglang-watchdog"]


async def _silences(am: RealAlertmanager) -> list[dict[str, Any]]:
    return await asyncio.to_thread(_ours, am)


async def test_silence_active_before_the_first_step_renewed_in_the_soak_expired_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real Alertmanager: the silence is active with our matchers when the first restart step
    starts, renewed while that step runs and again while verifying, and expired once the
    verification passed."""
    with real_alertmanager(tmp_path) as am:
        config = config_with_alertmanager(tmp_path, am.url, silence_seconds=60.0)
        async with httpx.AsyncClient() as http:
            h = make_harness(tmp_path, monkeypatch, config, http)
            at_first_step: list[dict[str, Any]] = []

            async def first_step() -> None:
                found = await _silences(am)
                at_first_step.extend(found)
                h.clock.advance(40)  # 20 of its 60 s left: renewed beside the running step
                ends = found[0]["endsAt"] if found else None
                for _ in range(3000):
                    now = await _silences(am)
                    if now and now[0]["endsAt"] != ends:
                        return
                    await asyncio.sleep(0.01)
                raise AssertionError("the silence was not renewed during the step")

            h.restarter.at_first_step = first_step
            await h.cycle(CO_RESTART)
            (silence,) = at_first_step
            assert silence["status"]["state"] == "active"
            assert silence["matchers"] == OUR_MATCHERS
            assert str(h.runtime.last_incident) in silence["comment"]
            # Renewed in place, or replaced by a new one (Alertmanager stores a start in the past
            # as its own now, and replaces an active silence whose start the renewal does not
            # match: the test's clock stands still while a loaded machine runs the evidence).
            (renewed,) = [s for s in await _silences(am) if s["status"]["state"] == "active"]
            assert renewed["endsAt"] > silence["endsAt"]

            h.clock.advance(40)
            await h.cycle(VERIFYING)  # the soak: renewed again
            (soaking,) = [s for s in await _silences(am) if s["status"]["state"] == "active"]
            assert soaking["endsAt"] > renewed["endsAt"]

            await h.cycle(PASSED)
            assert h.runtime.state.state is State.HEALTHY
            states = {s["id"]: s["status"]["state"] for s in await _silences(am)}
            assert set(states.values()) == {"expired"}, states
            assert h.runtime.silence is None


async def test_the_held_alert_reaches_alertmanager_with_the_incident(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real Alertmanager: held expires the silence and posts SGLangWatchdogHeld for the group,
    with the incident id and report path; re-arming resolves it."""
    with real_alertmanager(tmp_path) as am:
        config = config_with_alertmanager(tmp_path, am.url, silence_seconds=60.0)
        async with httpx.AsyncClient() as http:
            h = make_harness(tmp_path, monkeypatch, config, http)
            await h.cycle(CO_RESTART)
            await h.cycle(HELD)
            incident = h.runtime.last_incident
            assert incident is not None

            def held() -> list[dict[str, Any]]:
                return [
                    a
                    for a in am.alerts()
                    if a["labels"].get("alertname") == "SGLangWatchdogHeld"
                    and a["status"]["state"] == "active"
                ]

            await wait_for(lambda: bool(held()), "the held alert in Alertmanager")
            (alert,) = held()
            assert alert["labels"] == {
                "alertname": "SGLangWatchdogHeld",
                "group": GROUP,
                "severity": "critical",
            }
            assert alert["annotations"]["incident"] == incident
            assert alert["annotations"]["report"].endswith(f"incidents/{incident}/report.md")
            assert {s["status"]["state"] for s in await _silences(am)} == {"expired"}

            await h.cycle(HEALTHY)  # re-armed by `watchdog reset`
            await wait_for(lambda: not held(), "the held alert resolved")


async def test_the_storm_alert_names_the_groups_and_is_resolved_when_the_storm_ends(
    tmp_path: Path,
) -> None:
    """Real Alertmanager: a declared storm posts SGLangWatchdogStorm (no group label) naming the
    stalled groups, their shared suspects, the group acted on and the held ones; its end
    resolves it."""
    with real_alertmanager(tmp_path) as am:
        config = config_with_alertmanager(tmp_path, am.url, silence_seconds=60.0)
        assert config.alertmanager is not None
        storm = Storm(
            started_at=time.time(),
            groups=("f0", "f1", "f2"),
            total=4,
            suspects=(Suspect("router", "http://127.0.0.1:30000", ("f0", "f1", "f2")),),
            acted=("f0",),
            held=("f1", "f2"),
        )
        errors: list[str] = []
        async with httpx.AsyncClient() as http:
            client = AlertmanagerClient(
                config.alertmanager, http, token=None, clock=time.time, count_error=errors.append
            )
            follower = StormAlert(GroupAlerts(client, dry_run=False), lambda: storm, lambda: None)
            follower.declared(storm)

            def stormy() -> list[dict[str, Any]]:
                return [
                    a
                    for a in am.alerts()
                    if a["labels"].get("alertname") == "SGLangWatchdogStorm"
                    and a["status"]["state"] == "active"
                ]

            await wait_for(lambda: bool(stormy()), "the storm alert in Alertmanager")
            (alert,) = stormy()
            assert alert["labels"] == {"alertname": "SGLangWatchdogStorm", "severity": "critical"}
            notes = alert["annotations"]
            assert notes["groups"] == "f0, f1, f2"
            assert notes["suspects"] == "router http://127.0.0.1:30000: f0, f1, f2"
            assert (notes["acted"], notes["held"]) == ("f0", "f1, f2")
            assert "3 of 4 groups" in notes["summary"]

            follower.ended()
            await wait_for(lambda: not stormy(), "the storm alert resolved")
            await follower.close()
            assert errors == []


class _FailingRestarter(RecordingRestarter):
    """Every step of the plan fails (after `at_first_step`)."""

    async def execute(self, plan: RestartPlan) -> RestartOutcome:
        """The recorded outcome, failed."""
        outcome = await super().execute(plan)
        return replace(outcome, ok=False)


@pytest.mark.parametrize("fails", [False, True], ids=["succeeds", "fails"])
async def test_a_manual_restart_holds_the_groups_silence_while_it_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fails: bool
) -> None:
    """Real Alertmanager: `watchdog restart` silences the group before its first step; a restart
    that succeeded leaves the silence to lapse, one that failed expires it at once."""
    with real_alertmanager(tmp_path) as am:
        config = config_with_alertmanager(tmp_path, am.url, silence_seconds=60.0)
        restarter = (_FailingRestarter if fails else RecordingRestarter)(time.time)
        at_first_step: list[dict[str, Any]] = []

        async def first_step() -> None:
            at_first_step.extend(await _silences(am))

        restarter.at_first_step = first_step

        @contextlib.asynccontextmanager
        async def recording(**_: object) -> AsyncIterator[RecordingRestarter]:
            yield restarter

        monkeypatch.setattr(restart_command, "open_restarter", recording)
        group = config.group_named(GROUP)
        plan = plan_for_request(group, tuple(Role), "manual", config="test.toml")
        outcome = await restart_command._execute(
            plan, config.watchdog.state_dir, dry_run=False, config=config
        )
        assert outcome.ok is not fails
        (silence,) = at_first_step
        assert silence["status"]["state"] == "active"
        assert silence["matchers"] == OUR_MATCHERS
        assert "watchdog restart" in silence["comment"]
        (after,) = await _silences(am)
        assert after["status"]["state"] == ("expired" if fails else "active")
