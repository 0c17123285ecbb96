"""How often the fleet-wide outputs are refreshed after group cycles: the /metrics page and
status.json cover every group, so refreshing them after each group's cycle costs O(groups) each
time and O(groups²) per cycle (at 32 groups the page render was the largest single cost).

A fleet of up to SMALL_FLEET groups refreshes after every group cycle, as a daemon always did. A
larger one refreshes after every `groups`-th group cycle: once per cycle_seconds, its loops being
spread over the cycle, so what is served is at most about one cycle old, as a one-group daemon's
page is between its cycles. A state change still refreshes at once (Daemon._report_status).
Counted, not timed: no clock, so its behaviour does not depend on how fast the machine runs.
"""

from __future__ import annotations

SMALL_FLEET = 5


class AfterCycles:
    """Says after which group cycles to refresh the fleet-wide outputs."""

    def __init__(self, groups: int) -> None:
        self.every = 1 if groups <= SMALL_FLEET else groups
        self._since = 0

    def cycle_done(self) -> bool:
        """One group's cycle ended: whether to refresh now."""
        self._since += 1
        if self._since < self.every:
            return False
        self._since = 0
        return True
