"""decide() that decides a stall once: for the in-process daemon tests that need one co-restart
(in a dry run) without staging a real stall on the stack they watch."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest

from watchdog.config import GroupSection
from watchdog.decide import Decision, GroupState, Verdict, decide
from watchdog.model import Action, Observation, State
from watchdog.run import cycle


@dataclass(frozen=True)
class StallOnce:
    """The real decide(), except that its first call decides a silent stall and a co-restart
    (the group `restarting` from then); it keeps every decision it returned, in order."""

    decided: list[Decision] = field(default_factory=list)

    def __call__(
        self, state: GroupState, observation: Observation, group: GroupSection, now: float
    ) -> Decision:
        decision = decide(state, observation, group, now)
        if not self.decided:
            restarting = replace(decision.state, state=State.RESTARTING, since=now)
            decision = Decision(restarting, Verdict.SILENT_STALL, Action.CO_RESTART, ())
        self.decided.append(decision)
        return decision


def stall_once(monkeypatch: pytest.MonkeyPatch) -> StallOnce:
    """Make the daemon's cycles decide with a new StallOnce, which the test can then read."""
    stall = StallOnce()
    monkeypatch.setattr(cycle, "decide", stall)
    return stall
