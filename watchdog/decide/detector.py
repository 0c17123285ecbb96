"""The stall detector: a pure state machine, decide(state, observation, config, now) -> Decision.

No I/O, no clock, no logging: everything time-based takes `now`, and everything remembered between
cycles lives in the frozen, JSON-serialisable `GroupState`. The daemon executes the action and
reports a co-restart's outcome back through `after_restart()`.

States (design.md): warming → healthy ⇄ overloaded ⇄ degraded → stalled → restarting → verifying
→ healthy (or stalled again); held (budget exhausted, until an operator re-arms); paused (lease).

The signals and how they are read (reference/sglang-pd.md):

- **Progress** is a decode completion/token counter that advanced (`requests_total`,
  `generation_tokens_total`, `realtime_tokens_total`; all via
  `counter_increase`, and a counter read from a new process (its unit's ExecMainStartTimestamp
  changed) counts from zero, so a restart is neither a failure burst nor a progress-less gap), or
  an end-to-end probe that succeeded. The tokenizer counters skip health checks (SGLang sends them
  with `log_metrics=False`), but the scheduler's `realtime_tokens_total` counts every batch: each
  `/health` (ours every cycle, the router's every interval) runs one fake-bootstrap token through
  both workers. So decode's per-iteration counter is progress only when it grew by more than
  health checks and our own probes can explain (one check of ours per observation, the router's
  at up to one a second, `max_tokens` per probe finished or in flight, plus slack for batching
  jitter). Prefill's counters are never progress: during a transfer stall prefill keeps computing
  newly arrived prompts that then sit in its inflight queue (the incident's prefill kept accepting
  work for 17 hours), and its `requests_total` advances when a transfer concludes even if decode
  then stalls mid-stream. A 10-minute generation still shows as decode tokens advancing.
  Queue gauges are *not* progress: they freeze
  during a stall. `/v1/loads` queue sizes are live but not progress either (our own aborts of timed
  out probes shrink them during a stall); they only tell whether work is pending.
- **The no-progress clock** starts at the last progress, or at the last full scrape that showed
  nothing pending (an idle server is flat by right). It only grows with evidence: the flat span is
  `metrics_seen_at - progress_at`, where `metrics_seen_at` is the last cycle in which *both*
  workers were scraped. Counters are monotonic, so a value unchanged across a scrape gap was flat
  throughout; but while scrapes fail the span stops growing: no scrape is "unknown", never "flat".
- **Work pending**: a probe in flight or failed this cycle, `http_requests_active` > 0, any queue
  gauge > 0, or a live `/v1/loads` queue > 0.
- **Consecutive probe failures** count finished completion *and* multi-round probes; any success
  resets the count. Reasons say how many of the run were multi-round.
- **Transfer/bootstrap failures** per role are already the max over TP ranks (one failed request
  adds 1 on every rank). Prefill and decode usually both count the same failed request, so the
  windowed increase is the max over roles, never the sum.

Scrapes and probes failing together: a crash shows in units (and in failing /health), so it is
judged there. When every health check, scrape and probe fails at the connection level the
watchdog is cut off, which is not evidence of a stall: monitoring outage, never act. When probes
fail, /health passes and metrics are unavailable, the situation is ambiguous; the detector acts
only if the *last known* counters had already been flat (with work pending) for
`no_progress_seconds` before the scrapes stopped, and says so in the reasons
(`metrics_unavailable`). Otherwise the verdict is `monitoring_outage` (alert: progress unknown) and
nothing is restarted: a human looks. The same rule makes a group whose /metrics never worked
unable to ever confirm a silent stall; it alerts instead.

Actions are edges: ALERT is returned once per episode for each alert-worthy verdict (an episode
ends when the verdict is `ok`), CO_RESTART once per attempt; the verdict itself is a level and is
reported every cycle. A decision returning CO_RESTART has already moved to `restarting` and charged
the restart budget.

Decisions beyond the issue's letter, each for a reason:
- Warm-up also ends when health passes and both workers' units have been running for at least
  `startup_timeout_seconds` (a daemon start on a long-running stack need not wait for a probe to
  start judging; a stalled stack at daemon start is then detected within about
  `no_progress_seconds`, not after the whole warm-up timeout).
- At the end of warm-up without readiness, a failed start is declared only when the workers' health
  is failing (the model never came up) or a stall verdict is confirmed; counters advancing is
  overload and blindness is a monitoring outage, neither a failed start.
- A unit in `failed` raises `crash` at once (alert) and co-restarts once it has stayed down (failed,
  or activating again after failing) for `startup_timeout_seconds`: systemd >= 254 passes through
  `failed` briefly even when `Restart=` brings the unit back, and a decode brought back alone is
  then judged by the decode-only rule.
- After warm-up, a worker whose /health keeps failing for `no_progress_seconds` while its unit is
  active (same start timestamp: not a restart, so not a model load), probes fail and nothing
  progresses is treated as crashed: hung in a way systemd does not see, e.g. a TP collective that
  never returns (SGLang's /health answers 503 after its 20 s health timeout; its own
  --watchdog-timeout would kill the process only after 300 s). Without unit observation this stays
  an alert: a restart by someone else cannot be told from a hang.
- Decode-only restart: decode's start timestamp changed and prefill's current start is not later
  than decode's *previous* start, i.e. no prefill restart happened before the new decode start.
  An external co-restart that spans several cycles (prefill first, decode after its readiness wait)
  therefore is not flagged.
- Pinned request: our own probe in flight for `pinned_inflight_seconds`, or the PD hand-off queues
  (prefill inflight, decode transfer; live `/v1/loads` when present, gauges otherwise) never seen
  empty for that long while other requests complete. Under sustained heavy load the hand-off queue
  may never drain; that false positive is an alert, never an action.
- A stall verdict keeps the group `stalled` while it holds; it stops when the assessment no longer
  says act (a probe or counter shows progress). `failed_start` and `decode_only_restart` are sticky:
  only a successful probe with passing health, respectively a co-restart (ours, or a prefill
  restart by someone else), clears them.
- Backoff after a failed attempt: `backoff_seconds * 2**(n-1)` from the failure for our own
  attempts; a failed start (not our attempt) is measured from our last restart, if any.
- Scrape outage while probes pass: `monitoring_outage` once worker scrapes failed in
  `probe_failures` consecutive cycles (the same "in a row" threshold as probes), so a single lost
  scrape is not an alert.
- Our own restart and an external one forget the old processes' transfer-failure samples (the
  new processes' counters start from zero) and start a fresh alert episode.
- Entering `held` is visible as `state.state is HELD`; the verdict names the cause
  (`budget_exhausted`, or `verification_failed` when the last allowed attempt failed verification).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from watchdog.config import GroupSection
from watchdog.model import (
    Action,
    MetricsSnapshot,
    Observation,
    ProbeFailure,
    ProbeKind,
    ProbeResult,
    Reason,
    RestartOutcome,
    Role,
    ScrapeFailure,
    State,
    UnitState,
    counter_increase,
)


class Verdict(StrEnum):
    """What the detector concluded this cycle; also the `kind` label of stalls_detected_total."""

    OK = "ok"
    WARMING_UP = "warming_up"
    FAILED_START = "failed_start"
    SILENT_STALL = "silent_stall"
    DEGRADED_BOOTSTRAP = "degraded_bootstrap"
    TRANSFER_FAILURES_RISING = "transfer_failures_rising"
    PINNED_REQUEST = "pinned_request"
    OVERLOADED = "overloaded"
    STALL_SUSPECTED = "stall_suspected"  # probes failing, counters flat, not yet for long enough
    BLIP = "blip"
    MONITORING_OUTAGE = "monitoring_outage"
    WORKER_UNHEALTHY = "worker_unhealthy"  # a worker's /health fails while its unit runs
    CRASH = "crash"
    UNIT_STOPPED = "unit_stopped"
    DECODE_ONLY_RESTART = "decode_only_restart"
    RESTARTING = "restarting"
    VERIFYING = "verifying"
    VERIFICATION_PASSED = "verification_passed"
    VERIFICATION_FAILED = "verification_failed"
    BUDGET_EXHAUSTED = "budget_exhausted"
    HELD = "held"
    PAUSED = "paused"
    BACKOFF = "backoff"


# Verdicts that call for a co-restart (subject to budget and backoff).
ACT_VERDICTS = frozenset(
    {
        Verdict.SILENT_STALL,
        Verdict.DEGRADED_BOOTSTRAP,
        Verdict.CRASH,
        Verdict.DECODE_ONLY_RESTART,
        Verdict.FAILED_START,
        Verdict.VERIFICATION_FAILED,
    }
)
# Verdicts that tell an operator without acting (once per episode).
ALERT_VERDICTS = frozenset(
    {
        Verdict.TRANSFER_FAILURES_RISING,
        Verdict.PINNED_REQUEST,
        Verdict.MONITORING_OUTAGE,
        Verdict.WORKER_UNHEALTHY,
        Verdict.CRASH,
        Verdict.UNIT_STOPPED,
        Verdict.BACKOFF,
    }
)

_WORKERS = (Role.PREFILL, Role.DECODE)
_PROGRESS_COUNTERS = ("requests_total", "generation_tokens_total", "realtime_tokens_total")
_END_TO_END = frozenset({ProbeKind.COMPLETION, ProbeKind.MULTIROUND})
_PROBE_UNREACHABLE = frozenset({ProbeFailure.CONNECT_REFUSED, ProbeFailure.CONNECT_ERROR})
_HEALTH_UNREACHABLE = _PROBE_UNREACHABLE | {ProbeFailure.TIMEOUT}
_SCRAPE_UNREACHABLE = frozenset(
    {ScrapeFailure.CONNECT_REFUSED, ScrapeFailure.CONNECT_ERROR, ScrapeFailure.TIMEOUT}
)
_RUNNING_UNIT_STATES = frozenset({"active", "reloading"})
_MAX_BACKOFF_DOUBLINGS = 30  # 2**30 × any sane backoff is "forever"; avoids float overflow


# --- state ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CounterBaseline:
    """The last counters read from one worker, and which process (unit start) they came from."""

    role: Role
    at: float
    start_us: int  # ExecMainStartTimestamp when read; 0 = units not observed
    requests_total: float | None = None
    generation_tokens_total: float | None = None
    realtime_tokens_total: float | None = None
    failures: float = 0.0  # transfer + bootstrap failures, max over TP ranks


@dataclass(frozen=True, slots=True)
class FailureSample:
    """An increase of a worker's transfer/bootstrap failures seen at one cycle."""

    at: float
    role: Role
    increase: float


@dataclass(frozen=True, slots=True)
class UnitStart:
    """The last ExecMainStartTimestamp seen for a role's unit."""

    role: Role
    start_us: int


@dataclass(frozen=True, slots=True)
class RoleSince:
    """Since when a role has been in some condition (unit down, /health failing)."""

    role: Role
    at: float


@dataclass(frozen=True, slots=True)
class GroupState:
    """Everything the detector remembers about one group between cycles (persisted as JSON)."""

    state: State
    since: float  # when `state` was entered
    verdict: Verdict = Verdict.WARMING_UP  # the previous decision's verdict
    alerted: tuple[Verdict, ...] = ()  # alerts already sent in the current episode
    # End-to-end probes.
    probe_failures: int = 0  # consecutive finished completion/multi-round probes that failed
    probe_failing_since: float | None = None  # the cycle the current run of failures began
    multiround_failures: int = 0  # how many of those were multi-round
    last_probe_ok_at: float | None = None  # when the newest successful probe finished
    # Progress and failure counters.
    baselines: tuple[CounterBaseline, ...] = ()
    progress_at: float | None = None  # no-progress clock start: progress, or nothing pending
    advanced_at: float | None = None  # last counter advance or probe success
    metrics_seen_at: float | None = None  # last cycle with both workers scraped
    scrape_failures: int = 0  # consecutive cycles with a failed worker scrape
    failure_samples: tuple[FailureSample, ...] = ()
    handoff_busy_since: float | None = None  # PD hand-off queues not seen empty since
    # Units and health.
    unit_starts: tuple[UnitStart, ...] = ()
    down_since: tuple[RoleSince, ...] = ()
    unhealthy_since: tuple[RoleSince, ...] = ()
    decode_only_seen_at: float | None = None  # first seen; cleared when resolved
    # Warm-up and verification.
    warming_since: float | None = None
    verify_started_at: float | None = None
    verify_successes: int = 0
    # Restart budget and backoff.
    restart_times: tuple[float, ...] = ()
    consecutive_failures: int = 0
    backoff_until: float = 0.0
    backoff_base_seconds: float = 0.0  # backoff_seconds at the last attempt (for after_restart)
    budget_left: int = 0  # restarts left in the window right after the last attempt
    stall_verdict: Verdict | None = None  # what made the group stalled / the last attempt's trigger
    held_since: float | None = None
    held_reason: str = ""

    def budget_remaining(self, config: GroupSection, now: float) -> int:
        """Co-restarts still allowed in the budget window ending at `now`."""
        if self.state is State.HELD:
            return 0
        used = len(_in_window(self.restart_times, config.restart.budget_window_seconds, now))
        return max(0, config.restart.max_restarts - used)


@dataclass(frozen=True, slots=True)
class Decision:
    """One cycle's outcome: the next state, what was concluded, why, and what to do."""

    state: GroupState
    verdict: Verdict
    action: Action
    reasons: tuple[Reason, ...]


def initial_state(
    now: float,
    *,
    restart_times: tuple[float, ...] = (),
    consecutive_failures: int = 0,
    held: bool = False,
    held_since: float | None = None,
    backoff_seconds: float = 0.0,
) -> GroupState:
    """The state at daemon start: warming, with the budget seeded from the persisted history.

    With `backoff_seconds` (the group's restart.backoff_seconds), consecutive failures also carry
    their backoff across a daemon restart, measured from the newest restart.
    """
    backoff_until = 0.0
    if consecutive_failures > 0 and restart_times and backoff_seconds > 0:
        backoff_until = max(restart_times) + _backoff_seconds(backoff_seconds, consecutive_failures)
    if held:
        return GroupState(
            state=State.HELD,
            since=now,
            verdict=Verdict.HELD,
            restart_times=tuple(sorted(restart_times)),
            consecutive_failures=consecutive_failures,
            backoff_until=backoff_until,
            held_since=now if held_since is None else held_since,
            held_reason="held before the watchdog started",
        )
    return GroupState(
        state=State.WARMING,
        since=now,
        warming_since=now,
        restart_times=tuple(sorted(restart_times)),
        consecutive_failures=consecutive_failures,
        backoff_until=backoff_until,
    )


# --- per-cycle facts ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Facts:
    """What this cycle's observation says, once combined with memory (not persisted)."""

    probes_finished: int
    oldest_probe_seconds: float
    probe_ok_now: bool
    probe_failed_now: bool
    health: Mapping[Role, bool]  # workers whose /health was checked this cycle
    metrics_fresh: bool  # both workers scraped this cycle
    pending: tuple[tuple[str, float | str], ...]  # why work counts as pending (empty: none seen)
    nothing_reached: bool
    restarted: frozenset[Role]  # unit start timestamp changed (not counting decode-only)
    decode_only_new: bool
    decode_only_cancelled: bool
    units: Mapping[Role, UnitState]  # readable units this cycle
    stopped: tuple[Role, ...]

    @property
    def workers_healthy(self) -> bool:
        """Both workers answered /health this cycle."""
        return all(self.health.get(role) is True for role in _WORKERS)

    @property
    def workers_failing(self) -> tuple[Role, ...]:
        """Workers whose /health was checked and failed this cycle."""
        return tuple(role for role in _WORKERS if self.health.get(role) is False)


def _in_window(times: Iterable[float], window_seconds: float, now: float) -> tuple[float, ...]:
    # Inclusive lower edge: then no closed window of that length ever holds more than the budget.
    return tuple(t for t in times if now - window_seconds <= t <= now)


def _role_map(items: Iterable[RoleSince]) -> dict[Role, float]:
    return {item.role: item.at for item in items}


def _role_items(mapping: Mapping[Role, float]) -> tuple[RoleSince, ...]:
    return tuple(RoleSince(role, mapping[role]) for role in Role if role in mapping)


@dataclass(frozen=True, slots=True)
class _UnitFold:
    starts: dict[Role, int]
    restarted: frozenset[Role]
    decode_only_seen_at: float | None
    decode_only_new: bool
    decode_only_cancelled: bool


def _fold_unit_starts(
    state: GroupState, units: Mapping[Role, UnitState], now: float, *, quiet: bool
) -> _UnitFold:
    """External and decode-only restarts, from changes of ExecMainStartTimestamp."""
    previous = {u.role: u.start_us for u in state.unit_starts}
    starts = dict(previous)
    changed: set[Role] = set()
    for role, unit in units.items():
        if unit.exec_main_start_us <= 0:
            continue
        if role in previous and previous[role] != unit.exec_main_start_us:
            changed.add(role)
        starts[role] = unit.exec_main_start_us
    decode_only_new = False
    if Role.DECODE in changed and not quiet:
        prefill = units.get(Role.PREFILL)
        if prefill is None or prefill.exec_main_start_us <= 0:
            # Cannot tell whether prefill was restarted first: judge when prefill is readable.
            starts[Role.DECODE] = previous[Role.DECODE]
            changed.discard(Role.DECODE)
        elif prefill.exec_main_start_us <= previous[Role.DECODE]:
            # No prefill start after decode's previous one: nobody restarted prefill first.
            decode_only_new = True
    seen_at = state.decode_only_seen_at
    cancelled = False
    if quiet:
        seen_at = None
    elif Role.PREFILL in changed and (seen_at is not None or decode_only_new):
        # The operator restarted prefill too, within the grace window.
        seen_at = None
        decode_only_new = False
        cancelled = True
    elif decode_only_new and seen_at is None:
        seen_at = now
    restarted = frozenset(changed - {Role.DECODE} if decode_only_new else changed)
    return _UnitFold(starts, restarted, seen_at, decode_only_new, cancelled)


def _fold_down(
    state: GroupState, units: Mapping[Role, UnitState], now: float
) -> tuple[dict[Role, float], tuple[Role, ...]]:
    """Units down since (failed, or coming back after failing) and units stopped on purpose."""
    down = _role_map(state.down_since)
    for role, unit in units.items():
        if unit.active_state == "failed":
            down.setdefault(role, now)
        elif unit.active_state in _RUNNING_UNIT_STATES or unit.active_state == "inactive":
            down.pop(role, None)
        # activating/deactivating: a unit coming back after failing is still down.
    stopped = tuple(r for r in Role if r in units and units[r].active_state == "inactive")
    return down, stopped


def _fold_health(
    state: GroupState, obs: Observation, now: float
) -> tuple[dict[Role, bool], dict[Role, float]]:
    health: dict[Role, bool] = {}
    unhealthy = _role_map(state.unhealthy_since)
    for role in _WORKERS:
        check = obs.health_for(role.value)
        if check is None:
            continue
        health[role] = check.ok
        if check.ok:
            unhealthy.pop(role, None)
        else:
            unhealthy.setdefault(role, now)
    return health, unhealthy


def _fold_probes(state: GroupState, finished: Sequence[ProbeResult], now: float) -> GroupState:
    """Consecutive failures (and verification successes) over the probes finished, in order."""
    failing_since = state.probe_failing_since
    failures = state.probe_failures
    multiround = state.multiround_failures
    last_ok = state.last_probe_ok_at
    successes = state.verify_successes
    for probe in finished:
        if probe.ok:
            failures = 0
            failing_since = None
            multiround = 0
            successes += 1
            end = probe.started_at + probe.duration_seconds
            last_ok = end if last_ok is None else max(last_ok, end)
        else:
            failures += 1
            failing_since = now if failing_since is None else failing_since
            multiround += probe.kind is ProbeKind.MULTIROUND
            successes = 0
    return replace(
        state,
        probe_failures=failures,
        probe_failing_since=failing_since,
        multiround_failures=multiround,
        last_probe_ok_at=last_ok,
        verify_successes=successes,
    )


# Decode tokens that health checks alone can produce between two observations: one per /health of
# ours (one per cycle) and the router's (every --health-check-interval-secs: default 60 s, 1 s in
# the most aggressive setups), plus slack because a check's token can land on either side of a
# scrape. Any real decoding (tens of tokens a second per request) clears this easily.
HEALTH_TOKENS_PER_OBSERVATION = 1.0
ROUTER_HEALTH_TOKENS_PER_SECOND = 1.0
HEALTH_TOKENS_SLACK = 3.0


def own_probe_tokens(obs: Observation, config: GroupSection) -> float:
    """Decode tokens our own probes can have produced since the previous observation.

    Every probe that finished or is still in flight, at most max_tokens each (every round of a
    multi-round probe). A probe that got two tokens and then stalled is not progress: the probe
    result itself already says what happened to it.
    """
    per_probe = config.probe.max_tokens
    rounds = config.probe.multiround_rounds
    finished = sum(
        per_probe * (rounds if p.kind is ProbeKind.MULTIROUND else 1) for p in obs.probes
    )
    in_flight = obs.probes_in_flight * per_probe
    if config.probe.multiround_every_seconds > 0 and obs.probes_in_flight:
        in_flight += per_probe * rounds  # at most one multi-round conversation runs at a time
    return float(finished + in_flight)


def _grew(
    old: CounterBaseline, snap: MetricsSnapshot, new_process: bool, now: float, own_tokens: float
) -> bool:
    for name in _PROGRESS_COUNTERS:
        allowance = 0.0
        if name == "realtime_tokens_total":
            elapsed = max(0.0, now - old.at)
            allowance = (
                HEALTH_TOKENS_PER_OBSERVATION
                + ROUTER_HEALTH_TOKENS_PER_SECOND * elapsed
                + HEALTH_TOKENS_SLACK
                + own_tokens
            )
        before: float | None = getattr(old, name)
        current: float | None = getattr(snap, name)
        if current is None:
            continue
        if before is None or new_process:
            # A series that appeared, or a new process's count from zero.
            if current > allowance:
                return True
        elif counter_increase(before, current) > allowance:
            return True
    return False


def _fold_counters(
    state: GroupState,
    read: Sequence[MetricsSnapshot],
    units: Mapping[Role, UnitState],
    now: float,
    own_tokens: float,
) -> tuple[dict[Role, CounterBaseline], list[FailureSample], bool]:
    """New baselines, failure increases and whether any (decode) progress counter advanced."""
    baselines = {b.role: b for b in state.baselines}
    samples = list(state.failure_samples)
    advanced = False
    for snap in read:
        unit = units.get(snap.role)
        start_us = unit.exec_main_start_us if unit is not None else 0
        old = baselines.get(snap.role)
        failures = snap.transfer_failed + snap.bootstrap_failed
        if old is not None:
            new_process = bool(old.start_us and start_us and old.start_us != start_us)
            increase = failures if new_process else counter_increase(old.failures, failures)
            if increase > 0:
                samples.append(FailureSample(now, snap.role, increase))
            # End-to-end progress is what decode delivers: prefill finishing its side (its
            # requests_total advances when the KV transfer concludes) says nothing about a decode
            # that stalls mid-stream, and prefill compute goes on during a transfer stall.
            if snap.role is Role.DECODE:
                advanced = advanced or _grew(old, snap, new_process, now, own_tokens)
        baselines[snap.role] = CounterBaseline(
            role=snap.role,
            at=now,
            start_us=start_us,
            requests_total=snap.requests_total,
            generation_tokens_total=snap.generation_tokens_total,
            realtime_tokens_total=snap.realtime_tokens_total,
            failures=failures,
        )
    return baselines, samples, advanced


_PENDING_GAUGES = (
    "http_requests_active",
    "inflight_queue",
    "bootstrap_queue",
    "decode_prealloc_queue",
    "decode_transfer_queue",
    "running_reqs",
    "queue_reqs",
)
_PENDING_LOADS = (
    "running_reqs",
    "waiting_reqs",
    "prefill_inflight_queue_reqs",
    "prefill_bootstrap_queue_reqs",
    "decode_prealloc_queue_reqs",
    "decode_transfer_queue_reqs",
)


def _pending(
    obs: Observation, finished: Sequence[ProbeResult], read: Sequence[MetricsSnapshot]
) -> list[tuple[str, float | str]]:
    """Why work counts as pending this cycle (empty: nothing seen pending)."""
    pending: list[tuple[str, float | str]] = []
    if obs.probes_in_flight > 0:
        pending.append(("probes_in_flight", obs.probes_in_flight))
    failed = sum(not p.ok for p in finished)
    if failed:
        pending.append(("probes_failed_this_cycle", failed))
    for snap in read:
        for name in _PENDING_GAUGES:
            value = getattr(snap, name)
            if value is not None and value > 0:
                pending.append((f"{snap.role}_{name}", value))
    for loads in obs.loads:
        if loads.ok:
            for name in _PENDING_LOADS:
                value = getattr(loads, name)
                if value is not None and value > 0:
                    pending.append((f"{loads.role}_loads_{name}", value))
    return pending


def _handoff_values(obs: Observation, read: Sequence[MetricsSnapshot]) -> list[float]:
    """PD hand-off queue sizes (prefill inflight, decode transfer): live /v1/loads first."""
    values: list[float] = []
    for role, loads_name, gauge_name in (
        (Role.PREFILL, "prefill_inflight_queue_reqs", "inflight_queue"),
        (Role.DECODE, "decode_transfer_queue_reqs", "decode_transfer_queue"),
    ):
        loads = obs.loads_for(role)
        live = getattr(loads, loads_name) if loads is not None and loads.ok else None
        if live is not None:
            values.append(float(live))
            continue
        snap = next((m for m in read if m.role is role), None)
        gauge = getattr(snap, gauge_name) if snap is not None else None
        if gauge is not None:
            values.append(float(gauge))
    return values


def _observe(
    state: GroupState, obs: Observation, config: GroupSection, now: float, *, quiet: bool
) -> tuple[GroupState, _Facts]:
    """Fold the observation into memory; `quiet` absorbs unit restarts without judging them."""
    units = {u.role: u for u in obs.units if u.ok}
    unit_fold = _fold_unit_starts(state, units, now, quiet=quiet)
    down, stopped = _fold_down(state, units, now)
    health, unhealthy = _fold_health(state, obs, now)
    finished = [p for p in obs.probes if p.kind in _END_TO_END]
    mem = _fold_probes(state, finished, now)
    probe_ok_now = any(p.ok for p in finished)

    attempted = [m for m in obs.metrics if m.role in _WORKERS]
    read = [m for m in attempted if m.ok]
    baselines, samples, advanced = _fold_counters(
        state, read, units, now, own_probe_tokens(obs, config)
    )
    read_roles = {snap.role for snap in read}
    metrics_fresh = all(role in read_roles for role in _WORKERS)
    keep_seconds = max(config.stall.window_seconds, config.restart.verify_timeout_seconds)
    samples = [s for s in samples if s.at >= now - keep_seconds]
    scrape_failures = state.scrape_failures
    if attempted:
        scrape_failures = scrape_failures + 1 if len(read) < len(attempted) else 0
    pending = _pending(obs, finished, read)

    # The no-progress clock: restarts at progress, and at a full scrape with nothing pending.
    progress_at = state.progress_at
    advanced_at = state.advanced_at
    metrics_seen_at = state.metrics_seen_at
    if advanced or probe_ok_now:
        advanced_at = now
        progress_at = now
    if metrics_fresh:
        metrics_seen_at = now
        if not pending or progress_at is None:
            progress_at = now

    handoff = _handoff_values(obs, read)
    handoff_busy_since = state.handoff_busy_since
    if handoff:
        busy = any(v > 0 for v in handoff)
        handoff_busy_since = (handoff_busy_since or now) if busy else None

    # Cut off from everything: every check failed at the connection level.
    nothing_reached = (
        len(obs.health) + len(attempted) > 0
        and all(not h.ok and h.reason in _HEALTH_UNREACHABLE for h in obs.health)
        and all(not m.ok and m.error in _SCRAPE_UNREACHABLE for m in attempted)
        and all(not p.ok and p.reason in _PROBE_UNREACHABLE for p in finished)
    )

    mem = replace(
        mem,
        baselines=tuple(baselines[r] for r in _WORKERS if r in baselines),
        progress_at=progress_at,
        advanced_at=advanced_at,
        metrics_seen_at=metrics_seen_at,
        scrape_failures=scrape_failures,
        failure_samples=tuple(samples),
        handoff_busy_since=handoff_busy_since,
        unit_starts=tuple(UnitStart(r, unit_fold.starts[r]) for r in Role if r in unit_fold.starts),
        down_since=_role_items(down),
        unhealthy_since=_role_items(unhealthy),
        decode_only_seen_at=unit_fold.decode_only_seen_at,
    )
    facts = _Facts(
        probes_finished=len(finished),
        oldest_probe_seconds=obs.oldest_probe_in_flight_seconds if obs.probes_in_flight else 0.0,
        probe_ok_now=probe_ok_now,
        probe_failed_now=any(not p.ok for p in finished),
        health=health,
        metrics_fresh=metrics_fresh,
        pending=tuple(pending),
        nothing_reached=nothing_reached,
        restarted=unit_fold.restarted,
        decode_only_new=unit_fold.decode_only_new,
        decode_only_cancelled=unit_fold.decode_only_cancelled,
        units=units,
        stopped=stopped,
    )
    return mem, facts


# --- reasons --------------------------------------------------------------------------------------


def _r(code: str, message: str, **values: float | str | None) -> Reason:
    return Reason(
        code=code,
        message=message,
        values=tuple(
            (k, round(v, 3) if isinstance(v, float) else v)
            for k, v in values.items()
            if v is not None
        ),
    )


def _known_flat_seconds(mem: GroupState) -> float | None:
    if mem.metrics_seen_at is None or mem.progress_at is None:
        return None
    return max(0.0, mem.metrics_seen_at - mem.progress_at)


def _since_advance(mem: GroupState, now: float) -> float | None:
    return None if mem.advanced_at is None else now - mem.advanced_at


def _window_failures(mem: GroupState, since: float) -> tuple[float, dict[str, float]]:
    per_role: dict[str, float] = {}
    for sample in mem.failure_samples:
        if sample.at >= since:
            per_role[sample.role.value] = per_role.get(sample.role.value, 0.0) + sample.increase
    return max(per_role.values(), default=0.0), per_role


def _probe_reason(mem: GroupState, config: GroupSection) -> Reason:
    note = f" ({mem.multiround_failures} of them multi-round)" if mem.multiround_failures else ""
    return _r(
        "probe_failures",
        f"{mem.probe_failures} consecutive probe failures{note} "
        f"(threshold {config.stall.probe_failures})",
        consecutive=mem.probe_failures,
        multiround=mem.multiround_failures,
        threshold=config.stall.probe_failures,
    )


def _progress_reason(mem: GroupState, facts: _Facts, config: GroupSection, now: float) -> Reason:
    flat = _known_flat_seconds(mem)
    since = _since_advance(mem, now)
    metrics_age = None if mem.metrics_seen_at is None else now - mem.metrics_seen_at
    if flat is None:
        text = "progress counters never read"
    else:
        text = f"progress counters flat for {flat:.0f}s as last read"
    if not facts.metrics_fresh:
        text += "; metrics unavailable this cycle" + (
            f" (last full scrape {metrics_age:.0f}s ago)" if metrics_age is not None else ""
        )
    return _r(
        "no_progress" if facts.metrics_fresh else "metrics_unavailable",
        text,
        flat_seconds=flat,
        threshold_seconds=config.stall.no_progress_seconds,
        seconds_since_progress=since,
        metrics_age_seconds=metrics_age,
    )


def _pending_reason(facts: _Facts) -> Reason:
    if not facts.pending:
        return _r("nothing_pending", "no work seen pending")
    names = ", ".join(f"{k}={v}" for k, v in facts.pending)
    return Reason("work_pending", f"work pending: {names}", facts.pending)


def _health_reason(facts: _Facts) -> Reason:
    parts = {
        role.value: ("ok" if facts.health[role] else "failing")
        if role in facts.health
        else "unknown"
        for role in _WORKERS
    }
    return _r(
        "worker_health",
        "worker /health: " + ", ".join(f"{k} {v}" for k, v in parts.items()),
        **parts,
    )


# --- assessment -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Assessment:
    verdict: Verdict
    reasons: tuple[Reason, ...]
    act: bool = False


def _unit_assessment(
    mem: GroupState, facts: _Facts, config: GroupSection, now: float, *, hung: bool = True
) -> _Assessment | None:
    """Crash, hung worker or stopped unit: judged from units (and long-failing /health).

    `hung=False` during warm-up, where a worker without passing /health is a failed start.
    """
    timeout = config.stall.startup_timeout_seconds
    down = _role_map(mem.down_since)
    if down:
        role, since = min(down.items(), key=lambda item: item[1])
        seconds = now - since
        unit = facts.units.get(role)
        state = unit.active_state if unit is not None else "unknown"
        reason = _r(
            "unit_failed",
            f"{role} unit failed {seconds:.0f}s ago (now {state}); "
            + (
                "not brought back by systemd within startup_timeout_seconds"
                if seconds >= timeout
                else f"waiting up to {timeout:g}s for systemd's Restart="
            ),
            role=role.value,
            down_seconds=seconds,
            startup_timeout_seconds=timeout,
            n_restarts=unit.n_restarts if unit is not None else None,
        )
        return _Assessment(Verdict.CRASH, (reason,), act=seconds >= timeout)
    since_advance = _since_advance(mem, now)
    hung_after = config.stall.no_progress_seconds
    stuck = since_advance is None or since_advance >= hung_after
    probes_failing = mem.probe_failures >= config.stall.probe_failures
    for item in mem.unhealthy_since if hung else ():
        unit = facts.units.get(item.role)
        seconds = now - item.at
        if (
            seconds >= hung_after
            and stuck
            and probes_failing
            and not facts.nothing_reached
            and unit is not None
            and unit.active_state in _RUNNING_UNIT_STATES
        ):
            reason = _r(
                "health_failing",
                f"{item.role} /health failing for {seconds:.0f}s while its unit is "
                f"{unit.active_state}, probes fail and nothing progresses "
                f"(no_progress_seconds {hung_after:g})",
                role=item.role.value,
                failing_seconds=seconds,
                no_progress_seconds=hung_after,
            )
            return _Assessment(Verdict.CRASH, (reason,), act=True)
    if facts.stopped:
        names = ", ".join(f"{r} ({facts.units[r].unit})" for r in facts.stopped)
        reason = _r(
            "unit_stopped",
            f"stopped on purpose: {names}; use `watchdog pause` for maintenance",
            roles=",".join(r.value for r in facts.stopped),
        )
        return _Assessment(Verdict.UNIT_STOPPED, (reason,))
    return None


def _assess(mem: GroupState, facts: _Facts, config: GroupSection, now: float) -> _Assessment:  # noqa: PLR0912  # the verdict table in priority order
    """The stall verdict of a group that is neither warming, verifying nor held."""
    stall = config.stall
    units = _unit_assessment(mem, facts, config, now)
    if units is not None:
        return units
    probes = _probe_reason(mem, config)
    health = _health_reason(facts)
    if facts.nothing_reached:
        return _Assessment(
            Verdict.MONITORING_OUTAGE,
            (
                _r(
                    "nothing_reachable",
                    "every health check, scrape and probe failed to connect: the watchdog is "
                    "cut off, which is not evidence of a stall",
                ),
                probes,
            ),
        )
    window_failures, per_role = _window_failures(mem, now - stall.window_seconds)
    transfer = _r(
        "transfer_failures",
        f"transfer/bootstrap failures +{window_failures:g} in {stall.window_seconds:g}s "
        f"(max over roles and TP ranks; threshold {stall.transfer_failures})",
        increase=window_failures,
        threshold=stall.transfer_failures,
        window_seconds=stall.window_seconds,
        **{f"{role}_increase": value for role, value in per_role.items()},
    )
    rising = window_failures >= stall.transfer_failures
    flat = _known_flat_seconds(mem)
    since_advance = _since_advance(mem, now)
    advancing = since_advance is not None and since_advance < stall.no_progress_seconds
    progress = _progress_reason(mem, facts, config, now)
    failing = mem.probe_failures >= stall.probe_failures
    # Overloaded means other requests complete *while* probes fail, not merely before they did.
    advancing_while_failing = (
        advancing
        and mem.advanced_at is not None
        and mem.probe_failing_since is not None
        and mem.advanced_at >= mem.probe_failing_since
    )

    if failing:
        if rising:
            return _Assessment(Verdict.DEGRADED_BOOTSTRAP, (transfer, probes), act=True)
        if (
            facts.workers_healthy
            and facts.pending
            and flat is not None
            and flat >= stall.no_progress_seconds
        ):
            return _Assessment(
                Verdict.SILENT_STALL, (probes, progress, _pending_reason(facts), health), act=True
            )
        if advancing_while_failing:
            return _Assessment(Verdict.OVERLOADED, (probes, progress))
        if facts.workers_failing:
            return _Assessment(Verdict.WORKER_UNHEALTHY, (health, probes))
        if not facts.metrics_fresh:
            unknown = _r(
                "progress_unknown",
                "probes failing but progress cannot be confirmed without metrics; not acting",
            )
            return _Assessment(Verdict.MONITORING_OUTAGE, (unknown, probes, progress, health))
        return _Assessment(
            Verdict.STALL_SUSPECTED, (probes, progress, _pending_reason(facts), health)
        )
    if rising:
        return _Assessment(Verdict.TRANSFER_FAILURES_RISING, (transfer, probes))
    pinned = _pinned(mem, facts, config, now, advancing)
    if pinned is not None:
        return _Assessment(Verdict.PINNED_REQUEST, (pinned,))
    if facts.workers_failing:
        return _Assessment(Verdict.WORKER_UNHEALTHY, (health,))
    if mem.probe_failures > 0:
        return _Assessment(Verdict.BLIP, (probes,))
    if mem.scrape_failures >= stall.probe_failures:
        reason = _r(
            "scrape_failing",
            f"worker /metrics failed {mem.scrape_failures} cycles in a row while probes pass",
            consecutive=mem.scrape_failures,
        )
        return _Assessment(Verdict.MONITORING_OUTAGE, (reason, progress))
    if facts.pending and advancing:
        saturated = dict(facts.pending).get("probes_in_flight", 0)
        if isinstance(saturated, (int, float)) and saturated >= config.probe.max_in_flight:
            reason = _r(
                "probes_saturated",
                f"{saturated:g} probes in flight (max_in_flight {config.probe.max_in_flight}) "
                "while counters advance: slow but progressing",
                in_flight=saturated,
            )
            return _Assessment(Verdict.OVERLOADED, (reason, progress))
    return _Assessment(Verdict.OK, ())


def _pinned(
    mem: GroupState, facts: _Facts, config: GroupSection, now: float, advancing: bool
) -> Reason | None:
    limit = config.stall.pinned_inflight_seconds
    if not advancing:
        return None  # nothing completes: that is stall territory, not one pinned request
    if facts.oldest_probe_seconds >= limit:
        return _r(
            "probe_pinned",
            f"a probe has been in flight for {facts.oldest_probe_seconds:.0f}s while other "
            f"requests complete (pinned_inflight_seconds {limit:g}); a restart may not fix it",
            in_flight_seconds=facts.oldest_probe_seconds,
            threshold_seconds=limit,
        )
    if mem.handoff_busy_since is not None and now - mem.handoff_busy_since >= limit:
        seconds = now - mem.handoff_busy_since
        return _r(
            "handoff_queue_pinned",
            f"PD hand-off queue not empty for {seconds:.0f}s while other requests complete "
            f"(pinned_inflight_seconds {limit:g}); a restart may not fix it",
            busy_seconds=seconds,
            threshold_seconds=limit,
        )
    return None


# --- transitions ----------------------------------------------------------------------------------


def _move(mem: GroupState, state: State, now: float) -> GroupState:
    return mem if mem.state is state else replace(mem, state=state, since=now)


def _decision(
    mem: GroupState,
    verdict: Verdict,
    reasons: Sequence[Reason],
    action: Action = Action.NONE,
) -> Decision:
    alerted = () if verdict is Verdict.OK else mem.alerted
    if action is Action.NONE and verdict in ALERT_VERDICTS and verdict not in alerted:
        action = Action.ALERT
    if action is Action.ALERT and verdict not in alerted:
        alerted = (*alerted, verdict)
    return Decision(replace(mem, verdict=verdict, alerted=alerted), verdict, action, tuple(reasons))


def _backoff_seconds(base: float, failures: int) -> float:
    return float(base * 2 ** min(max(failures - 1, 0), _MAX_BACKOFF_DOUBLINGS))


def _budget_reason(recent: Sequence[float], config: GroupSection) -> Reason:
    return _r(
        "budget",
        f"{len(recent)} of {config.restart.max_restarts} co-restarts used in the last "
        f"{config.restart.budget_window_seconds:g}s",
        used=len(recent),
        max_restarts=config.restart.max_restarts,
        window_seconds=config.restart.budget_window_seconds,
    )


def _hold(mem: GroupState, why: str, now: float) -> GroupState:
    return replace(_move(mem, State.HELD, now), held_since=now, held_reason=why)


def _act(
    mem: GroupState, facts: _Facts, cause: _Assessment, config: GroupSection, now: float
) -> Decision:
    """Co-restart for `cause` if the budget and backoff allow; otherwise wait (stalled) or hold."""
    verdict, reasons = cause.verdict, cause.reasons
    if facts.stopped:
        # RestartUnit would start what an operator stopped on purpose: tell, never act.
        names = ", ".join(r.value for r in facts.stopped)
        stopped = _r(
            "not_acting_unit_stopped",
            f"{verdict} calls for a co-restart, but {names} is stopped on purpose; "
            "use `watchdog pause` for maintenance",
            roles=names,
        )
        return _decision(_move(mem, State.DEGRADED, now), Verdict.UNIT_STOPPED, (*reasons, stopped))
    recent = _in_window(mem.restart_times, config.restart.budget_window_seconds, now)
    budget = _budget_reason(recent, config)
    if len(recent) >= config.restart.max_restarts:
        held = _hold(
            replace(mem, stall_verdict=verdict, restart_times=recent),
            f"{verdict}: restart budget exhausted",
            now,
        )
        exhausted = _r(
            "budget_exhausted",
            "restart budget exhausted: holding (no more actions) until an operator re-arms "
            "with `watchdog reset`",
        )
        return _decision(
            held, Verdict.BUDGET_EXHAUSTED, (*reasons, budget, exhausted), Action.ALERT
        )
    if now < mem.backoff_until:
        waiting = _r(
            "backoff",
            f"backing off {mem.backoff_until - now:.0f}s more after {mem.consecutive_failures} "
            "consecutive failed attempt(s)",
            seconds_left=mem.backoff_until - now,
            consecutive_failures=mem.consecutive_failures,
        )
        stalled = replace(_move(mem, State.STALLED, now), stall_verdict=verdict)
        return _decision(stalled, Verdict.BACKOFF, (*reasons, waiting, budget))
    restarting = replace(
        _move(mem, State.RESTARTING, now),
        restart_times=(*recent, now),
        stall_verdict=verdict,
        backoff_base_seconds=config.restart.backoff_seconds,
        budget_left=config.restart.max_restarts - len(recent) - 1,
    )
    charged = _budget_reason((*recent, now), config)
    return _decision(restarting, verdict, (*reasons, charged), Action.CO_RESTART)


def _settle(
    mem: GroupState, facts: _Facts, assessment: _Assessment, config: GroupSection, now: float
) -> Decision:
    """Apply an assessment to a group in healthy, overloaded, degraded or stalled."""
    if assessment.act:
        return _act(mem, facts, assessment, config, now)
    verdict = assessment.verdict
    if verdict is Verdict.OK:
        target = State.HEALTHY
    elif verdict is Verdict.OVERLOADED:
        target = State.OVERLOADED
    elif verdict in (Verdict.BLIP, Verdict.STALL_SUSPECTED):
        keep = (State.HEALTHY, State.OVERLOADED, State.DEGRADED)
        target = mem.state if mem.state in keep else State.HEALTHY
    else:
        target = State.DEGRADED
    moved = _move(mem, target, now)
    if mem.state is State.STALLED and verdict in (Verdict.OK, Verdict.OVERLOADED):
        # Progress again without our help: the last attempt's failure is history.
        moved = replace(moved, stall_verdict=None, consecutive_failures=0, backoff_until=0.0)
    return _decision(moved, verdict, assessment.reasons)


def _warm(mem: GroupState, now: float) -> GroupState:
    """Start (or restart) a warm-up: the new processes' failures and flat clock start afresh."""
    return replace(
        _move(mem, State.WARMING, now),
        warming_since=now,
        probe_failures=0,
        probe_failing_since=None,
        multiround_failures=0,
        progress_at=now,
        handoff_busy_since=None,
        verify_started_at=None,
        # The old processes' failures say nothing about the new ones; alerts start afresh.
        failure_samples=(),
        alerted=(),
    )


def _unit_events(
    mem: GroupState, facts: _Facts, config: GroupSection, now: float
) -> Decision | None:
    """Crash (acting), decode-only restarts and external restarts, in every judging state."""
    units = _unit_assessment(mem, facts, config, now, hung=mem.state is not State.WARMING)
    if units is not None and units.act:
        return _act(mem, facts, units, config, now)
    if mem.decode_only_seen_at is not None:
        return _decode_only(mem, facts, config, now)
    if facts.decode_only_cancelled:
        reason = _r(
            "decode_then_prefill_restart",
            "decode was restarted and prefill followed within the grace window: treated as an "
            "external co-restart",
        )
        return _decision(_warm(mem, now), Verdict.WARMING_UP, (reason,))
    if facts.restarted:
        names = ", ".join(sorted(r.value for r in facts.restarted))
        reason = _r(
            "external_restart",
            f"restart of {names} detected (ExecMainStartTimestamp changed): warming up",
            roles=names,
        )
        return _decision(_warm(mem, now), Verdict.WARMING_UP, (reason,))
    return None


def _decode_only(mem: GroupState, facts: _Facts, config: GroupSection, now: float) -> Decision:
    seen = mem.decode_only_seen_at
    assert seen is not None
    grace = config.stall.decode_only_grace_seconds
    waited = now - seen
    starts = {u.role: u.start_us for u in mem.unit_starts}
    reason = _r(
        "decode_only_restart",
        "decode was restarted while prefill kept running (prefill started "
        f"{_age(starts.get(Role.PREFILL), now)}, decode {_age(starts.get(Role.DECODE), now)}); "
        "a decode restarted alone degrades the KV-transfer bootstrap state",
        seen_seconds_ago=waited,
        grace_seconds=grace,
        policy=config.stall.on_decode_only_restart,
        n_restarts=facts.units[Role.DECODE].n_restarts if Role.DECODE in facts.units else None,
    )
    if facts.decode_only_new:
        mem = _warm(mem, now)
    if waited < grace:
        grace_reason = _r(
            "grace",
            f"waiting {grace - waited:.0f}s more in case prefill is being restarted too",
            seconds_left=grace - waited,
        )
        return _decision(
            _move(mem, State.WARMING, now), Verdict.DECODE_ONLY_RESTART, (reason, grace_reason)
        )
    if config.stall.on_decode_only_restart == "alert":
        alerted = replace(mem, decode_only_seen_at=None)
        return _decision(alerted, Verdict.DECODE_ONLY_RESTART, (reason,), Action.ALERT)
    cause = _Assessment(Verdict.DECODE_ONLY_RESTART, (reason,), act=True)
    return _act(mem, facts, cause, config, now)


def _age(start_us: int | None, now: float) -> str:
    if not start_us:
        return "at an unknown time"
    return f"{max(0.0, now - start_us / 1e6):.0f}s ago"


# --- per-state handlers ---------------------------------------------------------------------------


def _judge(mem: GroupState, facts: _Facts, config: GroupSection, now: float) -> Decision:
    """healthy, overloaded, degraded."""
    event = _unit_events(mem, facts, config, now)
    if event is not None:
        return event
    return _settle(mem, facts, _assess(mem, facts, config, now), config, now)


def _stalled(mem: GroupState, facts: _Facts, config: GroupSection, now: float) -> Decision:
    event = _unit_events(mem, facts, config, now)
    if event is not None:
        return event
    assessment = _assess(mem, facts, config, now)
    if assessment.act:
        return _act(mem, facts, assessment, config, now)
    sticky = mem.stall_verdict
    # A pending decode-only restart is handled by _unit_events until a co-restart resolves it.
    if sticky is Verdict.FAILED_START and assessment.verdict is not Verdict.MONITORING_OUTAGE:
        ready = (
            mem.last_probe_ok_at is not None
            and mem.last_probe_ok_at >= mem.since
            and not facts.workers_failing
        )
        if not ready:
            reason = _r("not_started", "the failed start has not recovered")
            cause = _Assessment(sticky, (reason, *assessment.reasons), act=True)
            return _act(mem, facts, cause, config, now)
    return _settle(mem, facts, assessment, config, now)


def _ready(mem: GroupState, facts: _Facts, config: GroupSection, now: float) -> Reason | None:
    """Whether warm-up is over: health passes and a probe succeeded (or units long settled)."""
    if facts.workers_failing:
        return None
    since = mem.warming_since if mem.warming_since is not None else mem.since
    # Strictly after: a probe that finished in the cycle the restart was seen may predate it.
    if mem.last_probe_ok_at is not None and mem.last_probe_ok_at > since:
        return _r("warm_up_complete", "health passes and an end-to-end probe succeeded")
    timeout = config.stall.startup_timeout_seconds
    settled = [
        role
        for role in _WORKERS
        if role in facts.units
        and facts.units[role].exec_main_start_us > 0
        and now - facts.units[role].exec_main_start_us / 1e6 >= timeout
    ]
    if facts.workers_healthy and len(settled) == len(_WORKERS):
        return _r(
            "units_settled",
            f"health passes and both workers have run longer than {timeout:g}s: nothing to warm up",
        )
    return None


def _warming(mem: GroupState, facts: _Facts, config: GroupSection, now: float) -> Decision:
    event = _unit_events(mem, facts, config, now)
    if event is not None:
        return event
    since = mem.warming_since if mem.warming_since is not None else mem.since
    elapsed = now - since
    ready = _ready(mem, facts, config, now)
    if ready is not None:
        decision = _settle(
            replace(mem, warming_since=None), facts, _assess(mem, facts, config, now), config, now
        )
        return replace(decision, reasons=(ready, *decision.reasons))
    timeout = config.stall.startup_timeout_seconds
    if elapsed < timeout:
        stopped = _unit_assessment(mem, facts, config, now, hung=False)
        if stopped is not None:  # crash still within its wait, or a unit stopped: tell
            return _decision(mem, stopped.verdict, stopped.reasons)
        reason = _r(
            "warming_up",
            f"warming up for {elapsed:.0f}s of at most {timeout:g}s: waiting for health and a "
            "successful probe",
            elapsed_seconds=elapsed,
            startup_timeout_seconds=timeout,
        )
        return _decision(mem, Verdict.WARMING_UP, (reason, _health_reason(facts)))
    assessment = _assess(mem, facts, config, now)
    timed_out = _r(
        "startup_timeout",
        f"not ready {elapsed:.0f}s after the start (startup_timeout_seconds {timeout:g})",
        elapsed_seconds=elapsed,
        startup_timeout_seconds=timeout,
    )
    since_advance = _since_advance(mem, now)
    advancing = since_advance is not None and since_advance < config.stall.no_progress_seconds
    failed = assessment.act or (
        bool(facts.workers_failing) and not facts.nothing_reached and not advancing
    )
    if not failed:
        decision = _settle(replace(mem, warming_since=None), facts, assessment, config, now)
        return replace(decision, reasons=(timed_out, *decision.reasons))
    attempts = mem.consecutive_failures + 1
    last = max(mem.restart_times, default=None)
    backoff_until = (
        mem.backoff_until
        if last is None
        else max(
            mem.backoff_until, last + _backoff_seconds(config.restart.backoff_seconds, attempts)
        )
    )
    counted = replace(
        mem, consecutive_failures=attempts, backoff_until=backoff_until, warming_since=None
    )
    reasons = (timed_out, *assessment.reasons, _health_reason(facts))
    cause = _Assessment(Verdict.FAILED_START, reasons, act=True)
    return _act(counted, facts, cause, config, now)


def _verifying(mem: GroupState, facts: _Facts, config: GroupSection, now: float) -> Decision:
    event = _unit_events(mem, facts, config, now)
    if event is not None:
        return event
    started = mem.verify_started_at if mem.verify_started_at is not None else mem.since
    elapsed = now - started
    need = config.restart.verify_probes
    new_failures, per_role = _window_failures(mem, started)
    progress = _r(
        "verification",
        f"{mem.verify_successes}/{need} consecutive probe successes, "
        f"{elapsed:.0f}s of {config.restart.verify_timeout_seconds:g}s",
        successes=mem.verify_successes,
        required=need,
        elapsed_seconds=elapsed,
        timeout_seconds=config.restart.verify_timeout_seconds,
    )
    if new_failures > 0:
        why = _r(
            "new_transfer_failures",
            f"transfer/bootstrap failures rose by {new_failures:g} after the co-restart",
            increase=new_failures,
            **{f"{role}_increase": value for role, value in per_role.items()},
        )
        return _verification_failed(mem, (why, progress), config, now)
    if mem.verify_successes >= need:
        passed = replace(
            _move(mem, State.HEALTHY, now),
            verify_started_at=None,
            warming_since=None,
            consecutive_failures=0,
            backoff_until=0.0,
            stall_verdict=None,
        )
        resolved = _r("resolved", "the co-restart helped: incident resolved")
        return _decision(passed, Verdict.VERIFICATION_PASSED, (progress, resolved))
    if elapsed >= config.restart.verify_timeout_seconds:
        why = _r(
            "verify_timeout",
            f"fewer than {need} consecutive probe successes within "
            f"{config.restart.verify_timeout_seconds:g}s",
        )
        return _verification_failed(mem, (why, progress), config, now)
    return _decision(mem, Verdict.VERIFYING, (progress,))


def _verification_failed(
    mem: GroupState, reasons: Sequence[Reason], config: GroupSection, now: float
) -> Decision:
    attempts = mem.consecutive_failures + 1
    base = config.restart.backoff_seconds
    counted = replace(
        mem,
        consecutive_failures=attempts,
        backoff_until=now + _backoff_seconds(base, attempts),
        verify_started_at=None,
        warming_since=None,
    )
    recent = _in_window(mem.restart_times, config.restart.budget_window_seconds, now)
    if len(recent) >= config.restart.max_restarts:
        held = _hold(counted, "verification failed and the restart budget is exhausted", now)
        extra = (
            _budget_reason(recent, config),
            _r("budget_exhausted", "restart budget exhausted: holding until an operator re-arms"),
        )
        return _decision(held, Verdict.VERIFICATION_FAILED, (*reasons, *extra), Action.ALERT)
    stalled = _move(counted, State.STALLED, now)
    backoff = _r(
        "backoff",
        f"attempt {attempts} failed; next co-restart not before "
        f"{_backoff_seconds(base, attempts):g}s from now",
        consecutive_failures=attempts,
        backoff_seconds=_backoff_seconds(base, attempts),
    )
    return _decision(stalled, Verdict.VERIFICATION_FAILED, (*reasons, backoff), Action.ALERT)


def _held(mem: GroupState, facts: _Facts, config: GroupSection, now: float) -> Decision:
    underlying = _assess(mem, facts, config, now)
    reason = _r(
        "held",
        f"held since {now - (mem.held_since or now):.0f}s ago ({mem.held_reason}); no actions "
        f"until `watchdog reset`; meanwhile: {underlying.verdict}",
        underlying=str(underlying.verdict),
    )
    return _decision(mem, Verdict.HELD, (reason, *underlying.reasons))


# --- the entry points -----------------------------------------------------------------------------


def decide(
    state: GroupState, observation: Observation, config: GroupSection, now: float
) -> Decision:
    """One cycle of the state machine: fold in the observation, judge, and say what to do."""
    operator = observation.operator
    until = operator.paused_until
    paused = until is not None and now < until
    quiet = paused or state.state in (State.PAUSED, State.RESTARTING)
    mem, facts = _observe(state, observation, config, now, quiet=quiet)

    if paused and until is not None:
        lease = _r(
            "paused",
            f"maintenance lease for {until - now:.0f}s more"
            + (f": {operator.pause_reason}" if operator.pause_reason else "")
            + "; observing only",
            seconds_left=until - now,
        )
        return _decision(_move(mem, State.PAUSED, now), Verdict.PAUSED, (lease,))
    if state.state is State.PAUSED:
        if mem.held_since is not None:
            back = _move(mem, State.HELD, now)
            return _decision(back, Verdict.HELD, (_r("pause_ended", "lease over: still held"),))
        reason = _r("pause_ended", "maintenance lease over: warming up before judging again")
        return _decision(_warm(mem, now), Verdict.WARMING_UP, (reason,))
    if state.state is State.HELD:
        rearmed = operator.rearmed_at
        held_since = mem.held_since if mem.held_since is not None else mem.since
        if rearmed is None or rearmed <= held_since:
            return _held(mem, facts, config, now)
        mem = replace(
            _move(mem, State.HEALTHY, now),
            held_since=None,
            held_reason="",
            restart_times=(),
            consecutive_failures=0,
            backoff_until=0.0,
            stall_verdict=None,
            alerted=(),
        )
        decision = _judge(mem, facts, config, now)
        rearm = _r("rearmed", "re-armed by an operator: budget and failure count cleared")
        return replace(decision, reasons=(rearm, *decision.reasons))
    if state.state is State.RESTARTING:
        # Three steps, each bounded by ready_timeout_seconds: longer means the outcome was lost
        # (a daemon killed mid-sequence and restored from persisted state); count it as failed
        # rather than stay inert forever.
        limit = 3 * config.restart.ready_timeout_seconds + config.probe.timeout_seconds
        if now - state.since > limit:
            lost = _r(
                "restart_outcome_lost",
                f"no outcome {now - state.since:.0f}s after the co-restart began (at most "
                f"{limit:g}s expected): counted as a failed attempt",
            )
            attempts = mem.consecutive_failures + 1
            base = config.restart.backoff_seconds
            failed = replace(
                _move(mem, State.STALLED, now),
                consecutive_failures=attempts,
                backoff_until=now + _backoff_seconds(base, attempts),
                unit_starts=(),
            )
            return _decision(failed, Verdict.RESTARTING, (lost,), Action.ALERT)
        reason = _r("restarting", "co-restart in progress")
        return _decision(mem, Verdict.RESTARTING, (reason,))
    if state.state is State.WARMING:
        return _warming(mem, facts, config, now)
    if state.state is State.VERIFYING:
        return _verifying(mem, facts, config, now)
    if state.state is State.STALLED:
        return _stalled(mem, facts, config, now)
    return _judge(mem, facts, config, now)


def after_restart(state: GroupState, outcome: RestartOutcome, now: float) -> GroupState:
    """Fold in how a co-restart went: ok → verifying; failed → stalled (attempt counted) or held.

    A dry-run outcome counts as performed, so a rehearsal plays out verification, backoff and
    budget faithfully. Our own restart changes every start timestamp: forget them, so the next
    observation sets new baselines instead of reporting an external or decode-only restart.
    """
    fresh = replace(
        state,
        since=now,
        probe_failures=0,
        probe_failing_since=None,
        multiround_failures=0,
        verify_successes=0,
        unit_starts=(),
        down_since=(),
        unhealthy_since=(),
        decode_only_seen_at=None,
        handoff_busy_since=None,
        progress_at=now,
        failure_samples=(),
        alerted=(),
    )
    if outcome.ok and not outcome.interrupted:
        return replace(
            fresh,
            state=State.VERIFYING,
            verdict=Verdict.VERIFYING,
            verify_started_at=now,
            warming_since=now,
        )
    attempts = state.consecutive_failures + 1
    failed = replace(
        fresh,
        consecutive_failures=attempts,
        backoff_until=now + _backoff_seconds(state.backoff_base_seconds, attempts),
        verify_started_at=None,
        warming_since=None,
    )
    step = outcome.failed_step
    detail = f"{step.role} {step.phase}" if step is not None else "no step ran"
    if state.budget_left <= 0:
        return replace(
            failed,
            state=State.HELD,
            held_since=now,
            held_reason=f"co-restart failed ({detail}) and the restart budget is exhausted",
        )
    return replace(failed, state=State.STALLED)
