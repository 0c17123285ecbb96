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
#
# And no_progress_seconds 20 s, not bench's 6 s. Progress is decode's tokens beyond our probes'
# plus a slack of 2 per mark (docs/decisions.md, "Signals and how they are read"): a total rate
# must show 3 tokens within no_progress_seconds to read as progress. At 6 s that is 0.5 tok/s, the
# slowest members' rate with a single request running: on two cores busy with other work the
# stack's KV handoff slowed until decode ran one request, and the group was rightly called stalled
# at that margin (busy-machine runs failed so, in the family and in its stall twin). 20 s keeps
# every member far above the margin however slow the machine (0.5 tok/s: 10 tokens of one request
# per window) and still has requests that finish within it (8-16 s) and ones that do not (24-64 s).
# The shipped default (25 s) is measured by make bench-slow.
TIMINGS: Overrides = merge(
    COMPRESSED_TIMINGS,
    {"group": {"probe": {"health_timeout_seconds": 5.0}, "stall": {"no_progress_seconds": 20.0}}},
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
