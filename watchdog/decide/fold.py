"""Fold one observation into the detector's memory, and say what it shows (docs/decisions.md).

Counters, probes, units and health are remembered in GroupState; what only matters this cycle
goes to Facts. Where a role has several workers, counters and unit starts are kept per worker and
the group is judged as a whole: a role is as down or unhealthy as its worst worker, its progress
is any worker's, its failures the sum of its workers' (docs/decisions.md, "Several workers").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from watchdog.config import GroupSection
from watchdog.decide.counters import CounterStep, readable, step
from watchdog.decide.rank_progress import RankFold, fold_rank_progress
from watchdog.decide.ranks import fold_ranks
from watchdog.decide.state import (
    CounterBaseline,
    CounterDecrease,
    FailureSample,
    FreshPrefill,
    GroupState,
    PairResult,
    PrefillAtDecodeStart,
    ProbeRun,
    Progress,
    ProgressMark,
    RoleSince,
    UnitMemory,
    UnitStart,
    WorkerSince,
    by_role,
    role_items,
)
from watchdog.model import (
    LoadsSnapshot,
    MetricsSnapshot,
    Observation,
    OperatorControls,
    OwnTokens,
    ProbeFailure,
    ProbeKind,
    ProbeResult,
    Role,
    ScrapeFailure,
    UnitState,
    worker_name,
)

Worker = tuple[Role, int]  # a role and the index of one of its workers

WORKER_ROLES = (Role.PREFILL, Role.DECODE)  # the SGLang servers; the router is not a worker
RUNNING_UNIT_STATES = frozenset({"active", "reloading"})
_END_TO_END = frozenset({ProbeKind.COMPLETION, ProbeKind.MULTIROUND})
_PROBE_UNREACHABLE = frozenset({ProbeFailure.CONNECT_REFUSED, ProbeFailure.CONNECT_ERROR})
_HEALTH_UNREACHABLE = _PROBE_UNREACHABLE | {ProbeFailure.TIMEOUT}
_SCRAPE_UNREACHABLE = frozenset(
    {ScrapeFailure.CONNECT_REFUSED, ScrapeFailure.CONNECT_ERROR, ScrapeFailure.TIMEOUT}
)


@dataclass(frozen=True, slots=True)
class Facts:
    """What this cycle's observation says, once combined with memory (not remembered)."""

    oldest_probe_seconds: float
    probe_ok_now: bool
    health: Mapping[Role, bool]  # workers whose /health was checked this cycle
    metrics_fresh: bool  # both workers scraped this cycle
    pending: tuple[tuple[str, float | str], ...]  # why work counts as pending (empty: none seen)
    nothing_reached: bool
    restarted: frozenset[
        Role
    ]  # unit start timestamp changed (not counting decode- or prefill-only)
    decode_only_new: bool
    decode_only_cancelled: bool
    prefill_only_new: bool  # a prefill restarted alone was first seen this cycle
    units: Mapping[Role, UnitState]  # readable units this cycle (a role's worst worker)
    stopped: tuple[Role, ...]
    operator: OperatorControls  # maintenance lease and re-arm
    # Each decode's SGLang version, where its /v1/loads answered this cycle (0.5.23+).
    decode_versions: Mapping[int, str] = field(default_factory=dict)

    @property
    def workers_healthy(self) -> bool:
        """Both workers answered /health this cycle."""
        return all(self.health.get(role) is True for role in WORKER_ROLES)

    @property
    def workers_failing(self) -> tuple[Role, ...]:
        """Workers whose /health was checked and failed this cycle."""
        return tuple(role for role in WORKER_ROLES if self.health.get(role) is False)


@dataclass(frozen=True, slots=True)
class _UnitFold:
    starts: dict[Worker, int]
    restarted: frozenset[Role]
    decode_only_seen_at: float | None
    decode_only_new: bool
    decode_only_cancelled: bool
    prefill_starts_at_decode_start: tuple[PrefillAtDecodeStart, ...]
    decode_only_workers: tuple[str, ...]
    decode_only_prefills: tuple[int, ...]
    prefill_only: _PrefillOnlyFold


@dataclass(frozen=True, slots=True)
class _PrefillOnlyFold:
    fresh: tuple[FreshPrefill, ...]  # prefills restarted alone, not yet resolved
    seen_at: float | None
    new: bool  # a prefill restarted alone was first seen this cycle


_NO_PREFILL_ONLY = _PrefillOnlyFold((), None, new=False)
# Results that say nothing about how a process ended ("" where Result was not read).
_UNREMARKABLE_RESULTS = frozenset({"", "success"})


def _prefill_restarted_since(
    prefill_now: int, remembered: int, decode_before: int, now: float, settle_seconds: float
) -> bool:
    """Whether prefill was restarted as part of the restart that brought decode's new start.

    Prefill's start is compared with the one it had when decode's previous start was recorded,
    not with that start itself: processes started together may have come up in either order.
    Only when that is unknown is the previous decode start the reference. A prefill restart that
    ended longer than `settle_seconds` ago was its own affair, not part of this one.
    """
    restarted = prefill_now != remembered if remembered else prefill_now > decode_before
    return restarted and now - prefill_now / 1e6 < settle_seconds


def _prefills_kept_running(
    decode: int,
    prefill_now: Mapping[int, int],
    remembered: Mapping[tuple[int, int], int],
    *,
    decode_was_us: int,
    now: float,
    settle_seconds: float,
) -> list[int]:
    """The prefills not restarted since `decode`'s previous start: a decode restarted now is a
    decode-only restart with respect to each of them."""
    return [
        j
        for j in sorted(prefill_now)
        if not _prefill_restarted_since(
            prefill_now[j], remembered.get((decode, j), 0), decode_was_us, now, settle_seconds
        )
    ]


@dataclass(frozen=True, slots=True)
class _DecodeOnlyEpisode:
    new: bool  # a decode-only restart first seen this cycle
    seen_at: float | None  # when the pending one was first seen (None: none pending)
    cancelled: bool  # every prefill that kept running was restarted too, within the grace
    workers: tuple[str, ...]  # the decodes restarted alone, named with their prefills
    kept_prefills: tuple[int, ...]  # the prefills that kept running


def _decode_only_episode(
    state: GroupState,
    starts: Mapping[Worker, int],
    changed: set[Worker],
    prefill_now: Mapping[int, int],
    *,
    decode_only: Sequence[str],
    kept_running: set[int],
    now: float,
    quiet: bool,
) -> _DecodeOnlyEpisode:
    """This cycle's decode-only restarts folded into the pending episode: new, still pending,
    resolved by an operator restarting every prefill that kept running, or absorbed (quiet)."""
    decode_only_new = bool(decode_only)
    seen_at = state.units.decode_only_seen_at
    workers = tuple(decode_only) or state.units.decode_only_workers
    kept_prefills = tuple(sorted(kept_running)) or state.units.decode_only_prefills
    newest_decode = max((v for (r, _), v in starts.items() if r is Role.DECODE), default=0)
    # Resolved once every prefill that kept running has been restarted since.
    prefills_after = all(prefill_now.get(j, 0) > newest_decode for j in kept_prefills)
    if quiet:
        return _DecodeOnlyEpisode(decode_only_new, None, False, (), ())
    if (
        any(r is Role.PREFILL for r, _ in changed)
        and prefills_after
        and (seen_at is not None or decode_only_new)
    ):
        # The operator restarted every prefill too, within the grace window.
        return _DecodeOnlyEpisode(False, None, True, (), ())
    if decode_only_new and seen_at is None:
        seen_at = now
    return _DecodeOnlyEpisode(decode_only_new, seen_at, False, workers, kept_prefills)


def _changed_starts(
    state: GroupState, units: Mapping[Worker, UnitState]
) -> tuple[dict[Worker, int], dict[Worker, int], set[Worker]]:
    """(the starts known before, the starts now, the workers whose start changed)."""
    previous = {(u.role, u.worker): u.start_us for u in state.units.starts}
    starts = dict(previous)
    changed: set[Worker] = set()
    for key, unit in units.items():
        if unit.exec_main_start_us <= 0:
            continue
        if key in previous and previous[key] != unit.exec_main_start_us:
            changed.add(key)
        starts[key] = unit.exec_main_start_us
    return previous, starts, changed


def _decodes_restarted_alone(  # noqa: PLR0917  # the fold's working state, passed as it stands
    config: GroupSection,
    previous: Mapping[Worker, int],
    starts: dict[Worker, int],
    changed: set[Worker],
    prefill_now: Mapping[int, int],
    remembered: Mapping[tuple[int, int], int],
    *,
    now: float,
    quiet: bool,
) -> tuple[list[str], set[int]]:
    """Each decode whose start changed while a prefill it pairs with kept running, named with
    those prefills, and the prefills that kept running. A decode whose prefills cannot all be
    read yet is put back (its new start unrecorded) to be judged when they can."""
    prefills = len(config.workers(Role.PREFILL))
    decodes = len(config.workers(Role.DECODE))
    decode_only: list[str] = []
    kept_running: set[int] = set()
    for d in range(decodes):
        key = (Role.DECODE, d)
        if key not in changed or quiet:
            continue
        if any(prefill_now.get(j, 0) <= 0 for j in range(prefills)):
            # Cannot tell whether prefill was restarted first: judge when prefill is readable.
            starts[key] = previous[key]
            changed.discard(key)
            continue
        kept = _prefills_kept_running(
            d,
            prefill_now,
            remembered,
            decode_was_us=previous[key],
            now=now,
            settle_seconds=config.stall.startup_timeout_seconds,
        )
        if kept:
            names = ", ".join(worker_name(Role.PREFILL, j, prefills) for j in kept)
            decode_only.append(f"{worker_name(Role.DECODE, d, decodes)} ({names})")
            kept_running.update(kept)
    return decode_only, kept_running


def _fold_unit_starts(
    state: GroupState,
    units: Mapping[Worker, UnitState],
    config: GroupSection,
    now: float,
    *,
    quiet: bool,
) -> _UnitFold:
    """External and decode-only restarts, from changes of ExecMainStartTimestamp.

    A decode whose start changed while any prefill of the group was not restarted with it is a
    decode-only restart with respect to that prefill.
    """
    prefills = len(config.workers(Role.PREFILL))
    decodes = len(config.workers(Role.DECODE))
    previous, starts, changed = _changed_starts(state, units)
    prefill_now = {
        j: units[Role.PREFILL, j].exec_main_start_us
        for j in range(prefills)
        if (Role.PREFILL, j) in units
    }
    remembered = {
        (p.decode, p.prefill): p.start_us for p in state.units.prefill_starts_at_decode_start
    }
    decode_only, kept_running = _decodes_restarted_alone(
        config,
        previous,
        starts,
        changed,
        prefill_now,
        remembered,
        now=now,
        quiet=quiet,
    )
    for d in range(decodes):
        key = (Role.DECODE, d)
        if key in starts and starts[key] != previous.get(key):
            # decode's start (re)recorded: remember every prefill's
            for j in range(prefills):
                remembered[d, j] = max(prefill_now.get(j, 0), 0)
    episode = _decode_only_episode(
        state,
        starts,
        changed,
        prefill_now,
        decode_only=decode_only,
        kept_running=kept_running,
        now=now,
        quiet=quiet,
    )
    decode_only_new, seen_at, cancelled = episode.new, episode.seen_at, episode.cancelled
    workers, kept_prefills = episode.workers, episode.kept_prefills
    prefill_only = _fold_prefill_only(
        state,
        units,
        config,
        now,
        changed=changed,
        previous=previous,
        starts=starts,
        quiet=quiet,
        decode_only=decode_only_new or seen_at is not None or cancelled,
    )
    roles = {role for role, _ in changed}
    if decode_only_new:
        roles.discard(Role.DECODE)
    if prefill_only.new:
        roles.discard(Role.PREFILL)
    pairs = tuple(PrefillAtDecodeStart(d, j, start) for (d, j), start in sorted(remembered.items()))
    return _UnitFold(
        starts,
        frozenset(roles),
        seen_at,
        decode_only_new,
        cancelled,
        pairs,
        workers,
        kept_prefills,
        prefill_only,
    )


def _fold_prefill_only(
    state: GroupState,
    units: Mapping[Worker, UnitState],
    config: GroupSection,
    now: float,
    *,
    changed: set[Worker],
    previous: Mapping[Worker, int],
    starts: dict[Worker, int],
    quiet: bool,
    decode_only: bool,
) -> _PrefillOnlyFold:
    """Prefills restarted alone: a start changed while every decode kept its own.

    Judged in the first cycle that reads the new start, so the survivor rung can follow as soon
    as the fresh prefill serves (docs/decisions.md, "Restart rungs"). Every decode pairs with
    every prefill (watchdog/pairs.py), so no decode's start may have changed: one that did makes
    it an ordinary restart, or a decode-only one, judged as before. Resolved once every decode
    has started after every fresh prefill (an operator restarting in order by hand). Our own
    restart (`quiet`) and a pending decode-only restart are not judged here: the first restarts
    everything it needs, the second ends in the full co-restart or an alert.
    """
    if quiet:
        return _NO_PREFILL_ONLY
    memory = state.units
    decode_starts = [
        units[Role.DECODE, d].exec_main_start_us if (Role.DECODE, d) in units else 0
        for d in range(len(config.workers(Role.DECODE)))
    ]
    fresh = list(memory.prefill_only)
    if fresh and all(start > max(f.start_us for f in fresh) for start in decode_starts):
        fresh = []  # every decode started after the fresh prefills: they pair again
    prefills = sorted(j for role, j in changed if role is Role.PREFILL)
    new: list[FreshPrefill] = []
    if prefills and not decode_only and not any(role is Role.DECODE for role, _ in changed):
        if any(start <= 0 for start in decode_starts):
            # Cannot tell whether the decodes were restarted too: judge when they are readable.
            for j in prefills:
                starts[Role.PREFILL, j] = previous[Role.PREFILL, j]
                changed.discard((Role.PREFILL, j))
        else:
            before = {(u.role, u.worker): u for u in memory.starts}
            new = [
                _fresh_prefill(units[Role.PREFILL, j], before.get((Role.PREFILL, j)))
                for j in prefills
            ]
    if new:
        renewed = {f.worker for f in new}
        fresh = [f for f in fresh if f.worker not in renewed] + new
    if not fresh:
        return _NO_PREFILL_ONLY
    seen_at = memory.prefill_only_seen_at if memory.prefill_only_seen_at is not None else now
    return _PrefillOnlyFold(tuple(sorted(fresh, key=lambda f: f.worker)), seen_at, new=bool(new))


def _fresh_prefill(unit: UnitState, before: UnitStart | None) -> FreshPrefill:
    """A prefill restarted alone, with who restarted it where systemd tells.

    NRestarts grows only with the unit's own Restart= (a RestartUnit by anyone never adds to
    it). The old process's Result is read where a cycle saw it ended, or from the unit now where
    systemd still shows it.
    """
    ended = unit.result if unit.result not in _UNREMARKABLE_RESULTS else ""
    if not ended and before is not None:
        ended = before.ended
    return FreshPrefill(
        worker=unit.worker,
        start_us=unit.exec_main_start_us,
        by_systemd=before is not None and unit.n_restarts > before.n_restarts,
        n_restarts=unit.n_restarts,
        ended=ended,
    )


def _unit_starts(
    state: GroupState, units: Mapping[Worker, UnitState], starts: Mapping[Worker, int]
) -> tuple[UnitStart, ...]:
    """Every worker's start as judged, with its NRestarts and how its process ended, if seen."""
    before = {(u.role, u.worker): u for u in state.units.starts}
    out = []
    for role, worker in _in_order(starts):
        start = starts[role, worker]
        unit = units.get((role, worker))
        old = before.get((role, worker))
        n_restarts = unit.n_restarts if unit is not None else old.n_restarts if old else 0
        ended = old.ended if old is not None and old.start_us == start else ""
        if (
            unit is not None
            and unit.exec_main_start_us == start
            and unit.active_state not in RUNNING_UNIT_STATES
            and unit.result not in _UNREMARKABLE_RESULTS
        ):
            ended = unit.result  # the process of this start has ended, and systemd says how
        out.append(UnitStart(role, start, worker, n_restarts, ended))
    return tuple(out)


def _unserved_since(
    previous: float | None, starts: Iterable[int], served_at: float | None
) -> float | None:
    """The earliest unit start that no evidence of serving has followed (None: none).

    The earliest, not the latest: a unit that crash-loops moves its own start every few
    seconds, and the group has not served since the first of them (docs/decisions.md, "Never
    healthy"). Evidence dated at a start's very moment is not taken as the new process's.
    """
    unserved = [
        start_us / 1e6
        for start_us in starts
        if start_us > 0 and (served_at is None or start_us / 1e6 >= served_at)
    ]
    if previous is not None and (served_at is None or previous >= served_at):
        unserved.append(previous)
    return min(unserved, default=None)


def _worst_units(units: Mapping[Worker, UnitState]) -> dict[Role, UnitState]:
    """One unit state per role: its first worker not running, else its youngest process."""
    out: dict[Role, UnitState] = {}
    for (role, _), unit in units.items():
        held = out.get(role)
        if held is None or (
            held.active_state in RUNNING_UNIT_STATES
            and (
                unit.active_state not in RUNNING_UNIT_STATES
                or unit.exec_main_start_us > held.exec_main_start_us
            )
        ):
            out[role] = unit
    return out


def _fold_down(
    state: GroupState, units: Mapping[Role, UnitState], now: float
) -> tuple[dict[Role, float], tuple[Role, ...]]:
    """Units down since (failed, or coming back after failing) and units stopped on purpose."""
    down = by_role(state.units.down_since)
    for role, unit in units.items():
        if unit.active_state == "failed":
            down.setdefault(role, now)
        elif unit.active_state in RUNNING_UNIT_STATES or unit.active_state == "inactive":
            down.pop(role, None)
        # activating/deactivating: a unit coming back after failing is still down.
    stopped = tuple(r for r in Role if r in units and units[r].active_state == "inactive")
    return down, stopped


def _fold_health(
    state: GroupState, obs: Observation, now: float
) -> tuple[dict[Role, bool], dict[Role, float]]:
    """Each worker role's /health this cycle, and since when each failing one has failed.

    A failure found after cycles that repeated the last (passing) checks instead of fetching
    them is dated from the first such cycle: it may have begun there, and the hung-worker clock
    must never start later than checking every cycle would have started it.
    """
    health: dict[Role, bool] = {}
    unhealthy = by_role(state.units.unhealthy_since)
    since = now
    if obs.health_checked and state.units.health_unchecked_since is not None:
        since = min(now, state.units.health_unchecked_since)
    for role in WORKER_ROLES:
        checks = [h for h in obs.health if h.target == role.value]
        if not checks:
            continue
        health[role] = all(check.ok for check in checks)  # any worker failing fails the role
        if health[role]:
            unhealthy.pop(role, None)
        else:
            unhealthy.setdefault(role, since)
    return health, unhealthy


def _health_unchecked_since(state: GroupState, obs: Observation, now: float) -> float | None:
    """The first cycle since the last /health check that repeated it (None: checked now)."""
    if obs.health_checked:
        return None
    before = state.units.health_unchecked_since
    return now if before is None else before


def _fold_probes(state: GroupState, finished: Sequence[ProbeResult], now: float) -> GroupState:
    """Consecutive failures (and verification successes) over the probes finished, in order."""
    failing_since = state.probes.failing_since
    failures = state.probes.failures
    multiround = state.probes.multiround
    midstream = state.probes.midstream
    last_ok = state.progress.last_probe_ok_at
    successes = state.readiness.verify_successes
    verifying = state.readiness.verify_started_at is not None
    soak_passes = state.readiness.soak_passes
    for probe in finished:
        if probe.ok:
            failures = 0
            failing_since = None
            multiround = 0
            midstream = 0
            successes += 1
            soak_passes += verifying
            end = probe.started_at + probe.duration_seconds
            last_ok = end if last_ok is None else max(last_ok, end)
        else:
            failures += 1
            failing_since = now if failing_since is None else failing_since
            multiround += probe.kind is ProbeKind.MULTIROUND
            midstream += probe.reason is ProbeFailure.STALLED_MIDSTREAM
            successes = 0
    return replace(
        state,
        probes=ProbeRun(failures, failing_since, multiround, midstream),
        progress=replace(state.progress, last_probe_ok_at=last_ok),
        readiness=replace(state.readiness, verify_successes=successes, soak_passes=soak_passes),
    )


def _fold_direct(state: GroupState, probes: Iterable[ProbeResult]) -> tuple[PairResult, ...]:
    """The latest direct PD probe of each pair, newer results replacing older ones.

    A direct probe that raised inside the watchdog says nothing about the pair: left out.
    """
    latest = {(r.prefill, r.decode): r for r in state.direct}
    for probe in probes:
        if (
            probe.kind is not ProbeKind.DIRECT
            or probe.reason is ProbeFailure.INTERNAL_ERROR
            or probe.dp_rank is not None  # a pinned probe judges its rank (decide/ranks.py)
        ):
            continue
        key = (probe.peer, probe.worker)
        known = latest.get(key)
        if known is None or probe.started_at >= known.started_at:
            failed = "" if probe.ok else str(probe.reason)
            latest[key] = PairResult(
                probe.peer, probe.worker, probe.ok, probe.started_at, failed, probe.detail
            )
    return tuple(latest[key] for key in sorted(latest))


# What decode may count beyond our probes' received tokens without any request progressing:
# slack, once per mark (not per observation), for the tokens decode counts a moment before they
# reach us. Health checks add nothing: decode's fake health request finishes in the prebuilt step,
# and the per-iteration counters move only in the decode step
# (managers/scheduler_components/batch_result_processor.py:117-140, :983-1108 and
# metrics_reporter.py:901-915 @ 0.5.23; scheduler_output_processor_mixin.py:86-103, :533-538 @
# 0.5.9, the first release with realtime_tokens_total); checked on real 0.5.23 by
# tests/conformance (docs/decisions.md, "Progress").
TOKENS_SLACK = 2.0


@dataclass(frozen=True, slots=True)
class Ours:
    """What we can prove is ours in one decode worker's counters since its progress mark."""

    iteration_tokens: float  # realtime_tokens_total, /v1/loads decode_moments: received + slack
    first_tokens: float  # the TTFT count: our streams' first tokens (health checks not counted)
    finished_tokens: float  # generation_tokens_total: tokens of our probes that finished


def ours(mark: ProgressMark, own_now: OwnTokens) -> Ours:
    """The one account of what is ours, from the mark to a scrape.

    `own_now` is every token our probes received through the end of the observation that made
    the scrape; the mark holds the count from the start of the observation that set it. So our
    tokens received while either observation's fetches ran are counted whether or not the scrape
    saw them: a token is never taken for someone else's because it reached us after a scrape.
    Those counts are exact (watchdog/observe/probes/tally.py), never max_tokens per probe: an
    upper bound charged at every observation read a slow but serving decode as flat.
    """
    probes = own_now - mark.own
    return Ours(
        iteration_tokens=probes.received + TOKENS_SLACK,
        first_tokens=float(probes.first),
        finished_tokens=float(probes.finished),
    )


def _decode_advanced(
    mark: ProgressMark, own: Ours, *, per_iteration: bool, stalled_mid_stream: bool
) -> bool:
    """Decode delivered tokens since its mark beyond what our probes received.

    Finished-request counts are not progress: on 0.5.23 aborts, PD failures and the waiting
    timeout finish requests too (docs/sglang.md §7.3). Token counts and the TTFT count are.

    Counters that move when a request finishes (generation_tokens_total) or is first served
    (the TTFT count) say nothing once our own probes stalled mid-stream: a decode that stops
    after a few tokens still hands every new request its first token, and each request aborted
    or timed out then adds its few tokens at finish. Only the per-iteration counters tell
    progress then, where the version has one (realtime_tokens_total from 0.5.9, /v1/loads
    decode_moments on 0.5.23); without them the others stay the only signal, and are read.
    """
    finished_counts = not (stalled_mid_stream and per_iteration)
    return (
        (finished_counts and mark.generation_tokens_total > own.finished_tokens)
        or mark.realtime_tokens_total > own.iteration_tokens
        or (finished_counts and mark.ttft_count > own.first_tokens)
        or mark.decode_tokens_total > own.iteration_tokens
    )


def _new_mark(worker: int, at: float, own: OwnTokens, *, scraped: bool, live: bool) -> ProgressMark:
    """A mark at a reading made at `at`, with our tokens as of the start of its observation;
    behind each source (scrape, /v1/loads tokens) this cycle did not read."""
    return ProgressMark(worker, at, own=own, scraped_behind=not scraped, live_behind=not live)


def _moved_mark(
    mark: ProgressMark, steps: Mapping[str, CounterStep], *, scraped: bool, live: bool
) -> ProgressMark:
    """The mark with this reading's counter steps added, but none of a source the mark is
    behind: that step began before the mark (`scraped`/`live`: which sources were read now)."""

    def since(name: str, *, behind: bool) -> float:
        return 0.0 if behind else steps[name].increase

    old_scrape, old_live = mark.scraped_behind, mark.live_behind
    return replace(
        mark,
        generation_tokens_total=mark.generation_tokens_total
        + since("generation_tokens_total", behind=old_scrape),
        realtime_tokens_total=mark.realtime_tokens_total
        + since("realtime_tokens_total", behind=old_scrape),
        ttft_count=mark.ttft_count + since("ttft_count", behind=old_scrape),
        decode_tokens_total=mark.decode_tokens_total
        + since("decode_tokens_total", behind=old_live),
        scraped_behind=old_scrape and not scraped,
        live_behind=old_live and not live,
    )


# The CounterBaseline fields read from a worker's scrape (decode_tokens_total comes from /v1/loads).
_SCRAPED_COUNTERS = (
    "requests_total",
    "generation_tokens_total",
    "realtime_tokens_total",
    "ttft_count",
    "aborted_requests_total",
    "transfer_failed",
    "bootstrap_failed",
)
# Failure evidence: a series first seen in a process counts from zero only where we saw that
# process start (decide/counters.py). Every other counter only argues against acting.
_FAILURE_COUNTERS = frozenset({"transfer_failed", "bootstrap_failed"})


def _scraped(snap: MetricsSnapshot, name: str) -> float | None:
    """A counter as scraped; None where its series was absent (failure counters read 0 then)."""
    if name in snap.absent_counters:
        return None
    value: float | None = getattr(snap, name)
    return value


def _live_decode_tokens(loads: LoadsSnapshot | None) -> float | None:
    return loads.decode_tokens_total if loads is not None and loads.ok else None


def _first_baseline(
    snap: MetricsSnapshot, start_us: int, loads: LoadsSnapshot | None
) -> CounterBaseline:
    """The first scrape of a worker: what it shows is the baseline, nothing is counted."""
    values = {name: readable(_scraped(snap, name)) for name in _SCRAPED_COUNTERS}
    decode_tokens = readable(_live_decode_tokens(loads))
    return CounterBaseline(
        role=snap.role,
        worker=snap.worker,
        at=snap.scraped_at,
        start_us=start_us,
        decode_tokens_total=decode_tokens,
        loads_at=loads.fetched_at if loads is not None and decode_tokens is not None else None,
        seen_start=False,  # found running: its failure series seen later start a baseline
        **values,
    )


@dataclass(frozen=True, slots=True)
class _Read:
    """One scrape of a worker folded into its baseline."""

    baseline: CounterBaseline
    steps: Mapping[str, CounterStep]  # per CounterBaseline counter field
    decreases: tuple[CounterDecrease, ...]


def _read_counters(
    old: CounterBaseline, snap: MetricsSnapshot, start_us: int, loads: LoadsSnapshot | None
) -> _Read:
    """Each counter stepped from its last known value; a drop counts only with a new process."""
    new_process = bool(old.start_us and start_us and old.start_us != start_us)
    seen_start = new_process or old.seen_start
    readings = {name: _scraped(snap, name) for name in _SCRAPED_COUNTERS}
    readings["decode_tokens_total"] = _live_decode_tokens(loads)
    steps = {
        name: step(
            getattr(old, name),
            current,
            new_process=new_process,
            from_zero=seen_start or name not in _FAILURE_COUNTERS,
        )
        for name, current in readings.items()
    }
    decode = steps["decode_tokens_total"]
    loads_at = old.loads_at if not new_process else None
    if loads is not None and readable(readings["decode_tokens_total"]) is not None:
        loads_at = loads.fetched_at
    decreases = _decreases(old, steps, readings, at=snap.scraped_at)
    baseline = CounterBaseline(
        role=snap.role,
        worker=snap.worker,
        at=snap.scraped_at,
        start_us=start_us,
        decode_tokens_total=decode.known,
        loads_at=loads_at,
        seen_start=seen_start,
        **{name: steps[name].known for name in _SCRAPED_COUNTERS},
    )
    return _Read(baseline, steps, decreases)


def _decreases(
    old: CounterBaseline,
    steps: Mapping[str, CounterStep],
    readings: Mapping[str, float | None],
    *,
    at: float,
) -> tuple[CounterDecrease, ...]:
    """The counters of one reading that read lower than `old` in the same process."""
    return tuple(
        CounterDecrease(
            at=at,
            role=old.role,
            counter=name,
            before=float(getattr(old, name)),
            after=float(readings[name] or 0.0),
        )
        for name, counter in steps.items()
        if counter.decreased
    )


@dataclass(frozen=True, slots=True)
class _CounterFold:
    baselines: dict[Worker, CounterBaseline]
    samples: list[FailureSample]
    advanced_at: float | None  # when decode's counters were read showing progress
    decreases: tuple[CounterDecrease, ...]  # counters that went down in the same process
    completed: frozenset[Worker]  # workers read finishing requests beyond failures and aborts
    marks: dict[int, ProgressMark]  # per decode worker
    decode_tokens: float  # what decode's token counters added this cycle, ours included
    live_read: frozenset[int]  # decode workers whose /v1/loads tokens were read this cycle


@dataclass(frozen=True, slots=True)
class _OwnNow:
    """What this observation knows of its own hand, for the counters it read."""

    aborts: Mapping[Role, int]  # aborts we sent, per worker
    tokens: OwnTokens  # every token our probes received, through this observation's end
    tokens_at_start: OwnTokens  # the same when this observation's fetches began
    stalled_mid_stream: bool  # the current run of failed probes has one that stalled mid-stream


def _fold_counters(
    state: GroupState,
    obs: Observation,
    read: Sequence[MetricsSnapshot],
    units: Mapping[Worker, UnitState],
    config: GroupSection,
    *,
    now: float,
    own: _OwnNow,
) -> _CounterFold:
    """New baselines, this cycle's failure samples, and whether decode's counters advanced.

    Each baseline and sample carries its scrape's own time: a cycle stretched by a slow fetch
    must not date counters read at its start to its end.
    """
    baselines = {(b.role, b.worker): b for b in state.progress.baselines}
    marks = {m.worker: m for m in state.progress.marks}
    samples = list(state.progress.failure_samples)
    advanced_at: float | None = None
    decreases: list[CounterDecrease] = []
    completed: set[Worker] = set()
    scraped: set[Role] = set()
    decode_tokens = 0.0
    live_read = _live_read(obs)
    for snap in read:
        key = (snap.role, snap.worker)
        unit = units.get(key)
        old = baselines.get(key)
        start_us = unit.exec_main_start_us if unit is not None else 0
        if start_us <= 0 and old is not None:
            start_us = old.start_us  # unit not readable this cycle: still the process last seen
        # Our aborts went to every worker of a role, but only the one holding the request can
        # count them: the role's count is set against its failures once.
        own_aborts = 0.0 if snap.role in scraped else float(own.aborts.get(snap.role, 0))
        scraped.add(snap.role)
        loads = obs.loads_of(snap.role, snap.worker)
        mark = marks.get(snap.worker) if snap.role is Role.DECODE else None
        live = snap.worker in live_read
        if snap.role is Role.DECODE and (old is None or mark is None):
            marks[snap.worker] = _new_mark(
                snap.worker, snap.scraped_at, own.tokens_at_start, scraped=True, live=live
            )
        if old is None:
            baselines[key] = _first_baseline(snap, start_us, loads)
            samples.extend(_first_aborts(snap, own_aborts))
            continue
        counters = _read_counters(old, snap, start_us, loads)
        steps = counters.steps
        sample = FailureSample(
            at=snap.scraped_at,
            role=snap.role,
            increase=steps["transfer_failed"].increase + steps["bootstrap_failed"].increase,
            aborted=steps["aborted_requests_total"].increase,
            own_aborts=own_aborts,
            finished=steps["requests_total"].increase,
            worker=snap.worker,
        )
        if sample.increase or sample.aborted or sample.own_aborts or sample.finished:
            samples.append(sample)
        # Aborts and PD failures finish requests too: only what finished beyond them completed.
        if sample.finished > sample.increase + sample.aborted:
            completed.add(key)
        # End-to-end progress is what decode delivers: prefill finishing its side (its
        # requests_total advances when the KV transfer concludes) says nothing about a decode
        # that stalls mid-stream, and prefill compute goes on during a transfer stall.
        if mark is not None:
            decode_tokens += _tokens_added(steps)
            marks[snap.worker], advanced = _weigh(
                mark,
                steps,
                own,
                at=snap.scraped_at,
                per_iteration=_per_iteration(counters.baseline),
                scraped=True,
                live=live,
            )
            if advanced:
                advanced_at = snap.scraped_at
                completed.add(key)
        decreases.extend(counters.decreases)
        baselines[key] = counters.baseline
    alone = _fold_loads_alone(obs, read, baselines, marks, units=units, own=own, live=live_read)
    decode_tokens += sum(a.increase for a in alone)
    decreases.extend(d for a in alone for d in a.decreases)
    advanced_at = _latest(advanced_at, *(a.mark.at for a in alone if a.advanced))
    completed.update((Role.DECODE, a.mark.worker) for a in alone if a.advanced)
    for role, count in own.aborts.items():
        if role not in scraped and count:
            # Not scraped this cycle: the failures they cause show in a later scrape.
            samples.append(FailureSample(now, role, 0.0, own_aborts=float(count)))
    return _CounterFold(
        baselines,
        samples,
        advanced_at,
        tuple(decreases),
        frozenset(completed),
        marks,
        decode_tokens,
        live_read,
    )


def _first_aborts(snap: MetricsSnapshot, own_aborts: float) -> list[FailureSample]:
    """Our aborts set against a worker's first scrape (nothing to step its counters from)."""
    if not own_aborts:
        return []
    return [
        FailureSample(snap.scraped_at, snap.role, 0.0, own_aborts=own_aborts, worker=snap.worker)
    ]


def _weigh(
    mark: ProgressMark,
    steps: Mapping[str, CounterStep],
    own: _OwnNow,
    *,
    at: float,
    per_iteration: bool,
    scraped: bool,
    live: bool,
) -> tuple[ProgressMark, bool]:
    """A decode worker's mark moved by one reading's steps (made at `at`), and whether it
    showed progress beyond ours: then the mark starts again at that reading."""
    moved = _moved_mark(mark, steps, scraped=scraped, live=live)
    advanced = _decode_advanced(
        moved,
        ours(moved, own.tokens),
        per_iteration=per_iteration,
        stalled_mid_stream=own.stalled_mid_stream,
    )
    if advanced:
        moved = _new_mark(mark.worker, at, own.tokens_at_start, scraped=scraped, live=live)
    return moved, advanced


def _per_iteration(baseline: CounterBaseline) -> bool:
    """Whether a decode worker's tokens are known per decode iteration (realtime_tokens_total
    or /v1/loads decode_moments), not only when requests finish."""
    return baseline.realtime_tokens_total is not None or baseline.decode_tokens_total is not None


def _live_read(obs: Observation) -> frozenset[int]:
    """The decode workers whose /v1/loads answered this cycle with their decode-step tokens."""
    return frozenset(
        x.worker
        for x in obs.loads
        if x.role is Role.DECODE and readable(_live_decode_tokens(x)) is not None
    )


@dataclass(frozen=True, slots=True)
class _LiveAlone:
    """A decode worker read through /v1/loads alone this cycle, folded."""

    baseline: CounterBaseline
    mark: ProgressMark
    increase: float  # its decode-step tokens since the last reading
    advanced: bool  # beyond ours since the mark: progress, dated by the /v1/loads answer
    decreases: tuple[CounterDecrease, ...]


def _fold_loads_alone(
    obs: Observation,
    read: Sequence[MetricsSnapshot],
    baselines: dict[Worker, CounterBaseline],
    marks: dict[int, ProgressMark],
    *,
    units: Mapping[Worker, UnitState],
    own: _OwnNow,
    live: frozenset[int],
) -> list[_LiveAlone]:
    """Every decode worker with /v1/loads tokens read this cycle but no scrape, folded
    (`baselines` and `marks` updated in place)."""
    scraped = {(snap.role, snap.worker) for snap in read}
    folded = []
    for loads in obs.loads:
        key = (loads.role, loads.worker)
        if loads.role is not Role.DECODE or loads.worker not in live or key in scraped:
            continue
        unit = units.get(key)
        start_us = unit.exec_main_start_us if unit is not None else 0
        alone = _fold_live_alone(baselines.get(key), marks.get(loads.worker), loads, start_us, own)
        if alone is not None:
            baselines[key], marks[loads.worker] = alone.baseline, alone.mark
            folded.append(alone)
    return folded


def _fold_live_alone(
    old: CounterBaseline | None,
    mark: ProgressMark | None,
    loads: LoadsSnapshot,
    start_us: int,
    own: _OwnNow,
) -> _LiveAlone | None:
    """A decode worker whose /metrics the fetch cadence skipped, read through /v1/loads: its
    decode-step tokens (decode_moments) stepped and weighed against its mark as a scrape's are.

    They only ever show progress, never its absence (decode_moments leave out decode steps of
    2 s or more: STEP_MAX_US, managers/scheduler.py:404 @ 0.5.23); a flat reading moves no
    mark (docs/decisions.md, "Fetch cadence"). None where there is nothing to weigh
    against yet, or the worker runs a new process: its next scrape starts every counter of it
    at once (a baseline moved here would hide the restart from that scrape).
    """
    if old is None or mark is None:
        return None
    if old.start_us and start_us and start_us != old.start_us:
        return None
    current = _live_decode_tokens(loads)
    tokens = step(old.decode_tokens_total, current, new_process=False, from_zero=True)
    baseline = replace(old, decode_tokens_total=tokens.known, loads_at=loads.fetched_at)
    unread = CounterStep(None, 0.0)
    steps = dict.fromkeys(_SCRAPED_COUNTERS, unread) | {"decode_tokens_total": tokens}
    moved, advanced = _weigh(
        mark, steps, own, at=loads.fetched_at, per_iteration=True, scraped=False, live=True
    )
    decreases = _decreases(
        old, {"decode_tokens_total": tokens}, {"decode_tokens_total": current}, at=loads.fetched_at
    )
    return _LiveAlone(baseline, moved, tokens.increase, advanced, decreases)


def _tokens_added(steps: Mapping[str, CounterStep]) -> float:
    """Tokens one decode worker added in a scrape: a per-iteration counter where it has one."""
    for name in ("realtime_tokens_total", "decode_tokens_total", "generation_tokens_total"):
        if steps[name].known is not None:
            return steps[name].increase
    return 0.0


def _first_read_served(
    before: Iterable[CounterBaseline], after: Iterable[CounterBaseline], own_now: OwnTokens
) -> float | None:
    """When a decode worker read for the first time showed it served before we watched it."""
    known = {(b.role, b.worker) for b in before}
    return _latest(
        None,
        *(
            b.at
            for b in after
            if b.role is Role.DECODE
            and (b.role, b.worker) not in known
            and _served_before_watch(b, own_now)
        ),
    )


def _served_before_watch(first: CounterBaseline, own_now: OwnTokens) -> bool:
    """Whether a decode process's first reading shows tokens beyond every one of ours.

    Its counters count from its start, so tokens beyond what our probes ever received were
    served before we watched it: the group served since that start, which a daemon restart
    must not forget (docs/decisions.md, "Never healthy"). The same account as progress.
    """
    since_start = ProgressMark(
        first.worker,
        first.at,
        generation_tokens_total=first.generation_tokens_total or 0.0,
        realtime_tokens_total=first.realtime_tokens_total or 0.0,
        ttft_count=first.ttft_count or 0.0,
        decode_tokens_total=first.decode_tokens_total or 0.0,
    )
    return _decode_advanced(
        since_start,
        ours(since_start, own_now),
        per_iteration=_per_iteration(first),
        stalled_mid_stream=False,
    )


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
    obs: Observation,
    finished: Sequence[ProbeResult],
    read: Sequence[MetricsSnapshot],
    config: GroupSection,
) -> list[tuple[str, float | str]]:
    """Why work counts as pending this cycle (empty: nothing seen pending).

    Keys name the worker holding the work (`prefill_inflight_queue`, or `prefill#2_...` where the
    role has several): any worker's pending work is the group's.
    """
    pending: list[tuple[str, float | str]] = []
    if obs.probes_in_flight > 0:
        pending.append(("probes_in_flight", obs.probes_in_flight))
    failed = sum(not p.ok for p in finished)
    if failed:
        pending.append(("probes_failed_this_cycle", failed))
    for snap in read:
        label = worker_name(snap.role, snap.worker, len(config.workers(snap.role)))
        for name in _PENDING_GAUGES:
            value = getattr(snap, name)
            if value is not None and value > 0:
                pending.append((f"{label}_{name}", value))
    for loads in obs.loads:
        if loads.ok:
            label = worker_name(loads.role, loads.worker, len(config.workers(loads.role)))
            for name in _PENDING_LOADS:
                value = getattr(loads, name)
                if value is not None and value > 0:
                    pending.append((f"{label}_loads_{name}", value))
    return pending


def _handoff_values(
    obs: Observation, read: Sequence[MetricsSnapshot], config: GroupSection
) -> list[float]:
    """PD hand-off queue sizes (prefill inflight, decode transfer) of every worker: live
    /v1/loads first."""
    values: list[float] = []
    for role in WORKER_ROLES:
        for worker in range(len(config.workers(role))):
            value = _handoff_of(obs, read, role, worker)
            if value is not None:
                values.append(value)
    return values


_HANDOFF = {
    Role.PREFILL: ("prefill_inflight_queue_reqs", "inflight_queue"),
    Role.DECODE: ("decode_transfer_queue_reqs", "decode_transfer_queue"),
}


def _handoff_of(
    obs: Observation, read: Sequence[MetricsSnapshot], role: Role, worker: int
) -> float | None:
    """One worker's PD hand-off queue (prefill inflight, decode transfer): live /v1/loads
    first, else its gauge; None when neither was read this cycle."""
    loads_name, gauge_name = _HANDOFF[role]
    loads = obs.loads_of(role, worker)
    live = getattr(loads, loads_name) if loads is not None and loads.ok else None
    if live is not None:
        return float(live)
    snap = next((m for m in read if m.role is role and m.worker == worker), None)
    gauge = getattr(snap, gauge_name) if snap is not None else None
    return float(gauge) if gauge is not None else None


def _fold_stuck(
    state: GroupState,
    obs: Observation,
    read: Sequence[MetricsSnapshot],
    config: GroupSection,
    completed: frozenset[Worker],
) -> tuple[WorkerSince, ...]:
    """Workers (of roles with several) holding hand-off work without completing any since.

    The clock of a worker runs from the scrape that first saw its queue hold work, and stops at a
    scrape showing the queue empty or the worker completing requests (docs/decisions.md, "Several
    workers per role"). A worker not read this cycle keeps its clock.
    """
    since = {(s.role, s.worker): s.at for s in state.progress.stuck_since}
    for snap in read:
        key = (snap.role, snap.worker)
        if len(config.workers(snap.role)) < 2:
            continue
        held = _handoff_of(obs, read, snap.role, snap.worker)
        if held is not None and held > 0 and key not in completed:
            since.setdefault(key, snap.scraped_at)
        else:
            since.pop(key, None)
    return tuple(
        WorkerSince(role, worker, since[role, worker]) for role, worker in _in_order(since)
    )


def _in_order(keys: Iterable[Worker]) -> list[Worker]:
    """Workers in Role order, then by index."""
    roles = list(Role)
    return sorted(keys, key=lambda key: (roles.index(key[0]), key[1]))


def _latest(current: float | None, *times: float) -> float | None:
    """The latest of a remembered time and new ones (times seen never move backwards)."""
    return max((t for t in (current, *times) if t is not None), default=None)


def _handoff_busy_since(
    before: Progress,
    obs: Observation,
    read: Sequence[MetricsSnapshot],
    config: GroupSection,
    now: float,
) -> float | None:
    """Since when the PD hand-off queues have held work without a break (None: empty now);
    kept as it was when they were not read."""
    handoff = _handoff_values(obs, read, config)
    if not handoff:
        return before.handoff_busy_since
    busy = any(v > 0 for v in handoff)
    return (before.handoff_busy_since or now) if busy else None


@dataclass(frozen=True, slots=True)
class _Clocks:
    progress_at: float | None  # the no-progress clock's start
    advanced_at: float | None  # the latest progress seen (counters or a passing probe)
    metrics_seen_at: float | None  # the latest full scrape


def _progress_clocks(
    before: Progress,
    counters: _CounterFold,
    passed: Sequence[ProbeResult],
    full_scrape: Sequence[MetricsSnapshot] | None,
    *,
    pending: bool,
    own_at_start: OwnTokens,
) -> _Clocks:
    """The no-progress clock restarts at progress, and at a full scrape with nothing pending;
    each dated by when it was seen (the scrape, the probe's end), not by the cycle's end.

    A full scrape (`full_scrape`: every worker read this cycle) with nothing pending also moves
    decode's progress marks there: idle by right, what decode must show as progress is counted
    from it (`counters.marks` is updated in place).
    """
    seen: list[float] = []
    if counters.advanced_at is not None:
        seen.append(counters.advanced_at)
    if passed:
        seen.append(max(p.started_at + p.duration_seconds for p in passed))
    progress_at = _latest(before.progress_at, *seen)
    advanced_at = _latest(before.advanced_at, *seen)
    metrics_seen_at = before.metrics_seen_at
    if full_scrape:
        read_at = min(snap.scraped_at for snap in full_scrape)  # every worker read by then
        metrics_seen_at = _latest(metrics_seen_at, read_at)
        if not pending or progress_at is None:
            progress_at = _latest(progress_at, read_at)
        if not pending:
            for snap in full_scrape:
                if snap.role is Role.DECODE:
                    counters.marks[snap.worker] = _new_mark(
                        snap.worker,
                        snap.scraped_at,
                        own_at_start,
                        scraped=True,
                        live=snap.worker in counters.live_read,
                    )
    return _Clocks(progress_at, advanced_at, metrics_seen_at)


def _nothing_reached(
    obs: Observation, attempted: Sequence[MetricsSnapshot], finished: Sequence[ProbeResult]
) -> bool:
    """Cut off from everything: every check failed at the connection level."""
    return (
        len(obs.health) + len(attempted) > 0
        and all(not h.ok and h.reason in _HEALTH_UNREACHABLE for h in obs.health)
        and all(not m.ok and m.error in _SCRAPE_UNREACHABLE for m in attempted)
        and all(not p.ok and p.reason in _PROBE_UNREACHABLE for p in finished)
    )


def _every_worker_read(read: Sequence[MetricsSnapshot], config: GroupSection) -> bool:
    """Whether every prefill and decode of the group was scraped this cycle."""
    read_workers = {(snap.role, snap.worker) for snap in read}
    return all(
        (role, worker) in read_workers
        for role in WORKER_ROLES
        for worker in range(len(config.workers(role)))
    )


def _kept_samples(
    samples: Sequence[FailureSample], config: GroupSection, now: float
) -> tuple[FailureSample, ...]:
    """The failure samples still needed: the detector's window, or verification's, which reads
    failures from its start, for as long as the soak may last."""
    restart = config.restart
    keep_seconds = max(
        config.stall.window_seconds, restart.soak_seconds + restart.verify_timeout_seconds
    )
    return tuple(s for s in samples if s.at >= now - keep_seconds)


def _scrape_failures(
    before: int, attempted: Sequence[MetricsSnapshot], read: Sequence[MetricsSnapshot]
) -> int:
    """Cycles in a row with a worker scrape failing (unchanged when none was attempted)."""
    if not attempted:
        return before
    return before + 1 if len(read) < len(attempted) else 0


def _served_at(
    before: Progress, finished: Sequence[ProbeResult], counters: _CounterFold, own: OwnTokens
) -> float | None:
    """The latest evidence that the group serves: a passing probe's start, decode tokens beyond
    our own, or a decode process first read with such tokens already counted (docs/decisions.md,
    "Never healthy")."""
    counted = (
        counters.advanced_at,
        _first_read_served(before.baselines, counters.baselines.values(), own),
    )
    return _latest(
        before.served_at,
        *(p.started_at for p in finished if p.ok),
        *(t for t in counted if t is not None),
    )


def observe(
    state: GroupState, obs: Observation, config: GroupSection, now: float, *, quiet: bool
) -> tuple[GroupState, Facts]:
    """Fold the observation into memory; `quiet` absorbs unit restarts without judging them."""
    worker_units = {(u.role, u.worker): u for u in obs.units if u.ok}
    units = _worst_units(worker_units)
    unit_fold = _fold_unit_starts(state, worker_units, config, now, quiet=quiet)
    down, stopped = _fold_down(state, units, now)
    health, unhealthy = _fold_health(state, obs, now)
    finished = _end_to_end(obs)
    mem = _fold_probes(state, finished, now)
    mem = replace(
        mem, direct=_fold_direct(state, obs.probes), ranks=fold_ranks(state.ranks, obs.probes)
    )
    probe_ok_now = any(p.ok for p in finished)

    attempted = [m for m in obs.metrics if m.role in WORKER_ROLES]
    read = [m for m in attempted if m.ok]
    own = _own_now(state, obs, mem)
    own_tokens = own.tokens
    counters = _fold_counters(state, obs, read, worker_units, config, now=now, own=own)
    ranks = fold_rank_progress(
        state.progress,
        obs,
        read,
        {w: u.exec_main_start_us for (r, w), u in worker_units.items() if r is Role.DECODE},
        slack=TOKENS_SLACK,
    )
    metrics_fresh = _every_worker_read(read, config)
    samples = _kept_samples(counters.samples, config, now)
    before = state.progress
    scrape_failures = _scrape_failures(before.scrape_failures, attempted, read)
    pending = _pending(obs, finished, read, config)

    clocks = _progress_clocks(
        before,
        counters,
        [p for p in finished if p.ok],
        read if metrics_fresh else None,
        pending=bool(pending),
        own_at_start=own.tokens_at_start,
    )
    progress_at, advanced_at = clocks.progress_at, clocks.advanced_at
    metrics_seen_at = clocks.metrics_seen_at
    served_at = _served_at(before, finished, counters, own.tokens)

    handoff_busy_since = _handoff_busy_since(before, obs, read, config, now)

    nothing_reached = _nothing_reached(obs, attempted, finished)

    mem = replace(
        mem,
        progress=replace(
            _counted(mem.progress, before, counters, ranks),
            progress_at=progress_at,
            advanced_at=advanced_at,
            metrics_seen_at=metrics_seen_at,
            scrape_failures=scrape_failures,
            failure_samples=tuple(samples),
            handoff_busy_since=handoff_busy_since,
            stuck_since=_fold_stuck(state, obs, read, config, counters.completed),
            own=own_tokens,
            served_at=served_at,
        ),
        readiness=replace(
            mem.readiness,
            soak_decode_tokens=mem.readiness.soak_decode_tokens
            + (counters.decode_tokens if mem.readiness.verify_started_at is not None else 0.0),
        ),
        units=_units_memory(
            state,
            mem.units,
            worker_units,
            unit_fold,
            down_since=role_items(down),
            unhealthy_since=role_items(unhealthy),
            health_unchecked_since=_health_unchecked_since(state, obs, now),
            served_at=served_at,
        ),
    )
    facts = Facts(
        oldest_probe_seconds=obs.oldest_probe_in_flight_seconds if obs.probes_in_flight else 0.0,
        probe_ok_now=probe_ok_now,
        health=health,
        metrics_fresh=metrics_fresh,
        pending=tuple(pending),
        nothing_reached=nothing_reached,
        restarted=unit_fold.restarted,
        decode_only_new=unit_fold.decode_only_new,
        decode_only_cancelled=unit_fold.decode_only_cancelled,
        prefill_only_new=unit_fold.prefill_only.new,
        units=units,
        stopped=stopped,
        operator=obs.operator,
        decode_versions=_decode_versions(obs),
    )
    return mem, facts


def _end_to_end(obs: Observation) -> list[ProbeResult]:
    """The end-to-end probes that finished, but those that raised inside the watchdog.

    A probe that raised (internal_error) says nothing about the server: it is counted and logged
    where it happened, but it is neither a failure nor pending work here, so a watchdog bug can
    never add up to a restart of an idle server.
    """
    return [
        p
        for p in obs.probes
        if p.kind in _END_TO_END and p.reason is not ProbeFailure.INTERNAL_ERROR
    ]


def _own_now(state: GroupState, obs: Observation, mem: GroupState) -> _OwnNow:
    """What the watchdog's own probes did this cycle: aborts sent, tokens received."""
    tokens = state.progress.own + obs.own_tokens
    return _OwnNow(
        aborts={role: obs.own_aborts_for(role) for role in WORKER_ROLES},
        tokens=tokens,
        tokens_at_start=tokens - obs.own_tokens_during,
        stalled_mid_stream=mem.probes.midstream > 0,
    )


def _counted(
    progress: Progress, before: Progress, counters: _CounterFold, ranks: RankFold
) -> Progress:
    """`progress` with this observation's counter baselines, marks and decreases."""
    return replace(
        progress,
        baselines=tuple(counters.baselines[key] for key in _in_order(counters.baselines)),
        counter_decreases=before.counter_decreases + len(counters.decreases),
        last_decrease=counters.decreases[-1] if counters.decreases else before.last_decrease,
        marks=tuple(counters.marks[w] for w in sorted(counters.marks)),
        rank_baselines=ranks.baselines,
        rank_marks=ranks.marks,
        own_ranks=ranks.own,
    )


def _units_memory(
    state: GroupState,
    units: UnitMemory,
    worker_units: Mapping[Worker, UnitState],
    unit_fold: _UnitFold,
    *,
    down_since: tuple[RoleSince, ...],
    unhealthy_since: tuple[RoleSince, ...],
    health_unchecked_since: float | None,
    served_at: float | None,
) -> UnitMemory:
    """What the group remembers about its units after this observation."""
    return replace(
        units,
        starts=_unit_starts(state, worker_units, unit_fold.starts),
        down_since=down_since,
        unhealthy_since=unhealthy_since,
        health_unchecked_since=health_unchecked_since,
        decode_only_seen_at=unit_fold.decode_only_seen_at,
        prefill_starts_at_decode_start=unit_fold.prefill_starts_at_decode_start,
        decode_only_workers=unit_fold.decode_only_workers,
        decode_only_prefills=unit_fold.decode_only_prefills,
        prefill_only=unit_fold.prefill_only.fresh,
        prefill_only_seen_at=unit_fold.prefill_only.seen_at,
        prefill_only_ready_at=(
            state.units.prefill_only_ready_at if unit_fold.prefill_only.fresh else None
        ),
        unserved_since=_unserved_since(
            state.units.unserved_since, unit_fold.starts.values(), served_at
        ),
    )


def _decode_versions(obs: Observation) -> dict[int, str]:
    """The SGLang version each decode reported in /v1/loads this cycle (judge mode reads it)."""
    return {x.worker: x.version for x in obs.loads if x.role is Role.DECODE and x.version}
