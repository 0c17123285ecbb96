"""Observation builders for detector tests: a tiny simulated PD group stepped one cycle at a time.

`Stack` holds what a real group would carry from cycle to cycle (cumulative counters, unit start
times, a clock) and builds one `Observation` per `cycle()`; `Harness` feeds those through decide()
and after_restart() and keeps the decisions. The single-value builders (`probe`, `health`,
`metrics`, `unit`, ...) are for tests that want to spell an observation out by hand.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from watchdog.config import GroupSection
from watchdog.decide import Decision, GroupState, after_restart, decide, initial_state
from watchdog.model import (
    Action,
    LoadsSnapshot,
    MetricsSnapshot,
    Observation,
    OperatorControls,
    OwnTokens,
    ProbeFailure,
    ProbeKind,
    ProbeResult,
    RestartOutcome,
    RestartPlan,
    Role,
    ScrapeFailure,
    State,
    StepResult,
    UnitState,
)

T0 = 1_750_000_000.0  # an arbitrary but realistic unix time
DAY_SECONDS = 86_400.0
WORKER_ROLES = (Role.PREFILL, Role.DECODE)


def group_config(name: str = "g", **sections: dict[str, Any]) -> GroupSection:
    """A valid group with every default; `stall={...}`, `restart={...}`, `probe={...}` override."""
    data: dict[str, Any] = {
        "name": name,
        "prefill": {"unit": f"{name}-prefill.service", "url": "http://127.0.0.1:30000"},
        "decode": {"unit": f"{name}-decode.service", "url": "http://127.0.0.1:30002"},
        "router": {"unit": f"{name}-router.service", "url": "http://127.0.0.1:30001"},
    }
    data.update(sections)
    # The detector timelines here were written for these values (the earlier defaults):
    # pinned, so a change of the shipped defaults does not silently rewrite every table.
    for section, pinned in TIMELINE_TIMINGS.items():
        data[section] = {**pinned, **sections.get(section, {})}
    return GroupSection.model_validate(data)


TIMELINE_TIMINGS: dict[str, dict[str, Any]] = {
    "probe": {"timeout_seconds": 20.0, "stream_idle_seconds": 10.0},
    "stall": {"no_progress_seconds": 45.0},
    # Verification as before the soak: it passes with the verify_probes-th success in a row
    # (the soak needs that many anyway; tests/unit/test_soak.py runs the soak itself).
    "restart": {"soak_probes": 1, "soak_seconds": 0.0},
}


def probe(
    ok: bool = True,
    *,
    at: float,
    kind: ProbeKind = ProbeKind.COMPLETION,
    reason: ProbeFailure | None = None,
    duration_seconds: float = 0.5,
) -> ProbeResult:
    """A finished end-to-end probe that ended at `at`."""
    if reason is None:
        reason = ProbeFailure.OK if ok else ProbeFailure.TIMEOUT_BEFORE_HEADERS
    return ProbeResult(
        kind=kind,
        target="router",
        ok=ok,
        reason=reason,
        started_at=at - duration_seconds,
        duration_seconds=duration_seconds,
        ttft_seconds=0.1 if ok else None,
        tokens=4 if ok else 0,
        status_code=200 if ok or reason is ProbeFailure.TIMEOUT_BEFORE_HEADERS else 502,
    )


def health(
    target: str, ok: bool = True, *, at: float, reason: ProbeFailure | None = None
) -> ProbeResult:
    """A worker /health (or router /readiness) check."""
    if reason is None:
        reason = ProbeFailure.OK if ok else ProbeFailure.HTTP_ERROR
    kind = ProbeKind.READINESS if target == "router" else ProbeKind.HEALTH
    return ProbeResult(
        kind=kind,
        target=target,
        ok=ok,
        reason=reason,
        started_at=at - 0.01,
        duration_seconds=0.01,
        status_code=200 if ok else (503 if reason is ProbeFailure.HTTP_ERROR else None),
    )


def metrics(role: Role, *, at: float, **fields: Any) -> MetricsSnapshot:
    """A successful scrape of `role` with the given fields."""
    return MetricsSnapshot(role=role, scraped_at=at, ok=True, **fields)


def scrape_failure(
    role: Role, *, at: float, error: ScrapeFailure = ScrapeFailure.CONNECT_REFUSED
) -> MetricsSnapshot:
    """A scrape of `role` that produced nothing usable."""
    return MetricsSnapshot(role=role, scraped_at=at, ok=False, error=error, detail=str(error))


def unit(
    role: Role,
    start_us: int,
    active_state: str = "active",
    n_restarts: int = 0,
    result: str = "success",
) -> UnitState:
    """systemd's view of one unit."""
    sub = {"active": "running", "failed": "failed", "inactive": "dead"}.get(active_state, "start")
    return UnitState(
        role=role,
        unit=f"g-{role}.service",
        ok=True,
        load_state="loaded",
        active_state=active_state,
        sub_state=sub,
        main_pid=1000 if active_state == "active" else 0,
        exec_main_start_us=start_us,
        n_restarts=n_restarts,
        result=result,
    )


def outcome(
    ok: bool = True, *, at: float, dry_run: bool = False, group: str = "g"
) -> RestartOutcome:
    """How a co-restart sequence ended."""
    steps = tuple(
        StepResult(role=r, unit=f"g-{r}.service", ok=ok or r is not Role.DECODE, phase="ready")
        for r in Role
    )
    return RestartOutcome(
        plan=RestartPlan(group=group, trigger="test", steps=()),
        ok=ok,
        dry_run=dry_run,
        steps=steps,
        started_at=at,
        finished_at=at,
    )


def finished_own(probes: Iterable[ProbeResult]) -> OwnTokens:
    """Own tokens of probes that received all their tokens this cycle and finished."""
    tokens = sum(p.tokens for p in probes)
    return OwnTokens(received=tokens, first=sum(p.tokens > 0 for p in probes), finished=tokens)


@dataclass
class Stack:
    """A simulated PD group's observable state, advanced one cycle at a time."""

    group: str = "g"
    now: float = T0
    cycle_seconds: float = 5.0
    requests: dict[Role, float] = field(default_factory=lambda: dict.fromkeys(WORKER_ROLES, 100.0))
    tokens: dict[Role, float] = field(default_factory=lambda: dict.fromkeys(WORKER_ROLES, 1000.0))
    realtime: dict[Role, float] | None = None  # None: SGLang < 0.5.23 (no realtime_tokens_total)
    failures: dict[Role, float] = field(default_factory=lambda: dict.fromkeys(WORKER_ROLES, 0.0))
    starts_us: dict[Role, int] = field(
        default_factory=lambda: {r: int((T0 - DAY_SECONDS) * 1e6) for r in Role}
    )
    active: dict[Role, str] = field(default_factory=lambda: dict.fromkeys(Role, "active"))
    n_restarts: dict[Role, int] = field(default_factory=lambda: dict.fromkeys(Role, 0))
    results: dict[Role, str] = field(default_factory=lambda: dict.fromkeys(Role, "success"))
    observe_units: bool = True
    # Frozen gauges: what the scheduler last reported (they do not move during a stall).
    inflight_queue: float = 0.0
    transfer_queue: float = 0.0
    http_active: float = 0.0
    # Every cycle also answers /v1/loads as SGLang 0.5.23 does, decode's with its decode-step
    # tokens (decode_moments), unless the cycle is given its own `loads`.
    live: bool = False

    def advance(self, requests: float = 1.0, tokens: float = 10.0) -> None:
        """Requests finish on both workers (prefill counts only after the transfer concluded)."""
        for role in WORKER_ROLES:
            self.requests[role] += requests
            self.tokens[role] += tokens
            if self.realtime is not None:
                self.realtime[role] += tokens

    def restart(self, role: Role, *, at: float | None = None, reset_counters: bool = True) -> None:
        """A unit restarted: new ExecMainStartTimestamp; a worker's counters start from zero."""
        self.starts_us[role] = int((self.now if at is None else at) * 1e6)
        self.active[role] = "active"
        if reset_counters and role in WORKER_ROLES:
            self.requests[role] = 0.0
            self.tokens[role] = 0.0
            self.failures[role] = 0.0
            if self.realtime is not None:
                self.realtime[role] = 0.0

    def fail_transfers(self, count: float, roles: Iterable[Role] = WORKER_ROLES) -> None:
        """`count` requests failed their KV transfer (each worker's counter is a max over ranks)."""
        for role in roles:
            self.failures[role] += count

    def cycle(
        self,
        probes: Sequence[bool | ProbeResult] = (True,),
        *,
        progress: bool | None = None,
        scrape: bool | Sequence[Role] = True,
        health_ok: bool | dict[Role, bool] | None = True,
        in_flight: int = 0,
        oldest_in_flight_seconds: float = 0.0,
        loads: Sequence[LoadsSnapshot] = (),
        operator: OperatorControls | None = None,
        seconds: float | None = None,
        scrape_error: ScrapeFailure = ScrapeFailure.CONNECT_REFUSED,
        health_reason: ProbeFailure | None = None,
        own: OwnTokens | None = None,
        own_during: OwnTokens | None = None,
    ) -> Observation:
        """Advance the clock one cycle and observe.

        probes: finished end-to-end probes (True/False or full results); progress: counters
        advance (default: when a probe succeeded); scrape: True, False or the roles scraped
        successfully; health_ok: True/False for both workers, per role, or None (not checked);
        own: the tokens our probes received this cycle (default: the finished probes' tokens);
        own_during: the part of them received while the fetches ran (default: none).
        """
        self.now += self.cycle_seconds if seconds is None else seconds
        now = self.now
        results = tuple(
            p if isinstance(p, ProbeResult) else probe(p, at=now - 0.1 * i)
            for i, p in enumerate(reversed(probes))
        )[::-1]
        if progress is None:
            progress = any(r.ok for r in results)
        if progress:
            self.advance()
        scraped = set(WORKER_ROLES) if scrape is True else set() if scrape is False else set(scrape)
        snaps = []
        for role in WORKER_ROLES:
            if role not in scraped:
                snaps.append(scrape_failure(role, at=now, error=scrape_error))
                continue
            snaps.append(
                metrics(
                    role,
                    at=now,
                    requests_total=self.requests[role],
                    generation_tokens_total=self.tokens[role],
                    realtime_tokens_total=None if self.realtime is None else self.realtime[role],
                    transfer_failed=self.failures[role],
                    inflight_queue=self.inflight_queue if role is Role.PREFILL else None,
                    decode_transfer_queue=self.transfer_queue if role is Role.DECODE else None,
                    http_requests_active=self.http_active,
                )
            )
        checks: list[ProbeResult] = []
        if health_ok is not None:
            per_role = (
                health_ok if isinstance(health_ok, dict) else dict.fromkeys(WORKER_ROLES, health_ok)
            )
            checks = [
                health(role.value, per_role.get(role, True), at=now, reason=health_reason)
                for role in WORKER_ROLES
            ]
        units = (
            tuple(
                unit(
                    role,
                    self.starts_us[role],
                    self.active[role],
                    self.n_restarts[role],
                    self.results[role],
                )
                for role in Role
            )
            if self.observe_units
            else ()
        )
        return Observation(
            group=self.group,
            at=now,
            probes=results,
            probes_in_flight=in_flight,
            oldest_probe_in_flight_seconds=oldest_in_flight_seconds,
            health=tuple(checks),
            metrics=tuple(snaps),
            loads=tuple(loads) if loads or not self.live else self._live_loads(now),
            units=units,
            operator=operator or OperatorControls(),
            own_tokens=own if own is not None else finished_own(results),
            own_tokens_during=own_during or OwnTokens(),
        )

    def _live_loads(self, now: float) -> tuple[LoadsSnapshot, ...]:
        return tuple(
            LoadsSnapshot(
                role=role,
                fetched_at=now,
                ok=True,
                version="0.5.23",
                decode_tokens_total=self.tokens[role] if role is Role.DECODE else None,
            )
            for role in WORKER_ROLES
        )

    def stalled(self, **kwargs: Any) -> Observation:
        """A silent-stall cycle: probes time out, health passes, counters and gauges frozen."""
        kwargs.setdefault("in_flight", 4)
        self.http_active = max(self.http_active, 4.0)
        return self.cycle((False,), progress=False, **kwargs)


@dataclass
class Harness:
    """Feeds a Stack's observations through the detector and keeps every decision."""

    config: GroupSection = field(default_factory=group_config)
    stack: Stack = field(default_factory=Stack)
    state: GroupState | None = None
    decisions: list[Decision] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.state is None:
            self.state = initial_state(self.stack.now)

    def feed(self, observation: Observation) -> Decision:
        """decide() on one observation; the state moves on."""
        assert self.state is not None
        decision = decide(self.state, observation, self.config, observation.at)
        self.decisions.append(decision)
        self.state = decision.state
        return decision

    def step(self, *args: Any, **kwargs: Any) -> Decision:
        """One Stack.cycle() through decide()."""
        return self.feed(self.stack.cycle(*args, **kwargs))

    def stall(self, cycles: int = 1, **kwargs: Any) -> Decision:
        """`cycles` silent-stall cycles; returns the last decision."""
        decision = None
        for _ in range(cycles):
            decision = self.feed(self.stack.stalled(**kwargs))
        assert decision is not None
        return decision

    def steps(self, cycles: int, *args: Any, **kwargs: Any) -> Decision:
        """`cycles` identical Stack.cycle()s; returns the last decision."""
        decision = None
        for _ in range(cycles):
            decision = self.step(*args, **kwargs)
        assert decision is not None
        return decision

    def warm(self) -> Harness:
        """Run one healthy cycle so the group leaves warm-up."""
        decision = self.step()
        assert decision.state.state is State.HEALTHY, decision
        return self

    def restarted(
        self,
        ok: bool = True,
        *,
        dry_run: bool = False,
        co_restart: bool = True,
        roles: Sequence[Role] = tuple(Role),
    ) -> GroupState:
        """Report a restart's outcome; unless dry_run, the stack really restarted `roles` (every
        role by default, prefill first; a survivor restart: decode, router)."""
        assert self.state is not None
        if co_restart and not dry_run and ok:
            for offset, role in enumerate(roles):
                self.stack.restart(role, at=self.stack.now + offset)
        self.state = after_restart(
            self.state, outcome(ok, at=self.stack.now, dry_run=dry_run), self.stack.now
        )
        return self.state

    @property
    def actions(self) -> list[Action]:
        """Every decision's action, in order."""
        return [d.action for d in self.decisions]

    @property
    def verdicts(self) -> list[str]:
        """Every decision's verdict, in order."""
        return [str(d.verdict) for d in self.decisions]
