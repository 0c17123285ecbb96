"""One counter, scrape to scrape: counters as SGLang defines them, so bad data never adds.

A counter is read as evidence (failures, attempts, aborts) or as progress (tokens), so bad data
must neither add nor invent anything (docs/decisions.md, "Failure accounting"):
- a series missing from a scrape, or not a finite non-negative number, is unknown: nothing is
  counted and the last known value stays the baseline, so a series that comes back is compared
  with it, never counted again from zero;
- within one process (same unit start time) a counter never goes down, so a lower reading is a
  suspect scrape (a rank or label set missing from the body, a value cut short): recorded,
  nothing counted, and the baseline stays at the higher value it had, so the next true reading
  counts only true growth;
- with a new process a counter counts from zero, once: its whole new value, then growth;
- a series seen for the first time in a process: SGLang creates a labelled series at its first
  increment (docs/sglang.md §3), so its first value may be new growth or its whole life before
  we watched. The caller says which way errs safe (`from_zero`): failures count from zero only
  in a process we saw start (everything in it is after our last count of the one before), and
  otherwise start the baseline and add nothing; counters that only ever argue against acting
  (attempts, aborts, progress) count from zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CounterStep:
    """What one scrape of one counter counts, and what the next scrape is compared with."""

    known: float | None  # the new baseline (None: nothing known of this process yet)
    increase: float  # growth counted at this scrape
    decreased: bool = False  # read lower in the same process: not counted, baseline kept


def readable(value: float | None) -> float | None:
    """A counter's reading, or None where it says nothing (absent, NaN, infinite, negative)."""
    if value is None or not math.isfinite(value) or value < 0:
        return None
    return value


def step(
    known: float | None, current: float | None, *, new_process: bool, from_zero: bool
) -> CounterStep:
    """Fold one reading `current` of a counter whose last known value is `known`.

    `from_zero`: whether a series first seen in this process (nothing known of it yet) counts
    its whole value, or only starts the baseline.
    """
    current = readable(current)
    if current is None:
        # Unknown this scrape; a new process's value will count from zero when it shows.
        return CounterStep(None if new_process else known, 0.0)
    if new_process:
        return CounterStep(current, current)
    if known is None:
        return CounterStep(current, current if from_zero else 0.0)
    if current < known:
        return CounterStep(known, 0.0, decreased=True)
    return CounterStep(current, current - known)
