"""A slow but serving decode behind the real router, watched by the real daemon, at bench's
compressed cadence (the stack itself lives in bench/slowstack.py, shared with bench.slow_decode).

Several runs go side by side (asyncio.gather): the stacks mostly sleep, a slow decode costs no
CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from bench.harness import COMPRESSED_TIMINGS
from bench.slowstack import (
    ACT_VERDICTS,
    RESTART_EVENTS,
    ROUTER_HEALTH_INTERVAL_S,
    Run,
    Slow,
    act_decisions,
    decode_keys,
    decode_tokens,
)
from bench.slowstack import slow_stack as _slow_stack
from watchdog.configfile import Overrides, merge

# bench's compressed cadence, with the shipped /health deadline (5 s): a real /health answers once
# any output came out of the scheduler, which a decode stepping every 2 s gives within 1-2 s
# (pdsim.engine.Engine.health_check; docs/sglang.md §7.1).
TIMINGS: Overrides = merge(
    COMPRESSED_TIMINGS, {"group": {"probe": {"health_timeout_seconds": 5.0}}}
)
NO_PROGRESS_S = float(TIMINGS["group"]["stall"]["no_progress_seconds"])
CYCLE_S = float(TIMINGS["watchdog"]["cycle_seconds"])


@contextlib.asynccontextmanager
async def slow_stack(
    tmp_path: Path, slow: Slow, timings: Overrides = TIMINGS
) -> AsyncIterator[Run]:
    """bench.slowstack.slow_stack at `timings` (TIMINGS unless given)."""
    async with _slow_stack(tmp_path, slow, timings) as run:
        yield run


__all__ = [
    "ACT_VERDICTS",
    "CYCLE_S",
    "NO_PROGRESS_S",
    "RESTART_EVENTS",
    "ROUTER_HEALTH_INTERVAL_S",
    "TIMINGS",
    "Run",
    "Slow",
    "act_decisions",
    "decode_keys",
    "decode_tokens",
    "slow_stack",
]
