"""The verdict on a judging group, in priority order, with its reasons (docs/decisions.md)."""

from __future__ import annotations

from dataclasses import dataclass

from watchdog.config import GroupSection
from watchdog.decide.accounting import window_failures
from watchdog.decide.fold import RUNNING_UNIT_STATES, Facts
from watchdog.decide.reasons import (
    health_reason,
    known_flat_seconds,
    pending_reason,
    probe_reason,
    progress_reason,
    rank_flat_reason,
    rank_progress_reason,
    rank_reason,
    reason,
    since_advance,
    stuck_reason,
    transfer_reason,
)
from watchdog.decide.state import GroupState, by_role
from watchdog.decide.verdict import Verdict
from watchdog.model import Reason, Role, worker_name


@dataclass(frozen=True, slots=True)
class Assessment:
    """A verdict, why, and whether it calls for a co-restart."""

    verdict: Verdict
    reasons: tuple[Reason, ...]
    act: bool = False


@dataclass(frozen=True, slots=True)
class _Signals:
    """What the probe-failing and probe-passing verdict tables both read."""

    probes: Reason
    health: Reason
    transfer: Reason
    progress: Reason
    rising: bool  # net transfer/bootstrap failures at or over the threshold in the window
    failing_share: bool  # net failures at or over the ratio of attempted transfers
    flat: float | None  # seconds the counters were flat as last read
    advancing: bool  # progress within no_progress_seconds
    advancing_while_failing: bool
    stuck: Reason | None  # workers of several holding stuck work (reasons.stuck_reason)
    rank: Reason | None  # one DP rank of a decode wedged, its others serving (reasons.rank_reason)
    # Of those, the ranks whose own tokens are flat while they hold work, and why
    # (reasons.rank_flat_reason); else why the wedged ranks are not acted on.
    rank_flat: tuple[Reason, Reason] | None
    rank_progress: Reason | None


def unit_assessment(
    mem: GroupState, facts: Facts, config: GroupSection, now: float, *, hung: bool = True
) -> Assessment | None:
    """Crash, hung worker or stopped unit: judged from units (and long-failing /health).

    `hung=False` during warm-up, where a worker without passing /health is a failed start.
    """
    timeout = config.stall.startup_timeout_seconds
    down = by_role(mem.units.down_since)
    if down:
        role, since = min(down.items(), key=lambda item: item[1])
        seconds = now - since
        unit = facts.units.get(role)
        state = unit.active_state if unit is not None else "unknown"
        why = reason(
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
        return Assessment(Verdict.CRASH, (why,), act=seconds >= timeout)
    advance = since_advance(mem, now)
    hung_after = config.stall.no_progress_seconds
    stuck = advance is None or advance >= hung_after
    probes_failing = mem.probes.failures >= config.stall.probe_failures
    for item in mem.units.unhealthy_since if hung else ():
        unit = facts.units.get(item.role)
        seconds = now - item.at
        if (
            seconds >= hung_after
            and stuck
            and probes_failing
            and not facts.nothing_reached
            and unit is not None
            and unit.active_state in RUNNING_UNIT_STATES
        ):
            why = reason(
                "health_failing",
                f"{item.role} /health failing for {seconds:.0f}s while its unit is "
                f"{unit.active_state}, probes fail and nothing progresses "
                f"(no_progress_seconds {hung_after:g})",
                role=item.role.value,
                failing_seconds=seconds,
                no_progress_seconds=hung_after,
            )
            return Assessment(Verdict.CRASH, (why,), act=True)
    if facts.stopped:
        names = ", ".join(f"{r} ({facts.units[r].unit})" for r in facts.stopped)
        why = reason(
            "unit_stopped",
            f"stopped on purpose: {names}; use `watchdog pause` for maintenance",
            roles=",".join(r.value for r in facts.stopped),
        )
        return Assessment(Verdict.UNIT_STOPPED, (why,))
    return None


def assess(mem: GroupState, facts: Facts, config: GroupSection, now: float) -> Assessment:
    """The stall verdict of a group that is neither warming, verifying nor held."""
    units = unit_assessment(mem, facts, config, now)
    if units is not None:
        return units
    if facts.nothing_reached:
        cut_off = reason(
            "nothing_reachable",
            "every health check, scrape and probe failed to connect: the watchdog is "
            "cut off, which is not evidence of a stall",
        )
        return Assessment(Verdict.MONITORING_OUTAGE, (cut_off, probe_reason(mem, config)))
    signals = _signals(mem, facts, config, now)
    if mem.probes.failures >= config.stall.probe_failures:
        return _while_probes_fail(mem, facts, config, now, signals)
    return _while_probes_pass(mem, facts, config, now, signals)


def _signals(mem: GroupState, facts: Facts, config: GroupSection, now: float) -> _Signals:
    stall = config.stall
    failures = window_failures(mem.progress.failure_samples, now - stall.window_seconds)
    ratio = failures.ratio
    advance = since_advance(mem, now)
    advancing = advance is not None and advance < stall.no_progress_seconds
    advanced_at, failing_since = mem.progress.advanced_at, mem.probes.failing_since
    rank = rank_reason(mem, config)
    return _Signals(
        probes=probe_reason(mem, config),
        health=health_reason(facts),
        transfer=transfer_reason(failures, config),
        progress=progress_reason(mem, facts, config, now),
        rising=failures.net >= stall.transfer_failures,
        failing_share=(
            ratio is not None
            and failures.net > 0
            and failures.attempts >= stall.transfer_min_attempts
            and ratio >= stall.transfer_failure_ratio
        ),
        flat=known_flat_seconds(mem),
        stuck=stuck_reason(mem, config, now),
        rank=rank,
        rank_flat=rank_flat_reason(mem, config) if rank is not None else None,
        rank_progress=rank_progress_reason(mem, config) if rank is not None else None,
        advancing=advancing,
        # Overloaded means other requests complete *while* probes fail, not merely before they did.
        advancing_while_failing=(
            advancing
            and advanced_at is not None
            and failing_since is not None
            and advanced_at >= failing_since
        ),
    )


def _while_probes_fail(
    mem: GroupState, facts: Facts, config: GroupSection, now: float, s: _Signals
) -> Assessment:
    """Probes failed `probe_failures` times in a row: which kind of trouble, if any, to act on."""
    stuck = _stuck(facts, s)
    if stuck is not None:
        return stuck
    if s.rising or s.failing_share:
        return Assessment(Verdict.DEGRADED_BOOTSTRAP, (s.transfer, s.probes), act=True)
    router = _router_wedge(mem, facts, config, now)
    if router is not None:
        return Assessment(Verdict.ROUTER_WEDGE, (s.probes, router, s.health), act=True)
    if (
        facts.workers_healthy
        and facts.pending
        and s.flat is not None
        and s.flat >= config.stall.no_progress_seconds
    ):
        suspect = _router_suspected(mem, facts, config)
        if suspect is not None:
            # The flat clock starts at the last probe that passed, up to a period before the
            # failing run's, so it runs out first: without this hold a wedged router would be
            # co-restarted in full in the cycles before its own rung's clock runs out.
            return Assessment(Verdict.STALL_SUSPECTED, (s.probes, suspect, s.progress, s.health))
        direct = direct_reason(mem, config)
        return Assessment(
            Verdict.SILENT_STALL,
            (s.probes, s.progress, pending_reason(facts), s.health, *([direct] if direct else [])),
            act=True,
        )
    if s.advancing_while_failing:
        return Assessment(Verdict.OVERLOADED, (s.probes, s.progress))
    if facts.workers_failing:
        return Assessment(Verdict.WORKER_UNHEALTHY, (s.health, s.probes))
    if not facts.metrics_fresh:
        unknown = reason(
            "progress_unknown",
            "probes failing but progress cannot be confirmed without metrics; not acting",
        )
        return Assessment(Verdict.MONITORING_OUTAGE, (unknown, s.probes, s.progress, s.health))
    return Assessment(
        Verdict.STALL_SUSPECTED, (s.probes, s.progress, pending_reason(facts), s.health)
    )


def _stuck(facts: Facts, s: _Signals) -> Assessment | None:
    """One worker of several, or one DP rank of a decode, stalled: a silent stall of the share
    of traffic routed to it.

    Probes through the router fail only when they land on it, and the group's counters advance
    through the other workers, so neither the probe run nor the group's flat clock can see it
    (docs/decisions.md, "Several workers per role").
    """
    if s.stuck is not None:
        return Assessment(
            Verdict.SILENT_STALL, (s.stuck, s.probes, pending_reason(facts), s.transfer), act=True
        )
    if s.rank_flat is not None:
        # A wedged DP rank fails only the requests routed to it, found by its pinned probes, and
        # its own tokens stay flat beyond ours while it holds work: its scheduler is wedged. A
        # DP rank cannot be restarted alone, so the full co-restart (docs/decisions.md,
        # "DP-attention ranks").
        named, flat = s.rank_flat
        return Assessment(
            Verdict.SILENT_STALL,
            (named, flat, s.probes, pending_reason(facts), s.health),
            act=True,
        )
    if s.rank is not None and s.rank_progress is not None:
        # A rank whose queue is only long fails its pinned probes the same way, and its tokens
        # grow; where they are not read a busy rank cannot be told from a wedged one: an alert
        # naming the rank, never a restart of a server that may only be busy.
        return Assessment(
            Verdict.DP_RANK_WEDGED,
            (s.rank, s.rank_progress, s.probes, pending_reason(facts), s.health),
        )
    return None


def _while_probes_pass(
    mem: GroupState, facts: Facts, config: GroupSection, now: float, s: _Signals
) -> Assessment:
    """Probes pass (or failed fewer times than the threshold): alerts and overload only.

    Except a transfer path failing a large share of its transfers: the router's retries hide it
    from the probes, not from the requests it fails.
    """
    stuck = _stuck(facts, s)
    if stuck is not None:
        return stuck
    if s.failing_share:
        return Assessment(Verdict.DEGRADED_BOOTSTRAP, (s.transfer, s.probes), act=True)
    if s.rising:
        return Assessment(Verdict.TRANSFER_FAILURES_RISING, (s.transfer, s.probes))
    pinned = _pinned(mem, facts, config, now, s.advancing)
    if pinned is not None:
        return Assessment(Verdict.PINNED_REQUEST, (pinned,))
    if facts.workers_failing:
        return Assessment(Verdict.WORKER_UNHEALTHY, (s.health,))
    if mem.probes.failures > 0:
        return Assessment(Verdict.BLIP, (s.probes,))
    scrape_failures = mem.progress.scrape_failures
    if scrape_failures >= config.stall.probe_failures:
        why = reason(
            "scrape_failing",
            f"worker /metrics failed {scrape_failures} cycles in a row while probes pass",
            consecutive=scrape_failures,
        )
        return Assessment(Verdict.MONITORING_OUTAGE, (why, s.progress))
    if facts.pending and s.advancing:
        saturated = dict(facts.pending).get("probes_in_flight", 0)
        if isinstance(saturated, (int, float)) and saturated >= config.probe.max_in_flight:
            why = reason(
                "probes_saturated",
                f"{saturated:g} probes in flight (max_in_flight {config.probe.max_in_flight}) "
                "while counters advance: slow but progressing",
                in_flight=saturated,
            )
            return Assessment(Verdict.OVERLOADED, (why, s.progress))
    return Assessment(Verdict.OK, ())


# Pending-work keys (fold._pending) of requests waiting in a worker queue, live (/v1/loads) or as
# last reported. Running requests and active HTTP requests are left out: the direct probes
# themselves run there, and an idle scheduler may report its last running count for 30 s.
_WAITING = (
    "queue_reqs",  # the scheduler's waiting queue and every /v1/loads *_queue_reqs
    "waiting_reqs",
    "inflight_queue",
    "bootstrap_queue",
    "decode_prealloc_queue",
    "decode_transfer_queue",
)


def direct_reason(mem: GroupState, config: GroupSection) -> Reason | None:
    """The pairs whose latest direct PD probe failed, named (None: none failed)."""
    prefills, decodes = len(config.workers(Role.PREFILL)), len(config.workers(Role.DECODE))
    failed = [r for r in mem.direct if not r.ok]
    if not failed:
        return None
    names = [
        f"{worker_name(Role.PREFILL, r.prefill, prefills)}+"
        f"{worker_name(Role.DECODE, r.decode, decodes)}"
        for r in failed
    ]
    return reason(
        "direct_probe_failed",
        f"direct PD probe of {', '.join(names)} failed ({failed[0].reason}): the pair itself "
        "does not serve, not only the router",
        pairs=", ".join(names),
    )


def _pairs_serve_directly(mem: GroupState, facts: Facts, config: GroupSection) -> int | None:
    """How many prefill/decode pairs passed a direct PD probe during the failing router run,
    when that is every pair, the workers answer /health and no worker queue holds work beyond
    our own direct probes (an overload queues there: that is not a wedged router); None
    otherwise.

    The run is dated by the cycle that saw its first failure, which started up to a probe
    timeout earlier. Counters are not read: the direct probes' own tokens move them.
    """
    failing_since = mem.probes.failing_since
    if failing_since is None or not facts.workers_healthy:
        return None
    pairs = len(config.workers(Role.PREFILL)) * len(config.workers(Role.DECODE))
    run_began = failing_since - config.probe.timeout_seconds
    passed = [r for r in mem.direct if r.ok and r.started_at >= run_began]
    if len(passed) < pairs or len(mem.direct) != len(passed):
        return None
    if any(_waiting_beyond(key, value, pairs) for key, value in facts.pending):
        return None
    return len(passed)


def _waiting_beyond(key: str, value: float | str, ours: int) -> bool:
    """A worker queue holding more requests than one round of our direct probes puts there.

    A round puts at most one request per pair in a worker's queues, and queue gauges report the
    last stats report's counts, one of ours included for a while after it left: that much is not
    work of others waiting (an overload).
    """
    if not key.endswith(_WAITING):
        return False
    return not isinstance(value, int | float) or value > ours


def _router_wedge(mem: GroupState, facts: Facts, config: GroupSection, now: float) -> Reason | None:
    """Router probes fail while every pair answers a direct PD probe: the router alone is wedged.

    The pairs must serve directly (_pairs_serve_directly) and the failing run must have lasted
    no_progress_seconds. Anything less is judged by the other rules, whose action is the full
    co-restart (docs/decisions.md).
    """
    passed = _pairs_serve_directly(mem, facts, config)
    failing_since = mem.probes.failing_since
    if passed is None or failing_since is None:
        return None
    failing = now - (failing_since - config.probe.timeout_seconds)
    if failing < config.stall.no_progress_seconds:
        return None
    return reason(
        "router_wedge",
        f"router probes failing for about {failing:.0f}s while direct PD probes of all "
        f"{passed} prefill/decode pair(s) pass and no worker queue holds work: the router "
        "alone is wedged (a router restart leaves the KV bootstrap state alone)",
        failing_seconds=failing,
        direct_pairs_passed=passed,
        no_progress_seconds=config.stall.no_progress_seconds,
    )


def _router_suspected(mem: GroupState, facts: Facts, config: GroupSection) -> Reason | None:
    """Every pair serves directly but the router rung's clock has not run out yet: a hold."""
    passed = _pairs_serve_directly(mem, facts, config)
    if passed is None:
        return None
    return reason(
        "router_suspected",
        f"direct PD probes of all {passed} prefill/decode pair(s) pass while router probes "
        "fail: the router is suspected, not the pairs; waiting for "
        f"{config.stall.no_progress_seconds:g}s of failing router probes before restarting it "
        "alone",
        direct_pairs_passed=passed,
        no_progress_seconds=config.stall.no_progress_seconds,
    )


def _pinned(
    mem: GroupState, facts: Facts, config: GroupSection, now: float, advancing: bool
) -> Reason | None:
    limit = config.stall.pinned_inflight_seconds
    if not advancing:
        return None  # nothing completes: that is stall territory, not one pinned request
    if facts.oldest_probe_seconds >= limit:
        return reason(
            "probe_pinned",
            f"a probe has been in flight for {facts.oldest_probe_seconds:.0f}s while other "
            f"requests complete (pinned_inflight_seconds {limit:g}); a restart may not fix it",
            in_flight_seconds=facts.oldest_probe_seconds,
            threshold_seconds=limit,
        )
    busy_since = mem.progress.handoff_busy_since
    if busy_since is not None and now - busy_since >= limit:
        seconds = now - busy_since
        return reason(
            "handoff_queue_pinned",
            f"PD hand-off queue not empty for {seconds:.0f}s while other requests complete "
            f"(pinned_inflight_seconds {limit:g}); a restart may not fix it",
            busy_seconds=seconds,
            threshold_seconds=limit,
        )
    return None
