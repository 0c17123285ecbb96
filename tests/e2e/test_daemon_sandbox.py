"""End to end: the real daemon against a real systemd (PID 1 of a private namespace).

The simulated prefill and decode and the real sglang-router run as units of the sandboxed systemd
(sandbox/); the watchdog runs as `.venv/bin/watchdog` with compressed timings, either as a
subprocess on the sandbox's bus or as a Type=notify unit inside the sandbox. Faults are injected
through pdsim's `/_sim/fault`. One sandbox serves the whole module; every scenario stops its own
daemon by PID and leaves the stack serving for the next one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdsim.stack import http_json
from sandbox.events import wait_until
from sandbox.namespace import UnitSpec, skip_reason
from sandbox.pdsandbox import PdSandbox
from tests.e2e.daemon import (
    TIMINGS,
    WATCHDOG_BIN,
    DaemonProcess,
    DaemonSetup,
    MetricsWatcher,
    co_restart_stack,
    current_state,
    is_subsequence,
    sample,
    scrape,
    total,
)
from tests.sandbox.fixtures import clear_runtime_faults
from watchdog.configfile import merge
from watchdog.statefiles import history_path, lock_path, read_lock_holder

pytestmark = [
    pytest.mark.sandbox,
    pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or ""),
]

GROUP = "sbx"  # the stack name of tests.sandbox.fixtures.pd_sandbox
ORDER = ["prefill", "decode", "router"]
# Generous bounds for waits (never assertions about speed): a stall is detected in ~6 s here.
STALL_WAIT_SECONDS = 60.0
WATCHDOG_UNIT = "sglang-watchdog.service"
WATCHDOG_SEC = 4
RESTART_SEC = 2  # how long Result=watchdog stays readable before the restart


@pytest.fixture
def pd(pd_serving: PdSandbox) -> Iterator[PdSandbox]:
    """The module's stack, serving; faults set at run time are cleared afterwards."""
    yield pd_serving
    clear_runtime_faults(pd_serving)


def inject(pd: PdSandbox, role: str, kind: str, **params: object) -> None:
    """Set a fault at run time (gone when the process restarts)."""
    http_json("POST", pd.stack.url(role) + "/_sim/fault", {"kind": kind, **params})


def wait_healthy(daemon: DaemonProcess) -> None:
    """Until the daemon has warmed up on the serving stack."""
    daemon.wait_for_event("state_changed", new="healthy", timeout_seconds=30.0)


def history(setup: DaemonSetup) -> dict[str, Any]:
    """The group's restart history file, parsed (it must be valid JSON)."""
    data: dict[str, Any] = json.loads(history_path(setup.state_dir, GROUP).read_text())
    return data


def test_transfer_stall_is_detected_co_restarted_and_verified(pd: PdSandbox) -> None:
    """A transfer stall on prefill: detected, co-restart prefill → decode → router, verified."""
    setup = DaemonSetup.write(pd.stack, pd.sandbox.share_dir, "corestart")
    before = pd.start_times_us()
    with (
        DaemonProcess(setup, pd.env) as daemon,
        MetricsWatcher(setup.metrics_url) as watcher,
    ):
        wait_healthy(daemon)
        inject(pd, "prefill", "transfer_stall")
        stall = daemon.wait_for_event("stall_detected", timeout_seconds=STALL_WAIT_SECONDS)
        daemon.wait_for_event("verification_passed", timeout_seconds=60.0)
        # The watcher's own latest scrape, so its state sequence ends where the daemon did.
        samples = wait_until(
            lambda: (s := watcher.latest()) and current_state(s, GROUP) == "healthy" and s,
            timeout_seconds=10.0,
            what="state healthy on the metrics endpoint after verification",
        )
        assert daemon.stop() == 0
    after = pd.start_times_us()

    # Real restarts, in order: each unit started again, prefill before decode before router.
    assert all(after[role] > before[role] for role in ORDER), (before, after)
    assert after["prefill"] < after["decode"] < after["router"]
    started = [e["role"] for e in daemon.events("unit_restart_started")]
    assert started == ORDER
    finished = daemon.events("unit_restart_finished")
    assert [(e["role"], e["ok"], e["phase"]) for e in finished] == [
        (role, True, "ready") for role in ORDER
    ]
    (sequence,) = daemon.events("restart_sequence_finished")
    assert sequence["ok"] is True
    assert sequence["dry_run"] is False
    assert stall["verdict"] == "silent_stall"
    (planned,) = daemon.events("restart_planned")
    assert planned["rung"] == "full", planned  # a transfer stall fails the direct probes too
    changes = [(e["old"], e["new"]) for e in daemon.events("state_changed")]
    acted = [("healthy", "restarting"), ("restarting", "verifying"), ("verifying", "healthy")]
    assert changes[-3:] == acted, changes
    assert daemon.events("evidence_captured", group=GROUP)

    # The metrics endpoint showed every step while it happened.
    assert is_subsequence(["healthy", "restarting", "verifying", "healthy"], watcher.states(GROUP))
    # While restarting: the stall is counted, the restart not yet (it counts when it is done).
    assert watcher.first(
        lambda s: (
            current_state(s, GROUP) == "restarting"
            and total(s, "sglang_watchdog_stalls_detected_total", group=GROUP) == 1
            and sample(s, "sglang_watchdog_restarts_total", group=GROUP, result="done") == 0
        )
    )
    assert total(samples, "sglang_watchdog_stalls_detected_total", group=GROUP) == 1
    assert (
        sample(samples, "sglang_watchdog_stalls_detected_total", group=GROUP, kind=stall["verdict"])
        == 1
    )
    assert sample(samples, "sglang_watchdog_restarts_total", group=GROUP, result="done") == 1
    assert sample(samples, "sglang_watchdog_restarts_total", group=GROUP, result="failed") == 0
    assert sample(samples, "sglang_watchdog_restarts_total", group=GROUP, result="dry_run") == 0
    last = sample(samples, "sglang_watchdog_last_restart_timestamp_seconds", group=GROUP)
    assert last is not None
    assert last >= after["router"] / 1e6  # the sequence finished after the router started
    assert sample(samples, "sglang_watchdog_state", group=GROUP, state="healthy") == 1

    # The restart is in the persisted history.
    record = history(setup)["restarts"][-1]
    assert record["ok"] is True
    assert record["interrupted"] is False
    assert [s["phase"] for s in record["steps"]] == ["ready", "ready", "ready"]


def test_wedged_router_with_healthy_workers_is_restarted_alone_and_verified(
    pd: PdSandbox,
) -> None:
    """SIGSTOP of the router unit's main process (bench's router_wedge): the direct PD probes
    pass, so the daemon restarts the router alone, leaves both workers running, and verifies."""
    # The direct PD probes must answer before the flat clock runs out (5 s compressed), or the
    # verdict is silent_stall before any direct result: 15 s leaves them room on a busy machine.
    # Once they pass, the flat clock running out before the router rung's is held in decide()
    # (router_suspected; tests/unit/test_router_rung.py has the race, cycle by cycle).
    # A direct probe that times out says the pair does not serve: its 3 s compressed deadline
    # is raised, as a loaded machine may answer a direct probe late.
    timings = merge(
        TIMINGS,
        {
            "group": {
                "stall": {"no_progress_seconds": 15.0},
                "probe": {"timeout_seconds": 6.0, "stream_idle_seconds": 4.0},
            }
        },
    )
    setup = DaemonSetup.write(pd.stack, pd.sandbox.share_dir, "routerwedge", timings)
    router = pd.stack.unit("router")
    before = pd.start_times_us()
    with DaemonProcess(setup, pd.env) as daemon:
        wait_healthy(daemon)
        # A stopped process keeps its sockets: connects succeed and nothing answers. systemd's
        # stop sends SIGCONT right after SIGTERM, so the restart needs no SIGKILL.
        pid = pd.sandbox.kill_unit(router, signal.SIGSTOP)
        try:
            stall = daemon.wait_for_event("stall_detected", timeout_seconds=STALL_WAIT_SECONDS)
            planned = daemon.wait_for_event("restart_planned", timeout_seconds=10.0)
            daemon.wait_for_event("verification_passed", timeout_seconds=60.0)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)  # the test failed before the restart replaced it
        assert daemon.stop() == 0
    after = pd.start_times_us()

    assert stall["verdict"] == "router_wedge", json.dumps(stall["reasons"], indent=1)
    assert planned["rung"] == "router", planned
    assert planned["dry_run"] is False
    assert planned["sequence"] == [router], planned
    # Only the router was restarted: the workers (and their KV bootstrap state) kept running.
    assert after["router"] > before["router"], (before, after)
    assert (after["prefill"], after["decode"]) == (before["prefill"], before["decode"])
    assert [e["role"] for e in daemon.events("unit_restart_started")] == ["router"]
    finished = daemon.events("unit_restart_finished")
    assert [(e["role"], e["ok"], e["phase"]) for e in finished] == [("router", True, "ready")]
    (sequence,) = daemon.events("restart_sequence_finished")
    assert sequence["ok"] is True
    assert daemon.events("verification_failed") == []
    record = history(setup)["restarts"][-1]
    assert record["ok"] is True
    assert [s["role"] for s in record["steps"]] == ["router"]
    # The incident says which rung was taken and why.
    (opened,) = daemon.events("incident_opened", group=GROUP)
    summary = json.loads((Path(opened["path"]) / "summary.json").read_text())
    assert summary["action"]["rung"] == "router"
    assert "\nrung: router — " in (Path(opened["path"]) / "report.md").read_text()


def assert_status_healthy(setup: DaemonSetup, daemon: DaemonProcess) -> None:
    """`watchdog status`, run while the daemon runs, reads the daemon's own status: the daemon
    holds the lock, the group's line says healthy, exit 0."""
    done = subprocess.run(
        [str(WATCHDOG_BIN), "--config", str(setup.config_path), "status"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"daemon running on state_dir {setup.state_dir} (pid {daemon.pid})")
    assert "dry run" in lines[0]
    (line,) = [row for row in lines if row.split()[:1] == [GROUP]]
    assert line.split()[1] == "healthy"


def test_dry_run_detects_the_same_stall_and_restarts_nothing(pd: PdSandbox) -> None:
    """With --dry-run the stall is detected and the plan logged, but no unit restarts."""
    setup = DaemonSetup.write(pd.stack, pd.sandbox.share_dir, "dryrun")
    before = pd.start_times_us()
    with DaemonProcess(setup, pd.env, "--dry-run") as daemon:
        wait_healthy(daemon)
        assert_status_healthy(setup, daemon)
        inject(pd, "prefill", "transfer_stall")
        stall = daemon.wait_for_event("stall_detected", timeout_seconds=STALL_WAIT_SECONDS)
        skipped = daemon.wait_for_event("restart_skipped_dry_run", timeout_seconds=30.0)
        samples = wait_until(
            lambda: (
                (s := daemon.metrics())
                and sample(s, "sglang_watchdog_restarts_total", group=GROUP, result="dry_run") == 1
                and s
            ),
            timeout_seconds=10.0,
            what="restarts_total{result=dry_run} = 1",
        )
        assert daemon.stop() == 0

    assert pd.start_times_us() == before
    assert daemon.events("unit_restart_started") == []
    assert skipped["sequence"] == [pd.stack.unit(role) for role in ORDER]
    (planned,) = daemon.events("restart_planned")
    assert planned["dry_run"] is True
    (sequence,) = daemon.events("restart_sequence_finished")
    assert sequence["dry_run"] is True
    # Detection is the one of the real run: same verdict, same counters.
    assert stall["verdict"] == "silent_stall"
    assert total(samples, "sglang_watchdog_stalls_detected_total", group=GROUP) == 1
    assert sample(samples, "sglang_watchdog_restarts_total", group=GROUP, result="done") == 0
    assert sample(samples, "sglang_watchdog_restarts_total", group=GROUP, result="failed") == 0
    # A rehearsal is not a restart: no last-restart time.
    assert not sample(samples, "sglang_watchdog_last_restart_timestamp_seconds", group=GROUP)


def test_sigterm_during_co_restart_exits_cleanly_and_is_reported_next_start(
    pd: PdSandbox,
) -> None:
    """SIGTERM while prefill 'loads': clean exit, history records it, the next start reports it."""
    setup = DaemonSetup.write(pd.stack, pd.sandbox.share_dir, "interrupted", TIMINGS)
    # Persisted (fault file): the restarted prefill answers /health 503 for a minute, so the
    # co-restart waits in its first step long enough to be interrupted there.
    pd.stack.set_start_faults("prefill", [{"kind": "slow_start", "seconds": 60}])
    before = pd.start_times_us()
    try:
        with DaemonProcess(setup, pd.env) as daemon:
            wait_healthy(daemon)
            inject(pd, "prefill", "transfer_stall")
            daemon.wait_for_event(
                "unit_restart_started", role="prefill", timeout_seconds=STALL_WAIT_SECONDS
            )
            wait_until(
                lambda: pd.start_times_us()["prefill"] > before["prefill"],
                timeout_seconds=20.0,
                what="prefill restarted (now in its slow start)",
            )
            # The restart job is done; the daemon is waiting for prefill's readiness.
            code = daemon.stop(
                signal.SIGTERM, timeout_seconds=TIMINGS["watchdog"]["shutdown_timeout_seconds"] + 25
            )
        assert code == 0, daemon.output()[-3000:]
        after = pd.start_times_us()
        assert after["prefill"] > before["prefill"]
        assert (after["decode"], after["router"]) == (before["decode"], before["router"])
        assert daemon.events("shutdown_requested")
        assert daemon.events("shutdown_deadline_exceeded") == []
        assert daemon.events("watchdog_stopped")
        (sequence,) = daemon.events("restart_sequence_finished")
        assert sequence["interrupted"] is True
        assert sequence["ok"] is False

        record = history(setup)["restarts"][-1]
        assert record["interrupted"] is True
        assert record["ok"] is False
        assert [(s["role"], s["phase"]) for s in record["steps"]] == [
            ("prefill", "interrupted"),
            ("decode", "not_started"),
            ("router", "not_started"),
        ]
        # Nothing half-written or still held is left behind.
        assert read_lock_holder(lock_path(setup.state_dir, GROUP)) is None
        assert [p.name for p in setup.state_dir.iterdir() if ".tmp" in p.name] == []

        # The next start reads the history and says what was left undone.
        second = dataclasses.replace(setup, log_path=setup.log_path.with_name("second.log"))
        with DaemonProcess(second, pd.env, name="second daemon") as again:
            event = again.wait_for_event("previous_restart_interrupted", timeout_seconds=30.0)
            assert again.stop() == 0
        assert event["group"] == GROUP
        assert event["steps"] == ["prefill:interrupted", "decode:not_started", "router:not_started"]
        assert event["started_at"] == record["started_at"]
    finally:
        pd.stack.set_start_faults("prefill", [])
        co_restart_stack(pd, setup)


def _watchdog_unit(setup: DaemonSetup) -> UnitSpec:
    """systemd/sglang-watchdog.service without User= and the hardening a sandbox cannot apply."""
    return UnitSpec(
        name=WATCHDOG_UNIT,
        description="SGLang PD liveness watchdog (sandbox)",
        exec_start=[str(WATCHDOG_BIN), "--config", str(setup.config_path), "--log-format", "json"],
        service_type="notify",
        restart="on-failure",
        working_directory=str(setup.state_dir),
        timeout_stop_seconds=10,
        extra_service=[
            "NotifyAccess=main",
            f"WatchdogSec={WATCHDOG_SEC}s",
            f"RestartSec={RESTART_SEC}s",
            "RestartPreventExitStatus=2",
            # The watchdog kill is SIGABRT: no core file (core_pattern may point at the cwd).
            "LimitCORE=0",
            "TimeoutAbortSec=2s",
        ],
        wanted=False,
    )


def test_watchdog_runs_as_notify_unit_and_systemd_restarts_a_wedged_loop(
    pd: PdSandbox,
) -> None:
    """Type=notify reaches active; a SIGSTOPped loop stops the pings and systemd restarts it."""
    setup = DaemonSetup.write(pd.stack, pd.sandbox.share_dir, "unit")
    box = pd.sandbox

    def service(name: str) -> str:
        return box.unit_property(WATCHDOG_UNIT, name, "Service")

    def active() -> bool:
        return box.unit_property(WATCHDOG_UNIT, "ActiveState") == "active"

    box.add_unit(_watchdog_unit(setup), start=True)
    try:
        wait_until(active, timeout_seconds=30.0, what=f"{WATCHDOG_UNIT} active (READY=1)")
        first_pid = service("MainPID")
        assert first_pid not in ("", "0")
        restarts = int(service("NRestarts"))
        wait_until(
            lambda: (s := scrape(setup.metrics_url)) and current_state(s, GROUP) == "healthy",
            timeout_seconds=30.0,
            what="the unit's daemon healthy on its metrics endpoint",
        )
        # Alive past WatchdogSec: its pings arrive (otherwise systemd would have killed it).
        entered_us = int(box.unit_property(WATCHDOG_UNIT, "ActiveEnterTimestamp"))
        wait_until(
            lambda: time.time() - entered_us / 1e6 > WATCHDOG_SEC + 1,
            timeout_seconds=30.0,
            what=f"{WATCHDOG_SEC + 1} s of uptime",
        )
        assert service("MainPID") == first_pid
        assert int(service("NRestarts")) == restarts

        box.kill_unit(WATCHDOG_UNIT, signal.SIGSTOP)
        # Result= is reset when the unit starts again; RestartSec= leaves it readable meanwhile.
        wait_until(
            lambda: service("Result") == "watchdog",
            timeout_seconds=30.0,
            poll=0.05,
            what="systemd's watchdog timeout (Result=watchdog)",
        )
        wait_until(
            lambda: (
                int(service("NRestarts") or 0) > restarts
                and service("MainPID") not in ("", "0", first_pid)
                and active()
            ),
            timeout_seconds=30.0,
            what="systemd to restart the unit (READY=1 again)",
        )
    finally:
        box.queue_unit_job("StopUnit", WATCHDOG_UNIT, check=False)
        wait_until(
            lambda: box.unit_property(WATCHDOG_UNIT, "ActiveState") in ("inactive", "failed"),
            timeout_seconds=30.0,
            what=f"{WATCHDOG_UNIT} stopped",
        )
