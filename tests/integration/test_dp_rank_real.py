"""One wedged DP rank of decode, behind the real router: the pinned probes find it and name it.

The decode runs `--dp-size 4` (pdsim models the DP controller's routing, pdsim/dp.py) and rank 2
stalls before its first token (`decode_stall_midstream` with `dp_rank` 2); ranks 0, 1 and 3 keep
serving, so most router probes pass. The dry-run daemon, told `dp_size = 4`, sends a direct PD
probe pinned to each rank and must alert `dp_rank_wedged` naming `decode dp_rank 2`, and plan no
restart: a rank whose queue is only long fails its pinned probes alike, and per-rank progress is
not read yet (docs/decisions.md, "DP-attention ranks"). Every process is stopped by its PID.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bench.slowstack import wait_decision
from tests.integration.test_real_verdicts import real_stack, timings

pytestmark = pytest.mark.slow

DP_SIZE = 4
WEDGED = 2


async def test_a_wedged_dp_rank_is_found_by_the_pinned_probes_named_and_not_restarted(
    tmp_path: Path,
) -> None:
    extra = {"decode": {"dp_size": DP_SIZE}, "probe": {"dp_probe_every_seconds": 1.0}}
    decode_args = ("--dp-size", str(DP_SIZE))
    async with real_stack(tmp_path, timings(), decode_args=decode_args, group_extra=extra) as run:
        await asyncio.to_thread(
            run.stack.set_fault, "decode", "decode_stall_midstream", after_tokens=0, dp_rank=WEDGED
        )
        alert = await run.watchdog.wait_for_event(
            lambda e: (
                e.get("event") == "alert"
                and e.get("verdict") == "dp_rank_wedged"
                and e["_at"] >= run.t0
            ),
            40.0,
        )
        # Never a restart decision for it: watch 10 s more.
        decision = await wait_decision(run, 10.0)
        failed = [
            e
            for e in run.events_after("probe_failed")
            if e.get("kind") == "direct" and e["_at"] >= run.t0
        ]
    assert alert is not None, f"no alert:\n{run.decisions_text()}"
    (rank,) = [r for r in alert["reasons"] if r.get("code") == "dp_rank_stalled"]
    assert rank["workers"] == f"decode dp_rank {WEDGED}", rank
    assert decision is None, run.decisions_text()
    assert not run.events_after("restart_planned"), run.decisions_text()
    # Only the wedged rank's pinned probes failed: the other ranks answered every one. (An
    # unpinned direct probe, sent while a router probe failed, may land on rank 2 too.)
    details = [str(e.get("detail", "")) for e in failed]
    assert any(f"dp_rank {WEDGED}" in d for d in details), details
    serving = [r for r in range(DP_SIZE) if r != WEDGED]
    assert not [d for d in details for r in serving if f"dp_rank {r}" in d], details
