"""The reasons a decision gives: a code, a sentence, the numbers behind it (docs/decisions.md)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from watchdog.config import GroupSection
from watchdog.decide.accounting import WindowFailures
from watchdog.decide.fold import WORKER_ROLES, Facts
from watchdog.decide.ranks import flat_ranks, rank_mark, wedged_ranks
from watchdog.decide.state import GroupState, RankRun
from watchdog.model import Reason, Role, worker_name


def reason(code: str, message: str, **values: float | str | None) -> Reason:
    """A Reason with its values (None left out, floats rounded to milliseconds)."""
    return Reason(
        code=code,
        message=message,
        values=tuple(
            (k, round(v, 3) if isinstance(v, float) else v)
            for k, v in values.items()
            if v is not None
        ),
    )


def known_flat_seconds(mem: GroupState) -> float | None:
    """How long the counters were flat as last read (None: never read)."""
    progress = mem.progress
    if progress.metrics_seen_at is None or progress.progress_at is None:
        return None
    return max(0.0, progress.metrics_seen_at - progress.progress_at)


def since_advance(mem: GroupState, now: float) -> float | None:
    """Seconds since a counter last advanced or a probe last succeeded (None: never)."""
    advanced_at = mem.progress.advanced_at
    return None if advanced_at is None else now - advanced_at


def transfer_reason(failures: WindowFailures, config: GroupSection) -> Reason:
    """Transfer/bootstrap failures in the window, net of what aborts explain, and their ratio."""
    stall = config.stall
    ratio = failures.ratio
    # Where a role has several workers, name the ones whose counters rose (the suspects).
    several = any(len(config.workers(role)) > 1 for role in WORKER_ROLES)
    rose = {
        worker_name(role, worker, len(config.workers(role))): increase
        for role, worker, increase in failures.workers
    }
    where = (
        "; rose on " + ", ".join(f"{name} +{value:g}" for name, value in rose.items())
        if several and rose
        else ""
    )
    share = (
        f"; {ratio:.0%} of {failures.attempts:g} transfers attempted "
        f"(ratio threshold {stall.transfer_failure_ratio:g} from {stall.transfer_min_attempts})"
        if ratio is not None
        else ""
    )
    return reason(
        "transfer_failures",
        f"transfer/bootstrap failures +{failures.net:g} in {stall.window_seconds:g}s beyond "
        f"what aborts explain (raw +{failures.raw:g}, explained {failures.explained:g}; max over "
        f"roles and TP ranks; threshold {stall.transfer_failures}){share}{where}",
        increase=failures.net,
        raw_increase=failures.raw,
        explained_by_aborts=failures.explained,
        threshold=stall.transfer_failures,
        window_seconds=stall.window_seconds,
        attempts=failures.attempts,
        ratio=ratio,
        ratio_threshold=stall.transfer_failure_ratio,
        min_attempts=stall.transfer_min_attempts,
        **{f"{role}_increase": value for role, value in failures.net_by_role().items()},
        workers=", ".join(rose) if several and rose else None,
    )


def probe_reason(mem: GroupState, config: GroupSection) -> Reason:
    """The current run of probe failures."""
    run = mem.probes
    note = f" ({run.multiround} of them multi-round)" if run.multiround else ""
    return reason(
        "probe_failures",
        f"{run.failures} consecutive probe failures{note} "
        f"(threshold {config.stall.probe_failures})",
        consecutive=run.failures,
        multiround=run.multiround,
        threshold=config.stall.probe_failures,
    )


def progress_reason(mem: GroupState, facts: Facts, config: GroupSection, now: float) -> Reason:
    """How long the counters have been flat, and whether metrics are available."""
    flat = known_flat_seconds(mem)
    since = since_advance(mem, now)
    seen_at = mem.progress.metrics_seen_at
    metrics_age = None if seen_at is None else now - seen_at
    if flat is None:
        text = "progress counters never read"
    else:
        text = f"progress counters flat for {flat:.0f}s as last read"
    if not facts.metrics_fresh:
        text += "; metrics unavailable this cycle" + (
            f" (last full scrape {metrics_age:.0f}s ago)" if metrics_age is not None else ""
        )
    return reason(
        "no_progress" if facts.metrics_fresh else "metrics_unavailable",
        text,
        flat_seconds=flat,
        threshold_seconds=config.stall.no_progress_seconds,
        seconds_since_progress=since,
        metrics_age_seconds=metrics_age,
    )


def pending_reason(facts: Facts) -> Reason:
    """What work is pending, if any."""
    if not facts.pending:
        return reason("nothing_pending", "no work seen pending")
    names = ", ".join(f"{k}={v}" for k, v in facts.pending)
    return Reason("work_pending", f"work pending: {names}", facts.pending)


def stuck_reason(mem: GroupState, config: GroupSection, now: float) -> Reason | None:
    """Workers that held PD hand-off work for no_progress_seconds without completing any of
    their own, while their role has other workers (None: no such worker)."""
    limit = config.stall.no_progress_seconds
    stuck = [s for s in mem.progress.stuck_since if now - s.at >= limit]
    if not stuck:
        return None
    names = [worker_name(s.role, s.worker, len(config.workers(s.role))) for s in stuck]
    seconds = max(now - s.at for s in stuck)
    return reason(
        "worker_stalled",
        f"{', '.join(names)}: PD hand-off queue held work for {seconds:.0f}s while that worker "
        f"completed nothing of its own (no_progress_seconds {limit:g}); the other workers of "
        "its role still progress, so only the requests routed to it hang",
        workers=", ".join(names),
        stuck_seconds=seconds,
        threshold_seconds=limit,
    )


def _rank_names(ranks: Sequence[RankRun], config: GroupSection) -> list[str]:
    decodes = len(config.decodes)
    return [f"{worker_name(Role.DECODE, r.decode, decodes)} dp_rank {r.dp_rank}" for r in ranks]


def rank_reason(
    mem: GroupState, config: GroupSection, ranks: Sequence[RankRun] | None = None
) -> Reason | None:
    """DP ranks of a decode whose pinned probes fail while its other ranks pass, named
    (`decode#1 dp_rank 3`); `ranks` narrows them (the flat ones). None: no such rank."""
    wedged = wedged_ranks(mem.ranks, config.stall.probe_failures) if ranks is None else ranks
    if not wedged:
        return None
    names = _rank_names(wedged, config)
    failures = min(r.failures for r in wedged)
    return reason(
        "dp_rank_stalled",
        f"{', '.join(names)}: {failures} pinned direct PD probes in a row failed while the other "
        "DP ranks of that decode pass; a DP rank cannot be restarted alone, so the whole group "
        f"is ({wedged[0].detail or 'no detail'})",
        workers=", ".join(names),
        consecutive=failures,
        threshold=config.stall.probe_failures,
    )


def rank_flat_reason(mem: GroupState, config: GroupSection) -> tuple[Reason, Reason] | None:
    """Wedged ranks whose own decode tokens are flat while they hold work: named, and how long
    they were flat (None: no such rank; docs/decisions.md, "DP-attention ranks")."""
    limit = config.stall.no_progress_seconds
    wedged = wedged_ranks(mem.ranks, config.stall.probe_failures)
    flat = flat_ranks(wedged, mem.progress.rank_marks, limit)
    named = rank_reason(mem, config, flat)
    if named is None:
        return None
    marks = [m for r in flat if (m := rank_mark(mem.progress.rank_marks, r)) is not None]
    seconds = min(m.read_at - m.at for m in marks)
    work = min(m.work or 0.0 for m in marks)
    why = reason(
        "dp_rank_tokens_flat",
        f"{', '.join(_rank_names(flat, config))}: the rank's own decode tokens have not grown "
        f"beyond what our pinned probes received on it for {seconds:.0f}s (no_progress_seconds "
        f"{limit:g}) while it holds {work:g} running or waiting requests: wedged, not busy",
        flat_seconds=seconds,
        threshold_seconds=limit,
        work=work,
    )
    return named, why


def rank_progress_reason(mem: GroupState, config: GroupSection) -> Reason:
    """Why wedged ranks are alerted, not acted on: their tokens grow (busy), they hold no work,
    they were not flat long enough, or per-rank progress is not read."""
    limit = config.stall.no_progress_seconds
    wedged = wedged_ranks(mem.ranks, config.stall.probe_failures)
    parts = []
    for name, run in zip(_rank_names(wedged, config), wedged, strict=True):
        mark = rank_mark(mem.progress.rank_marks, run)
        if mark is None:
            parts.append(f"{name} tokens not read")
        elif mark.work is None or mark.work <= 0:
            parts.append(f"{name} holds no work as last read")
        else:
            flat = mark.read_at - mark.at
            parts.append(f"{name} tokens flat for {flat:.0f}s of {limit:g}s as last read")
    if all(rank_mark(mem.progress.rank_marks, run) is None for run in wedged):
        return reason(
            "rank_progress_unknown",
            "per-rank progress is not read (no realtime_tokens_total series labelled dp_rank: "
            "metrics off, or a version without them), so a busy rank cannot be told from a "
            "wedged one: alerting, not acting",
        )
    return reason(
        "rank_not_flat",
        f"{'; '.join(parts)}: a rank whose tokens grow is busy, not wedged: alerting, not acting",
        threshold_seconds=limit,
    )


def health_reason(facts: Facts) -> Reason:
    """Each worker's /health this cycle."""
    parts = {
        role.value: ("ok" if facts.health[role] else "failing")
        if role in facts.health
        else "unknown"
        for role in WORKER_ROLES
    }
    return reason(
        "worker_health",
        "worker /health: " + ", ".join(f"{k} {v}" for k, v in parts.items()),
        **parts,
    )


def budget_reason(recent: Sequence[float], config: GroupSection) -> Reason:
    """How much of the restart budget the window holds."""
    return reason(
        "budget",
        f"{len(recent)} of {config.restart.max_restarts} co-restarts used in the last "
        f"{config.restart.budget_window_seconds:g}s",
        used=len(recent),
        max_restarts=config.restart.max_restarts,
        window_seconds=config.restart.budget_window_seconds,
    )


def prefill_only_reason(mem: GroupState, config: GroupSection, now: float) -> Reason:
    """Which prefills were restarted alone, when, and by whom where systemd tells.

    NRestarts grows only with the unit's own Restart=; otherwise someone's RestartUnit (an
    operator, another tool) brought it back (docs/decisions.md, "Restart rungs").
    """
    prefills = len(config.workers(Role.PREFILL))
    decodes = len(config.workers(Role.DECODE))
    parts = []
    for fresh in mem.units.prefill_only:
        started = fresh.start_us / 1e6
        who = (
            f"by systemd's Restart= (NRestarts {fresh.n_restarts})"
            if fresh.by_systemd
            else f"not by systemd's Restart= (NRestarts {fresh.n_restarts}): an operator or "
            "another tool"
        )
        ended = f", its previous process ended with Result {fresh.ended!r}" if fresh.ended else ""
        parts.append(
            f"{worker_name(Role.PREFILL, fresh.worker, prefills)} started "
            f"{max(0.0, now - started):.0f}s ago ({_utc(started)}) {who}{ended}"
        )
    kept = "decode kept running" if decodes == 1 else "every decode kept running"
    first = mem.units.prefill_only[0] if mem.units.prefill_only else None
    return reason(
        "prefill_only_restart",
        f"prefill restarted alone: {'; '.join(parts)}; {kept}, holding KV-transfer bootstrap "
        "state for the old prefill process",
        workers=",".join(
            worker_name(Role.PREFILL, f.worker, prefills) for f in mem.units.prefill_only
        ),
        started_at=first.start_us / 1e6 if first is not None else None,
        n_restarts=first.n_restarts if first is not None else None,
        by="systemd" if first is not None and first.by_systemd else "other",
        ended=first.ended if first is not None and first.ended else None,
    )


def _utc(at: float) -> str:
    """A unix time as ISO 8601 UTC, to the second."""
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
