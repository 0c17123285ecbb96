"""Decide: the pure stall detector (no I/O, no clock, no logging); see docs/decisions.md.

decide(state, observation, config, now) -> Decision, one cycle; after_restart() folds in how a
co-restart went; initial_state() seeds a group at daemon start.
"""

from watchdog.decide.fold import ours
from watchdog.decide.machine import after_restart, decide
from watchdog.decide.state import Decision, GroupState, initial_state
from watchdog.decide.verdict import ACT_VERDICTS, ALERT_VERDICTS, Verdict

__all__ = [
    "ACT_VERDICTS",
    "ALERT_VERDICTS",
    "Decision",
    "GroupState",
    "Verdict",
    "after_restart",
    "decide",
    "initial_state",
    "ours",
]
