"""One observation of a group: health, scrapes, loads, units and probe results, under one deadline.

Everything a cycle looks at is fetched concurrently in one TaskGroup; whatever has not answered by
the deadline is recorded as timed out, so a hung target costs one deadline, not one per target.
The result is an immutable Observation (decide()'s input) plus, for evidence, the raw /metrics
bodies, and the counter deltas against the previous successful scrape of each worker. Every worker
of a role is fetched on its own; its records carry its index (`worker`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import traceback
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol, TypeVar

import httpx
import structlog

from watchdog.clock import Clock
from watchdog.config import GroupSection
from watchdog.model import (
    LoadsSnapshot,
    MetricsSnapshot,
    Observation,
    OperatorControls,
    OwnTokens,
    ProbeFailure,
    ProbeKind,
    ProbeResult,
    RankTokens,
    Role,
    RoleCount,
    ScrapeFailure,
    UnitState,
    add_rank_tokens,
)
from watchdog.observe.bounded import ParseSlot
from watchdog.observe.cadence import (
    FETCH_ALL,
    Ages,
    Cadences,
    Calm,
    FetchPlan,
    plan_fetches,
    probes_passed,
)
from watchdog.observe.probes import ABORT_TIMEOUT_SECONDS, internal_error_result
from watchdog.observe.probes.completion import run_completion_probe
from watchdog.observe.probes.health import check_health, health_url
from watchdog.observe.scrape import ScrapeResult, fetch_loads, scrape_metrics
from watchdog.observe.sglang_metrics import CounterDeltas, counter_deltas

log = structlog.get_logger()

T = TypeVar("T")
K = TypeVar("K")
WORKER_ROLES: tuple[Role, Role] = (Role.PREFILL, Role.DECODE)
Worker = tuple[Role, int]  # a role and the index of one of its workers
# Past the longest per-target timeout: each fetch enforces its own, this only catches a fetch
# that ignores it (a unit reader on a stuck bus).
DEADLINE_GRACE_SECONDS = 1.0
# SGLang's /health handler sleeps 1 s before it first looks (entrypoints/http_server.py:778-781
# @ 0.5.23, docs/sglang.md §7.1): asked this long before a cycle, its answer is in when the
# cycle's other fetches are, and the cycle's decision does not wait for it (docs/decisions.md,
# "/health asked ahead").
HEALTH_LEAD_SECONDS = 1.0


class UnitReader(Protocol):
    """Reads one systemd unit's state; never raises for a failing unit (UnitState(ok=False))."""

    async def read_unit(self, role: Role, unit: str) -> UnitState: ...


class ProbeSource(Protocol):
    """What an observation takes from the probe scheduler (probes/scheduler.ProbeScheduler)."""

    @property
    def in_flight(self) -> int: ...

    def oldest_in_flight_seconds(self, now: float) -> float: ...

    def own_tokens(self) -> OwnTokens: ...

    def own_rank_tokens(self) -> tuple[RankTokens, ...]: ...

    def finished_so_far(self) -> tuple[ProbeResult, ...]: ...

    def drain_finished(self) -> tuple[ProbeResult, ...]: ...


@dataclass(frozen=True, slots=True)
class ObservedCycle:
    """One observation plus what evidence and the detector need beside it."""

    observation: Observation
    # The capped /metrics body of each role scraped this cycle (None when the scrape got none);
    # the first worker's where a role has several.
    raw_metrics: Mapping[Role, bytes | None] = field(default_factory=dict)
    # Counter growth since the previous successful scrape of each role (resets handled).
    deltas: tuple[CounterDeltas, ...] = ()
    duration_seconds: float = 0.0
    plan: FetchPlan = FETCH_ALL  # what this observation fetched (observe/cadence.py)

    def deltas_for(self, role: Role) -> CounterDeltas | None:
        """The counter deltas of `role`, when it and its previous scrape both succeeded."""
        return next((d for d in self.deltas if d.role == role), None)


def default_deadline_seconds(group: GroupSection, *, one_shot: bool) -> float:
    """The observation deadline: the slowest fetch's own timeout plus a grace period."""
    probe = group.probe
    longest = max(probe.health_timeout_seconds, probe.scrape_timeout_seconds)
    if one_shot:
        longest = max(longest, probe.timeout_seconds + ABORT_TIMEOUT_SECONDS)
    return longest + DEADLINE_GRACE_SECONDS


@dataclass(frozen=True, slots=True)
class _ProbesAndOwn:
    """What one observation takes from the probe scheduler (or its one-shot probe)."""

    probes: tuple[ProbeResult, ...]
    in_flight: int
    oldest_seconds: float
    own: OwnTokens  # our tokens since the previous observation
    own_during: OwnTokens  # the part received while this observation's fetches ran
    own_ranks: tuple[RankTokens, ...]  # the same, per DP rank of our pinned probes
    own_ranks_during: tuple[RankTokens, ...]


@dataclass(frozen=True, slots=True)
class _Fetches:
    """The tasks of one observation, per worker; the dicts fill in as the fetches start."""

    health: dict[Worker, asyncio.Task[ProbeResult | None]] = field(default_factory=dict)
    scrapes: dict[Worker, asyncio.Task[ScrapeResult | None]] = field(default_factory=dict)
    loads: dict[Worker, asyncio.Task[LoadsSnapshot | None]] = field(default_factory=dict)
    units: dict[Worker, asyncio.Task[UnitState | None]] = field(default_factory=dict)
    # The one-shot completion probe (no scheduler), under key 0; empty with a scheduler.
    one_shot: dict[int, asyncio.Task[ProbeResult | None]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _Answers:
    """What one observation's fetches answered, every late target filled in as timed out."""

    at: float
    health: dict[Worker, ProbeResult]
    scrapes: dict[Worker, ScrapeResult]
    loads: dict[Worker, LoadsSnapshot]
    units: dict[Worker, UnitState]
    one_shot: tuple[ProbeResult, ...]

    def all_ok(self) -> bool:
        """Every /health, scrape and /v1/loads of this observation answered ok.

        Unit reads are not asked: they are made every cycle whatever the plan, and no HTTP
        fetch stands in for one that failed.
        """
        return (
            all(h.ok for h in self.health.values())
            and all(r.snapshot.ok for r in self.scrapes.values())
            # A server without /v1/loads (before 0.5.23) is a version, not a doubt.
            and all(x.ok or x.error is ScrapeFailure.UNSUPPORTED for x in self.loads.values())
        )

    def live_progress(self) -> bool:
        """Every decode's /v1/loads answered with its decode-step tokens (0.5.23+), one rank
        each: its progress can then be read between scrapes (observe/cadence.py)."""
        decodes = [x for (role, _), x in self.loads.items() if role is Role.DECODE]
        return bool(decodes) and all(
            x.ok and x.decode_tokens_total is not None and len(x.ranks) <= 1 for x in decodes
        )

    def metrics(self, keys: Sequence[Worker]) -> tuple[MetricsSnapshot, ...]:
        """The scraped snapshots of the processes `keys` (the router's too), in that order."""
        return tuple(self.scrapes[key].snapshot for key in keys if key in self.scrapes)


class GroupObserver:
    """Observes one group per call of observe(); keeps the previous scrapes for counter deltas.

    With a ProbeScheduler, the probes that finished since the last call are collected. Without one
    (`watchdog check`, `--once`), exactly one completion probe is run as part of the observation.
    """

    def __init__(
        self,
        group: GroupSection,
        client: httpx.AsyncClient,
        *,
        scheduler: ProbeSource | None = None,
        unit_reader: UnitReader | None = None,
        operator_reader: Callable[[], OperatorControls] | None = None,
        clock: Clock = time.time,
        api_key: str | None = None,
        deadline_seconds: float | None = None,
        observe_loads: bool = True,
    ) -> None:
        self.group = group
        self._client = client
        self._scheduler = scheduler
        self._unit_reader = unit_reader
        self._operator_reader = operator_reader
        self._clock = clock
        self._api_key = api_key
        self._deadline_seconds = (
            deadline_seconds
            if deadline_seconds is not None
            else default_deadline_seconds(group, one_shot=scheduler is None)
        )
        self._observe_loads = observe_loads
        self._last_ok: dict[Worker, MetricsSnapshot] = {}
        # One /metrics parse per target at a time, across cycles (bounded.ParseSlot).
        self._parse_slots: dict[Worker, ParseSlot] = {}
        # The scheduler's own-token count at the end of the previous observation.
        self._own_reported = scheduler.own_tokens() if scheduler is not None else OwnTokens()
        self._own_ranks_reported = scheduler.own_rank_tokens() if scheduler is not None else ()
        self.internal_errors = 0
        # What may be skipped while nothing is in doubt (observe/cadence.py): nothing until the
        # first decision says healthy and an observation has answered ok.
        self._cadences = Cadences.of(group.probe)
        self._ages = Ages()
        self._decided_healthy = False
        self._answers_ok = False
        # Whether the last /v1/loads read every decode's tokens (worker /metrics may then wait).
        self._live_progress = False
        self._last_health: dict[Worker, ProbeResult] = {}
        # The probes the previous observation collected: a probe started with a cycle finishes
        # during that cycle's fetches, so the next plan finds nothing new finished yet.
        self._last_probes: tuple[ProbeResult, ...] = ()
        # The next observation's /health, asked ahead of it (start_health_ahead).
        self._ahead: dict[Worker, asyncio.Task[ProbeResult | None]] = {}

    def start_health_ahead(self) -> None:
        """Ask the next observation's /health and /readiness now, when its plan would ask them
        (anything in doubt, or their cadence due): that observation then takes these answers
        instead of asking and waiting ~1 s for SGLang's. Only with a scheduler (the daemon);
        `check` and `--once` ask everything at once."""
        if self._scheduler is None or self._ahead or not self._plan().health:
            return
        started_mono = time.monotonic()
        for key, base, _ in self._workers():
            self._ahead[key] = asyncio.create_task(self._health(key, base, started_mono))

    def cancel_ahead(self) -> None:
        """Cancel /health asked ahead that no observation will take (the daemon stopping)."""
        for task in self._ahead.values():
            task.cancel()
        self._ahead.clear()

    def note_decision(self, *, healthy: bool) -> None:
        """What the last decision said: healthy (state healthy, verdict ok) or not."""
        self._decided_healthy = healthy

    def _plan(self) -> FetchPlan:
        """This observation's fetches: everything while anything is in doubt (and always
        without a scheduler: `check` and `--once` see everything)."""
        scheduler = self._scheduler
        if scheduler is None:
            return FETCH_ALL
        calm = Calm(
            decided_healthy=self._decided_healthy,
            probes_passed=probes_passed(self._last_probes + scheduler.finished_so_far()),
            none_late=scheduler.oldest_in_flight_seconds(self._clock())
            <= self.group.probe.period_seconds,
            answers_ok=self._answers_ok,
        )
        return plan_fetches(
            self._cadences, self._ages, in_doubt=calm.in_doubt, live_progress=self._live_progress
        )

    def _workers(self, roles: tuple[Role, ...] = tuple(Role)) -> list[tuple[Worker, str, str]]:
        """(role, index), URL and unit of every process of `roles`, in config order."""
        return [
            ((role, index), section.url, section.unit)
            for role in roles
            for index, section in enumerate(self.group.workers(role))
        ]

    def _scrape_targets(self, plan: FetchPlan) -> list[tuple[Worker, str]]:
        targets = (
            [(key, f"{url}/metrics") for key, url, _ in self._workers(WORKER_ROLES)]
            if plan.worker_metrics
            else []
        )
        if self.group.router.metrics_url is not None and plan.router_metrics:
            targets.append(((Role.ROUTER, 0), self.group.router.metrics_url))
        return targets

    async def observe(self) -> ObservedCycle:
        """Fetch everything concurrently under the deadline; never raises for a failing target."""
        started_mono = time.monotonic()
        # Our probes' tokens before any counter is scraped: what they receive from here to the
        # end of the observation may or may not be in the scrapes (docs/decisions.md, "Progress").
        own_before = self._scheduler.own_tokens() if self._scheduler is not None else None
        own_ranks_before = self._scheduler.own_rank_tokens() if self._scheduler is not None else ()
        ahead, self._ahead = self._ahead, {}
        # /health asked ahead is this observation's check, whatever the plan says by now.
        plan = dataclasses.replace(self._plan(), health=True) if ahead else self._plan()
        fetches = _Fetches()
        try:
            async with asyncio.timeout(self._deadline_seconds), asyncio.TaskGroup() as tasks:
                self._start_fetches(tasks, fetches, started_mono, plan, ahead)
        except TimeoutError:
            pass  # whatever did not answer is filled in below as timed out
        finally:
            for task in ahead.values():
                task.cancel()  # only one not awaited (this observation cancelled) is still running
        answers = self._answers(fetches, plan)
        self._ages = self._ages.after(plan)
        self._answers_ok = answers.all_ok()
        if plan.loads:
            self._live_progress = answers.live_progress()
        if plan.health:
            self._last_health = dict(answers.health)
        ours = self._probes_and_own_tokens(
            answers.at, answers.one_shot, own_before, own_ranks_before
        )
        self._last_probes = ours.probes
        metrics = answers.metrics(self._worker_keys())
        return ObservedCycle(
            observation=self._observation(answers, ours, metrics, health_checked=plan.health),
            raw_metrics=MappingProxyType(
                {role: r.raw for (role, index), r in answers.scrapes.items() if index == 0}
            ),
            deltas=self._deltas(metrics),
            duration_seconds=time.monotonic() - started_mono,
            plan=plan,
        )

    def _worker_keys(self) -> list[Worker]:
        return [key for key, _, _ in self._workers()]

    async def _keep(
        self, what: str, fetch: Awaitable[T], failed: Callable[[Exception], T] | None = None
    ) -> T | None:
        """`fetch`'s answer; a fetch that raised is logged and counted, and answers `failed`."""
        try:
            return await fetch
        except Exception as exc:  # a bug in a fetcher must not cost the whole observation
            self.internal_errors += 1
            log.error(
                "observe_internal_error",
                group=self.group.name,
                what=what,
                error=repr(exc),
                traceback=traceback.format_exc(),
            )
            return failed(exc) if failed is not None else None

    def _probe_raised(
        self, kind: ProbeKind, target: str, started_mono: float
    ) -> Callable[[Exception], ProbeResult]:
        """A probe that raised is a failed probe naming the exception, not a late one."""
        started_at = self._clock()

        def result(exc: Exception) -> ProbeResult:
            return internal_error_result(
                kind,
                target,
                exc,
                started_at=started_at,
                duration_seconds=time.monotonic() - started_mono,
            )

        return result

    def _start_fetches(
        self,
        tasks: asyncio.TaskGroup,
        fetches: _Fetches,
        started_mono: float,
        plan: FetchPlan,
        ahead: Mapping[Worker, asyncio.Task[ProbeResult | None]],
    ) -> None:
        """Every fetch `plan` makes as a task of `tasks`: per process its health (the one asked
        ahead where there is one), unit and loads, then the scrapes, then (without a scheduler)
        the one-shot probe."""
        for (role, index), base, unit in self._workers():
            if plan.health:
                asked = ahead.get((role, index))
                fetches.health[role, index] = tasks.create_task(
                    _answer_of(asked)
                    if asked is not None
                    else self._health((role, index), base, started_mono)
                )
            if self._unit_reader is not None:
                fetches.units[role, index] = tasks.create_task(
                    self._keep(f"unit:{role}:{index}", self._unit_reader.read_unit(role, unit))
                )
            if self._loads_wanted(role, plan):
                self._start_loads(tasks, fetches, (role, index), base)
        for key, url in self._scrape_targets(plan):
            self._start_scrape(tasks, fetches, key, url)
        if self._scheduler is None:
            fetches.one_shot[0] = tasks.create_task(
                self._keep(
                    "completion_probe",
                    run_completion_probe(
                        self._client, self.group, api_key=self._api_key, clock=self._clock
                    ),
                    self._probe_raised(ProbeKind.COMPLETION, "router", started_mono),
                )
            )

    async def _health(self, key: Worker, base: str, started_mono: float) -> ProbeResult | None:
        role, index = key
        return await self._keep(
            f"health:{role}:{index}",
            check_health(
                self._client,
                role.value,
                health_url(role, base),
                timeout_seconds=self.group.probe.health_timeout_seconds,
                clock=self._clock,
            ),
            self._probe_raised(_health_kind(role), role.value, started_mono),
        )

    def _start_loads(
        self, tasks: asyncio.TaskGroup, fetches: _Fetches, key: Worker, base: str
    ) -> None:
        role, index = key
        fetches.loads[key] = tasks.create_task(
            self._keep(
                f"loads:{role}:{index}",
                fetch_loads(
                    self._client,
                    role,
                    base,
                    timeout_seconds=self.group.probe.scrape_timeout_seconds,
                    clock=self._clock,
                    api_key=self._api_key,
                ),
            )
        )

    def _start_scrape(
        self, tasks: asyncio.TaskGroup, fetches: _Fetches, key: Worker, url: str
    ) -> None:
        role, index = key
        fetches.scrapes[key] = tasks.create_task(
            self._keep(
                f"scrape:{role}:{index}",
                scrape_metrics(
                    self._client,
                    role,
                    url,
                    timeout_seconds=self.group.probe.scrape_timeout_seconds,
                    clock=self._clock,
                    parse_slot=self._parse_slots.setdefault(key, ParseSlot()),
                ),
            )
        )

    def _loads_wanted(self, role: Role, plan: FetchPlan) -> bool:
        return self._observe_loads and plan.loads and role in WORKER_ROLES

    def _answers(self, fetches: _Fetches, plan: FetchPlan) -> _Answers:
        """What the fetches answered by the deadline, the late ones filled in as timed out;
        /health not fetched is the last checks, repeated."""
        health = _results(fetches.health) if plan.health else dict(self._last_health)
        scrapes = _results(fetches.scrapes)
        loads = _results(fetches.loads)
        units = _results(fetches.units)
        one_shot = list(_results(fetches.one_shot).values())
        at = self._clock()
        late = f"no result within the {self._deadline_seconds:g} s observation deadline"
        self._fill_in_late(at, late, plan, health=health, units=units, loads=loads, scrapes=scrapes)
        if self._scheduler is None and not one_shot:
            one_shot.append(_late_probe(self.group.name, at, late))
        return _Answers(at, health, scrapes, loads, units, tuple(one_shot))

    def _observation(
        self,
        answers: _Answers,
        ours: _ProbesAndOwn,
        metrics: tuple[MetricsSnapshot, ...],
        *,
        health_checked: bool,
    ) -> Observation:
        keys = self._worker_keys()
        return Observation(
            group=self.group.name,
            at=answers.at,
            probes=ours.probes,
            probes_in_flight=ours.in_flight,
            oldest_probe_in_flight_seconds=ours.oldest_seconds,
            health=tuple(answers.health[key] for key in keys),
            health_checked=health_checked,
            metrics=metrics,
            loads=tuple(answers.loads[key] for key in keys if key in answers.loads),
            units=tuple(answers.units[key] for key in keys if key in answers.units),
            operator=self._operator_reader() if self._operator_reader else OperatorControls(),
            own_aborts=own_aborts(ours.probes),
            own_tokens=ours.own,
            own_tokens_during=ours.own_during,
            own_rank_tokens=ours.own_ranks,
            own_rank_tokens_during=ours.own_ranks_during,
        )

    def _fill_in_late(
        self,
        at: float,
        late: str,
        plan: FetchPlan,
        *,
        health: dict[Worker, ProbeResult],
        units: dict[Worker, UnitState],
        loads: dict[Worker, LoadsSnapshot],
        scrapes: dict[Worker, ScrapeResult],
    ) -> None:
        """Every target that did not answer by the deadline, filled in as timed out; each
        result numbered with its worker (in place)."""
        for key, _, unit in self._workers():
            role, index = key
            health[key] = dataclasses.replace(
                health.get(key) or _late_health(role, at, late), worker=index
            )
            if self._unit_reader is not None:
                state = units.get(key) or UnitState(role=role, unit=unit, ok=False, error=late)
                units[key] = dataclasses.replace(state, worker=index)
            if self._loads_wanted(role, plan):
                answer = loads.get(key) or LoadsSnapshot(
                    role, at, ok=False, error=ScrapeFailure.TIMEOUT
                )
                loads[key] = dataclasses.replace(answer, worker=index)
        for key, url in self._scrape_targets(plan):
            result = scrapes.get(key) or ScrapeResult(
                MetricsSnapshot(
                    role=key[0],
                    scraped_at=at,
                    ok=False,
                    error=ScrapeFailure.TIMEOUT,
                    detail=f"{url}: {late}",
                ),
                None,
            )
            scrapes[key] = ScrapeResult(
                dataclasses.replace(result.snapshot, worker=key[1]), result.raw
            )

    def _probes_and_own_tokens(
        self,
        at: float,
        one_shot: Sequence[ProbeResult],
        own_before: OwnTokens | None,
        own_ranks_before: tuple[RankTokens, ...],
    ) -> _ProbesAndOwn:
        """This observation's finished probes and our own tokens: with a scheduler, the growth
        since the previous observation and the part received while this one's fetches ran
        (docs/decisions.md, "Progress"); without one, the one-shot probe of this observation."""
        if self._scheduler is None:
            probes = tuple(one_shot)
            own = finished_tokens(probes)  # ran during this observation
            return _ProbesAndOwn(probes, 0, 0.0, own, own, (), ())  # `check` pins no probe
        scheduler = self._scheduler
        own_after = scheduler.own_tokens()
        ranks_after = scheduler.own_rank_tokens()
        ours = _ProbesAndOwn(
            probes=scheduler.drain_finished(),
            in_flight=scheduler.in_flight,
            oldest_seconds=scheduler.oldest_in_flight_seconds(at),
            own=own_after - self._own_reported,
            own_during=own_after - own_before if own_before is not None else OwnTokens(),
            own_ranks=add_rank_tokens(ranks_after, self._own_ranks_reported, sign=-1),
            own_ranks_during=add_rank_tokens(ranks_after, own_ranks_before, sign=-1),
        )
        self._own_reported = own_after
        self._own_ranks_reported = ranks_after
        return ours

    def _deltas(self, metrics: tuple[MetricsSnapshot, ...]) -> tuple[CounterDeltas, ...]:
        out = []
        for snapshot in metrics:
            if not snapshot.ok:
                continue  # keep the last good scrape: the next good one is compared with it
            previous = self._last_ok.get((snapshot.role, snapshot.worker))
            self._last_ok[snapshot.role, snapshot.worker] = snapshot
            if previous is not None:
                delta = counter_deltas(previous, snapshot)
                if delta is not None:
                    out.append(delta)
        return tuple(out)


def own_aborts(probes: tuple[ProbeResult, ...]) -> tuple[RoleCount, ...]:
    """Our aborts per worker: each timed-out probe's rid is aborted on prefill and decode alike.

    On SGLang 0.5.23 each may add one transfer/bootstrap failure there (docs/sglang.md §7.2); the
    detector does not count those as degradation.

    A direct PD probe that failed without an abort counts the same: the pair it ran against
    may count it as a bootstrap or transfer failure (a wrong `bootstrap_port` fails every one),
    and the watchdog must never take a failure of its own making for degradation.
    """
    sent = sum(
        1
        for p in probes
        if p.abort_sent
        or (p.kind is ProbeKind.DIRECT and not p.ok and p.reason is not ProbeFailure.INTERNAL_ERROR)
    )
    return tuple(RoleCount(role, sent) for role in WORKER_ROLES) if sent else ()


def finished_tokens(probes: tuple[ProbeResult, ...]) -> OwnTokens:
    """The own tokens of probes run without a scheduler: their results' counts (no tally)."""
    tokens = sum(p.tokens for p in probes)
    return OwnTokens(received=tokens, first=sum(p.tokens > 0 for p in probes), finished=tokens)


async def _answer_of(task: asyncio.Task[T]) -> T:
    """`task`'s answer, awaited inside an observation's TaskGroup: cancelled at its deadline,
    this cancels `task` too."""
    return await task


def _results(tasks: Mapping[K, asyncio.Task[T | None]]) -> dict[K, T]:
    """The results of the tasks that finished with one (not cancelled at the deadline, not None)."""
    out: dict[K, T] = {}
    for key, task in tasks.items():
        if task.done() and not task.cancelled():
            result = task.result()
            if result is not None:
                out[key] = result
    return out


def _health_kind(role: Role) -> ProbeKind:
    return ProbeKind.READINESS if role == Role.ROUTER else ProbeKind.HEALTH


def _late_health(role: Role, at: float, detail: str) -> ProbeResult:
    return ProbeResult(
        kind=_health_kind(role),
        target=role.value,
        ok=False,
        reason=ProbeFailure.TIMEOUT,
        started_at=at,
        duration_seconds=0.0,
        detail=detail,
    )


def _late_probe(group: str, at: float, detail: str) -> ProbeResult:
    return ProbeResult(
        kind=ProbeKind.COMPLETION,
        target="router",
        ok=False,
        reason=ProbeFailure.TIMEOUT,
        started_at=at,
        duration_seconds=0.0,
        detail=f"{group}: {detail}",
    )
