"""One wedged DP rank of decode, behind the real router: the pinned probes find it and name it.

The decode runs `--dp-size 4` (pdsim models the DP controller's routing, pdsim/dp.py) and rank 2
stalls before its first token (`decode_stall_midstream` with `dp_rank` 2); ranks 0, 1 and 3 keep
serving, so most router probes pass. The dry-run daemon, told `dp_size = 4`, sends a direct PD
probe pinned to each rank and must log `stall_detected` naming `decode dp_rank 2`, with the full
co-restart planned. Every process is stopped by its PID.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from bench.harness import GroupTarget, WatchdogProcess
from pdsim.stack import REAL_SGLANG, StackConfig, StackPorts, free_ports, start_stack
from tests.integration.test_real_verdicts import (
    HEALTHY_TIMEOUT_S,
    LIGHT_LOAD,
    ROUTER_ARGS,
    Run,
    timings,
    wait_decision,
)
from watchdog.configfile import config_text

pytestmark = pytest.mark.slow

DP_SIZE = 4
WEDGED = 2


async def test_a_wedged_dp_rank_is_detected_by_the_pinned_probes_and_named(
    tmp_path: Path,
) -> None:
    ports = StackPorts(*free_ports(5))
    (metrics_port,) = free_ports(1)
    config = StackConfig(
        compat=REAL_SGLANG,
        router_args=ROUTER_ARGS,
        worker_args=("--no-access-log",),
        decode_args=("--dp-size", str(DP_SIZE)),
        ports=ports,
        log_dir=tmp_path / "stack",
    )
    stack = await asyncio.to_thread(start_stack, config)
    target = GroupTarget(
        name="real",
        prefill_url=stack.prefill_url,
        decode_url=stack.decode_url,
        router_url=stack.router_url,
        router_metrics_url=stack.router_metrics_url,
    )
    group = target.overrides()
    group["prefill"]["bootstrap_port"] = ports.bootstrap
    group["decode"]["dp_size"] = DP_SIZE
    group["probe"] = {"dp_probe_every_seconds": 1.0}
    own = {
        "watchdog": {
            "state_dir": str(tmp_path / "state"),
            "metrics_listen": f"127.0.0.1:{metrics_port}",
        },
        "group": [group],
    }
    config_path = tmp_path / "watchdog.toml"
    config_path.write_text(config_text(timings(), own))
    watchdog = WatchdogProcess(config_path, dry_run=True, log_path=tmp_path / "watchdog.log")
    run = Run(stack, watchdog)
    try:
        await watchdog.start()
        run.start_load(LIGHT_LOAD)
        healthy = await watchdog.wait_for_event(
            lambda e: e.get("event") == "state_changed" and e.get("new") == "healthy",
            HEALTHY_TIMEOUT_S,
        )
        assert healthy is not None, f"never healthy:\n{watchdog.tail(40)}"
        run.t0 = time.time()
        await asyncio.to_thread(
            stack.set_fault, "decode", "decode_stall_midstream", after_tokens=0, dp_rank=WEDGED
        )
        decision = await wait_decision(run, 40.0)
        await watchdog.wait_for_event(
            lambda e: e.get("event") == "restart_skipped_dry_run" and e["_at"] >= run.t0, 10.0
        )
        planned = run.events_after("restart_planned")
        failed = [
            e
            for e in run.events_after("probe_failed")
            if e.get("kind") == "direct" and e["_at"] >= run.t0
        ]
    finally:
        await run.stop_loads()
        await watchdog.stop()
        await asyncio.to_thread(stack.stop)
    assert decision is not None, f"no decision:\n{run.decisions_text()}"
    assert decision["verdict"] == "silent_stall", run.decisions_text()
    (rank,) = [r for r in decision["reasons"] if r.get("code") == "dp_rank_stalled"]
    assert rank["workers"] == f"decode dp_rank {WEDGED}", rank
    assert planned, run.decisions_text()
    assert planned[0]["rung"] == "full"
    # Only the wedged rank's pinned probes failed: the other ranks answered every one. (An
    # unpinned direct probe, sent while a router probe failed, may land on rank 2 too.)
    details = [str(e.get("detail", "")) for e in failed]
    assert any(f"dp_rank {WEDGED}" in d for d in details), details
    serving = [r for r in range(DP_SIZE) if r != WEDGED]
    assert not [d for d in details for r in serving if f"dp_rank {r}" in d], details
