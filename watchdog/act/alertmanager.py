"""Alertmanager (API v2): a silence over a group's own alerts while the watchdog heals it, and the
watchdog's own alerts.

A co-restart makes the team's SGLang alerts fire (targets down, error rates) for an event that is
expected and already handled. The silence is created before the first restart step, renewed while
the group restarts and verifies, and expired as soon as the group leaves those states (docs/
decisions.md, "Alertmanager silences"). Its lifetime is short (`silence_seconds`): a watchdog that
dies stops renewing it and it lapses by itself.

Alertmanager is optional to healing: every request runs under one whole deadline
(`timeout_seconds`), a failure (down, slow, 5xx, a malformed answer) is counted
(`alertmanager_errors_total{operation}`), logged with what was lost, and never raised, so a
co-restart waits at most that deadline and then goes ahead.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

import httpx
import structlog

from watchdog.clock import Clock
from watchdog.config import AlertmanagerSection, LabelMatcher
from watchdog.decide.fleet import Storm
from watchdog.observe.bounded import ACCEPT_ENCODING, read_capped
from watchdog.observe.probes import auth_headers, load_api_key
from watchdog.redact import redact_text

log = structlog.get_logger("watchdog.act.alertmanager")

SILENCES_PATH = "/api/v2/silences"
SILENCE_PATH = "/api/v2/silence/"  # + id: DELETE expires it
ALERTS_PATH = "/api/v2/alerts"
CREATED_BY = "sglang-watchdog"
HELD_ALERT = "SGLangWatchdogHeld"
STORM_ALERT = "SGLangWatchdogStorm"
# The `operation` label of alertmanager_errors_total.
CREATE, EXTEND, EXPIRE, POST_ALERT = "create", "extend", "expire", "post_alert"
OPERATIONS: tuple[str, ...] = (CREATE, EXTEND, EXPIRE, POST_ALERT)
# Alertmanager answers these calls with a few hundred bytes; a larger answer is not read.
_MAX_ANSWER_BYTES = 64 * 1024


def rfc3339(at: float) -> str:
    """A unix time as Alertmanager's timestamps (UTC, milliseconds)."""
    return (
        datetime.fromtimestamp(at, tz=UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    )


def matcher_json(matcher: LabelMatcher) -> dict[str, Any]:
    """One matcher as API v2 takes it."""
    return {
        "name": matcher.name,
        "value": matcher.value,
        "isRegex": matcher.regex,
        "isEqual": matcher.equal,
    }


@dataclass(frozen=True, slots=True)
class Silence:
    """A silence the watchdog holds for one group."""

    id: str
    group: str
    matchers: tuple[LabelMatcher, ...]
    starts_at: float
    ends_at: float
    comment: str

    def texts(self) -> list[str]:
        """The matchers as written in the config, for logs and the incident."""
        return [m.text() for m in self.matchers]


class AlertmanagerError(Exception):
    """One request failed; the message says how (never a credential)."""


class AlertmanagerClient:
    """The four API calls, each bounded, counted and logged on failure; none raises."""

    def __init__(
        self,
        settings: AlertmanagerSection,
        http: httpx.AsyncClient,
        *,
        token: str | None = None,
        clock: Clock,
        count_error: Callable[[str], None] | None = None,
    ) -> None:
        self.settings = settings
        self.http = http
        self.clock = clock
        self._headers = {
            "Content-Type": "application/json",
            **ACCEPT_ENCODING,  # only encodings read_capped decodes under its cap
            **auth_headers(token),
        }
        self._count_error = count_error

    async def create_silence(
        self, group: str, matchers: Sequence[LabelMatcher], comment: str
    ) -> Silence | None:
        """A new silence from now for silence_seconds; None when Alertmanager failed."""
        now = self.clock()
        silence = Silence(
            "", group, tuple(matchers), now, now + self.settings.silence_seconds, comment
        )
        new_id = await self._post_silence(
            CREATE,
            silence,
            lost="no silence: the group's own alerts may fire during the co-restart",
        )
        return None if new_id is None else replace(silence, id=new_id)

    async def extend_silence(self, silence: Silence, comment: str | None = None) -> Silence | None:
        """`silence` renewed for silence_seconds from now (Alertmanager may answer with a new
        id: it replaces a silence it cannot update); None when Alertmanager failed."""
        renewed = replace(
            silence,
            ends_at=self.clock() + self.settings.silence_seconds,
            comment=comment if comment is not None else silence.comment,
        )
        lost = f"the silence lapses at {rfc3339(silence.ends_at)} unless a later renewal works"
        new_id = await self._post_silence(EXTEND, renewed, lost=lost)
        return None if new_id is None else replace(renewed, id=new_id)

    async def expire_silence(self, silence: Silence) -> bool:
        """Expire `silence` now; False when Alertmanager failed (it lapses at its end)."""
        try:
            await self._request("DELETE", SILENCE_PATH + silence.id)
        except AlertmanagerError as exc:
            self._failed(
                EXPIRE,
                exc,
                group=silence.group,
                silence=silence.id,
                lost=f"the silence stays until it lapses at {rfc3339(silence.ends_at)}",
            )
            return False
        return True

    async def post_alert(
        self,
        labels: Mapping[str, str],
        annotations: Mapping[str, str],
        *,
        starts_at: float,
        ends_at: float,
    ) -> bool:
        """Post one alert (firing until `ends_at`; an `ends_at` now resolves it). False when
        Alertmanager failed. For the watchdog's own alerts: held groups, and any other caller."""
        alert = {
            "labels": dict(labels),
            "annotations": dict(annotations),
            "startsAt": rfc3339(starts_at),
            "endsAt": rfc3339(ends_at),
        }
        try:
            await self._request("POST", ALERTS_PATH, [alert])
        except AlertmanagerError as exc:
            self._failed(
                POST_ALERT,
                exc,
                group=labels.get("group"),
                alertname=labels.get("alertname"),
                lost="the alert did not reach Alertmanager; the log line and metrics remain",
            )
            return False
        return True

    # ---------------------------------------------------------------- internals
    async def _post_silence(self, operation: str, silence: Silence, *, lost: str) -> str | None:
        body: dict[str, Any] = {
            "matchers": [matcher_json(m) for m in silence.matchers],
            "startsAt": rfc3339(silence.starts_at),
            "endsAt": rfc3339(silence.ends_at),
            "createdBy": CREATED_BY,
            "comment": silence.comment,
        }
        if silence.id:
            body["id"] = silence.id
        try:
            answer = await self._request("POST", SILENCES_PATH, body)
            new_id = answer.get("silenceID") if isinstance(answer, dict) else None
            if not isinstance(new_id, str) or not new_id:
                raise AlertmanagerError("the answer carries no silenceID")
        except AlertmanagerError as exc:
            self._failed(operation, exc, group=silence.group, silence=silence.id or None, lost=lost)
            return None
        return new_id

    async def _request(self, method: str, path: str, body: Any = None) -> Any:
        """One request under the whole deadline; the parsed JSON answer (None when empty)."""
        deadline = self.settings.timeout_seconds
        content = None if body is None else json.dumps(body).encode()
        try:
            async with asyncio.timeout(deadline):
                async with self.http.stream(
                    method,
                    self.settings.url + path,
                    content=content,
                    headers=self._headers,
                    timeout=httpx.Timeout(deadline),
                ) as response:
                    answer = await read_capped(response, _MAX_ANSWER_BYTES)
        except TimeoutError:
            raise AlertmanagerError(f"no answer within timeout_seconds ({deadline:g} s)") from None
        except httpx.HTTPError as exc:
            raise AlertmanagerError(f"{type(exc).__name__}: {exc}") from None
        if not 200 <= response.status_code < 300:
            text = answer.text().strip()[:200]
            raise AlertmanagerError(f"HTTP {response.status_code}: {text}")
        if answer.truncated:
            raise AlertmanagerError(f"the answer is longer than {_MAX_ANSWER_BYTES} bytes")
        if not answer.data.strip():
            return None
        try:
            return json.loads(answer.data)
        except ValueError:
            raise AlertmanagerError("the answer is not JSON") from None

    def _failed(self, operation: str, exc: AlertmanagerError, **fields: Any) -> None:
        if self._count_error is not None:
            self._count_error(operation)
        log.error(
            "alertmanager_failed",
            operation=operation,
            error=redact_text(str(exc)),
            **fields,
            effect="healing goes on without it",
        )


def storm_alert(storm: Storm) -> tuple[dict[str, str], dict[str, str]]:
    """The labels and annotations of the watchdog's storm alert: fleet-wide (no `group` label, so
    no group's silence covers it), naming the stalled groups, what they share and what was done."""
    labels = {"alertname": STORM_ALERT, "severity": "critical"}
    shared = "; ".join(f"{s.kind} {s.value}: {', '.join(s.groups)}" for s in storm.suspects)
    annotations = {
        "summary": f"sglang-watchdog: {len(storm.groups)} of {storm.total} groups stalled "
        "together (a storm)",
        "description": "Many groups stalled at once point at a shared cause; the watchdog "
        "co-restarts at most its fleet budget and holds the rest until each recovers on its "
        "own or an operator runs `watchdog reset` for it.",
        "groups": ", ".join(storm.groups),
        "suspects": shared or "(nothing shared)",
        "acted": ", ".join(storm.acted) or "(none)",
        "held": ", ".join(storm.held) or "(none)",
    }
    return labels, annotations


@dataclass(frozen=True, slots=True)
class HeldAlert:
    """The watchdog's own alert that a group is held, as last posted."""

    group: str
    labels: tuple[tuple[str, str], ...]
    annotations: tuple[tuple[str, str], ...]
    starts_at: float
    ends_at: float


class GroupAlerts:
    """Each group's silence and held alert through their lifecycle (docs/decisions.md,
    "Alertmanager silences"). A rehearsal (dry run, `--once`) sends nothing: it logs what it
    would have sent."""

    def __init__(self, client: AlertmanagerClient, *, dry_run: bool) -> None:
        self.client = client
        self.settings = client.settings
        self.dry_run = dry_run

    @property
    def clock(self) -> Clock:
        """The client's clock."""
        return self.client.clock

    async def silence_restart(
        self,
        group: str,
        matchers: Sequence[LabelMatcher],
        held: Silence | None,
        *,
        incident: str | None,
        trigger: str,
        lifecycle: str = "Renewed while the group restarts and verifies, expired after",
    ) -> Silence | None:
        """Before the first restart step: a new silence, or the one already held renewed (a
        failed verification that co-restarts again); None when there is none. `lifecycle`
        tells the silence's readers when it ends."""
        comment = (
            f"{CREATED_BY}: co-restart of group {group} ({trigger}); incident "
            f"{incident or '(not recorded)'}. {lifecycle}; lapses by itself "
            f"{self.settings.silence_seconds:g} s after its last renewal"
        )
        if self.dry_run:
            log.info(
                "alertmanager_dry_run",
                operation=CREATE,
                group=group,
                matchers=[m.text() for m in matchers],
                seconds=self.settings.silence_seconds,
                effect="dry run: no silence is created",
            )
            return None
        if held is not None:
            renewed = await self.client.extend_silence(held, comment)
            if renewed is not None:
                self._log_extended(held, renewed, incident=incident)
            return renewed or held
        silence = await self.client.create_silence(group, matchers, comment)
        if silence is not None:
            log.info(
                "silence_created",
                group=group,
                silence=silence.id,
                matchers=silence.texts(),
                ends_at=rfc3339(silence.ends_at),
                incident=incident,
            )
        return silence

    async def keep(self, silence: Silence) -> Silence:
        """`silence` renewed when less than half its lifetime is left (else as it is)."""
        if silence.ends_at - self.clock() > self.settings.silence_seconds / 2:
            return silence
        renewed = await self.client.extend_silence(silence)
        if renewed is None:
            return silence
        self._log_extended(silence, renewed)
        return renewed

    async def expire(self, silence: Silence, why: str) -> bool:
        """Expire `silence` now (`why`: what ended it); False when Alertmanager failed."""
        expired = await self.client.expire_silence(silence)
        if expired:
            log.info("silence_expired", group=silence.group, silence=silence.id, why=why)
        return expired

    async def hold_alert(
        self, group: str, held: HeldAlert | None, *, incident: str | None, report: str | None
    ) -> HeldAlert | None:
        """The held alert posted (first) or renewed when less than half its lifetime is left;
        what was posted last (None while nothing was)."""
        now = self.clock()
        if held is not None and held.ends_at - now > self.settings.silence_seconds / 2:
            return held
        labels = {"alertname": HELD_ALERT, "group": group, "severity": "critical"}
        annotations = {
            "summary": f"sglang-watchdog holds group {group}: its restart budget is spent",
            "description": "The watchdog stopped restarting the group: a person must look at "
            "it, then run `watchdog reset` to re-arm it.",
            "incident": incident or "(none recorded)",
            "report": report or "(none recorded)",
        }
        if held is not None:  # a renewal keeps what the first post said
            labels, annotations = dict(held.labels), dict(held.annotations)
        started = held.starts_at if held is not None else now
        posted = HeldAlert(
            group,
            tuple(labels.items()),
            tuple(annotations.items()),
            started,
            now + self.settings.silence_seconds,
        )
        if await self.post(labels, annotations, starts_at=started, ends_at=posted.ends_at):
            return posted
        return held

    async def resolve(self, held: HeldAlert) -> bool:
        """The held alert resolved (its end set to now): the group left `held`."""
        return await self.post(
            dict(held.labels),
            dict(held.annotations),
            starts_at=held.starts_at,
            ends_at=self.clock(),
        )

    async def post(
        self,
        labels: Mapping[str, str],
        annotations: Mapping[str, str],
        *,
        starts_at: float,
        ends_at: float,
    ) -> bool:
        """Post one of the watchdog's own alerts (logged, or only logged in a rehearsal)."""
        fields = {"alertname": labels.get("alertname"), "group": labels.get("group")}
        resolved = ends_at <= self.clock()
        if self.dry_run:
            log.info(
                "alertmanager_dry_run",
                operation=POST_ALERT,
                **fields,
                resolved=resolved,
                effect="dry run: no alert is posted",
            )
            return True  # rehearsed: renewed on the same schedule, not logged every cycle
        ok = await self.client.post_alert(labels, annotations, starts_at=starts_at, ends_at=ends_at)
        if ok:
            log.info(
                "alert_posted",
                **fields,
                resolved=resolved,
                ends_at=rfc3339(ends_at),
                annotations=dict(annotations),
            )
        return ok

    def _log_extended(self, old: Silence, new: Silence, incident: str | None = None) -> None:
        log.info(
            "silence_extended",
            group=new.group,
            silence=new.id,
            replaced=old.id if old.id != new.id else None,
            ends_at=rfc3339(new.ends_at),
            **({"incident": incident} if incident else {}),
        )


def group_alerts(
    settings: AlertmanagerSection,
    http: httpx.AsyncClient,
    *,
    clock: Clock,
    dry_run: bool,
    count_error: Callable[[str], None] | None = None,
) -> GroupAlerts:
    """The GroupAlerts of an [alertmanager] section over `http`, its bearer token read from
    its file (the daemon's and `watchdog restart`'s one way to build them)."""
    token = load_api_key(settings.bearer_token_file, "alertmanager.bearer_token_file")
    client = AlertmanagerClient(settings, http, token=token, clock=clock, count_error=count_error)
    return GroupAlerts(client, dry_run=dry_run)


@contextlib.asynccontextmanager
async def renewing_beside(
    renew: Callable[[], Awaitable[None]], every: float
) -> AsyncIterator[None]:
    """`renew()` every `every` seconds in the background while the block runs.

    On leaving, the renewer is asked to stop and awaited, never cancelled: a renewal in flight
    finishes and its answer is kept. Alertmanager may have replaced the silence by then (a new
    id, the old one expired), so a renewal cancelled before its answer was stored leaves the
    holder with an expired id, whose next renewal creates a second silence nobody tracks. The
    wait is bounded by the renewal's own deadline (the client's `timeout_seconds`).
    """
    stop = asyncio.Event()

    async def renew_until_stopped() -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every)
            if stop.is_set():  # read, not inferred: a wait timed out may race the stop
                return
            await renew()

    renewer = asyncio.create_task(renew_until_stopped())
    try:
        yield
    finally:
        stop.set()
        await renewer  # cancelling us (a shutdown) cancels it too: asyncio passes it on
