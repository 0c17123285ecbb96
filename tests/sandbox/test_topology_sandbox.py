"""Two prefills and two decodes behind the real router, as units of a real systemd (2P2D).

The router balances at random over both prefills and both decodes (`--policy random`), so a
fault on one worker reaches only the requests routed to it: probes through the router fail now
and then, and the group's counters keep advancing through the other workers. The watchdog must
still name the worker (docs/decisions.md, "Several workers per role").
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdsim.stack import ROUTER_FAST_ARGS, StackError, http_json
from sandbox.pdsandbox import PdSandbox
from tests.e2e.daemon import TIMINGS, DaemonProcess, DaemonSetup, co_restart_stack
from tests.sandbox.test_sandbox_restart import assert_outcome_ok, co_restart, serves_a_completion
from watchdog.configfile import merge

pytestmark = pytest.mark.sandbox

GROUP = "topo"
PREFILLS = ["prefill", "prefill2"]
DECODES = ["decode", "decode2"]


@pytest.fixture(scope="module")
def pd_2p2d(host_tmp_sentinel: Path) -> Iterator[PdSandbox]:
    """A sandboxed 2P2D stack behind the real router (random load balancing)."""
    pd = PdSandbox.start(
        GROUP,
        ready_timeout_seconds=30.0,
        prefills=2,
        decodes=2,
        router_args=(*ROUTER_FAST_ARGS, "--policy", "random"),
    )
    try:
        yield pd
    finally:
        pd.stop()


@pytest.fixture
def pd(pd_2p2d: PdSandbox) -> Iterator[PdSandbox]:
    """The stack serving; run-time faults cleared and stuck requests released afterwards."""
    pd_2p2d.wait_until_serving(timeout_seconds=30.0)
    yield pd_2p2d
    for key in PREFILLS + DECODES:
        for method, path in (("DELETE", "/_sim/fault"), ("POST", "/_sim/release")):
            with contextlib.suppress(OSError, StackError):
                http_json(method, pd_2p2d.stack.url(key) + path, timeout_s=2.0)


class ClientLoad:
    """Clients with long timeouts sending completions through the router from threads: the
    requests routed to a stalled prefill stay in its queue, as real clients' would."""

    def __init__(self, url: str, clients: int = 6) -> None:
        self.url = url + "/v1/completions"
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(clients)]

    def _run(self, i: int) -> None:
        with httpx.Client(trust_env=False, timeout=60) as http:
            while not self.stop.is_set():
                body = {"model": "pdsim", "prompt": f"client {i}", "max_tokens": 4}
                with contextlib.suppress(httpx.HTTPError):
                    http.post(self.url, json=body)
                self.stop.wait(0.2)

    def __enter__(self) -> ClientLoad:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()


def test_transfer_stall_on_prefill_two_is_detected_and_named(pd: PdSandbox) -> None:
    """A transfer stall on prefill #2 only: the dry-run daemon detects it and names prefill#2."""
    setup = DaemonSetup.write(pd.stack, pd.sandbox.share_dir, "stall2")
    before = pd.start_times_us()
    load = ClientLoad(pd.stack.url("router"))
    with DaemonProcess(setup, pd.env, "--dry-run") as daemon:
        daemon.wait_for_event("state_changed", new="healthy", timeout_seconds=60.0)
        http_json("POST", pd.stack.url("prefill2") + "/_sim/fault", {"kind": "transfer_stall"})
        try:
            with load:
                stall = daemon.wait_for_event("stall_detected", timeout_seconds=60.0)
                daemon.wait_for_event("restart_skipped_dry_run", timeout_seconds=30.0)
        finally:
            for method, path in (("DELETE", "/_sim/fault"), ("POST", "/_sim/release")):
                http_json(method, pd.stack.url("prefill2") + path)
            for thread in load.threads:
                thread.join(timeout=30)
        assert daemon.stop() == 0
    assert pd.start_times_us() == before  # dry run: nothing restarted
    assert stall["verdict"] == "silent_stall", stall
    stuck = [r for r in stall["reasons"] if r["code"] == "worker_stalled"]
    assert stuck, stall["reasons"]
    # prefill#2 is named and prefill#1 never is. A decode may be named beside it: once every
    # client waits on a request routed through prefill#2, a decode's transfer queue holds those
    # requests while it completes nothing (seen on a busy machine), which is what the rule says.
    named = stuck[0]["workers"].split(", ")
    assert "prefill#2" in named, stuck
    assert "prefill#1" not in named, stuck
    pending = next(r for r in stall["reasons"] if r["code"] == "work_pending")
    assert "prefill#2_inflight_queue" in pending["message"]
    # The incident records the verdict's reasons, which name the suspect.
    summaries = list((setup.state_dir / "incidents").glob("*/summary.json"))
    assert summaries, list(setup.state_dir.iterdir())
    summary = json.loads(summaries[-1].read_text())
    assert "prefill#2" in json.dumps(summary["decision_reasons"])
    report = (summaries[-1].parent / "report.md").read_text()
    assert "| suspected worker(s) | prefill#2" in report, report
    # The bundle holds every worker: its unit, journal and process tree, each named.
    incident = summaries[-1].parent
    units = {u["worker"]: u for u in json.loads((incident / "units.json").read_text())}
    workers = ["prefill#1", "prefill#2", "decode#1", "decode#2"]
    assert list(units) == [*workers, "router"], list(units)
    processes = {p["worker"]: p for p in json.loads((incident / "processes.json").read_text())}
    items = {i["name"] for i in json.loads((incident / "items.json").read_text())}
    for worker in workers:
        assert units[worker]["state"]["main_pid"] > 0, units[worker]
        assert worker in processes, list(processes)
        # The daemon runs outside the sandbox, whose journal it cannot reach: each worker's
        # journal item is there with its reason (tests/unit/test_evidence_workers.py reads them).
        assert units[worker]["journal"] is not None, units[worker]
        assert {f"journal:{worker}", f"processes:{worker}", f"unit:{worker}"} <= items, items


async def test_co_restart_of_every_worker_in_order(pd: PdSandbox) -> None:
    """Both prefills start before both decodes, which start before the router; it serves."""
    before = pd.start_times_us()
    outcome = await co_restart(pd)
    assert_outcome_ok(outcome, pd)
    after = pd.start_times_us()
    assert all(after[key] > before[key] for key in before), (before, after)
    assert max(after[k] for k in PREFILLS) < min(after[k] for k in DECODES)
    assert max(after[k] for k in DECODES) < after["router"]
    assert [s.phase for s in outcome.steps] == ["ready"] * 5
    assert await serves_a_completion(pd)


def test_decode_two_restarted_alone_is_decode_only(pd: PdSandbox) -> None:
    """`systemctl restart` of decode #2 alone is a decode-only restart naming decode#2."""
    setup = DaemonSetup.write(pd.stack, pd.sandbox.share_dir, "dec2")
    try:
        with DaemonProcess(setup, pd.env, "--dry-run") as daemon:
            daemon.wait_for_event("state_changed", new="healthy", timeout_seconds=60.0)
            before = pd.start_times_us()
            unit = pd.stack.unit("decode2")
            pd.sandbox.queue_unit_job("RestartUnit", unit)
            pd.wait_for_new_start("decode2", before, timeout_seconds=30.0)
            event = daemon.wait_for_event("decode_only_restart_detected", timeout_seconds=60.0)
            assert daemon.stop() == 0
        after = pd.start_times_us()
        assert {k: after[k] for k in (*PREFILLS, "decode")} == {
            k: before[k] for k in (*PREFILLS, "decode")
        }
        assert event["group"] == GROUP
        assert "decode#2 (prefill#1, prefill#2)" in json.dumps(event["reasons"]), event
    finally:
        co_restart_stack(pd, setup)


def test_prefill_two_restarted_alone_restarts_prefill_one_then_the_decodes(pd: PdSandbox) -> None:
    """`systemctl restart` of prefill #2 alone: every decode pairs with it, and with prefill #1,
    which kept running; restarting the decodes under prefill #1 would be a decode-only restart
    (pdsim degrades it, as the incident did), so the survivor rung restarts prefill #1, then
    both decodes, then the router, and not prefill #2 again (docs/decisions.md, "Restart
    rungs")."""
    timings = merge(TIMINGS, {"group": {"stall": {"decode_only_grace_seconds": 2.0}}})
    setup = DaemonSetup.write(pd.stack, pd.sandbox.share_dir, "pre2", timings)
    try:
        with DaemonProcess(setup, pd.env) as daemon:
            daemon.wait_for_event("state_changed", new="healthy", timeout_seconds=60.0)
            before = pd.start_times_us()
            pd.sandbox.queue_unit_job("RestartUnit", pd.stack.unit("prefill2"))
            fresh = pd.wait_for_new_start("prefill2", before, timeout_seconds=30.0)
            detected = daemon.wait_for_event("prefill_only_restart_detected", timeout_seconds=60.0)
            daemon.wait_for_event("verification_passed", timeout_seconds=120.0)
            assert daemon.stop() == 0
        after = pd.start_times_us()
    finally:
        pd.wait_until_serving(timeout_seconds=60.0)

    assert after["prefill"] > before["prefill"], (before, after)
    assert after["prefill2"] == fresh["prefill2"], (fresh, after)  # not restarted again
    assert max(after[k] for k in PREFILLS) < min(after[k] for k in DECODES), after
    assert max(after[k] for k in DECODES) < after["router"], after
    why = next(r for r in detected["reasons"] if r["code"] == "prefill_only_restart")
    assert "prefill#2 started" in why["message"], why
    (planned,) = daemon.events("restart_planned")
    assert planned["rung"] == "survivor", planned
    assert planned["sequence"] == [
        pd.stack.unit("prefill"),
        *(pd.stack.unit(k) for k in DECODES),
        pd.stack.unit("router"),
    ], planned
    (stall,) = daemon.events("stall_detected")
    rung = next(r for r in stall["reasons"] if r["code"] == "rung")
    assert rung["stale_prefills"] == "prefill#1", rung
