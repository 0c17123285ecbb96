"""The fleet-wide outputs (/metrics page, status.json) refreshed once per cycle in a large
fleet, not after every group's cycle (watchdog/run/fleetpace.py)."""

from __future__ import annotations

from watchdog.run.fleetpace import SMALL_FLEET, AfterCycles


def test_small_fleets_refresh_after_every_cycle() -> None:
    """Up to SMALL_FLEET groups: a refresh after every group cycle, as before."""
    for groups in range(1, SMALL_FLEET + 1):
        pace = AfterCycles(groups)
        assert all(pace.cycle_done() for _ in range(3 * groups))


def test_large_fleets_refresh_once_per_round_of_group_cycles() -> None:
    """6, 32 or 128 groups: one refresh per `groups` group cycles (once per cycle_seconds),
    never one per group (the page and status.json cost O(groups) each)."""
    for groups in (SMALL_FLEET + 1, 32, 128):
        pace = AfterCycles(groups)
        due = [pace.cycle_done() for _ in range(3 * groups)]
        assert [i for i, d in enumerate(due) if d] == [groups - 1, 2 * groups - 1, 3 * groups - 1]
