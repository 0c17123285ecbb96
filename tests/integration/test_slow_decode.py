"""A slow but serving decode is never restarted, under both routers.

Decode makes 0.5 to 5 tokens a second per request with its slots busy, so the daemon's probes
wait in its queue and time out there; 1 or 2 decodes; with and without /v1/loads; requests that
finish within no_progress_seconds (20 s here: tests/integration/slowdecode.py says why) and
requests that do not (then only the per-iteration counters show progress). For at least three minutes the daemon must decide nothing with an action:
decode's tokens beyond its own probes' (counted exactly; health checks add none) are progress
(docs/decisions.md, "Progress"). The four members run side by side (tests/integration/
slowdecode.py). The bench measures the lowest rate read as progress at the shipped defaults
(bench/results.md, python -m bench.slow_decode).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.integration.slowdecode import Slow, act_decisions, decode_tokens, slow_stack

pytestmark = pytest.mark.slow

WINDOW_S = 180.0
FAMILY = (
    # 0.5 tok/s: 64 s requests (none finishes within no_progress_seconds: only realtime_tokens_total
    # and decode_moments can show progress) and 16 s ones; 2 and 5 tok/s: 32 s and 24 s.
    Slow(tokens_per_s=0.5, decodes=1, loads=True, slots=8, clients=10, max_tokens=32),
    Slow(tokens_per_s=0.5, decodes=2, loads=False, slots=4, clients=6, max_tokens=8),
    Slow(tokens_per_s=2.0, decodes=1, loads=False, slots=4, clients=6, max_tokens=64),
    Slow(tokens_per_s=5.0, decodes=2, loads=True, slots=8, clients=10, max_tokens=120),
)


async def _watch(tmp_path: Path, slow: Slow) -> str:
    """Run one member for WINDOW_S; what went wrong with it ("" when nothing did)."""
    async with slow_stack(tmp_path, slow) as run:
        before = await decode_tokens(run, slow.decodes)
        await asyncio.sleep(WINDOW_S)
        after = await decode_tokens(run, slow.decodes)
        acted = act_decisions(run)
        failed_probes = run.events_after("probe_failed")
        problems = []
        if acted:
            problems.append(f"acted on:\n{run.decisions_text()}")
        # The scenario is the issue's: decode kept generating while the probes failed.
        if after - before < slow.tokens_per_s * WINDOW_S:
            problems.append(f"decode generated only {after - before:g} tokens")
        if len(failed_probes) < 10:
            problems.append(f"only {len(failed_probes)} probes failed: not saturated")
        return f"{slow.name}: " + "; ".join(problems) if problems else ""


async def test_a_slow_decode_is_never_restarted(tmp_path: Path) -> None:
    """A slow but serving decode, at every rate of the family, is never restarted."""
    results = await asyncio.gather(
        *(_watch(tmp_path / f"m{i}", slow) for i, slow in enumerate(FAMILY)),
        return_exceptions=True,
    )
    failures = [repr(r) if isinstance(r, BaseException) else r for r in results if r]
    assert not failures, "\n\n".join(failures)
