"""One counter, scrape to scrape: missing is unknown, a drop counts only with a new process.

A counter is read as evidence (failures, attempts, aborts) or as progress (tokens), so bad data
must neither add nor invent anything (docs/decisions.md, "Failure accounting"):
- a series missing from a scrape, or not a finite non-negative number, is unknown: nothing is
  counted and the last known value stays the baseline, so a series that comes back is compared
  with it, never counted again from zero;
- a counter that went down while its process stayed the same (same unit start time) is bad data:
  recorded, the baseline re-set to the new value, nothing counted;
- with a new process a counter counts from zero, once: its whole new value, then growth;
- a series seen for the first time in a process counts from zero too: SGLang creates a labelled
  series at its first increment (docs/sglang.md §3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CounterStep:
    """What one scrape of one counter counts, and what the next scrape is compared with."""

    known: float | None  # the new baseline (None: nothing known of this process yet)
    increase: float  # growth counted at this scrape
    decreased: bool = False  # went down in the same process: not counted, baseline re-set


def readable(value: float | None) -> float | None:
    """A counter's reading, or None where it says nothing (absent, NaN, infinite, negative)."""
    if value is None or not math.isfinite(value) or value < 0:
        return None
    return value


def step(known: float | None, current: float | None, *, new_process: bool) -> CounterStep:
    """Fold one reading `current` of a counter whose last known value is `known`."""
    current = readable(current)
    if current is None:
        # Unknown this scrape; a new process's value will count from zero when it shows.
        return CounterStep(None if new_process else known, 0.0)
    if new_process or known is None:
        return CounterStep(current, current)
    if current < known:
        return CounterStep(current, 0.0, decreased=True)
    return CounterStep(current, current - known)
