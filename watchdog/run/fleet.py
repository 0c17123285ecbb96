"""The daemon's side of the fleet arbiter (watchdog/decide/fleet.py): its state, shared by every
group loop, and what it logs and counts.

The loops run on one asyncio thread and a cycle calls `rule()` with no await between noting a
decision and ruling on it, so the shared state needs no lock: whichever group asks first, acts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import structlog

from watchdog.config import FleetSection, GroupSection
from watchdog.decide import Decision, GroupState
from watchdog.decide.fleet import (
    FleetState,
    Hold,
    Storm,
    arbitrate,
    fleet_state,
    hold_text,
    note,
    rearmed,
    refused,
    view,
    withdrawn,
)
from watchdog.model import Action, OperatorControls
from watchdog.run.metrics import WatchdogMetrics

log = structlog.get_logger()


class FleetArbiter:
    """One per daemon with two or more groups: notes every decision, rules on co-restarts."""

    def __init__(
        self,
        config: FleetSection,
        groups: Iterable[GroupSection],
        *,
        metrics: WatchdogMetrics,
        on_storm: Callable[[Storm], None],
        on_storm_ended: Callable[[Storm], None] | None = None,
    ) -> None:
        self.config = config
        self.state: FleetState = fleet_state(groups)
        self.metrics = metrics
        self.on_storm = on_storm  # the daemon's one place where a storm is reported
        self.on_storm_ended = on_storm_ended

    def rule(
        self,
        group: str,
        previous: GroupState,
        decision: Decision,
        operator: OperatorControls,
        now: float,
    ) -> Decision:
        """The group's decision as the fleet allows it: unchanged, or its co-restart refused."""
        noted = note(self.state, group, view(decision, operator), self.config, now)
        self.state = noted.fleet
        if noted.released is not None:
            hold, why = noted.released
            log.info(
                "fleet_hold_released",
                group=group,
                reason=hold.reason,
                released_by=why,
                held_seconds=round(now - hold.since, 3),
            )
            if why == "operator":
                decision = rearmed(decision)
        if noted.ended is not None:
            self._storm_ended(noted.ended, now)
        if decision.action is Action.CO_RESTART:
            decision = self._arbitrate(group, previous, decision, now)
        if noted.declared is not None and self.state.storm is not None:
            # After the ruling: the group that declared it may be the one the storm acts on.
            self.metrics.count_storm()
            self.metrics.set_storm_active(True)
            self.on_storm(self.state.storm)
        return decision

    def _arbitrate(
        self, group: str, previous: GroupState, decision: Decision, now: float
    ) -> Decision:
        ruling = arbitrate(self.state, group, self.config, now)
        self.state = ruling.fleet
        if ruling.refused is None:
            return decision
        self.metrics.count_refusal(group, ruling.refused)
        if ruling.first:  # once per episode: the next tries are counted, not logged
            self.metrics.count_stall(group, str(decision.verdict))
            log.warning(
                "fleet_restart_refused",
                group=group,
                reason=ruling.refused,
                verdict=str(decision.verdict),
                detail=ruling.detail,
                effect="nothing restarted, not charged to the group's budget; asks again "
                "after backoff_seconds",
            )
        return refused(previous, decision, ruling.refused, ruling.detail, now)

    def _storm_ended(self, storm: Storm, now: float) -> None:
        self.metrics.set_storm_active(False)
        log.info(
            "storm_ended",
            groups=list(storm.groups),
            duration_seconds=round(now - storm.started_at, 3),
            still_held=[h.group for h in self.state.holds if h.group in storm.held],
        )
        if self.on_storm_ended is not None:
            self.on_storm_ended(storm)

    def withdraw(self, group: str, started_at: float) -> None:
        """A co-restart refused before its first step: it used no fleet budget."""
        self.state = withdrawn(self.state, group, started_at)

    def hold(self, group: str) -> Hold | None:
        """The group's refusal episode, if it is in one."""
        return self.state.hold_of(group)

    def hold_text(self, group: str) -> str:
        """Why the fleet holds or defers the group, for `watchdog status` ("" when it does not)."""
        hold = self.state.hold_of(group)
        return "" if hold is None else hold_text(hold, self.state.storm)
