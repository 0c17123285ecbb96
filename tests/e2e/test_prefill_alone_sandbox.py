"""End to end: a prefill killed and brought back alone by systemd takes the survivor rung.

The prefill unit has Restart=on-failure (this module's sandbox only). Its main process is killed
with SIGKILL; systemd starts it again alone, so decode keeps KV-transfer bootstrap state for the
old prefill process. The daemon must restart decode, then the router, never the prefill, and
verify the result (docs/decisions.md, "Restart rungs"). Only the units' start timestamps and the
daemon's events are asserted: bounds on waits are generous, never claims about speed.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

from sandbox.events import wait_until
from sandbox.namespace import skip_reason
from sandbox.pdsandbox import PdSandbox
from tests.e2e.daemon import TIMINGS, DaemonProcess, DaemonSetup, co_restart_stack
from watchdog.configfile import merge

pytestmark = [
    pytest.mark.sandbox,
    pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or ""),
]

GROUP = "surv"
# The grace after the fresh prefill serves, short here: nobody restarts decode by hand.
SURVIVOR_TIMINGS = merge(TIMINGS, {"group": {"stall": {"decode_only_grace_seconds": 2.0}}})


@pytest.fixture(scope="module")
def pd(host_tmp_sentinel: object) -> Iterator[PdSandbox]:
    """A sandboxed stack whose prefill unit systemd restarts after a crash (Restart=on-failure)."""
    stack = PdSandbox.start(GROUP, restart={"prefill": "on-failure"})
    try:
        yield stack
    finally:
        stack.stop()


def _n_restarts(pd: PdSandbox, key: str) -> int:
    return int(pd.sandbox.unit_property(pd.stack.unit(key), "NRestarts", "Service") or 0)


def test_prefill_killed_and_restarted_alone_takes_the_survivor_rung(pd: PdSandbox) -> None:
    """kill -9 of prefill: systemd brings it back; the daemon restarts decode, then the router."""
    setup = DaemonSetup.write(pd.stack, pd.sandbox.share_dir, "survivor", SURVIVOR_TIMINGS)
    prefill = pd.stack.unit("prefill")
    try:
        with DaemonProcess(setup, pd.env) as daemon:
            daemon.wait_for_event("state_changed", new="healthy", timeout_seconds=60.0)
            before = pd.start_times_us()
            restarts_before = _n_restarts(pd, "prefill")
            pd.sandbox.kill_unit(prefill, signal.SIGKILL)
            fresh = pd.wait_for_new_start("prefill", before, timeout_seconds=60.0)
            detected = daemon.wait_for_event("prefill_only_restart_detected", timeout_seconds=60.0)
            daemon.wait_for_event("verification_passed", timeout_seconds=120.0)
            assert daemon.stop() == 0
        after = pd.start_times_us()
    finally:
        pd.wait_until_serving(timeout_seconds=60.0)

    # systemd restarted the prefill (its own Restart=), before anything else moved.
    assert _n_restarts(pd, "prefill") == restarts_before + 1
    assert fresh["decode"] == before["decode"]
    assert fresh["router"] == before["router"]
    # The watchdog did not restart the prefill again; it restarted decode, then the router,
    # each after every process it depends on.
    assert after["prefill"] == fresh["prefill"], (fresh, after)
    assert after["prefill"] < after["decode"] < after["router"], after
    assert after["decode"] > before["decode"]

    assert detected["group"] == GROUP
    why = next(r for r in detected["reasons"] if r["code"] == "prefill_only_restart")
    assert "prefill started" in why["message"]
    assert "by systemd's Restart=" in why["message"]
    (planned,) = daemon.events("restart_planned")
    assert planned["rung"] == "survivor", planned
    assert planned["sequence"] == [pd.stack.unit("decode"), pd.stack.unit("router")]
    assert [e["role"] for e in daemon.events("unit_restart_started")] == ["decode", "router"]
    finished = daemon.events("unit_restart_finished")
    assert [(e["role"], e["ok"]) for e in finished] == [("decode", True), ("router", True)]
    (stall,) = daemon.events("stall_detected")
    assert stall["verdict"] == "prefill_only_restart"
    assert daemon.events("evidence_captured", group=GROUP)


def test_router_restarted_alone_restarts_no_worker(pd: PdSandbox) -> None:
    """`systemctl restart` of the router alone: it holds no KV bootstrap state, so the daemon
    restarts nothing, warms up and is healthy again through the new router."""
    setup = DaemonSetup.write(pd.stack, pd.sandbox.share_dir, "routeralone", SURVIVOR_TIMINGS)
    with DaemonProcess(setup, pd.env) as daemon:
        daemon.wait_for_event("state_changed", new="healthy", timeout_seconds=60.0)
        before = pd.start_times_us()
        healthy_before = len(daemon.events("state_changed", new="healthy"))
        pd.sandbox.queue_unit_job("RestartUnit", pd.stack.unit("router"))
        pd.wait_for_new_start("router", before, timeout_seconds=30.0)
        wait_until(
            lambda: any(
                "router_restarted_alone" in [r["code"] for r in e["reasons"]]
                for e in daemon.events("state_changed", new="warming")
            ),
            timeout_seconds=60.0,
            what="warming up after the router restarted alone",
        )
        wait_until(
            lambda: len(daemon.events("state_changed", new="healthy")) > healthy_before,
            timeout_seconds=60.0,
            what="healthy again through the new router",
        )
        assert daemon.stop() == 0
    after = pd.start_times_us()
    assert {k: after[k] for k in ("prefill", "decode")} == {
        k: before[k] for k in ("prefill", "decode")
    }, (before, after)
    assert daemon.events("restart_planned") == []
    assert daemon.events("unit_restart_started") == []
    assert daemon.events("stall_detected") == []


# "judge": direct PD probes every second judge the pair; pdsim's decode runs 0.5.23 (it refreshes
# a restarted prefill's stale bootstrap metadata after one failed room: docs/sglang.md §7.11).
JUDGED_TIMINGS = merge(
    TIMINGS,
    {
        "group": {
            "probe": {"direct_every_seconds": 1.0},
            "stall": {"decode_only_grace_seconds": 5.0, "on_prefill_only_restart": "judge"},
        }
    },
)


def test_prefill_restarted_alone_is_judged_and_only_alerted(pd: PdSandbox) -> None:
    """With "judge", the pair recovers by itself on 0.5.23: an alert, nothing restarted."""
    setup = DaemonSetup.write(pd.stack, pd.sandbox.share_dir, "judged", JUDGED_TIMINGS)
    try:
        with DaemonProcess(setup, pd.env) as daemon:
            daemon.wait_for_event("state_changed", new="healthy", timeout_seconds=60.0)
            before = pd.start_times_us()
            pd.sandbox.kill_unit(pd.stack.unit("prefill"), signal.SIGKILL)
            fresh = pd.wait_for_new_start("prefill", before, timeout_seconds=60.0)
            daemon.wait_for_event("prefill_only_restart_detected", timeout_seconds=60.0)
            alert = daemon.wait_for_event(
                "alert", verdict="prefill_only_restart", timeout_seconds=120.0
            )
            assert daemon.stop() == 0
        after = pd.start_times_us()
    finally:
        pd.wait_until_serving(timeout_seconds=60.0)

    why = next(r for r in alert["reasons"] if r["code"] == "prefill_only_recovered")
    assert (why["pairs"], why["version"]) == ("prefill+decode", "0.5.23"), why
    assert after == fresh, (fresh, after)  # nothing restarted after systemd's own restart
    assert daemon.events("restart_planned") == []
    assert daemon.events("stall_detected") == []


def test_stack_is_left_serving(pd: PdSandbox) -> None:
    """The module leaves its stack as it found it (a co-restart if a scenario broke it)."""
    if not pd.router_ready():
        co_restart_stack(pd, DaemonSetup.write(pd.stack, pd.sandbox.share_dir, "cleanup"))
    pd.wait_until_serving(timeout_seconds=60.0)
