"""Frozen value objects passed between observe, decide and act; no behaviour beyond small accessors.

Times are unix seconds (float) unless the name says otherwise; durations end in `_seconds`.
Everything here is JSON-serialisable through pydantic's TypeAdapter (see `watchdog.run.recording`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum


class Role(StrEnum):
    """The three processes of a PD group."""

    PREFILL = "prefill"
    DECODE = "decode"
    ROUTER = "router"


class ProbeKind(StrEnum):
    """What a ProbeResult measured."""

    COMPLETION = "completion"  # one streamed request through the router
    MULTIROUND = "multiround"  # a growing-context conversation through the router
    DIRECT = "direct"  # one prefill and one decode asked directly, as the router pairs them
    HEALTH = "health"  # a worker's /health
    READINESS = "readiness"  # the router's /readiness


class ProbeFailure(StrEnum):
    """Why a probe failed; `ok` when it did not."""

    OK = "ok"
    CONNECT_REFUSED = "connect_refused"
    CONNECT_ERROR = "connect_error"
    TIMEOUT_BEFORE_HEADERS = "timeout_before_headers"
    STALLED_MIDSTREAM = "stalled_midstream"
    HTTP_ERROR = "http_error"
    MALFORMED = "malformed"
    EMPTY_OUTPUT = "empty_output"
    UNEXPECTED_OUTPUT = "unexpected_output"
    TIMEOUT = "timeout"  # non-streaming checks (health, readiness) past their deadline
    INTERNAL_ERROR = "internal_error"  # the probe raised instead of returning (detail: the class)


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """The outcome of one probe. Probes return this; they never raise for a failing target."""

    kind: ProbeKind
    target: str  # "router", "prefill" or "decode"
    ok: bool
    reason: ProbeFailure
    started_at: float
    duration_seconds: float
    ttft_seconds: float | None = None  # first non-empty token, not the response headers
    tokens: int = 0
    status_code: int | None = None
    error_code: str | None = None  # router's x-smg-error-code header
    request_id: str = ""
    detail: str = ""
    # /abort_request was posted to both workers for this rid: on SGLang 0.5.23 each abort of a
    # request sitting in a PD queue is a counted transfer/bootstrap failure (docs/sglang.md §7.2).
    abort_sent: bool = False
    worker: int = 0  # health checks: which worker of `target` (its index in the config)
    # Direct probes (target "decode", `worker` the decode): the prefill worker of the pair.
    peer: int = 0
    # Direct probes pinned to one DP rank of the decode (docs/sglang.md §7.10); None: not pinned.
    dp_rank: int | None = None


class ScrapeFailure(StrEnum):
    """Why a /metrics (or /v1/loads) fetch produced no usable snapshot; `ok` when it did."""

    OK = "ok"
    CONNECT_REFUSED = "connect_refused"
    CONNECT_ERROR = "connect_error"
    TIMEOUT = "timeout"
    HTTP_STATUS = "http_status"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    NOT_PROMETHEUS = "not_prometheus"  # empty, HTML, or no sample line parsed
    TRUNCATED = "truncated"  # cut short: its last line, or its compressed stream, never ended
    UNSUPPORTED = "unsupported"  # endpoint absent on this server version (e.g. /v1/loads < 0.5.23)
    # Not scraped: the previous page of this target is still being parsed (observe/bounded.py,
    # ParseSlot). The target answered that one: this says nothing about its reachability.
    PARSE_BUSY = "parse_busy"


@dataclass(frozen=True, slots=True)
class RankLoad:
    """One DP rank of a decode as one source reports it (docs/decisions.md, "DP-attention ranks").

    SGLang labels each DP rank's scheduler series with `dp_rank` when the server runs DP
    (observability/metrics_collector.py:1391-1392 @ 0.5.23), and /v1/loads answers one row per
    rank (managers/scheduler_components/load_inquirer.py:229-256 @ 0.5.23). None: not reported.
    """

    dp_rank: int
    # Tokens the rank's decode steps generated so far: realtime_tokens_total{mode="decode"}, or
    # its decode_moments tokens (0 where the row says none yet, load_inquirer.py:226-227).
    decode_tokens: float | None = None
    running_reqs: float | None = None
    waiting_reqs: float | None = None  # waiting and decode PD queues (load_inquirer.py:114-141)

    @property
    def work(self) -> float | None:
        """Requests the rank holds, running or waiting (None: neither reported)."""
        if self.running_reqs is None and self.waiting_reqs is None:
            return None
        return (self.running_reqs or 0.0) + (self.waiting_reqs or 0.0)


@dataclass(frozen=True, slots=True)
class MetricsSnapshot:
    """The SGLang signals extracted from one /metrics scrape of one role.

    Counters are None when the series is absent *and* absence cannot be read as zero; failure
    counters (transfer/bootstrap) are created only on the first failure, so absent reads 0 and
    `absent_counters` names them (a series seen before and missing now is unknown, not zero).
    Failure counters are the max over TP ranks: SGLang adds 1 on every rank for one failure.
    """

    role: Role
    scraped_at: float
    ok: bool
    error: ScrapeFailure = ScrapeFailure.OK
    detail: str = ""
    duration_seconds: float = 0.0
    transfer_failed: float = 0.0
    bootstrap_failed: float = 0.0
    inflight_queue: float | None = None  # prefill: KV transfer in progress (frozen during a stall)
    bootstrap_queue: float | None = None  # prefill bootstrap/prealloc queue
    decode_prealloc_queue: float | None = None
    decode_transfer_queue: float | None = None
    running_reqs: float | None = None
    queue_reqs: float | None = None
    requests_total: float | None = None  # summed over label sets; advances at request finish
    generation_tokens_total: float | None = None
    prompt_tokens_total: float | None = None
    realtime_tokens_total: float | None = None  # 0.5.23+: per-iteration progress
    # Requests given a first token; only where aborts are not counted in it (0.5.23: series
    # labelled is_streaming), else None (docs/sglang.md §7.3).
    ttft_count: float | None = None
    aborted_requests_total: float | None = None  # every /abort_request the worker acted on
    http_requests_active: float | None = None  # generate endpoints only
    malformed_lines: int = 0
    absent_counters: tuple[str, ...] = ()  # failure counter fields that read 0 for want of a series
    # Router only (from its separate Prometheus listener):
    workers_unhealthy: int | None = None  # smg_worker_health == 0
    circuit_breakers_open: int | None = None  # smg_worker_cb_state == 1
    worker: int = 0  # which worker of `role` (its index in the config)
    # Per DP rank, where the series carry a dp_rank label (empty: no DP, or not labelled).
    ranks: tuple[RankLoad, ...] = ()


@dataclass(frozen=True, slots=True)
class LoadsSnapshot:
    """`GET /v1/loads?include=disagg` (SGLang 0.5.23+): live queue sizes, republished each 50 ms."""

    role: Role
    fetched_at: float
    ok: bool
    error: ScrapeFailure = ScrapeFailure.OK
    timestamp: float | None = (
        None  # the scheduler's own (what a frozen one means: docs/sglang.md §7.6)
    )
    version: str | None = None  # the server's SGLang version, from the answer's `version` field
    running_reqs: int | None = None
    waiting_reqs: int | None = None
    prefill_inflight_queue_reqs: int | None = None
    prefill_bootstrap_queue_reqs: int | None = None
    decode_prealloc_queue_reqs: int | None = None
    decode_transfer_queue_reqs: int | None = None
    # Tokens generated by decode steps, summed over DP ranks (decode_moments[5], 0.5.23): a
    # cumulative count of the process; None when absent or before the first decode step.
    decode_tokens_total: float | None = None
    worker: int = 0  # which worker of `role` (its index in the config)
    ranks: tuple[RankLoad, ...] = ()  # one per row that names its dp_rank


@dataclass(frozen=True, slots=True)
class OwnTokens:
    """What our own probes (every kind) received from the servers, each token counted once.

    `received`: tokens streamed to our probes, finished or still in flight; `first`: streams
    that got their first token (each round of a multi-round probe is a stream); `finished`:
    tokens of the probes that finished, counted when they finished (what counters that move at a
    request's finish, like generation_tokens_total, add for them). Counted at the edge, as the
    chunks arrive (watchdog/observe/probes/tally.py; docs/decisions.md, "Progress").
    """

    received: int = 0
    first: int = 0
    finished: int = 0

    def __add__(self, other: OwnTokens) -> OwnTokens:
        return OwnTokens(
            self.received + other.received, self.first + other.first, self.finished + other.finished
        )

    def __sub__(self, other: OwnTokens) -> OwnTokens:
        return OwnTokens(
            self.received - other.received, self.first - other.first, self.finished - other.finished
        )


@dataclass(frozen=True, slots=True)
class RankTokens:
    """Tokens our pinned probes received from one DP rank of one decode worker, each counted
    once (watchdog/observe/probes/scheduler.py): the only tokens provably ours on that rank."""

    decode: int
    dp_rank: int
    received: int


def add_rank_tokens(*counts: Iterable[RankTokens], sign: int = 1) -> tuple[RankTokens, ...]:
    """Per-rank counts added up (`sign` -1 subtracts the later ones from the first), in order."""
    total: dict[tuple[int, int], int] = {}
    for i, items in enumerate(counts):
        factor = 1 if i == 0 else sign
        for item in items:
            key = (item.decode, item.dp_rank)
            total[key] = total.get(key, 0) + factor * item.received
    return tuple(RankTokens(d, r, n) for (d, r), n in sorted(total.items()))


@dataclass(frozen=True, slots=True)
class RoleCount:
    """A count per role, e.g. the aborts the watchdog itself sent to a worker this cycle."""

    role: Role
    count: int


@dataclass(frozen=True, slots=True)
class UnitState:
    """systemd's view of one unit, read over D-Bus."""

    role: Role
    unit: str
    ok: bool  # False: the properties could not be read (error says why)
    error: str = ""
    load_state: str = ""
    active_state: str = ""  # active, reloading, inactive, failed, activating, deactivating
    sub_state: str = ""
    main_pid: int = 0
    exec_main_start_us: int = 0  # ExecMainStartTimestamp, microseconds since the epoch
    n_restarts: int = 0  # NRestarts: restarts by systemd's own Restart=
    worker: int = 0  # which worker of `role` (its index in the config)
    # Result: how the unit's last run ended ("success", "signal", "oom-kill", "exit-code", ...);
    # "" where it was not read (recordings made before it was).
    result: str = ""


@dataclass(frozen=True, slots=True)
class OperatorControls:
    """What operators asked for through `watchdog pause/resume/reset`, read from state_dir."""

    paused_until: float | None = None  # maintenance lease: observe only until then
    pause_reason: str = ""
    rearmed_at: float | None = None  # `watchdog reset`: a held group may act again


@dataclass(frozen=True, slots=True)
class Observation:
    """Everything one cycle saw of one group: the only input of decide() besides state, config."""

    group: str
    at: float
    # Completion and multi-round probes *finished* since the previous observation, oldest first.
    probes: tuple[ProbeResult, ...] = ()
    probes_in_flight: int = 0
    oldest_probe_in_flight_seconds: float = 0.0
    health: tuple[ProbeResult, ...] = ()  # worker /health and router /readiness (evidence)
    # False: /health was not fetched this cycle, nothing being in doubt (observe/cadence.py), and
    # `health` repeats the last checks, each with its own started_at; decide() dates a failure
    # found after such cycles from the first of them.
    health_checked: bool = True
    metrics: tuple[MetricsSnapshot, ...] = ()
    loads: tuple[LoadsSnapshot, ...] = ()
    units: tuple[UnitState, ...] = ()  # empty when systemd is not observed
    operator: OperatorControls = field(default_factory=OperatorControls)
    # Our own /abort_request calls per worker since the previous observation (timed-out probes).
    own_aborts: tuple[RoleCount, ...] = ()
    # Tokens our probes received since the previous observation's end, through this one's end
    # (in-flight probes' tokens so far included: each token is in exactly one observation), and
    # the part of them received while this observation's fetches ran: the counters it scraped
    # may or may not include those (docs/decisions.md, "Progress").
    own_tokens: OwnTokens = field(default_factory=OwnTokens)
    own_tokens_during: OwnTokens = field(default_factory=OwnTokens)
    # The same for our pinned probes, per DP rank they are pinned to (a share of own_tokens).
    own_rank_tokens: tuple[RankTokens, ...] = ()
    own_rank_tokens_during: tuple[RankTokens, ...] = ()

    def units_of(self, role: Role) -> tuple[UnitState, ...]:
        """The unit states of every worker of `role` (empty when systemd was not observed)."""
        return tuple(u for u in self.units if u.role == role)

    def loads_of(self, role: Role, worker: int) -> LoadsSnapshot | None:
        """The /v1/loads answer of one worker of `role`, if fetched this cycle."""
        return next((x for x in self.loads if x.role == role and x.worker == worker), None)

    def metrics_for(self, role: Role) -> MetricsSnapshot | None:
        """The scrape of `role` (its first worker), if one was attempted this cycle."""
        return next((m for m in self.metrics if m.role == role), None)

    def unit_of(self, role: Role, worker: int) -> UnitState | None:
        """The unit state of one worker of `role`, if systemd was observed this cycle."""
        return next((u for u in self.units if u.role == role and u.worker == worker), None)

    def health_for(self, target: str) -> ProbeResult | None:
        """The health (worker) or readiness (router) check of `target`."""
        return next((h for h in self.health if h.target == target), None)

    def own_aborts_for(self, role: Role) -> int:
        """How many aborts the watchdog itself sent to `role` since the previous observation."""
        return sum(c.count for c in self.own_aborts if c.role == role)


def worker_name(role: Role | str, worker: int, count: int) -> str:
    """How reports name one worker: the role alone, or `prefill#2` (1-based) among several."""
    return f"{role}#{worker + 1}" if count > 1 else str(role)


@dataclass(frozen=True, slots=True, order=True)
class Worker:
    """One process of a group: its role and its index among that role's workers (config order).

    `name` is how people read it (`prefill#2`, or `prefill` alone in a 1P1D group), `slug` the
    same for file names (`prefill-2`).
    """

    role: Role
    index: int
    name: str

    @property
    def slug(self) -> str:
        """The name, safe in a file name."""
        return self.name.replace("#", "-")


def counter_increase(previous: float | None, current: float | None) -> float:
    """How much a counter grew, treating a drop as a reset to zero (as Prometheus rate() does)."""
    if previous is None or current is None:
        return 0.0
    if current < previous:
        return current
    return current - previous


class State(StrEnum):
    """Per-group states (docs/architecture.md, "States of a group")."""

    WARMING = "warming"
    HEALTHY = "healthy"
    OVERLOADED = "overloaded"
    DEGRADED = "degraded"
    STALLED = "stalled"
    RESTARTING = "restarting"
    VERIFYING = "verifying"
    HELD = "held"
    PAUSED = "paused"


class Action(StrEnum):
    """What the daemon should do about a decision."""

    NONE = "none"
    ALERT = "alert"
    CO_RESTART = "co_restart"


@dataclass(frozen=True, slots=True)
class Reason:
    """One machine-readable reason with the numbers behind it."""

    code: str
    message: str
    values: tuple[tuple[str, float | str], ...] = ()


@dataclass(frozen=True, slots=True)
class RestartStep:
    """One unit of a co-restart plan and how its readiness is checked."""

    role: Role
    unit: str
    ready_url: str  # worker /health or router /readiness
    ready_timeout_seconds: float
    # Router only: worker URLs that must be listed (and healthy) in its GET /workers before the
    # step counts as ready; /readiness alone is 200 as soon as one worker per side is healthy.
    expect_workers: tuple[str, ...] = ()
    # The (host, port) pairs the unit's process listens on (its URL's port, a prefill's
    # bootstrap port): they must be free, and the unit's old processes gone, before it starts.
    ports: tuple[tuple[str, int], ...] = ()
    clear_timeout_seconds: float = 60.0


class Rung(StrEnum):
    """How much of a group a restart covers (README "Restart rungs")."""

    FULL = "full"  # every prefill, then every decode, then the router
    ROUTER = "router"  # the router alone: it holds no KV bootstrap state
    # The workers whose state about a worker restarted alone is stale, in the fixed order: for a
    # prefill restarted alone, the decodes that pair with it, then the router; never that prefill.
    SURVIVOR = "survivor"


# How reports and logs name what each rung does.
RUNG_ACTIONS = {
    Rung.FULL: "co-restart",
    Rung.ROUTER: "router-only restart",
    Rung.SURVIVOR: "survivor restart",
}


@dataclass(frozen=True, slots=True)
class RestartPlan:
    """The exact sequence of a co-restart; only ever built from a group's validated order."""

    group: str
    trigger: str  # verdict or "manual"
    steps: tuple[RestartStep, ...]
    rung: Rung = Rung.FULL
    why: str = ""  # why this rung (shown by `watchdog plan` and in the restart log)


@dataclass(frozen=True, slots=True)
class StepResult:
    """How one step of a restart sequence went."""

    role: Role
    unit: str
    ok: bool
    # "stop_job", "start_job", "active", "ready", "dry_run", "not_started", "interrupted"
    # ("restart_job" in histories written before the stop/clear/start sequence)
    phase: str
    detail: str = ""
    started_at: float = 0.0
    finished_at: float = 0.0
    # How the wait between stop and start went: the old processes gone and the ports free
    # ("clear after 0.4 s"), or what was still there at the deadline when it started anyway.
    clear: str = ""


@dataclass(frozen=True, slots=True)
class RestartOutcome:
    """The result of executing a RestartPlan."""

    plan: RestartPlan
    ok: bool
    dry_run: bool
    steps: tuple[StepResult, ...]
    started_at: float
    finished_at: float
    interrupted: bool = False  # shutdown arrived mid-sequence
    # Why no step was started, when the sequence was refused before its first step (e.g.
    # "host_unreachable"): nothing was restarted, so it is not charged to the restart budget.
    refused: str = ""

    @property
    def failed_step(self) -> StepResult | None:
        """The first step that did not succeed, if any."""
        return next((s for s in self.steps if not s.ok), None)
