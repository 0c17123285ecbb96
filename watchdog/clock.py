"""The clock every time-dependent part takes as a parameter."""

from __future__ import annotations

from collections.abc import Callable

Clock = Callable[[], float]
"""Wall-clock seconds since the epoch (`time.time` in production).

Injected rather than read directly so tests drive time by hand and decisions stay reproducible.
"""
