"""The stall twin of test_slow_decode.py: the same slow load, then the transfer path wedged.

Decode is slow and busy as in test_slow_decode.py (the daemon reads it as slow, never flat); then
prefill's KV transfers stop completing (pdsim's `transfer_stall`, the incident's fault). Decode
finishes what it holds (running, and queued with its KV already received: at 0.5 tokens/s that
takes tens of seconds, and it is real progress) and gets nothing more: the daemon decides a silent
stall within no_progress_seconds plus a cycle of decode's last token, which the test reads from
decode's own counter. Requests are short so that they finish within seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import pytest

from bench.slowstack import wait_decision
from tests.integration.slowdecode import (
    CYCLE_S,
    NO_PROGRESS_S,
    Run,
    Slow,
    act_decisions,
    decode_tokens,
    slow_stack,
)

pytestmark = pytest.mark.slow

SLOW_FIRST_S = 2.5 * NO_PROGRESS_S  # read as slow, not flat, for two windows before the fault
# Generous for a busy machine: the verdict is due no_progress_seconds and a cycle after decode's
# last token; a scrape, a /health and a probe deadline may each run late.
MARGIN_S = 15.0
DRAIN_LIMIT_S = 180.0  # decode finishing what it holds at 0.5 tokens/s: a bound, not a claim
# 0.5 and 5 tokens/s, 1 and 2 decodes, with and without /v1/loads.
FAMILY = (
    Slow(tokens_per_s=0.5, decodes=1, loads=True, slots=8, clients=6, max_tokens=4),
    Slow(tokens_per_s=0.5, decodes=2, loads=False, slots=4, clients=3, max_tokens=4),
    Slow(tokens_per_s=5.0, decodes=2, loads=False, slots=4, clients=3, max_tokens=8),
)


async def _growth_times(run: Run, slow: Slow, into: list[float]) -> None:
    """Append the wall time of every poll that saw decode's token counter grow (until cancelled)."""
    last = await decode_tokens(run, slow.decodes)
    while True:
        await asyncio.sleep(CYCLE_S / 2)
        now = await decode_tokens(run, slow.decodes)
        if now > last:
            into.append(time.time())
        last = now


async def _stall(tmp_path: Path, slow: Slow) -> str:
    async with slow_stack(tmp_path, slow) as run:
        await asyncio.sleep(SLOW_FIRST_S)
        early = act_decisions(run)
        grew: list[float] = []
        poller = asyncio.create_task(_growth_times(run, slow, grew))
        await asyncio.to_thread(run.stack.set_fault, "prefill", "transfer_stall")
        fault_at = time.time()
        try:
            decision = await wait_decision(run, DRAIN_LIMIT_S + NO_PROGRESS_S + MARGIN_S)
        finally:
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller
        problems = []
        if early:
            problems.append(f"acted on while only slow:\n{run.decisions_text()}")
        if decision is None:
            problems.append(f"no decision:\n{run.decisions_text()}")
        elif decision["verdict"] != "silent_stall" or decision["_at"] < fault_at:
            problems.append(f"decided {decision['verdict']}:\n{run.decisions_text()}")
        else:
            took = decision["_at"] - fault_at
            last_token = max((t for t in grew if t <= decision["_at"]), default=fault_at)
            after_last = decision["_at"] - last_token
            print(
                f"{slow.name}: silent_stall {took:.1f}s after the fault, "
                f"{after_last:.1f}s after decode's last token"
            )
            if after_last > NO_PROGRESS_S + CYCLE_S + MARGIN_S:
                problems.append(
                    f"silent_stall {after_last:.1f}s after decode's last token:\n"
                    f"{run.decisions_text()}"
                )
        return f"{slow.name}: " + "; ".join(problems) if problems else ""


async def test_a_slow_decode_whose_transfers_wedge_is_a_silent_stall(tmp_path: Path) -> None:
    """The same slow decode whose transfers then wedge is decided a silent stall at every rate."""
    results = await asyncio.gather(
        *(_stall(tmp_path / f"m{i}", slow) for i, slow in enumerate(FAMILY)),
        return_exceptions=True,
    )
    failures = [repr(r) if isinstance(r, BaseException) else r for r in results if r]
    assert not failures, "\n\n".join(failures)
