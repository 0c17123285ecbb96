"""End to end: verification as a soak, and a group that never comes up, against a real systemd.

The simulated stack and the real router run as units of the sandboxed systemd; the watchdog runs
as `.venv/bin/watchdog` with compressed timings (tests/e2e/daemon.py). A relapse inside the soak
is the fault coming back once the group came back from the co-restart (docs/decisions.md,
"Verification is a soak"); a deploy that never serves is every unit started again with a fault
read at start (docs/decisions.md, "Never healthy"). Waits are generous bounds, never claims about
speed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from pdsim.stack import http_json
from sandbox.namespace import skip_reason
from sandbox.pdsandbox import PdSandbox
from tests.e2e.daemon import (
    TIMINGS,
    DaemonProcess,
    DaemonSetup,
    co_restart_stack,
    restart_every_unit,
)
from tests.sandbox.fixtures import clear_runtime_faults
from watchdog.configfile import merge
from watchdog.evidence.incident import IncidentStore

# The soak and never_healthy rules read probes, counters and unit starts; which router carries
# the probes changes none of it, so `make test` runs this module under sglang-router only.
pytestmark = [
    pytest.mark.router_agnostic,
    pytest.mark.sandbox,
    pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or ""),
]

# A soak long enough for the fault to come back inside it on a busy machine (the probe period is
# 1 s here, so 30 probes fit in it many times over).
SOAK_TIMINGS = merge(TIMINGS, {"group": {"restart": {"soak_probes": 30, "soak_seconds": 90.0}}})
RELAPSE_CAUSES = {
    "relapse_probes_failing",
    "relapse_stall_verdict",
    "relapse_decode_flat",
    "new_transfer_failures",
}
# How long the never-healthy group is watched after its page (well past startup_timeout_seconds
# and no_progress_seconds of TIMINGS): a slow machine only judges fewer cycles in it.
WATCH_SECONDS = 20.0


@pytest.fixture
def pd(pd_serving: PdSandbox) -> Iterator[PdSandbox]:
    """The module's stack, serving; faults set at run time are cleared afterwards."""
    yield pd_serving
    clear_runtime_faults(pd_serving)


def inject(pd: PdSandbox, role: str, kind: str) -> None:
    """Set a fault at run time (gone when the process restarts)."""
    http_json("POST", pd.stack.url(role) + "/_sim/fault", {"kind": kind})


def test_a_stall_that_returns_inside_the_soak_fails_verification_as_one_incident(
    pd: PdSandbox,
) -> None:
    """Transfer stall → co-restart → the group comes back (soak_started) → the stall returns:
    verification_failed with the relapse, one co-restart, one incident."""
    setup = DaemonSetup.write(pd.stack, pd.sandbox.share_dir, "relapse", SOAK_TIMINGS)
    with DaemonProcess(setup, pd.env) as daemon:
        daemon.wait_for_event("state_changed", new="healthy", timeout_seconds=60.0)
        inject(pd, "prefill", "transfer_stall")
        daemon.wait_for_event("stall_detected", timeout_seconds=60.0)
        came_back = daemon.wait_for_event("soak_started", timeout_seconds=90.0)
        inject(pd, "prefill", "transfer_stall")  # the co-restart cleared it; now it returns
        failed = daemon.wait_for_event("verification_failed", timeout_seconds=90.0)
        assert daemon.stop() == 0

    assert failed["relapse"] is True, failed
    soak = failed["soak"]
    assert soak["relapse"].startswith("relapse during soak after "), soak
    assert soak["relapse_cause"] in RELAPSE_CAUSES, soak
    assert soak["soak_probes_passed"] >= came_back["soak"]["soak_probes_passed"] >= 3
    assert soak["soak_probes_passed"] < 30  # the soak had not held yet
    assert not daemon.events("verification_passed")
    assert len(daemon.events("restart_planned")) == 1  # backoff_seconds 600: no second attempt
    incidents = IncidentStore(setup.state_dir, keep=50, max_mib=200).list_incidents()
    assert len(incidents) == 1, incidents
    assert incidents[0].verification == "failed"
    summary = json.loads(
        (setup.state_dir / "incidents" / incidents[0].id / "summary.json").read_text()
    )
    assert summary["verification"]["soak"]["relapse"] == soak["relapse"]


def _deploy(pd: PdSandbox, setup: DaemonSetup) -> None:
    """Every unit started again in order, by someone other than the daemon (a deploy)."""
    restart_every_unit(pd, setup, "test deploy")


def test_a_deploy_that_never_serves_is_paged_never_healthy_and_not_restarted(
    pd: PdSandbox,
) -> None:
    """Units started again with a transfer stall from the start: never_healthy, alerted once,
    the units' start timestamps unchanged afterwards (0 restarts)."""
    setup = DaemonSetup.write(pd.stack, pd.sandbox.share_dir, "never", TIMINGS)
    try:
        with DaemonProcess(setup, pd.env) as daemon:
            daemon.wait_for_event("state_changed", new="healthy", timeout_seconds=60.0)
            pd.stack.set_start_faults("prefill", [{"kind": "transfer_stall"}])
            _deploy(pd, setup)
            deployed = pd.start_times_us()
            daemon.wait_for_event("alert", verdict="never_healthy", timeout_seconds=90.0)
            time.sleep(WATCH_SECONDS)
            still = pd.start_times_us()
            assert daemon.stop() == 0
    finally:
        pd.stack.set_start_faults("prefill", [])
    try:
        assert still == deployed, (deployed, still)
        assert not daemon.events("stall_detected")
        assert not daemon.events("restart_planned")
        assert len(daemon.events("alert", verdict="never_healthy")) == 1
        paged = daemon.events("state_changed", verdict="never_healthy")
        assert paged, daemon.output()[-3000:]
        assert paged[-1]["new"] == "degraded"
        codes = [r["code"] for r in paged[-1]["reasons"]]
        assert "never_healthy" in codes, codes
    finally:
        co_restart_stack(pd, setup)  # the next test wants the stack serving, without the fault
