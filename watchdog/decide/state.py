"""What the detector remembers about one group between cycles, as small frozen records.

GroupState lives in the daemon's memory only; the restart budget is persisted separately
(statefiles.RestartHistory) and seeds `initial_state` at daemon start. See docs/decisions.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from watchdog.config import GroupSection
from watchdog.decide.verdict import Verdict
from watchdog.model import Action, OwnTokens, RankTokens, Reason, Role, Rung, State

_MAX_BACKOFF_DOUBLINGS = 30  # 2**30 × any sane backoff is "forever"; avoids float overflow


@dataclass(frozen=True, slots=True)
class CounterBaseline:
    """The last known counters of one worker, when it was scraped, and from which process.

    A counter missing from the latest scrape keeps its last known value (None: not yet seen in
    this process); see watchdog/decide/counters.py.
    """

    role: Role
    at: float  # when the scrape was made (its own time, not the end of the cycle)
    start_us: int  # ExecMainStartTimestamp when read; 0 = units not observed
    requests_total: float | None = None  # finished requests: not progress, but attempts
    generation_tokens_total: float | None = None
    realtime_tokens_total: float | None = None
    ttft_count: float | None = None
    aborted_requests_total: float | None = None
    transfer_failed: float | None = None  # max over TP ranks
    bootstrap_failed: float | None = None  # max over TP ranks
    decode_tokens_total: float | None = None  # /v1/loads decode_moments tokens
    loads_at: float | None = None  # when decode_tokens_total was read
    worker: int = 0  # which worker of `role`
    # This process was first read after another one (its unit start time changed): all of its
    # failures are after our last count of the one before, so a failure series first seen in it
    # counts from zero. False for the process found running when we started watching.
    seen_start: bool = False


@dataclass(frozen=True, slots=True)
class ProgressMark:
    """What one decode worker's progress counters added since its mark, and what we did since.

    Progress is judged from the mark on, not per scrape: a decode making a token or two a second
    beyond our own reads as progress within seconds, however short the cycle, because what is ours
    since the mark is what our probes received plus one slack (docs/decisions.md, "Progress").
    The mark moves to a reading that showed progress (a scrape, or /v1/loads alone in a cycle
    whose scrape the cadence skipped), or a full scrape with nothing pending; counters are
    summed step by step (a reset or a missing series adds nothing).
    """

    worker: int
    at: float  # the reading the mark was set at
    generation_tokens_total: float = 0.0
    realtime_tokens_total: float = 0.0
    ttft_count: float = 0.0
    decode_tokens_total: float = 0.0
    own: OwnTokens = field(
        default_factory=OwnTokens
    )  # Progress.own when the observation that set the mark began
    # A mark made in a cycle that did not read one of the worker's two sources (its /metrics
    # skipped at the fetch cadence, or its /v1/loads tokens) is behind that source: the
    # source's next step began before the mark, so it only brings the baseline up to date and
    # adds nothing since the mark (else tokens from before the mark would date progress after
    # it). Cleared by that next reading.
    scraped_behind: bool = False
    live_behind: bool = False


@dataclass(frozen=True, slots=True)
class CounterDecrease:
    """A counter read lower while its process stayed the same: a suspect scrape, not a reset."""

    at: float
    role: Role
    counter: str  # the CounterBaseline field
    before: float
    after: float


@dataclass(frozen=True, slots=True)
class FailureSample:
    """What one cycle's scrape of a worker added to its failure accounting.

    `increase` is the raw growth of its transfer/bootstrap failures; `aborted` (the worker's
    num_aborted_requests_total growth) and `own_aborts` (our aborts of timed-out probes sent to
    it) bound how many of them aborts explain; `finished` is its num_requests_total growth.
    """

    at: float
    role: Role
    increase: float
    aborted: float = 0.0
    own_aborts: float = 0.0
    finished: float = 0.0
    worker: int = 0  # which worker of `role`


@dataclass(frozen=True, slots=True)
class UnitStart:
    """The last ExecMainStartTimestamp seen for the unit of one worker of a role."""

    role: Role
    start_us: int
    worker: int = 0
    n_restarts: int = 0  # NRestarts as last read: it grows only with systemd's own Restart=
    # The latest Result other than "success" read while this process ran: how it ended, where a
    # cycle saw the unit between its end and the next start ("signal", "oom-kill", ...).
    ended: str = ""


@dataclass(frozen=True, slots=True)
class FreshPrefill:
    """A prefill restarted alone: its decodes kept running (docs/decisions.md, "Restart rungs").

    Who restarted it, where systemd tells: NRestarts grows only with the unit's own Restart=
    (a RestartUnit by anyone never adds to it), and `ended` is the Result its old process ended
    with.
    """

    worker: int
    start_us: int  # the new process's ExecMainStartTimestamp
    by_systemd: bool  # NRestarts grew: systemd's Restart= brought it back
    n_restarts: int
    ended: str = ""  # the old process's Result, where read ("" when never seen failing)


@dataclass(frozen=True, slots=True)
class PrefillAtDecodeStart:
    """A prefill's start when a decode's current start was first recorded (0: unknown).

    That decode's start changing while this prefill's is still this one means the prefill was not
    restarted in between: a decode-only restart with respect to that prefill.
    """

    decode: int  # the decode worker
    prefill: int  # the prefill worker
    start_us: int


@dataclass(frozen=True, slots=True)
class RoleSince:
    """Since when a role has been in some condition (unit down, /health failing)."""

    role: Role
    at: float


@dataclass(frozen=True, slots=True)
class WorkerSince:
    """Since when one worker of a role has been in some condition (holding stuck work)."""

    role: Role
    worker: int
    at: float


@dataclass(frozen=True, slots=True)
class ProbeRun:
    """The current run of failed end-to-end probes; `ProbeRun()` is no run at all."""

    failures: int = 0  # consecutive finished completion/multi-round probes that failed
    failing_since: float | None = None  # the cycle the run began
    multiround: int = 0  # how many of those were multi-round
    midstream: int = 0  # how many of those got their first token, then stalled


@dataclass(frozen=True, slots=True)
class PairResult:
    """The latest direct PD probe of one prefill/decode pair (README "Restart rungs")."""

    prefill: int
    decode: int
    ok: bool
    started_at: float
    reason: str = ""  # the ProbeFailure when it failed
    detail: str = ""


@dataclass(frozen=True, slots=True)
class RankRun:
    """The pinned direct PD probes of one DP rank of a decode: the run of failures in a row."""

    decode: int
    dp_rank: int
    failures: int  # consecutive failed pinned probes, 0 after a pass
    started_at: float  # the latest one's start
    detail: str = ""  # the latest failure's detail


@dataclass(frozen=True, slots=True)
class RankBaseline:
    """One DP rank's decode tokens as last known, per source, and from which process."""

    decode: int
    dp_rank: int
    start_us: int  # the decode's ExecMainStartTimestamp when read; 0 = units not observed
    realtime: float | None = None  # realtime_tokens_total{mode="decode",dp_rank=...}
    moments: float | None = None  # its /v1/loads row's decode_moments tokens


@dataclass(frozen=True, slots=True)
class RankMark:
    """What one DP rank's decode tokens added since its mark, and our pinned tokens on it then.

    The rank's own progress mark, read as ProgressMark is for a worker (docs/decisions.md,
    "DP-attention ranks"): it moves to a read whose tokens grew beyond ours on the rank and one
    slack, or one showing the rank idle. `read_at - at` is how long its tokens were flat as last
    read.
    """

    decode: int
    dp_rank: int
    at: float  # the read the mark was set at
    read_at: float  # the latest read of the rank's tokens
    realtime: float = 0.0  # growth since the mark, per source
    moments: float = 0.0
    own: int = 0  # our pinned tokens on the rank when the observation that set the mark began
    work: float | None = None  # running + waiting requests as last read (None: not reported)


@dataclass(frozen=True, slots=True)
class Progress:
    """Progress and failure counters as last read, and the no-progress clock."""

    baselines: tuple[CounterBaseline, ...] = ()
    progress_at: float | None = None  # no-progress clock start: progress, or nothing pending
    advanced_at: float | None = None  # last counter advance or probe success
    metrics_seen_at: float | None = None  # last cycle with both workers scraped
    scrape_failures: int = 0  # consecutive cycles with a failed worker scrape
    failure_samples: tuple[FailureSample, ...] = ()
    handoff_busy_since: float | None = None  # PD hand-off queues not seen empty since
    last_probe_ok_at: float | None = None  # when the newest successful probe finished
    counter_decreases: int = 0  # counters read lower without a new process (ignored), ever
    last_decrease: CounterDecrease | None = None  # the latest of them
    # Workers of a role with several, holding PD hand-off work without completing any of their
    # own since (docs/decisions.md, "Several workers per role").
    stuck_since: tuple[WorkerSince, ...] = ()
    own: OwnTokens = field(
        default_factory=OwnTokens
    )  # every token our probes received, since the daemon started
    marks: tuple[ProgressMark, ...] = ()  # per decode worker
    # Per DP rank of each decode that reports ranks (docs/decisions.md, "DP-attention ranks").
    rank_baselines: tuple[RankBaseline, ...] = ()
    rank_marks: tuple[RankMark, ...] = ()
    own_ranks: tuple[RankTokens, ...] = ()  # our pinned probes' tokens per rank, since start
    # The latest evidence that the group serves: a passing probe's start, decode tokens beyond
    # our own (dated by their scrape), or a decode process first read with such tokens already
    # counted. Never forgotten: never_healthy compares it with the units' starts
    # (docs/decisions.md, "Never healthy").
    served_at: float | None = None

    def restarted(self, now: float) -> Progress:
        """New processes: the flat clock starts now; old failures, queues and marks say nothing."""
        return replace(
            self,
            progress_at=now,
            handoff_busy_since=None,
            failure_samples=(),
            stuck_since=(),
            marks=(),
            rank_marks=(),
        )


@dataclass(frozen=True, slots=True)
class UnitMemory:
    """Unit starts and since when units were down or /health failing; `UnitMemory()`: none seen."""

    starts: tuple[UnitStart, ...] = ()
    down_since: tuple[RoleSince, ...] = ()
    unhealthy_since: tuple[RoleSince, ...] = ()
    # The first of the cycles since the last /health check that repeated it instead
    # (Observation.health_checked); a failure the next check finds is dated from it.
    health_unchecked_since: float | None = None
    decode_only_seen_at: float | None = None  # first seen; cleared when resolved
    # Every prefill's start when each decode's current start was first recorded.
    prefill_starts_at_decode_start: tuple[PrefillAtDecodeStart, ...] = ()
    # Which decodes were restarted while which prefills kept running ("decode#2 (prefill#1)").
    decode_only_workers: tuple[str, ...] = ()
    decode_only_prefills: tuple[int, ...] = ()  # the prefills that kept running
    # Prefills restarted alone while their decodes kept running, until the survivor rung (or a
    # restart of every decode, or a co-restart) resolves them; first seen, and since when every
    # prefill has passed /health again (docs/decisions.md, "Restart rungs").
    prefill_only: tuple[FreshPrefill, ...] = ()
    prefill_only_seen_at: float | None = None
    prefill_only_ready_at: float | None = None
    # The earliest unit start (seconds) that no evidence of serving has followed: the group has
    # not once served since (docs/decisions.md, "Never healthy"). None: it served since every
    # start it knows of, or no start is known (units not observed).
    unserved_since: float | None = None


@dataclass(frozen=True, slots=True)
class Readiness:
    """Warm-up and post-restart verification."""

    warming_since: float | None = None
    verify_started_at: float | None = None
    verify_successes: int = 0  # consecutive probe successes (counted in every state)
    # The soak (docs/decisions.md, "Verification is a soak"): when verify_probes successes in a
    # row first came back, the probes passed and decode tokens counted since verification began.
    recovered_at: float | None = None
    soak_passes: int = 0
    soak_decode_tokens: float = 0.0


@dataclass(frozen=True, slots=True)
class Budget:
    """The restart budget, the streak of failed attempts and its backoff, and the hold."""

    restart_times: tuple[float, ...] = ()
    consecutive_failures: int = 0
    backoff_until: float = 0.0
    backoff_base_seconds: float = 0.0  # backoff_seconds at the last attempt (for after_restart)
    left_after_attempt: int = 0  # restarts left in the window right after the last attempt
    stall_verdict: Verdict | None = None  # what made the group stalled / the last attempt's trigger
    held_since: float | None = None
    held_reason: str = ""
    # A partial rung (the router alone, the survivors of a prefill restarted alone) was tried in
    # this streak: the next action is the full co-restart.
    partial_tried: bool = False

    def failed_attempt(
        self, backoff_seconds: float, measured_from: float | None, *, keep_longer: bool = False
    ) -> Budget:
        """Count one more failed attempt and back off `backoff_seconds * 2**(n-1)` from a time.

        `measured_from` None leaves the backoff as it is; `keep_longer` never shortens a backoff
        already running (needed when measuring from the past, e.g. our last restart).
        """
        attempts = self.consecutive_failures + 1
        until = self.backoff_until
        if measured_from is not None:
            until = measured_from + backoff_for(backoff_seconds, attempts)
            if keep_longer:
                until = max(self.backoff_until, until)
        return replace(self, consecutive_failures=attempts, backoff_until=until)

    def recovered(self) -> Budget:
        """The streak is over: no failed attempts, no backoff, no trigger.

        Only a passed verification and an operator's re-arm end it: progress without our help
        (overload easing, a blip passing) leaves the backoff and the count as they are.
        """
        return replace(
            self,
            consecutive_failures=0,
            backoff_until=0.0,
            stall_verdict=None,
            partial_tried=False,
        )


@dataclass(frozen=True, slots=True)
class GroupState:
    """Everything the detector remembers about one group between cycles (in memory only)."""

    state: State
    since: float  # when `state` was entered
    verdict: Verdict = Verdict.WARMING_UP  # the previous decision's verdict
    alerted: tuple[Verdict, ...] = ()  # alerts already sent in the current episode
    probes: ProbeRun = ProbeRun()
    progress: Progress = Progress()
    units: UnitMemory = UnitMemory()
    readiness: Readiness = Readiness()
    budget: Budget = Budget()
    direct: tuple[PairResult, ...] = ()  # the latest direct PD probe of each pair
    ranks: tuple[RankRun, ...] = ()  # the pinned probes of each DP rank (decide/ranks.py)

    def budget_remaining(self, config: GroupSection, now: float) -> int:
        """Co-restarts still allowed in the budget window ending at `now`."""
        if self.state is State.HELD:
            return 0
        used = len(in_window(self.budget.restart_times, config.restart.budget_window_seconds, now))
        return max(0, config.restart.max_restarts - used)


@dataclass(frozen=True, slots=True)
class Decision:
    """One cycle's outcome: the next state, what was concluded, why, and what to do."""

    state: GroupState
    verdict: Verdict
    action: Action
    reasons: tuple[Reason, ...]
    rung: Rung = Rung.FULL  # what a co_restart covers
    # Rung survivor: the prefills restarted alone; the plan restarts their decodes, then the router.
    fresh_prefills: tuple[int, ...] = ()


def in_window(times: Iterable[float], window_seconds: float, now: float) -> tuple[float, ...]:
    """The times inside the window of `window_seconds` ending at `now`."""
    # Inclusive lower edge: then no closed window of that length ever holds more than the budget.
    return tuple(t for t in times if now - window_seconds <= t <= now)


def backoff_for(base: float, failures: int) -> float:
    """The wait after `failures` consecutive failed attempts: base × 2**(failures-1), capped."""
    return float(base * 2 ** min(max(failures - 1, 0), _MAX_BACKOFF_DOUBLINGS))


def forget_old_processes(mem: GroupState, now: float) -> GroupState:
    """New processes: their probe run, flat clock and failures start afresh, and so do alerts."""
    return replace(
        mem,
        probes=ProbeRun(),
        progress=mem.progress.restarted(now),
        alerted=(),
        direct=(),
        ranks=(),
    )


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
        backoff_until = max(restart_times) + backoff_for(backoff_seconds, consecutive_failures)
    budget = Budget(
        restart_times=tuple(sorted(restart_times)),
        consecutive_failures=consecutive_failures,
        backoff_until=backoff_until,
    )
    if held:
        return GroupState(
            state=State.HELD,
            since=now,
            verdict=Verdict.HELD,
            budget=replace(
                budget,
                held_since=now if held_since is None else held_since,
                held_reason="held before the watchdog started",
            ),
        )
    return GroupState(
        state=State.WARMING, since=now, readiness=Readiness(warming_since=now), budget=budget
    )


def by_role(items: Iterable[RoleSince]) -> dict[Role, float]:
    """RoleSince records as a mapping."""
    return {item.role: item.at for item in items}


def role_items(mapping: dict[Role, float]) -> tuple[RoleSince, ...]:
    """A mapping as RoleSince records, in Role order."""
    return tuple(RoleSince(role, mapping[role]) for role in Role if role in mapping)
