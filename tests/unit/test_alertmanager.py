"""Alertmanager silences and the held alert (watchdog/act/alertmanager.py), against an in-memory
Alertmanager behind httpx.MockTransport: the requests' shapes, the lifecycle through the daemon's
cycle, and that Alertmanager down, slow or failing never stops a co-restart."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from structlog.testing import capture_logs

from tests.alertmanager_support import (
    CO_RESTART,
    GROUP,
    HEALTHY,
    HELD,
    PASSED,
    VERIFYING,
    FakeAlertmanager,
    Harness,
    config_with_alertmanager,
    make_harness,
    wait_for,
)
from tests.unit import configs
from watchdog.act.alertmanager import renewing_beside, rfc3339
from watchdog.act.plan import plan_for_request
from watchdog.commands import restart as restart_command
from watchdog.config import Config, parse_matcher
from watchdog.configfile import build_config
from watchdog.errors import ConfigError
from watchdog.model import RestartOutcome, RestartPlan, Role, State
from watchdog.redact import redact_text

URL = "http://alertmanager.test:9093"


def _harness(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    am: FakeAlertmanager,
    *,
    dry_run: bool = False,
    **settings: object,
) -> Harness:
    config = config_with_alertmanager(tmp_path, URL, **settings)
    http = httpx.AsyncClient(transport=am.transport())
    return make_harness(tmp_path, monkeypatch, config, http, dry_run=dry_run)


# --- the lifecycle through the cycle ---------------------------------------------------------


async def test_the_silence_is_active_before_the_first_restart_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A co-restart creates the group's silence (its matchers, createdBy, a comment naming the
    incident) before the restarter's first step, and the incident records the silence id."""
    am = FakeAlertmanager()
    h = _harness(tmp_path, monkeypatch, am, silence_seconds=60.0)
    seen: list[list[dict[str, object]]] = []

    async def first_step() -> None:
        seen.append(am.active())

    h.restarter.at_first_step = first_step
    with capture_logs() as logs:
        await h.cycle(CO_RESTART)
    (active,) = seen[0]
    assert active["matchers"] == [
        {"name": "group", "value": GROUP, "isRegex": False, "isEqual": True}
    ]
    assert active["createdBy"] == "sglang-watchdog"
    # It lives silence_seconds (60 here) from now, and lapses then unless renewed.
    assert active["startsAt"] == rfc3339(h.clock())
    assert active["endsAt"] == rfc3339(h.clock() + 60.0)
    incident = h.runtime.last_incident
    assert incident is not None
    assert incident in str(active["comment"])
    assert h.runtime.state.state is State.VERIFYING
    created = [e for e in logs if e["event"] == "silence_created"]
    assert [(e["silence"], e["incident"]) for e in created] == [(active["id"], incident)]
    summary = json.loads((tmp_path / "state" / "incidents" / incident / "summary.json").read_text())
    assert summary["silence"]["id"] == active["id"]
    assert summary["silence"]["matchers"] == [f'group="{GROUP}"']
    report = (tmp_path / "state" / "incidents" / incident / "report.md").read_text()
    assert str(active["id"]) in report


async def test_the_silence_is_renewed_during_a_long_sequence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sequence longer than the silence lives: it is renewed beside the sequence, before it
    lapses (the group loop itself is blocked in the sequence)."""
    am = FakeAlertmanager()
    h = _harness(tmp_path, monkeypatch, am, silence_seconds=60.0)
    ends: list[str] = []

    async def long_step() -> None:
        (silence,) = am.active()
        ends.append(str(silence["endsAt"]))
        h.clock.advance(40)  # 20 s of 60 left: less than half
        await wait_for(lambda: am.active()[0]["endsAt"] != ends[0], "renewed during the step")

    h.restarter.at_first_step = long_step
    with capture_logs() as logs:
        await h.cycle(CO_RESTART)
    assert [e["event"] for e in logs].count("silence_extended") >= 1
    (silence,) = am.active()
    assert silence["endsAt"] > ends[0]
    assert len(am.silences) == 1  # renewed in place (same id), not a second silence


async def test_a_renewal_answered_after_the_sequence_ended_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Alertmanager replaces the silence (a new id, the old one expired) and its answer arrives
    only once the sequence has ended: the renewer is let finish, not cancelled, so the group holds
    the new id, and the soak's renewal extends that one instead of creating a second silence."""
    am = FakeAlertmanager()
    h = _harness(tmp_path, monkeypatch, am, silence_seconds=60.0)
    in_flight, sequence_ended = asyncio.Event(), asyncio.Event()

    async def replace_then_answer_late(request: httpx.Request) -> httpx.Response | None:
        body = json.loads(request.content) if request.method == "POST" else {}
        old = body.pop("id", None)
        if old is None or sequence_ended.is_set():
            return None
        am.silences[old]["status"] = {"state": "expired"}
        new_id = f"{old}-replaced"
        am.silences[new_id] = {**body, "id": new_id, "status": {"state": "active"}}
        in_flight.set()
        await sequence_ended.wait()  # a cancelled renewer never gets this answer
        return httpx.Response(200, json={"silenceID": new_id})

    async def long_step() -> None:
        h.clock.advance(40)  # 20 s of 60 left: the renewer asks Alertmanager
        await in_flight.wait()

    execute = h.restarter.execute

    async def ends_then_signals(plan: RestartPlan) -> RestartOutcome:
        outcome = await execute(plan)
        sequence_ended.set()
        return outcome

    am.fail = replace_then_answer_late
    h.restarter.at_first_step = long_step
    monkeypatch.setattr(h.restarter, "execute", ends_then_signals)
    await h.cycle(CO_RESTART)
    (active,) = am.active()
    assert h.runtime.silence is not None
    assert h.runtime.silence.id == active["id"]
    h.clock.advance(40)
    await h.cycle(VERIFYING)  # renewed: the held id is active, so extended in place
    assert [s["id"] for s in am.active()] == [active["id"]]


async def test_leaving_the_block_lets_a_renewal_in_flight_finish() -> None:
    """renewing_beside, as the daemon's sequence and `watchdog restart` use it: leaving the block
    waits for the renewal already asked (its answer is kept), and starts no new one."""
    asked, answer = asyncio.Event(), asyncio.Event()
    renewals: list[str] = []

    async def renew() -> None:
        asked.set()
        await answer.wait()
        renewals.append("answered")

    async def hold_then_leave() -> None:
        async with renewing_beside(renew, every=0.0):
            await asked.wait()

    leaving = asyncio.create_task(hold_then_leave())
    await asked.wait()
    for _ in range(20):
        await asyncio.sleep(0)
    assert not leaving.done()  # still waiting for the answer, not cancelled past it
    answer.set()
    await leaving
    assert renewals == ["answered"]


async def test_a_cancelled_holder_takes_its_renewer_with_it() -> None:
    """The holder cancelled (the daemon shutting down) while waiting for a renewal: the renewer is
    cancelled too, nothing is left running."""
    asked = asyncio.Event()
    renewers: list[asyncio.Task[Any]] = []

    async def renew() -> None:
        me = asyncio.current_task()
        assert me is not None
        renewers.append(me)
        asked.set()
        await asyncio.Event().wait()  # an answer that never comes

    async def hold_then_leave() -> None:
        async with renewing_beside(renew, every=0.0):
            await asked.wait()

    leaving = asyncio.create_task(hold_then_leave())
    await asked.wait()
    await asyncio.sleep(0)
    leaving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaving
    (renewer,) = renewers
    await asyncio.wait([renewer])
    assert renewer.cancelled()


async def test_renewed_while_verifying_only_past_half_and_expired_when_verified(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Verifying: renewed once less than half its lifetime is left, not before; expired when the
    verification passes, and the incident says when."""
    am = FakeAlertmanager()
    h = _harness(tmp_path, monkeypatch, am, silence_seconds=60.0)
    await h.cycle(CO_RESTART)
    posts = len(am.bodies("POST", "/api/v2/silences"))
    h.clock.advance(20)  # 40 of 60 s left
    await h.cycle(VERIFYING)
    assert len(am.bodies("POST", "/api/v2/silences")) == posts  # no renewal yet
    h.clock.advance(20)  # 20 of 60 s left
    with capture_logs() as logs:
        await h.cycle(VERIFYING)
    renewals = am.bodies("POST", "/api/v2/silences")[posts:]
    assert len(renewals) == 1
    assert renewals[0]["id"] in am.silences
    assert [e["event"] for e in logs] == ["silence_extended"]
    with capture_logs() as logs:
        await h.cycle(PASSED)
    assert am.active() == []
    (expired,) = [e for e in logs if e["event"] == "silence_expired"]
    assert "verification_passed" in expired["why"]
    assert h.runtime.silence is None
    incident = h.runtime.last_incident
    assert incident is not None
    summary = json.loads((tmp_path / "state" / "incidents" / incident / "summary.json").read_text())
    assert summary["silence"]["expired_at"] == h.clock()


async def test_held_expires_the_silence_posts_the_alert_and_a_reset_resolves_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Held: the silence is expired (a person must see the group's alerts) and the watchdog's
    own alert fires with the incident id and report path; renewed past half its lifetime;
    resolved when the group is re-armed."""
    am = FakeAlertmanager()
    h = _harness(tmp_path, monkeypatch, am, silence_seconds=60.0)
    await h.cycle(CO_RESTART)
    with capture_logs() as logs:
        await h.cycle(HELD)
    assert am.active() == []
    incident = h.runtime.last_incident
    assert incident is not None
    (alert,) = am.alerts
    assert alert["labels"] == {
        "alertname": "SGLangWatchdogHeld",
        "group": GROUP,
        "severity": "critical",
    }
    assert alert["annotations"]["incident"] == incident
    report = tmp_path / "state" / "incidents" / incident / "report.md"
    assert alert["annotations"]["report"] == str(report)
    assert "alert_posted" in [e["event"] for e in logs]
    await h.cycle(HELD)
    assert len(am.alerts) == 1  # not re-posted every cycle
    h.clock.advance(40)
    await h.cycle(HELD)
    assert len(am.alerts) == 2
    assert am.alerts[1]["startsAt"] == alert["startsAt"]
    await h.cycle(HEALTHY)  # `watchdog reset`
    resolved = am.alerts[-1]
    assert len(am.alerts) == 3
    assert resolved["labels"] == alert["labels"]
    assert resolved["endsAt"] == rfc3339(h.clock())  # ends now: resolved
    assert h.runtime.held_alert is None


async def test_a_failed_verification_that_co_restarts_again_keeps_one_silence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Verification failed and the budget allows another co-restart: the silence held is
    renewed for it (naming the new incident), never expired in between."""
    am = FakeAlertmanager()
    h = _harness(tmp_path, monkeypatch, am)
    await h.cycle(CO_RESTART)
    first = h.runtime.last_incident
    await h.cycle(CO_RESTART)
    assert h.runtime.last_incident != first
    assert len(am.silences) == 1
    assert len(am.active()) == 1
    assert am.bodies("DELETE", f"/api/v2/silence/{am.active()[0]['id']}") == []
    assert str(h.runtime.last_incident) in str(am.active()[0]["comment"])


async def test_a_refused_restart_expires_its_silence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing restarted (the group's lock is held by an operator): no silence is left behind."""
    from watchdog.statefiles import RestartLock

    am = FakeAlertmanager()
    h = _harness(tmp_path, monkeypatch, am)
    with RestartLock(tmp_path / "state", GROUP, purpose="operator"):
        await h.cycle(CO_RESTART)
    assert h.restarter.plans == []
    assert len(am.silences) == 1
    assert am.active() == []


async def test_a_dry_run_sends_nothing_and_says_what_it_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rehearsal creates no silence and posts no alert; it logs what it would have sent."""
    am = FakeAlertmanager()
    h = _harness(tmp_path, monkeypatch, am, dry_run=True)
    with capture_logs() as logs:
        await h.cycle(CO_RESTART)
        await h.cycle(HELD)
    assert am.requests == []
    rehearsed = [e for e in logs if e["event"] == "alertmanager_dry_run"]
    assert [e["operation"] for e in rehearsed] == ["create", "post_alert"]
    assert rehearsed[0]["matchers"] == [f'group="{GROUP}"']
    assert h.restarter.plans  # the rehearsal still ran its (recording) restarter


# --- Alertmanager down, slow or failing --------------------------------------------------------


async def _server_error(request: httpx.Request) -> httpx.Response:
    return httpx.Response(500, text="internal error")


async def _refused(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


async def _hang(request: httpx.Request) -> httpx.Response:
    await asyncio.Event().wait()  # never answers
    raise AssertionError("unreachable")


async def _not_json(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, text="<html>proxy</html>")


async def _no_id(request: httpx.Request) -> httpx.Response | None:
    if request.url.path == "/api/v2/silences":
        return httpx.Response(200, json={"id": "wrong-key"})
    return None


async def _huge(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json={"silenceID": "x", "padding": "p" * (1 << 20)})


FAILURES = {
    "5xx": _server_error,
    "huge_answer": _huge,
    "refused": _refused,
    "slow": _hang,
    "not_json": _not_json,
    "no_silence_id": _no_id,
}


@pytest.mark.parametrize("failure", sorted(FAILURES))
async def test_alertmanager_failing_never_stops_the_co_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    """Down, slow (bounded by timeout_seconds), 5xx or a malformed answer: the co-restart runs,
    the failure is counted by operation and logged with what was lost, nothing raises."""
    am = FakeAlertmanager()
    am.fail = FAILURES[failure]
    h = _harness(tmp_path, monkeypatch, am, timeout_seconds=0.2)
    with capture_logs() as logs:
        await h.cycle(CO_RESTART)
    assert len(h.restarter.plans) == 1
    assert h.runtime.state.state is State.VERIFYING
    assert h.runtime.silence is None
    assert h.errors("create") == 1.0
    (failed,) = [e for e in logs if e["event"] == "alertmanager_failed"]
    assert failed["operation"] == "create"
    assert failed["group"] == GROUP
    assert "alerts may fire" in failed["lost"]
    if failure == "slow":
        assert "timeout_seconds" in failed["error"]
    if failure == "huge_answer":
        assert "longer than 65536 bytes" in failed["error"]


async def test_failed_renewal_expiry_and_alert_are_counted_and_healing_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Alertmanager lost after the silence was created: a failed renewal keeps the old silence
    (it lapses at its end), a failed expiry and a failed held alert are each counted."""
    am = FakeAlertmanager()
    h = _harness(tmp_path, monkeypatch, am, silence_seconds=60.0)
    await h.cycle(CO_RESTART)
    held = h.runtime.silence
    am.fail = _server_error
    h.clock.advance(40)
    with capture_logs() as logs:
        await h.cycle(VERIFYING)
        await h.cycle(HELD)
    assert h.runtime.state.state is State.HELD
    assert (h.errors("extend"), h.errors("expire"), h.errors("post_alert")) == (1.0, 1.0, 1.0)
    lost = [e["lost"] for e in logs if e["event"] == "alertmanager_failed"]
    assert held is not None
    assert len(lost) == 3
    assert "lapses at" in lost[0]
    assert "stays until it lapses" in lost[1]
    assert h.runtime.silence is None
    assert h.runtime.held_alert is None


async def test_a_bug_in_the_alertmanager_code_never_stops_the_co_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unexpected exception creating or renewing the silence is logged and counted as an
    internal error; the co-restart runs and its outcome is kept."""
    from watchdog.act.alertmanager import GroupAlerts

    async def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("alertmanager code bug")

    am = FakeAlertmanager()
    h = _harness(tmp_path, monkeypatch, am, silence_seconds=60.0)

    async def long_step() -> None:
        h.clock.advance(40)
        await wait_for(lambda: "keep" in failed_at, "a renewal attempted beside the step")

    failed_at: list[str] = []

    async def broken_keep(self: GroupAlerts, silence: object) -> None:
        failed_at.append("keep")
        raise RuntimeError("renewal bug")

    monkeypatch.setattr(GroupAlerts, "keep", broken_keep)
    h.restarter.at_first_step = long_step
    with capture_logs() as logs:
        await h.cycle(CO_RESTART)
    assert h.runtime.state.state is State.VERIFYING  # the outcome was not lost
    monkeypatch.setattr(GroupAlerts, "silence_restart", broken)
    h.runtime.silence = None
    with capture_logs() as more:
        await h.cycle(CO_RESTART)
    assert len(h.restarter.plans) == 2
    errors = [e for e in [*logs, *more] if e["event"] == "internal_error"]
    assert {e["where"] for e in errors} == {"alertmanager"}
    assert any("renewal bug" in e["error"] for e in errors)
    assert any("alertmanager code bug" in e["error"] for e in errors)
    assert h.registry.get_sample_value("sglang_watchdog_internal_errors_total") == len(errors)


# --- the requests ------------------------------------------------------------------------------


async def test_requests_carry_the_bearer_token_and_never_log_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bearer_token_file is sent as `Authorization: Bearer`; it appears in no log line, even
    when Alertmanager (or a proxy before it) echoes the request's headers in its error body."""
    from watchdog.act.alertmanager import AlertmanagerClient, GroupAlerts
    from watchdog.observe.probes import load_api_key

    token_file = tmp_path / "am.token"
    token_file.write_text("s3cret-alertmanager-token\n")
    token_file.chmod(0o600)
    config = config_with_alertmanager(tmp_path, URL, bearer_token_file=str(token_file))
    assert config.alertmanager is not None
    am = FakeAlertmanager()

    async def echo(request: httpx.Request) -> httpx.Response:
        raw = request.headers["Authorization"].removeprefix("Bearer ")
        body = f"denied {request.headers['Authorization']} (token {raw})"
        return httpx.Response(401, text=body)

    am.fail = echo
    http = httpx.AsyncClient(transport=am.transport())
    token = load_api_key(config.alertmanager.bearer_token_file, "alertmanager.bearer_token_file")
    alerts = GroupAlerts(
        AlertmanagerClient(config.alertmanager, http, token=token, clock=lambda: 1e9), dry_run=False
    )
    with capture_logs() as logs:
        await alerts.post({"alertname": "X", "group": GROUP}, {}, starts_at=1e9, ends_at=2e9)
    assert am.requests[0].headers["Authorization"] == "Bearer s3cret-alertmanager-token"
    (failed,) = [e for e in logs if e["event"] == "alertmanager_failed"]
    assert failed["error"].startswith("HTTP 401: denied")
    assert "s3cret-alertmanager-token" not in repr(logs)


def test_matchers_are_parsed_as_amtool_writes_them() -> None:
    """=, !=, =~, !~ with a double-quoted value; only \\" and \\\\ are unescaped."""
    m = parse_matcher(r'instance=~"10\.0\.0\.7:(30000|30002)"')
    assert (m.name, m.value, m.regex, m.equal) == (
        "instance",
        r"10\.0\.0\.7:(30000|30002)",
        True,
        True,
    )
    m = parse_matcher(r'job!="say \"hi\" \\ there"')
    assert (m.value, m.regex, m.equal) == (r'say "hi" \ there', False, False)
    assert parse_matcher(m.text()) == m
    assert parse_matcher('a!~"x"').text() == 'a!~"x"'
    for bad in ("group", "group=g1", '1abc="x"', 'group=="x"', 'a="x"y"', 'a=~"("'):
        with pytest.raises(ValueError, match=r"label matcher|unescaped|regular expression"):
            parse_matcher(bad)


def _config(section: dict[str, object] | None, /, **group: Any) -> Config:
    layers: dict[str, object] = {"group": [configs.group(GROUP, **group)]}
    if section is not None:
        layers["alertmanager"] = section
    return build_config(layers)


def test_the_section_is_optional_and_its_matchers_are_per_group() -> None:
    """Absent: off. The default matcher is the group's label; a group's own list replaces it."""
    assert _config(None).alertmanager is None
    config = _config({"url": URL})
    assert config.alertmanager is not None
    assert [m.text() for m in config.alertmanager.matchers_for(config.group[0])] == [
        f'group="{GROUP}"'
    ]
    own = ['cluster="{group}-east"', 'instance=~"h1:3000[0-2]"']
    config = _config({"url": URL}, alertmanager={"silence_matchers": own})
    assert config.alertmanager is not None
    assert [m.text() for m in config.alertmanager.matchers_for(config.group[0])] == [
        f'cluster="{GROUP}-east"',
        'instance=~"h1:3000[0-2]"',
    ]


@pytest.mark.parametrize(
    ("alertmanager", "group", "key", "words"),
    [
        ({"url": "ftp://am:9093"}, {}, "alertmanager.url", "not an http(s) URL"),
        ({"url": URL, "silence_matchers": []}, {}, "alertmanager.silence_matchers", "at least one"),
        ({"url": URL, "silence_matchers": ["nope"]}, {}, "alertmanager.silence_matchers#1", "not a label matcher"),
        ({"url": URL, "silence_matchers": ['a=~".*"', 'b!="x"']}, {}, "alertmanager.silence_matchers", "every matcher"),
        ({"url": URL, "silence_seconds": 10}, {}, "alertmanager.silence_seconds", "lapse"),
        ({"url": URL, "timeout_seconds": 11}, {}, "alertmanager.timeout_seconds", "less than or equal to 10"),
        ({"url": URL, "timeout_seconds": 0.01}, {}, "alertmanager.timeout_seconds", "below the minimum"),
        ({"url": URL, "bearer_token_file": "/nonexistent/token"}, {}, "alertmanager.bearer_token_file", "not a readable file"),
        ({"url": URL, "extra": 1}, {}, "alertmanager.extra", "unknown key"),
        (None, {"alertmanager": {"silence_matchers": ['a="b"']}}, "group[0].alertmanager", "[alertmanager]"),
    ],
)  # fmt: skip
def test_bad_sections_are_refused_naming_the_key(
    alertmanager: dict[str, object] | None, group: dict[str, object], key: str, words: str
) -> None:
    """Every mistake names its key and says why."""
    with pytest.raises(ConfigError) as caught:
        _config(alertmanager, **group)
    issues = [(i.key, i.reason) for i in caught.value.issues]
    assert any(k == key and words in reason for k, reason in issues), issues


def test_the_url_credentials_are_masked_in_the_effective_config() -> None:
    """A user:password in the URL is masked like every other configured URL's."""
    from watchdog.config import effective_config

    config = _config({"url": "http://watchdog:hunter2hunter2@am:9093"})
    assert effective_config(config)["alertmanager"]["url"] == "http://***@am:9093"
    assert "hunter2hunter2" not in redact_text("error at http://watchdog:hunter2hunter2@am:9093")
    assert "alertmanager" not in effective_config(_config(None))


async def test_a_failed_create_is_asked_again_while_verifying(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Alertmanager refusing when the first step starts: the co-restart runs unsilenced; while the
    group verifies the silence is asked again, not before a quarter of silence_seconds, and once
    created it is held and expired as usual."""
    am = FakeAlertmanager()
    am.fail = FAILURES["refused"]
    h = _harness(tmp_path, monkeypatch, am, silence_seconds=60.0)
    await h.cycle(CO_RESTART)
    assert h.runtime.silence is None
    assert h.errors("create") == 1.0
    am.fail = None
    h.clock.advance(10)  # under a quarter of 60 s: not asked yet
    await h.cycle(VERIFYING)
    assert h.runtime.silence is None
    assert am.active() == []
    h.clock.advance(6)
    await h.cycle(VERIFYING)
    assert h.runtime.silence is not None
    (silence,) = am.active()
    assert str(h.runtime.last_incident) in silence["comment"]
    await h.cycle(PASSED)
    assert am.active() == []
    assert h.runtime.silence is None


async def test_a_manual_dry_run_says_which_silence_it_would_hold(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`watchdog restart --dry-run` with [alertmanager] names the silence it would hold and
    sends nothing (nothing listens at the URL)."""
    config = config_with_alertmanager(tmp_path, "http://127.0.0.1:9")
    plan = plan_for_request(config.group_named(GROUP), tuple(Role), "manual", config="t.toml")
    outcome = await restart_command._execute(
        plan, config.watchdog.state_dir, dry_run=True, config=config
    )
    assert outcome.dry_run
    out = capsys.readouterr().out
    assert "dry run: no silence is created; a restart would hold one at http://127.0.0.1:9" in out
    assert 'group="g1"' in out
