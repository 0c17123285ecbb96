"""The fleet arbiter: a group's co-restart weighed against the whole daemon (pure; time passed in).

Each group decides alone (decide()). A shared cause (a router, the network, a metadata server, a
bad deploy) makes many groups stall at once, and co-restarting all of them would drop every
in-flight request of the fleet without curing the cause. So when a group's decision is a
co-restart, arbitrate() says whether it may go ahead:

- the fleet budget: at most `max_concurrent_restarts` groups down for a co-restart at once (from
  the co-restart until the group serves again or its verification fails), at most
  `max_restarts_per_hour` co-restarts in any rolling hour; a group refused for it stays stalled,
  uncharged, and asks again after its backoff_seconds;
- a storm: more than `storm_share` of the groups (and at least `storm_min_groups`) had a stall
  verdict within `storm_window_seconds` and do not serve again since. A storm is a verdict of
  its own, declared once per episode with the stalled groups and what they share (the
  suspects). It co-restarts at most
  `max_concurrent_restarts` groups in all and holds the rest until each recovers on its own
  (serves again), an operator re-arms it (`watchdog reset`) or pauses it, or decide() holds it
  itself (its own budget). The storm ends when the stalled share falls back; holds do not end
  with it.

note() folds in every decision of every group (each cycle), arbitrate() rules on a co-restart.
With fewer than two groups neither ever refuses. See docs/decisions.md, "Fleet budget and
storms".
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from urllib.parse import urlsplit

from watchdog.config import FleetSection, GroupSection
from watchdog.decide.machine import refused_before_first_step
from watchdog.decide.reasons import reason
from watchdog.decide.state import Decision, GroupState
from watchdog.model import Action, OperatorControls, State

FLEET_BUDGET = "fleet_budget"
STORM = "storm"
HOUR_SECONDS = 3600.0
# A group in these states serves: a hold it was under is over (it recovered on its own).
SERVING = frozenset({State.HEALTHY, State.OVERLOADED})


@dataclass(frozen=True, slots=True)
class Topology:
    """What one group could share with others: the suspects of a storm."""

    group: str
    router: str  # the router's URL
    hosts: tuple[str, ...]  # the host part of every URL, and every SSH host
    prefills: tuple[str, ...]  # the prefill workers' URLs


def topology(group: GroupSection) -> Topology:
    """The group's router URL, hosts and prefill URLs, as configured."""
    hosts: set[str] = set()
    for _, section in group.members():
        name = urlsplit(section.url).hostname
        if name:
            hosts.add(name)
        target = group.host_of(section)
        if target is not None:
            hosts.add(target.hostname)
    return Topology(
        group=group.name,
        router=group.router.url,
        hosts=tuple(sorted(hosts)),
        prefills=tuple(p.url for p in group.prefills),
    )


@dataclass(frozen=True, slots=True)
class Suspect:
    """One thing two or more stalled groups share: a router, a host or a prefill."""

    kind: str  # router, host, prefill
    value: str
    groups: tuple[str, ...]


def suspects(stalled: Iterable[str], topologies: Iterable[Topology]) -> tuple[Suspect, ...]:
    """What at least two of the `stalled` groups share, the most shared first."""
    names = set(stalled)
    shared: dict[tuple[str, str], list[str]] = {}
    for top in topologies:
        if top.group not in names:
            continue
        values = [("router", top.router), *(("host", h) for h in top.hosts)]
        values += [("prefill", p) for p in top.prefills]
        for key in dict.fromkeys(values):
            shared.setdefault(key, []).append(top.group)
    found = [Suspect(k, v, tuple(sorted(g))) for (k, v), g in shared.items() if len(g) >= 2]
    return tuple(sorted(found, key=lambda s: (-len(s.groups), s.kind, s.value)))


@dataclass(frozen=True, slots=True)
class Storm:
    """A storm verdict: the groups stalled together, what they share, what was done."""

    started_at: float
    groups: tuple[str, ...]  # the groups with a stall verdict inside the window
    total: int  # groups of the daemon
    suspects: tuple[Suspect, ...]
    acted: tuple[str, ...]  # co-restarted for it (at most max_concurrent_restarts)
    held: tuple[str, ...]  # held until they recover or an operator re-arms them


@dataclass(frozen=True, slots=True)
class Hold:
    """A group refused by the fleet, since when and why (one refusal episode)."""

    group: str
    reason: str  # FLEET_BUDGET (waits its turn) or STORM (held)
    since: float


@dataclass(frozen=True, slots=True)
class GroupView:
    """What the arbiter needs of one group's decision."""

    state: State
    stalled: bool  # a stall verdict: stalled, or a co-restart decided now or running
    busy: bool  # down for a co-restart: restarting, or verifying and not serving yet
    rearmed_at: float | None  # `watchdog reset`


def view(decision: Decision, operator: OperatorControls) -> GroupView:
    """The arbiter's view of a decision (and of the operator controls it saw)."""
    state = decision.state
    restarting = state.state is State.RESTARTING or decision.action is Action.CO_RESTART
    verifying = state.state is State.VERIFYING and state.readiness.recovered_at is None
    return GroupView(
        state=state.state,
        stalled=restarting or state.state is State.STALLED,
        busy=restarting or verifying,
        rearmed_at=operator.rearmed_at,
    )


@dataclass(frozen=True, slots=True)
class FleetState:
    """Everything the arbiter remembers between cycles (in memory only)."""

    topologies: tuple[Topology, ...]
    stalled_at: tuple[tuple[str, float], ...] = ()  # each group's latest stall verdict
    restarts: tuple[tuple[str, float], ...] = ()  # co-restarts started, for the rolling hour
    busy: tuple[str, ...] = ()  # groups down for a co-restart now
    holds: tuple[Hold, ...] = ()  # refusal episodes, one per refused group
    storm: Storm | None = None
    exempt: tuple[str, ...] = ()  # re-armed by an operator during the storm: acts in it

    def hold_of(self, group: str) -> Hold | None:
        """The group's refusal episode, if it is in one."""
        return next((h for h in self.holds if h.group == group), None)

    def stalled_since(self, now: float, window_seconds: float) -> frozenset[str]:
        """The groups with a stall verdict inside the window ending at `now`."""
        return frozenset(g for g, at in self.stalled_at if now - window_seconds <= at <= now)

    def in_daemon_order(self, groups: frozenset[str]) -> tuple[str, ...]:
        """`groups` in the order of the daemon's config."""
        return tuple(t.group for t in self.topologies if t.group in groups)


def fleet_state(groups: Iterable[GroupSection]) -> FleetState:
    """The arbiter's state at daemon start: nothing stalled, nothing restarted."""
    return FleetState(topologies=tuple(topology(g) for g in groups))


def _storm_now(fleet: FleetState, config: FleetSection, now: float) -> tuple[str, ...]:
    """The stalled groups if they make a storm now, else ()."""
    total = len(fleet.topologies)
    stalled = fleet.stalled_since(now, config.storm_window_seconds)
    if (
        total < 2
        or len(stalled) < config.storm_min_groups
        or len(stalled) <= config.storm_share * total
    ):
        return ()
    # Ordered only once it is a storm: every group's every decision comes here, and walking
    # the whole fleet each time cost O(groups) per decision, O(groups²) per cycle.
    return fleet.in_daemon_order(stalled)


def _declare(
    fleet: FleetState, stalled: tuple[str, ...], config: FleetSection, now: float
) -> Storm:
    window = config.storm_window_seconds
    recent = (g for g, at in fleet.restarts if now - window <= at <= now and g in stalled)
    acted = tuple(dict.fromkeys(recent))
    return Storm(
        started_at=now,
        groups=stalled,
        total=len(fleet.topologies),
        suspects=suspects(stalled, fleet.topologies),
        acted=acted,
        held=tuple(g for g in stalled if g not in acted),
    )


def _release_reason(hold: Hold, seen: GroupView) -> str | None:
    """Why a refusal episode ends with this view of the group, or None while it goes on."""
    if seen.state in SERVING:
        return "recovered"
    if seen.state is State.PAUSED:
        return "paused"
    if seen.state is State.HELD:
        return "held"  # decide()'s own hold (its budget) takes over; `watchdog reset` ends it
    if seen.rearmed_at is not None and seen.rearmed_at > hold.since:
        return "operator"
    return None


@dataclass(frozen=True, slots=True)
class Noted:
    """note()'s result: the new state and what changed that the daemon reports."""

    fleet: FleetState
    released: tuple[Hold, str] | None = None  # a refusal episode over, and why
    declared: Storm | None = None  # a storm begins
    ended: Storm | None = None  # the storm is over


def _seen(fleet: FleetState, group: str, seen: GroupView, now: float) -> FleetState:
    # A group serving again drops its stall verdict: it is no evidence of a shared cause any more.
    # Others keep theirs until it leaves the window (a group verifying after its co-restart
    # still counts: it has not shown that it serves).
    stalled_at = tuple((g, at) for g, at in fleet.stalled_at if g != group)
    if seen.stalled:
        stalled_at = (*stalled_at, (group, now))
    elif seen.state not in SERVING:
        stalled_at = (*stalled_at, *((g, at) for g, at in fleet.stalled_at if g == group))
    busy = tuple(g for g in fleet.busy if g != group) + ((group,) if seen.busy else ())
    return replace(fleet, stalled_at=stalled_at, busy=busy)


def note(fleet: FleetState, group: str, seen: GroupView, config: FleetSection, now: float) -> Noted:
    """Fold in one group's decision: its stall verdict, a hold it leaves, a storm that begins
    or ends."""
    fleet = _seen(fleet, group, seen, now)
    released: tuple[Hold, str] | None = None
    hold = fleet.hold_of(group)
    why = _release_reason(hold, seen) if hold is not None else None
    if hold is not None and why is not None:
        released = (hold, why)
        fleet = replace(fleet, holds=tuple(h for h in fleet.holds if h.group != group))
        if why == "operator" and fleet.storm is not None:
            fleet = replace(fleet, exempt=(*fleet.exempt, group))
    stalled = _storm_now(fleet, config, now)
    if fleet.storm is None and stalled:
        storm = _declare(fleet, stalled, config, now)
        # Groups already waiting for the fleet budget are held by the storm from now on.
        holds = tuple(
            Hold(h.group, STORM, now) if h.group in storm.held else h for h in fleet.holds
        )
        fleet = replace(fleet, storm=storm, holds=holds, exempt=())
        return Noted(fleet, released, declared=storm)
    if fleet.storm is not None and not stalled:
        ended = fleet.storm
        return Noted(replace(fleet, storm=None, exempt=()), released, ended=ended)
    return Noted(fleet, released)


@dataclass(frozen=True, slots=True)
class Ruling:
    """arbitrate()'s answer: act, or refuse for `refused` (first: a new refusal episode)."""

    fleet: FleetState
    refused: str | None = None  # None: act; else FLEET_BUDGET or STORM
    first: bool = False  # the first refusal of this episode: log it
    detail: str = ""


def _refuse(fleet: FleetState, group: str, why: str, detail: str, now: float) -> Ruling:
    old = fleet.hold_of(group)
    first = old is None or old.reason != why
    holds = tuple(h for h in fleet.holds if h.group != group)
    hold = Hold(group, why, now if first or old is None else old.since)
    storm = fleet.storm
    if why == STORM and storm is not None and group not in storm.held:
        groups = storm.groups if group in storm.groups else (*storm.groups, group)
        storm = replace(storm, groups=groups, held=(*storm.held, group))
    busy = tuple(g for g in fleet.busy if g != group)  # note() took the decision as acting
    refused_fleet = replace(fleet, holds=(*holds, hold), storm=storm, busy=busy)
    return Ruling(refused_fleet, why, first, detail)


def _budget_refusal(fleet: FleetState, group: str, config: FleetSection, now: float) -> str:
    """Why the fleet budget refuses a co-restart now ("" when it allows one)."""
    busy = [g for g in fleet.busy if g != group]
    if len(busy) >= config.max_concurrent_restarts:
        return (
            f"{len(busy)} group(s) already down for a co-restart ({', '.join(busy)}); "
            f"[fleet] max_concurrent_restarts is {config.max_concurrent_restarts}"
        )
    hour = [at for _, at in fleet.restarts if now - HOUR_SECONDS <= at <= now]
    if len(hour) >= config.max_restarts_per_hour:
        return (
            f"{len(hour)} co-restarts across the fleet in the last hour; [fleet] "
            f"max_restarts_per_hour is {config.max_restarts_per_hour}"
        )
    return ""


def _storm_refusal(fleet: FleetState, group: str, config: FleetSection) -> str:
    """Why a storm refuses a co-restart of `group` ("" when it allows one)."""
    hold = fleet.hold_of(group)
    storm = fleet.storm
    if hold is not None and hold.reason == STORM:
        return "held by a storm until it recovers on its own or an operator re-arms it"
    if storm is None or group in fleet.exempt:
        return ""
    if group in storm.acted or len(storm.acted) >= config.max_concurrent_restarts:
        return (
            f"storm: {len(storm.groups)} of {storm.total} groups stalled together; "
            f"{len(storm.acted)} co-restarted for it ({', '.join(storm.acted) or 'none'}), the "
            "rest held until they recover or an operator re-arms them"
        )
    return ""


def arbitrate(fleet: FleetState, group: str, config: FleetSection, now: float) -> Ruling:
    """Rule on a co-restart `group` decided at `now`: act (recorded) or refuse, and why."""
    if len(fleet.topologies) < 2:
        return Ruling(fleet)
    storm = _storm_refusal(fleet, group, config)
    if storm:
        return _refuse(fleet, group, STORM, storm, now)
    budget = _budget_refusal(fleet, group, config, now)
    if budget:
        return _refuse(fleet, group, FLEET_BUDGET, budget, now)
    hour = tuple((g, at) for g, at in fleet.restarts if now - HOUR_SECONDS <= at <= now)
    busy = (*(g for g in fleet.busy if g != group), group)
    acted = replace(
        fleet,
        restarts=(*hour, (group, now)),
        busy=busy,
        holds=tuple(h for h in fleet.holds if h.group != group),
    )
    if acted.storm is not None and group not in acted.storm.acted:
        held = tuple(g for g in acted.storm.held if g != group)
        acted = replace(
            acted, storm=replace(acted.storm, acted=(*acted.storm.acted, group), held=held)
        )
    return Ruling(acted)


def withdrawn(fleet: FleetState, group: str, started_at: float) -> FleetState:
    """A co-restart refused before its first step (a host down, the lock held): it restarted
    nothing, so it does not count against the rolling hour nor keep the group busy."""
    restarts = tuple((g, at) for g, at in fleet.restarts if (g, at) != (group, started_at))
    return replace(fleet, restarts=restarts, busy=tuple(g for g in fleet.busy if g != group))


def refused(previous: GroupState, acted: Decision, why: str, detail: str, now: float) -> Decision:
    """The group's decision once the fleet refused its co-restart: nothing restarted, the charge
    taken back, stalled until its next try after backoff_seconds (refused_before_first_step)."""
    state = refused_before_first_step(acted.state, now)
    state = replace(
        state, budget=replace(state.budget, partial_tried=previous.budget.partial_tried)
    )
    told = reason(
        "fleet_refused",
        f"co-restart refused by the fleet ({why}): {detail}",
        refusal=why,
    )
    return replace(acted, state=state, action=Action.NONE, reasons=(*acted.reasons, told))


def rearmed(decision: Decision) -> Decision:
    """The decision of a group an operator released from a fleet hold (`watchdog reset`): its
    backoff is over, so its next stall verdict acts (within the fleet budget) rather than one
    backoff_seconds after its last refusal."""
    state = decision.state
    return replace(decision, state=replace(state, budget=replace(state.budget, backoff_until=0.0)))


def hold_text(hold: Hold, storm: Storm | None) -> str:
    """One line for `watchdog status`: why the fleet holds or defers the group."""
    if hold.reason == STORM:
        shared = ""
        if storm is not None and storm.suspects:
            top = storm.suspects[0]
            shared = f"; shared {top.kind} {top.value}"
        together = f" ({len(storm.groups)} of {storm.total} stalled{shared})" if storm else ""
        return f"storm{together}: held until it recovers or `watchdog reset`"
    return "fleet budget: waiting for its turn"
