"""One DP rank of decode wedged, or only slow, behind the real router: acted on, or not.

The decode runs `--dp-size 4` (pdsim models the DP controller's routing and each rank's own
`dp_rank` series and /v1/loads row, pdsim/dp.py) under closed-loop client load. The dry-run
daemon, told `dp_size = 4`, sends a direct PD probe pinned to each rank and reads each rank's
own decode tokens (docs/decisions.md, "DP-attention ranks"):

- rank 2 wedged (`decode_stall_midstream` with `dp_rank` 2): its pinned probes fail while the
  others pass, and its tokens stop while it holds the requests routed to it: `silent_stall`
  naming `decode dp_rank 2` (the full co-restart: a DP rank cannot be restarted alone);
- rank 1 only slow (`slow_decode` with `dp_rank` 1): its pinned probes time out just the same,
  but its tokens grow with the clients' requests on it: never a restart.

Every process is stopped by its PID.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bench.harness import LoadProfile
from bench.slowstack import RESTART_EVENTS, wait_decision
from tests.integration.test_real_verdicts import real_stack, timings

# The rank is found by direct probes pinned to it and judged by its own counters, neither of
# which passes the router: `make test` runs this module under sglang-router only.
pytestmark = [pytest.mark.slow, pytest.mark.router_agnostic]

DP_SIZE = 4
EXTRA = {"decode": {"dp_size": DP_SIZE}, "probe": {"dp_probe_every_seconds": 1.0}}
DECODE_ARGS = ("--dp-size", str(DP_SIZE))
# Closed-loop clients whose short requests land on every rank in turn: a slow rank keeps some
# of them, so its own tokens keep growing beyond our pinned probes'.
CLIENTS = LoadProfile(clients=4, max_tokens=8, think_seconds=0.2, timeout_seconds=30.0)


async def test_a_wedged_dp_rank_whose_tokens_stop_is_a_silent_stall_naming_it(
    tmp_path: Path,
) -> None:
    """One DP rank whose tokens stop is a silent stall naming that rank, not a busy decode."""
    wedged = 2
    async with real_stack(
        tmp_path, timings(), decode_args=DECODE_ARGS, background=CLIENTS, group_extra=EXTRA
    ) as run:
        await asyncio.to_thread(
            run.stack.set_fault, "decode", "decode_stall_midstream", after_tokens=0, dp_rank=wedged
        )
        decision = await wait_decision(run, 60.0)
        failed = [
            e
            for e in run.events_after("probe_failed")
            if e.get("kind") == "direct" and e["_at"] >= run.t0
        ]
    assert decision is not None, run.decisions_text()
    assert decision["verdict"] == "silent_stall", run.decisions_text()
    (rank,) = [r for r in decision["reasons"] if r.get("code") == "dp_rank_stalled"]
    assert rank["workers"] == f"decode dp_rank {wedged}", rank
    assert [r for r in decision["reasons"] if r.get("code") == "dp_rank_tokens_flat"], decision
    # Only the wedged rank's pinned probes failed: the other ranks answered every one. (An
    # unpinned direct probe, sent while a router probe failed, may land on rank 2 too.)
    details = [str(e.get("detail", "")) for e in failed]
    assert any(f"dp_rank {wedged}" in d for d in details), details
    serving = [r for r in range(DP_SIZE) if r != wedged]
    assert not [d for d in details for r in serving if f"dp_rank {r}" in d], details


async def test_a_slow_dp_rank_whose_tokens_grow_is_never_restarted(tmp_path: Path) -> None:
    """A slow DP rank whose tokens still grow is at most an alert, never a co-restart."""
    slow = 1
    async with real_stack(
        tmp_path, timings(), decode_args=DECODE_ARGS, background=CLIENTS, group_extra=EXTRA
    ) as run:
        await asyncio.to_thread(
            run.stack.set_fault, "decode", "slow_decode", tokens_per_s=0.5, dp_rank=slow
        )
        alert = await run.watchdog.wait_for_event(
            lambda e: (
                e.get("event") == "alert"
                and e.get("verdict") == "dp_rank_wedged"
                and e["_at"] >= run.t0
            ),
            40.0,
        )
        # Never a restart decision for it: watch well past no_progress_seconds (6 s) more.
        decision = await wait_decision(run, 20.0)
        restarts = [e for e in run.all_events(RESTART_EVENTS) if e["_at"] >= run.t0]
    assert alert is not None, f"no alert:\n{run.decisions_text()}"
    (rank,) = [r for r in alert["reasons"] if r.get("code") == "dp_rank_stalled"]
    assert rank["workers"] == f"decode dp_rank {slow}", rank
    # Its tokens were read, per rank, and grew: busy, not wedged (not "progress unknown").
    assert [r for r in alert["reasons"] if r.get("code") == "rank_not_flat"], alert
    assert decision is None, run.decisions_text()
    assert restarts == [], run.decisions_text()
