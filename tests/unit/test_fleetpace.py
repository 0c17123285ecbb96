"""The fleet-wide outputs (/metrics page, status.json) refreshed about REFRESHES_PER_CYCLE times
per cycle, not after every group's cycle (watchdog/run/fleetpace.py)."""

from __future__ import annotations

from watchdog.run.fleetpace import REFRESHES_PER_CYCLE, AfterCycles


def _refreshes(groups: int, cycles: int) -> int:
    pace = AfterCycles(groups)
    return sum(pace.cycle_done() for _ in range(groups * cycles))


def test_small_fleets_refresh_after_every_cycle() -> None:
    """Up to REFRESHES_PER_CYCLE groups: a refresh after every group cycle, as before."""
    for groups in range(1, REFRESHES_PER_CYCLE + 1):
        pace = AfterCycles(groups)
        assert pace.every == 1
        assert all(pace.cycle_done() for _ in range(3 * groups))


def test_large_fleets_refresh_a_bounded_number_of_times_per_cycle() -> None:
    """32 or 128 groups: at most REFRESHES_PER_CYCLE refreshes per round of group cycles, never
    one per group (the page and status.json cost O(groups) each)."""
    for groups in (6, 32, 128, 1000):
        refreshes = _refreshes(groups, cycles=10)
        assert refreshes <= REFRESHES_PER_CYCLE * 10, groups
        assert refreshes >= (REFRESHES_PER_CYCLE - 2) * 10, groups


def test_refreshes_come_after_every_kth_cycle() -> None:
    """128 groups: every 26th group cycle, so what is served is at most 25 group cycles old."""
    pace = AfterCycles(128)
    assert pace.every == 26
    pattern = [pace.cycle_done() for _ in range(52)]
    assert [i for i, due in enumerate(pattern) if due] == [25, 51]
