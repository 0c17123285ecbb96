"""How often the fleet-wide outputs are refreshed after group cycles: the /metrics page and
status.json cover every group, so refreshing them after each group's cycle costs O(groups) each
time and O(groups²) per cycle. `AfterCycles` refreshes after every k-th group cycle instead,
k = ceil(groups / REFRESHES_PER_CYCLE): a fleet of up to that many groups still refreshes after
every cycle, a larger one about REFRESHES_PER_CYCLE times per cycle_seconds (its loops are
spread over the cycle), so what is served is at most about cycle_seconds / REFRESHES_PER_CYCLE
old. A state change still refreshes at once (Daemon._report_status). Counted, not timed: no
clock, so its behaviour does not depend on how fast the machine runs.
"""

from __future__ import annotations

import math

# 5 at the default 5 s cycle: the page and status.json are at most about a second old.
REFRESHES_PER_CYCLE = 5


class AfterCycles:
    """Says after which group cycles to refresh the fleet-wide outputs."""

    def __init__(self, groups: int, per_cycle: int = REFRESHES_PER_CYCLE) -> None:
        self.every = max(1, math.ceil(groups / per_cycle))
        self._since = 0

    def cycle_done(self) -> bool:
        """One group's cycle ended: whether to refresh now."""
        self._since += 1
        if self._since < self.every:
            return False
        self._since = 0
        return True
