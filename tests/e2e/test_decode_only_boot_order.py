"""End to end: a decode restarted alone is noticed whatever order the units last started in.

Units started together (at boot, by a target) may start prefill a few milliseconds *after* decode.
A rule that asks "did prefill start after decode's previous start?" then says yes forever, and a
later decode-only restart reads as an external co-restart. The daemon must still log
`decode_only_restart_detected` (docs/decisions.md, decode-only restarts).
"""

from __future__ import annotations

import pytest

from sandbox.events import wait_until
from sandbox.namespace import skip_reason
from sandbox.pdsandbox import PdSandbox
from tests.e2e.daemon import DaemonProcess, DaemonSetup, co_restart_stack

pytestmark = [
    pytest.mark.sandbox,
    pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or ""),
]


def _active(pd: PdSandbox, unit: str) -> str:
    return pd.sandbox.unit_property(unit, "ActiveState").strip('"')


def _start_decode_then_prefill(pd: PdSandbox) -> None:
    """Stop both workers, then start decode and, right after it, prefill (as a target might)."""
    decode, prefill = pd.stack.unit("decode"), pd.stack.unit("prefill")
    for unit in (decode, prefill):
        pd.sandbox.queue_unit_job("StopUnit", unit)
    wait_until(
        lambda: all(_active(pd, u) in ("inactive", "failed") for u in (decode, prefill)),
        timeout_seconds=30.0,
        what="both workers stopped",
    )
    pd.sandbox.queue_unit_job("StartUnit", decode)
    pd.sandbox.queue_unit_job("StartUnit", prefill)
    pd.wait_until_serving(timeout_seconds=60.0)


def test_decode_restarted_alone_after_a_boot_that_started_prefill_last(
    pd_serving: PdSandbox,
) -> None:
    """Prefill started a few ms after decode; decode alone restarted later is still detected."""
    pd = pd_serving
    _start_decode_then_prefill(pd)
    starts = pd.start_times_us()
    assert starts["prefill"] > starts["decode"], starts  # the boot order this test is about
    setup = DaemonSetup.write(pd.stack, pd.sandbox.share_dir, "bootorder")
    try:
        with DaemonProcess(setup, pd.env, "--dry-run") as daemon:
            daemon.wait_for_event("state_changed", new="healthy", timeout_seconds=60.0)
            before = pd.start_times_us()
            pd.sandbox.queue_unit_job("RestartUnit", pd.stack.unit("decode"))
            pd.wait_for_new_start("decode", before, timeout_seconds=30.0)
            event = daemon.wait_for_event("decode_only_restart_detected", timeout_seconds=60.0)
            assert daemon.stop() == 0
        after = pd.start_times_us()
        assert after["prefill"] == before["prefill"]  # prefill really kept running
        assert event["group"] == "sbx"
    finally:
        co_restart_stack(pd, setup)
