"""A PD group over two hosts: two sandboxed systemds, the second one reached through a real sshd.

Sandbox A (the watchdog's local bus) runs prefill and the router; sandbox B runs decode and a real
OpenSSH server on a 127.0.0.1 port. The watchdog reaches B's systemd only over SSH: B's system bus
forwarded to a local socket, EXTERNAL auth as the remote user's uid.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry

from pdsim.stack import REPO_ROOT, StackError, free_ports, http_json
from sandbox.events import wait_until
from sandbox.namespace import SystemdSandbox
from sandbox.pdsandbox import PdSandbox
from sandbox.pdunits import PdStackUnits
from sandbox.sshd import UNIT as SSHD_UNIT
from sandbox.sshd import SshdFiles, make_sshd_files, sshd_skip_reason
from tests.e2e.daemon import TIMINGS, DaemonProcess, DaemonSetup
from watchdog.act.hosts import UnitBuses, targets_of
from watchdog.act.plan import build_plan
from watchdog.act.restarters import open_restarter
from watchdog.act.ssh import SshHost
from watchdog.act.systemd import SystemdClient
from watchdog.cli import main
from watchdog.config import GroupSection, load_config
from watchdog.configfile import merge
from watchdog.evidence.capture import EvidenceTools, capture_evidence
from watchdog.evidence.incident import IncidentStore
from watchdog.evidence.journal import JournalctlReader
from watchdog.model import Observation, Role
from watchdog.run.metrics import WatchdogMetrics

pytestmark = pytest.mark.sandbox


@dataclass
class TwoHosts:
    """Sandbox A (prefill, router), sandbox B (decode, sshd) and the group's config."""

    a: SystemdSandbox
    b: SystemdSandbox
    stack: PdStackUnits
    sshd: SshdFiles
    group: GroupSection
    config_path: Path
    remote: dict[str, str]  # the decode role's host, key and known_hosts in the config

    def sandbox_of(self, role: str) -> SystemdSandbox:
        return self.b if role == "decode" else self.a

    def start_times_us(self) -> dict[str, int]:
        out = {}
        for role in ("prefill", "decode", "router"):
            value = self.sandbox_of(role).unit_property(
                self.stack.unit(role), "ExecMainStartTimestamp", "Service"
            )
            out[role] = int(value or 0)
        return out

    def buses(self, **kwargs: object) -> UnitBuses:
        local = SystemdClient(self.a.bus_address)
        return UnitBuses(local, targets_of([self.group]), **kwargs)  # type: ignore[arg-type]


def _wait_for_port(port: int, timeout_seconds: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError(f"nothing listens on 127.0.0.1:{port}")


@pytest.fixture(scope="module")
def two_hosts(host_tmp_sentinel: Path) -> Iterator[TwoHosts]:
    """Both sandboxes booted, sshd listening, the stack serving through the router."""
    reason = sshd_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    shared = [REPO_ROOT, Path(sys.prefix)]
    a = SystemdSandbox(host_paths=shared)
    b = SystemdSandbox(host_paths=shared)
    try:
        stack = PdStackUnits.allocate("mh", a.share_dir / "faults")
        for spec in stack.specs():
            (b if spec.name == stack.unit("decode") else a).add_unit(spec)
        (port,) = free_ports(1)
        sshd = make_sshd_files(b.share_dir / "ssh", port)
        b.add_unit(sshd.unit())
        state_dir = a.share_dir / "state"
        state_dir.mkdir()
        config_path = a.share_dir / "watchdog.toml"
        remote = {
            "host": sshd.url,
            "ssh_key_file": str(sshd.client_key),
            "known_hosts_file": str(sshd.known_hosts),
        }
        config_path.write_text(stack.config_toml(state_dir, {"group": {"decode": remote}}))
        b.start()
        a.start()
        _wait_for_port(port)
        PdSandbox(a, stack, config_path, state_dir).wait_until_serving(timeout_seconds=60.0)
        group = load_config(config_path).group[0]
        yield TwoHosts(a, b, stack, sshd, group, config_path, remote)
    finally:
        # A short Manager.Exit wait: SIGKILL of PID 1 then ends whatever is left in the namespace.
        b.stop(timeout_seconds=5.0)
        a.stop(timeout_seconds=5.0)


def _set_sshd(hosts: TwoHosts, method: str) -> None:
    hosts.b.queue_unit_job(method, SSHD_UNIT)


async def test_co_restart_across_two_hosts_in_order(two_hosts: TwoHosts) -> None:
    """prefill (A) ready, then decode (B, over SSH), then router (A): the start times say so."""
    buses = two_hosts.buses()
    try:
        checks = await buses.connect_remote(wait=True)
        assert [c.ok for c in checks] == [True], checks
        assert "remote uid 0" in checks[0].detail
        decode = await buses.read_unit(Role.DECODE, two_hosts.stack.unit("decode"))
        assert decode.ok, decode.error
        assert decode.active_state == "active"
        before = two_hosts.start_times_us()
        async with open_restarter(dry_run=False, units=buses, poll_seconds=0.1) as restarter:
            outcome = await restarter.execute(build_plan(two_hosts.group, "test"))
        assert outcome.ok, [(s.unit, s.phase, s.detail) for s in outcome.steps]
        after = two_hosts.start_times_us()
        assert all(after[r] > before[r] for r in after), (before, after)
        assert after["prefill"] < after["decode"] < after["router"]
        assert buses.host_label(two_hosts.stack.unit("decode")) == two_hosts.sshd.url[6:]
        assert buses.host_label(two_hosts.stack.unit("prefill")) == "local"
    finally:
        await buses.close()


async def test_ssh_down_refuses_before_the_first_step_then_recovers(two_hosts: TwoHosts) -> None:
    """sshd stopped: decode's state is unknown, the co-restart is refused before prefill is
    touched (logged, counted); sshd back: reads and the pre-restart check succeed again."""
    buses = two_hosts.buses(backoff_max_seconds=1.0)
    decode_unit = two_hosts.stack.unit("decode")
    registry = CollectorRegistry()
    metrics = WatchdogMetrics(registry, groups=[two_hosts.group.name])
    plan = build_plan(two_hosts.group, "test")
    try:
        assert [c.ok for c in await buses.connect_remote(wait=True)] == [True]
        _set_sshd(two_hosts, "StopUnit")  # kills the sshd cgroup: our session goes with it
        state = await buses.read_unit(Role.DECODE, decode_unit)
        # StopUnit only queues the job: under a loaded suite the cgroup may take seconds to go.
        deadline = time.monotonic() + 30
        while state.ok and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            state = await buses.read_unit(Role.DECODE, decode_unit)
        assert not state.ok
        assert "ssh" in state.error or "lost" in state.error, state.error
        # Never a stall: an observation read answers at once while the host is down.
        started = time.monotonic()
        await buses.read_unit(Role.DECODE, decode_unit)
        assert time.monotonic() - started < 2.0

        before = two_hosts.start_times_us()
        started = time.monotonic()
        async with open_restarter(
            dry_run=False,
            units=buses,
            on_host_refused=lambda group: metrics.count_refusal(group, "host_unreachable"),
        ) as restarter:
            refused = await restarter.execute(plan)
        assert time.monotonic() - started < 5.0  # one attempt, not the reconnect timeout
        assert refused is not None
        assert not refused.ok
        assert {s.phase for s in refused.steps} == {"not_started"}
        assert "host unreachable" in refused.steps[0].detail
        assert two_hosts.sshd.url[6:] in refused.steps[0].detail
        assert two_hosts.start_times_us()["prefill"] == before["prefill"]
        refusals = registry.get_sample_value(
            "sglang_watchdog_restart_refusals_total",
            {"group": two_hosts.group.name, "reason": "host_unreachable"},
        )
        assert refusals == 1.0

        _set_sshd(two_hosts, "StartUnit")
        _wait_for_port(two_hosts.sshd.port)
        deadline = time.monotonic() + 10
        while not state.ok and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            state = await buses.read_unit(Role.DECODE, decode_unit)
        assert state.ok, state.error
        assert state.active_state == "active"
        assert await buses.unreachable(plan) == []  # the pre-restart check passes again
    finally:
        _set_sshd(two_hosts, "StartUnit")
        await buses.close()


async def test_a_wrong_host_key_is_refused_with_a_clear_message(
    two_hosts: TwoHosts, tmp_path: Path
) -> None:
    """A host whose key does not match known_hosts is refused, saying why; nothing is read."""
    wrong = two_hosts.sshd.write_wrong_known_hosts(tmp_path / "known_hosts")
    group = two_hosts.group.model_copy(
        update={"decode": two_hosts.group.decode.model_copy(update={"known_hosts_file": wrong})}
    )
    buses = UnitBuses(None, targets_of([group]))
    try:
        (check,) = await buses.connect_remote(wait=True)
        assert not check.ok
        assert "host key verification failed" in check.detail
        assert "refusing to connect" in check.detail
        state = await buses.read_unit(Role.DECODE, two_hosts.stack.unit("decode"))
        assert not state.ok
        assert "host key verification failed" in state.error
    finally:
        await buses.close()


async def test_a_remote_command_past_its_deadline_or_cap_is_stopped_on_the_host(
    two_hosts: TwoHosts,
) -> None:
    """On the real sshd (a root login, for which OpenSSH refuses signal requests): a command
    that never exits and one that streams without end are gone from host B once run() returned,
    the first at its deadline, the second at its cap."""
    target = two_hosts.group.host_of(two_hosts.group.decode)
    assert target is not None
    host = SshHost(target)

    async def running(pattern: str) -> bool:
        # Anchored: the guard's own sh has the pattern in the middle of its command line.
        found = await host.run(("pgrep", "-f", pattern), 30.0)
        assert found.returncode in (0, 1), found
        return found.returncode == 0

    async def gone(pattern: str) -> bool:
        async with asyncio.timeout(30):  # the close is on its way once run() returned
            while await running(pattern):
                await asyncio.sleep(0.1)
        return True

    try:
        await host.ensure(wait=True)
        slept = await host.run(("sleep", "4242"), 1.0)
        assert slept.returncode is None
        assert "timed out after 1 s over ssh" in slept.error
        assert await gone("^sleep 4242")
        streamed = await host.run(("yes", "4242"), 60.0, 2**20)
        assert streamed.stdout_truncated
        assert await gone("^yes 4242")
    finally:
        await host.close()


def test_a_dry_run_prints_the_plan_with_hosts_and_check_shows_them(
    two_hosts: TwoHosts, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`watchdog restart --dry-run` names each role's host; `watchdog check --json` connects to
    sandbox B over SSH (remote uid 0) and reads its decode unit through it."""
    config = str(two_hosts.config_path)
    label = two_hosts.sshd.url[len("ssh://") :]
    assert main(["restart", "--config", config, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "Hosts, in the sequence:" in out
    assert f"  decode   {label}" in out
    assert "  prefill  local" in out

    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", two_hosts.a.bus_address)
    main(["check", "--config", config, "--json"])
    document = json.loads(capsys.readouterr().out)
    (host,) = document["hosts"]
    assert host["host"] == label
    assert host["reachable"] is True
    assert host["uid"] == 0
    assert host["units"] == [two_hosts.stack.unit("decode")]
    units = {u["role"]: u for u in document["groups"][0]["observation"]["units"]}
    assert units["decode"]["active_state"] == "active"


async def test_the_incident_report_shows_the_remote_hosts_evidence(
    two_hosts: TwoHosts, tmp_path: Path
) -> None:
    """Evidence of the two-host group: decode's journal and cmdline come from sandbox B over SSH
    (its own journald and PID namespace), and report.md says which host each role is on."""
    buses = two_hosts.buses()
    label = two_hosts.sshd.url[len("ssh://") :]
    tools = EvidenceTools(
        proc_root=Path(f"/proc/{two_hosts.a.init_pid}/root/proc"),
        journal=JournalctlReader(directory=two_hosts.a.journal_dir),
        stacks=None,
    )
    try:
        assert [c.ok for c in await buses.connect_remote(wait=True)] == [True]
        async with httpx.AsyncClient(trust_env=False) as client:
            evidence = await capture_evidence(
                two_hosts.group,
                Observation(group=two_hosts.group.name, at=time.time()),
                raw_metrics={},
                unit_reader=buses,
                client=client,
                total_timeout_seconds=10.0,
                journal_lines=50,
                tools=tools,
                remote_hosts=buses.remote_units(),
            )
    finally:
        await buses.close()
    decode = evidence.units_of(Role.DECODE)[0]
    assert decode is not None
    assert decode.host == label
    assert decode.state is not None
    assert decode.state.ok
    assert decode.journal is not None
    assert decode.journal.ok, decode.journal.detail
    assert decode.journal.lines > 0
    assert decode.processes, [i for i in evidence.items if i.name == "processes:decode"]
    assert decode.processes[0].pid == decode.state.main_pid
    assert any("decode" in arg for arg in decode.processes[0].cmdline)
    store = IncidentStore(tmp_path, keep=5, max_mib=10)
    incident = store.open_incident(group=two_hosts.group.name, evidence=evidence, now=time.time())
    report = (incident.path / "report.md").read_text()
    assert "## Hosts" in report
    assert f"| decode | {two_hosts.stack.unit('decode')} | {label} |" in report
    assert f"| prefill | {two_hosts.stack.unit('prefill')} | local |" in report
    summary = json.loads((incident.path / "summary.json").read_text())
    hosts = {row["role"]: row for row in summary["hosts"]}
    assert hosts["decode"]["journal"] == f"{decode.journal.lines} line(s)"
    assert str(decode.state.main_pid) in hosts["decode"]["main_process"]
    assert (incident.path / "journal-decode.txt").read_text().strip()


# --- the real daemon (a subprocess on sandbox A's bus) over the two hosts ------------------------

STALL_WAIT_SECONDS = 60.0  # a bound, not an expectation: a stall is detected in ~6 s here


def _daemon_setup(
    hosts: TwoHosts, name: str, *, backoff_seconds: float | None = None
) -> DaemonSetup:
    """tests/e2e's compressed timings, decode on sandbox B over SSH, a fresh state dir."""
    timings = merge(TIMINGS, {"group": {"decode": hosts.remote}})
    if backoff_seconds is not None:
        timings = merge(timings, {"group": {"restart": {"backoff_seconds": backoff_seconds}}})
    return DaemonSetup.write(hosts.stack, hosts.a.share_dir, name, timings)


def _daemon(hosts: TwoHosts, setup: DaemonSetup, *args: str) -> DaemonProcess:
    env = {**os.environ, "DBUS_SYSTEM_BUS_ADDRESS": hosts.a.bus_address}
    return DaemonProcess(setup, env, *args)


def _inject_stall(hosts: TwoHosts) -> None:
    url = hosts.stack.url("prefill") + "/_sim/fault"
    http_json("POST", url, {"kind": "transfer_stall"})


def _clear_faults(hosts: TwoHosts) -> None:
    """Run-time faults cleared and stuck transfers released (best effort: a worker may be down)."""
    for role in ("prefill", "decode"):
        for method, path in (("DELETE", "/_sim/fault"), ("POST", "/_sim/release")):
            with contextlib.suppress(OSError, StackError):
                http_json(method, hosts.stack.url(role) + path, timeout_s=2.0)


def test_the_daemon_co_restarts_across_hosts_and_reports_each_hosts_evidence(
    two_hosts: TwoHosts,
) -> None:
    """A transfer stall on prefill (A): the daemon detects it, captures decode's evidence on B over
    SSH, co-restarts prefill (A) → decode (B) → router (A) and verifies; the incident report's
    Hosts table names B for decode with B's journal and main process."""
    hosts = two_hosts
    label = hosts.sshd.url[len("ssh://") :]
    setup = _daemon_setup(hosts, "daemon-corestart")
    before = hosts.start_times_us()
    try:
        with _daemon(hosts, setup) as daemon:
            daemon.wait_for_event("state_changed", new="healthy", timeout_seconds=30.0)
            _inject_stall(hosts)
            stall = daemon.wait_for_event("stall_detected", timeout_seconds=STALL_WAIT_SECONDS)
            captured = daemon.wait_for_event("evidence_captured", timeout_seconds=30.0)
            daemon.wait_for_event("verification_passed", timeout_seconds=60.0)
            assert daemon.stop() == 0
    finally:
        _clear_faults(hosts)
    after = hosts.start_times_us()
    assert stall["verdict"] == "silent_stall"
    assert all(after[r] > before[r] for r in after), (before, after)
    assert after["prefill"] < after["decode"] < after["router"]
    assert [e["role"] for e in daemon.events("unit_restart_started")] == [
        "prefill",
        "decode",
        "router",
    ]
    assert "processes:decode" not in captured["unavailable"]
    assert "journal:decode" not in captured["unavailable"]

    incident = Path(captured["path"])
    report = (incident / "report.md").read_text()
    assert "## Hosts" in report
    assert f"| decode | {hosts.stack.unit('decode')} | {label} |" in report
    assert f"| prefill | {hosts.stack.unit('prefill')} | local |" in report
    summary = json.loads((incident / "summary.json").read_text())
    rows = {row["role"]: row for row in summary["hosts"]}
    assert rows["decode"]["host"] == label
    assert rows["decode"]["journal"].endswith("line(s)"), rows["decode"]
    # B's own PID namespace: the PID systemd on B reported, with decode's command line.
    assert rows["decode"]["main_process"].startswith("PID "), rows["decode"]
    assert "decode" in rows["decode"]["main_process"]
    assert (incident / "journal-decode.txt").read_text().strip()
    units = {u["role"]: u for u in json.loads((incident / "units.json").read_text())}
    assert units["decode"]["host"] == label
    assert units["prefill"]["host"] == "local"


def _budget_key(group: str) -> tuple[str, frozenset[tuple[str, str]]]:
    return ("sglang_watchdog_restart_budget_remaining", frozenset({"group": group}.items()))


def _assert_refusals_not_charged(daemon: DaemonProcess, group: str) -> None:
    """Refused again after each (short) backoff, past max_restarts (3): never charged or held."""
    wait_until(
        lambda: len(daemon.events("restart_refused", reason="host_unreachable")) >= 4,
        timeout_seconds=60.0,
        what="four refusals",
    )
    assert not daemon.events("budget_exhausted")
    # Between tries (each charges for the moment of its host check, then takes it back).
    wait_until(
        lambda: (daemon.metrics() or {}).get(_budget_key(group)) == 3.0,
        timeout_seconds=30.0,
        what="the whole budget left",
    )


def _assert_only_the_real_restart_charged(
    daemon: DaemonProcess, setup: DaemonSetup, group: str
) -> None:
    """The host is back: the stall's next try runs its steps, and only real runs are charged
    (the history holds no refusal, the budget counts the runs alone)."""
    daemon.wait_for_event("unit_restart_started", timeout_seconds=60.0)

    def ran() -> bool:
        return any(
            (e.get("reasons") or [{}])[0].get("result") != "refused"
            for e in daemon.events("state_changed", old="restarting", group=group)
        )

    wait_until(ran, timeout_seconds=60.0, what="the co-restart's outcome")
    assert not daemon.events("budget_exhausted")
    path = setup.state_dir / f"{group}.history.json"

    def charged_runs_only() -> bool:
        runs = json.loads(path.read_text())["restarts"]
        assert runs, "no co-restart in the history"
        assert all(r["refused"] == "" for r in runs), runs
        return (daemon.metrics() or {}).get(_budget_key(group)) == 3.0 - len(runs)

    wait_until(charged_runs_only, timeout_seconds=30.0, what="budget = 3 - real co-restarts")


def test_the_daemon_with_ssh_down_alerts_and_refuses_then_recovers(two_hosts: TwoHosts) -> None:
    """sshd on B stopped: the daemon alerts (B unreachable, decode's state unknown), a stall is
    refused before its first step (prefill untouched, restart_refused names B), again after each
    (short) backoff, more often than the budget allows, never charged and never held; sshd back:
    the daemon reconnects, reads decode's unit again and the stall's co-restart runs, the only
    one charged (budget and history)."""
    hosts = two_hosts
    label = hosts.sshd.url[len("ssh://") :]
    setup = _daemon_setup(hosts, "daemon-sshdown", backoff_seconds=2.0)
    try:
        with _daemon(hosts, setup) as daemon:
            daemon.wait_for_event("state_changed", new="healthy", timeout_seconds=30.0)
            daemon.wait_for_event("ssh_host_connected", timeout_seconds=10.0, host=label)
            _set_sshd(hosts, "StopUnit")
            down = daemon.wait_for_event("ssh_host_unreachable", timeout_seconds=30.0, host=label)
            assert "lost" in down["error"], down
            # The alert: once per outage, naming the host and the units whose state is unknown.
            alert = daemon.wait_for_event(
                "alert", timeout_seconds=30.0, verdict="monitoring_outage"
            )
            (reason,) = alert["reasons"]
            assert reason["code"] == "host_unreachable"
            assert reason["host"] == label
            assert reason["units"] == [hosts.stack.unit("decode")]
            before = hosts.start_times_us()
            _inject_stall(hosts)
            daemon.wait_for_event("stall_detected", timeout_seconds=STALL_WAIT_SECONDS)
            refused = daemon.wait_for_event(
                "restart_refused", timeout_seconds=30.0, reason="host_unreachable"
            )
            assert refused["hosts"] == [label]
            assert hosts.start_times_us() == before  # nothing restarted, on either host
            # The incident says why nothing ran, and that B's evidence could not be fetched.
            captured = daemon.wait_for_event("evidence_captured", timeout_seconds=5.0)
            assert "journal:decode" in captured["unavailable"]
            incident = Path(captured["path"])
            report = wait_until(
                lambda: (
                    "host unreachable" in (text := (incident / "report.md").read_text()) and text
                ),
                timeout_seconds=10.0,
                what="the refusal in report.md",
            )
            assert label in report
            assert f"| decode | {hosts.stack.unit('decode')} | {label} |" in report
            assert not daemon.events("unit_restart_started")
            samples = daemon.metrics()
            assert samples is not None
            key = (
                "sglang_watchdog_restart_refusals_total",
                frozenset({"group": hosts.group.name, "reason": "host_unreachable"}.items()),
            )
            assert samples.get(key, 0.0) >= 1.0
            _assert_refusals_not_charged(daemon, hosts.group.name)

            _set_sshd(hosts, "StartUnit")
            _wait_for_port(hosts.sshd.port)
            back = daemon.wait_for_event(
                "ssh_host_connected", timeout_seconds=30.0, host=label, connections=2
            )
            assert back["uid"] == 0
            # Reads recover: decode's unit is read again over the new connection.
            daemon.wait_for_event(
                "host_reachable_again", timeout_seconds=30.0, host=label, group=hosts.group.name
            )
            assert len(daemon.events("alert", verdict="monitoring_outage")) == 1
            _assert_only_the_real_restart_charged(daemon, setup, hosts.group.name)
            assert daemon.stop() == 0
    finally:
        _set_sshd(hosts, "StartUnit")
        _clear_faults(hosts)
