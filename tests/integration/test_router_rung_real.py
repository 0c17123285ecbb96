"""The router rung against pdsim behind the real router: a wedged router is restarted alone.

The router is wedged as bench's `router_wedge` scenario does it (SIGSTOP: connects succeed, nothing
answers); the workers stay healthy, so the daemon's direct PD probes (a prefill and a decode asked
directly with the same bootstrap fields) pass while router probes fail. The dry-run daemon must
call it `router_wedge` and plan the router alone. A transfer stall fails the direct probes too and
keeps the full co-restart. Every process is stopped by its PID.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from bench.slowstack import wait_decision
from tests.integration.test_real_verdicts import real_stack, timings

pytestmark = pytest.mark.slow


async def test_wedged_router_with_healthy_workers_plans_the_router_alone(tmp_path: Path) -> None:
    """A wedged router before healthy workers plans a restart of the router alone."""
    # The direct PD probes start once router probes fail and must answer before the flat clock
    # (6 s compressed) runs out, or the stale decode gauges read as pending work and the verdict
    # is silent_stall: seen under smg on a loaded machine. 15 s leaves them room; which rule
    # wins once their results are in is what the test is about (the flat clock running out
    # before the router rung's is held in decide(): tests/unit/test_router_rung.py).
    async with real_stack(tmp_path, timings(no_progress_seconds=15.0)) as run:
        pid = run.stack.pids["router"]
        os.kill(pid, signal.SIGSTOP)
        try:
            decision = await wait_decision(run, 40.0)
            rehearsed = await run.watchdog.wait_for_event(
                lambda e: e.get("event") == "restart_skipped_dry_run" and e["_at"] >= run.t0,
                10.0,
            )
            planned = run.events_after("restart_planned")
            direct = [
                e
                for e in run.watchdog.events
                if e.get("event") == "probe_failed" and e.get("kind") == "direct"
            ]
        finally:
            os.kill(pid, signal.SIGCONT)
    assert decision is not None, f"no decision:\n{run.decisions_text()}"
    assert decision["verdict"] == "router_wedge", run.decisions_text()
    codes = [r.get("code") for r in decision.get("reasons", [])]
    assert "router_wedge" in codes, decision
    assert rehearsed is not None, run.decisions_text()
    assert planned, run.decisions_text()
    assert planned[0]["rung"] == "router", planned[0]
    assert planned[0]["sequence"] == ["sglang-real-router.service"], planned[0]
    assert planned[0]["dry_run"] is True
    assert direct == [], direct  # the workers answered every direct probe


async def test_transfer_stall_fails_direct_probes_and_keeps_the_full_co_restart(
    tmp_path: Path,
) -> None:
    """A transfer stall fails the direct PD probes too, so it keeps the full co-restart."""
    async with real_stack(tmp_path, timings()) as run:
        await asyncio.to_thread(run.stack.set_fault, "prefill", "transfer_stall")
        decision = await wait_decision(run, 40.0)
        await run.watchdog.wait_for_event(
            lambda e: e.get("event") == "restart_skipped_dry_run" and e["_at"] >= run.t0, 10.0
        )
        # The direct round starts once router probes fail and fails at its own deadline: its
        # result can land in the cycle of the decision or a few after it.
        await run.watchdog.wait_for_event(
            lambda e: (
                e.get("event") == "probe_failed"
                and e.get("kind") == "direct"
                and e["_at"] >= run.t0
            ),
            15.0,
        )
        planned = run.events_after("restart_planned")
        direct = [
            e
            for e in run.events_after("probe_failed")
            if e.get("kind") == "direct" and e["_at"] >= run.t0
        ]
    assert decision is not None, f"no decision:\n{run.decisions_text()}"
    assert decision["verdict"] == "silent_stall", run.decisions_text()
    assert planned, run.decisions_text()
    assert planned[0]["rung"] == "full"
    assert len(planned[0]["sequence"]) == 3
    assert direct, "the direct probes should have failed too"
