"""The watchdog at its shipped defaults against the released sglang 0.5.23 (CPU, mooncake TCP).

One sandbox for the module: a real prefill and decode (decode capped at MAX_RUNNING running
requests, so a modest load can overload it) behind sglang-router 0.3.2 and smg 1.13 at once. The
watchdog under test runs inside the sandbox as a unit, one per router. The tests run in file
order and share the stack: each acting test leaves it co-restarted and verified.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from realsglang.daemon import SHORT_SOAK, SHORT_SOAK_SECONDS, WatchdogUnit
from realsglang.load import load
from realsglang.stack import RealSandbox
from tests.real.conftest import real_sandbox
from watchdog.configfile import Overrides

pytestmark = [pytest.mark.real, pytest.mark.slow]

# States the group may be in on a healthy or busy server.
CALM_STATES = frozenset({"warming", "healthy", "overloaded"})
MAX_RUNNING = 4
ROUTERS = ["sglang-router", "smg"]
# Shipped defaults: a stall is decided within no_progress_seconds (25 s) of the first scrape after
# the fault, plus the probe run that must fail first; the real /health takes 1 s per check.
DETECT_SECONDS = 150.0
# Evidence, then prefill, decode and router each started and gated on readiness (a real server
# loads in 30-65 s on two cores), then 8 verification probes and the tier's short soak (the
# daemons that act run it: realsglang.daemon.SHORT_SOAK).
RECOVER_SECONDS = 420.0 + SHORT_SOAK_SECONDS


@pytest.fixture(scope="module")
def real(real_available: None) -> Iterator[RealSandbox]:
    """The module's real stack (silent mooncake timeouts at the first start)."""
    yield from real_sandbox(
        real_available, decode_args=("--max-running-requests", str(MAX_RUNNING))
    )


@pytest.fixture
def serving(real: RealSandbox) -> RealSandbox:
    """The stack, serving (a previous test may have left it restarting)."""
    real.restore_transfer()
    real.wait_until_serving(timeout_seconds=300.0)
    return real


def _watch(
    real: RealSandbox, name: str, router: str, *, dry_run: bool, overrides: Overrides | None = None
) -> WatchdogUnit:
    unit = WatchdogUnit(real, name, router, dry_run=dry_run, overrides=overrides or {})
    unit.start()
    unit.wait_for_event("state_changed", new="healthy", timeout_seconds=120.0)
    return unit


def _hold(seconds: float) -> None:
    time.sleep(seconds)


def test_idle_moderate_load_and_overload_are_never_acted_on(serving: RealSandbox) -> None:
    """Idle, then a moderate load, then an overload that times the probes out in decode's
    queue: behind both routers, no action verdict; idle and moderate are only ok/overloaded."""
    daemons = [_watch(serving, f"calm-{r}", r, dry_run=True) for r in ROUTERS]
    try:
        _hold(15.0)
        with load(serving, ROUTERS, concurrency=2, max_tokens=64) as moderate:
            _hold(40.0)
        for daemon in daemons:
            assert set(daemon.states()) <= CALM_STATES, daemon.states()
            assert daemon.acted() == [], daemon.acted()
            assert daemon.alerts() == [], daemon.alerts()
        assert moderate.statuses.get(200, 0) > 0, moderate.statuses

        # Every running slot busy with long generations, more waiting: the probes queue behind
        # them past their deadline and fail, while decode delivers tokens the whole time.
        with load(serving, ROUTERS, concurrency=3 * MAX_RUNNING, max_tokens=1500) as heavy:
            _hold(80.0)
        for daemon in daemons:
            assert daemon.acted() == [], daemon.acted()
            assert daemon.events("probe_failed"), "the overload never failed a probe"
        assert heavy.statuses.get(200, 0) > 0, heavy.statuses
    finally:
        for daemon in daemons:
            daemon.stop()


def _assert_co_restarted(real: RealSandbox, daemon: WatchdogUnit, before: dict[str, int]) -> None:
    after = {key: real.start_time_us(key) for key in ("prefill", "decode", daemon.router)}
    assert all(after[k] > before[k] for k in after), (before, after)
    assert after["prefill"] < after["decode"] < after[daemon.router], after
    started = [e["role"] for e in daemon.events("unit_restart_started")]
    assert started == ["prefill", "decode", "router"], started
    finished = daemon.events("unit_restart_finished")
    assert [(e["role"], e["ok"], e["phase"]) for e in finished] == [
        (role, True, "ready") for role in ("prefill", "decode", "router")
    ], finished


def test_silent_transfer_stall_is_co_restarted_and_verified(serving: RealSandbox) -> None:
    """Decode's mooncake data port dropped with long timeouts: /health stays 200, requests hang;
    decided silent_stall, classified transfer_stall from the real journal and processes, the
    real units co-restarted prefill → decode → router and verified with real probes."""
    serving.ensure_mooncake("silent")
    router = "sglang-router"
    daemon = _watch(serving, "stall", router, dry_run=False, overrides=SHORT_SOAK)
    try:
        before = {key: serving.start_time_us(key) for key in ("prefill", "decode", router)}
        serving.drop_transfer()
        # The next test wants mooncake's default timeouts: the co-restart brings them.
        serving.mooncake_timeouts("default")
        # Probes hang and fail while every /health still answers 200: silent.
        daemon.wait_for_event("probe_failed", timeout_seconds=DETECT_SECONDS)
        for key in ("prefill", "decode"):
            assert serving.get(serving.stack.url(key) + "/health", 10.0)[0] == 200, key
        stall = daemon.wait_for_event("stall_detected", timeout_seconds=DETECT_SECONDS)
        assert stall["verdict"] == "silent_stall", stall
        daemon.wait_for_event("unit_restart_started", role="prefill", timeout_seconds=60.0)
        serving.restore_transfer()
        daemon.wait_for_event("verification_passed", timeout_seconds=RECOVER_SECONDS)
        _assert_co_restarted(serving, daemon, before)

        summary, path = daemon.incident()
        classification = summary["classification"]
        assert classification["kind"] == "transfer_stall", classification
        # The real journals' tails (SGLang's own lines: prefill's batches, decode's access log)
        # and the real processes are in the bundle.
        assert "Prefill batch" in (path / "journal-prefill.txt").read_text()
        assert '"GET /health HTTP/1.1" 200' in (path / "journal-decode.txt").read_text()
        processes = json.loads((path / "processes.json").read_text())
        assert "sglang.launch_server" in json.dumps(processes), processes
    finally:
        serving.restore_transfer()
        daemon.stop()


def test_failure_burst_with_default_mooncake_timeouts_is_acted_on(serving: RealSandbox) -> None:
    """With mooncake's default 30 s timeouts a dropped path fails its transfers, counted on both
    sides: acted on (not ignored), co-restarted prefill → decode → router behind smg, verified."""
    serving.ensure_mooncake("default")
    daemon = _watch(serving, "burst", "smg", dry_run=False, overrides=SHORT_SOAK)
    try:
        before = {key: serving.start_time_us(key) for key in ("prefill", "decode", "smg")}
        # Users' requests, not only the watchdog's (which it aborts itself at 12 s, before
        # mooncake's 30 s): theirs run into mooncake's timeout and fail through the retries.
        with load(serving, ["smg"], concurrency=2, max_tokens=16, timeout_seconds=90.0):
            serving.drop_transfer()
            serving.mooncake_timeouts("silent")  # for the servers the co-restart brings
            stall = daemon.wait_for_event("stall_detected", timeout_seconds=DETECT_SECONDS)
            # Acted on, whichever rule saw it first: failures rising (degraded) or tokens flat
            # with work pending (the stall rule, at no_progress_seconds).
            assert stall["verdict"] in ("degraded_bootstrap", "silent_stall"), stall
            daemon.wait_for_event("unit_restart_started", role="prefill", timeout_seconds=60.0)
            serving.restore_transfer()
        daemon.wait_for_event("verification_passed", timeout_seconds=RECOVER_SECONDS)
        _assert_co_restarted(serving, daemon, before)
    finally:
        serving.restore_transfer()
        daemon.stop()


def test_silent_transfer_stall_is_decided_behind_smg(serving: RealSandbox) -> None:
    """The silent stall behind smg: decided silent_stall at the shipped defaults and classified
    transfer_stall (dry run: the full loop behind smg is the failure-burst test's)."""
    serving.ensure_mooncake("silent")
    daemon = _watch(serving, "stall-smg", "smg", dry_run=True)
    try:
        serving.drop_transfer()
        stall = daemon.wait_for_event("stall_detected", timeout_seconds=DETECT_SECONDS)
        assert stall["verdict"] == "silent_stall", stall
        daemon.wait_for_event("restart_skipped_dry_run", timeout_seconds=60.0)
        summary, _ = daemon.incident()
        assert summary["classification"]["kind"] == "transfer_stall", summary["classification"]
        assert daemon.events("unit_restart_started") == []
    finally:
        serving.restore_transfer()
        daemon.stop()
    # Nothing restarted the pair: once the path is back, the held transfers complete (TCP
    # retransmits); the next test starts from a pair that serves.
    serving.wait_for_completion("smg", timeout_seconds=240.0)


def test_decode_restarted_alone_is_detected_co_restarted_and_verified(
    serving: RealSandbox,
) -> None:
    """Someone restarts decode alone (the incident's seed): detected as a decode-only restart,
    the full co-restart follows and is verified."""
    # The one key off its default: decode_only_grace_seconds (60 s) is how long the watchdog
    # lets a decode restarted alone settle before it acts, a wait, not a judgement; 15 s keeps
    # the tier inside its time budget.
    daemon = _watch(
        serving,
        "decode-alone",
        "sglang-router",
        dry_run=False,
        overrides={
            "group": [{"stall": {"decode_only_grace_seconds": 15}, **SHORT_SOAK["group"][0]}]
        },
    )
    try:
        serving.sandbox.queue_unit_job("RestartUnit", serving.stack.unit("decode"))
        detected = daemon.wait_for_event("decode_only_restart_detected", timeout_seconds=180.0)
        assert detected["group"] == daemon.group
        before = {key: serving.start_time_us(key) for key in ("prefill", "decode", "sglang-router")}
        stall = daemon.wait_for_event("stall_detected", timeout_seconds=240.0)
        assert stall["verdict"] == "decode_only_restart", stall
        daemon.wait_for_event("verification_passed", timeout_seconds=RECOVER_SECONDS)
        _assert_co_restarted(serving, daemon, before)
    finally:
        daemon.stop()
