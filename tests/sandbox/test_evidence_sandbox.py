"""Evidence, classification and incident reports against a real systemd running the simulated stack.

The PD stack (simulated prefill/decode, the real sglang-router) runs as units of a sandboxed systemd
(PID 1 of a private namespace). Unit properties come over the sandbox's own bus; /proc is read
through the namespace's procfs (MainPID is a namespace PID); the journal is the sandbox's own
journald's, read with `journalctl --directory`. The GPU source is a stand-in nvidia-smi printing the incident's idle
B200 readings, because the simulated stack has no GPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import stat
import time
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import structlog

from pdsim.stack import http_json
from sandbox.pdsandbox import PdSandbox
from watchdog.act.systemd import SystemdClient
from watchdog.cli import main
from watchdog.config import GroupSection, load_config
from watchdog.evidence.capture import EvidenceTools, capture_evidence
from watchdog.evidence.classify import DECODE_ALONE_MIN_GAP_SECONDS
from watchdog.evidence.gpu import read_gpus
from watchdog.evidence.incident import Incident, IncidentStore
from watchdog.evidence.journal import JournalctlReader
from watchdog.evidence.records import Evidence, GpuReading
from watchdog.model import Observation, Reason, Role
from watchdog.observe.observer import GroupObserver
from watchdog.observe.sglang_metrics import extract_snapshot

pytestmark = pytest.mark.sandbox

SECRET = "sk-sandbox-must-never-be-written"
UNIT_ENV = {
    "decode": {
        "SGLANG_API_KEY": SECRET,  # allowlisted prefix, secret-looking name: kept, redacted
        "SGLANG_EVIDENCE_MARK": "decode",
        "NCCL_DEBUG": "WARN",
        "OTHER_TOKEN": SECRET,  # not allowlisted: dropped entirely
    },
    "prefill": {"SGLANG_EVIDENCE_MARK": "prefill"},
}
IDLE_B200 = Path(__file__).parents[1] / "data" / "gpu" / "smi-b200-transfer-stall.csv"


@pytest.fixture(scope="module")
def pd_evidence(host_tmp_sentinel: Path) -> Iterator[PdSandbox]:
    """A sandboxed stack whose decode unit carries a secret in its Environment=."""
    pd = PdSandbox.start("evd", ready_timeout_seconds=30.0, env=UNIT_ENV)
    try:
        yield pd
    finally:
        pd.stop()


@pytest.fixture
def pd_ready(pd_evidence: PdSandbox) -> Iterator[PdSandbox]:
    """The stack serving, without faults; faults and stuck requests are cleared afterwards."""
    pd_evidence.wait_until_serving(timeout_seconds=30.0)
    yield pd_evidence
    for role in ("prefill", "decode"):
        with contextlib.suppress(Exception):
            http_json("DELETE", pd_evidence.stack.url(role) + "/_sim/fault")
            http_json("POST", pd_evidence.stack.url(role) + "/_sim/release")
    structlog.reset_defaults()


@pytest.fixture
async def systemd(pd_evidence: PdSandbox) -> AsyncIterator[SystemdClient]:
    """A SystemdClient on the sandbox's bus."""
    async with SystemdClient(pd_evidence.sandbox.bus_address) as client:
        yield client


class StandInNvidiaSmi:
    """GpuReader: the real nvidia-smi code path, run against a script printing recorded output."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "nvidia-smi"
        self.path.write_text(f"#!/bin/sh\ncat {IDLE_B200}\n")
        self.path.chmod(self.path.stat().st_mode | stat.S_IEXEC)

    async def read_gpus(self, timeout_seconds: float) -> GpuReading:
        def no_nvml() -> Any:
            raise ImportError("no NVML in the sandbox")

        return await read_gpus(timeout_seconds, load_nvml=no_nvml, nvidia_smi=str(self.path))


def _group(pd: PdSandbox) -> GroupSection:
    """The sandbox config, with drift expectations: two met, one not."""
    group = load_config(pd.config_path).group[0]
    decode = group.decode.model_copy(
        update={
            "expect_cmdline_contains": ("--role decode", "--disable-overlap-schedule"),
            "expect_env": {"SGLANG_EVIDENCE_MARK": "decode"},
        }
    )
    return group.model_copy(update={"decodes": (decode,)})


def _tools(pd: PdSandbox, *, journal: bool) -> EvidenceTools:
    # MainPID values are PIDs of the sandbox's namespace: read them through its own procfs. With
    # `journal`, the units' journal is the sandbox journald's, under its /run; without, journalctl
    # reads the host's journal, which has none of the sandbox's units.
    where = pd.sandbox.journal_dir if journal else None
    return EvidenceTools(
        proc_root=Path(f"/proc/{pd.sandbox.init_pid}/root/proc"),
        journal=JournalctlReader(directory=where),
        gpu=StandInNvidiaSmi(pd.sandbox.share_dir),
    )


async def _observe_and_capture(
    pd: PdSandbox,
    group: GroupSection,
    systemd: SystemdClient,
    http: httpx.AsyncClient,
    *,
    journal: bool = False,
) -> tuple[Observation, Evidence]:
    cycle = await GroupObserver(group, http, unit_reader=systemd).observe()
    ev = await capture_evidence(
        group,
        cycle.observation,
        raw_metrics=cycle.raw_metrics,
        unit_reader=systemd,
        client=http,
        total_timeout_seconds=15.0,
        journal_lines=200,
        tools=_tools(pd, journal=journal),
    )
    return cycle.observation, ev


async def _metric(http: httpx.AsyncClient, pd: PdSandbox, role: Role, field: str) -> float:
    response = await http.get(pd.stack.url(str(role)) + "/metrics", timeout=5)
    value = getattr(extract_snapshot(response.text, role, time.time()), field)
    return float(value or 0.0)


async def _wait_for(condition: Any, what: str, attempts: int = 100) -> None:
    for _ in range(attempts):
        if await condition():
            return
        await asyncio.sleep(0.2)
    pytest.fail(f"gave up waiting for {what}")


def _iso(unix_us: int) -> str:
    return datetime.fromtimestamp(unix_us / 1e6, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _incident_text(incident: Incident) -> str:
    return "\n".join(p.read_text(errors="replace") for p in incident.path.iterdir())


async def test_transfer_stall_incident_report(  # noqa: PLR0915  # one assertion per report section, read top to bottom
    pd_ready: PdSandbox, systemd: SystemdClient, capsys: pytest.CaptureFixture[str]
) -> None:
    """A stalled transfer yields a transfer_stall report with cmdline, redacted environ, units."""
    pd = pd_ready
    group = _group(pd)
    http_json("POST", pd.stack.url("prefill") + "/_sim/fault", {"kind": "transfer_stall"})
    async with httpx.AsyncClient(trust_env=False, timeout=120) as http:
        body = {"model": "pdsim", "prompt": "Reply with the word ok.", "max_tokens": 4}
        stuck = [
            asyncio.create_task(http.post(pd.stack.url("router") + "/v1/completions", json=body))
            for _ in range(3)
        ]
        try:

            async def parked() -> bool:
                return await _metric(http, pd, Role.PREFILL, "inflight_queue") >= 3

            await _wait_for(parked, "three requests parked in the prefill inflight queue")
            observation, ev = await _observe_and_capture(pd, group, systemd, http)
        finally:
            http_json("POST", pd.stack.url("prefill") + "/_sim/release")
            for task in stuck:
                task.cancel()
            await asyncio.gather(*stuck, return_exceptions=True)

    store = IncidentStore(pd.state_dir, keep=10, max_mib=50)
    incident = store.open_incident(
        group=group.name,
        evidence=ev,
        observation=observation,
        verdict="silent_stall",
        decision_reasons=(Reason("silent_stall", "probes fail while every /health is 200"),),
        now=time.time(),
    )
    assert incident.kind == "transfer_stall", (incident.path / "report.md").read_text()
    summary = json.loads((incident.path / "summary.json").read_text())
    ruled_out = summary["classification"]["ruled_out"]
    assert any(
        r.startswith("not a collective hang:") and "0 % util, 165–172 W of 1000 W" in r
        for r in ruled_out
    ), ruled_out
    for prefix in ("not a crash:", "not a degraded bootstrap:", "not a router wedge:"):
        assert any(r.startswith(prefix) for r in ruled_out), (prefix, ruled_out)
    reasoning = "\n".join(summary["classification"]["reasoning"])
    assert "prefill inflight (KV transfer) queue 3" in reasoning

    # The live process: cmdline, filtered environ with the secret redacted, never written.
    processes = {p["role"]: p for p in json.loads((incident.path / "processes.json").read_text())}
    decode_main = processes["decode"]["processes"][0]
    assert decode_main["cmdline"][1:5] == ["-m", "pdsim.worker", "--role", "decode"]
    assert processes["decode"]["environ"] == {
        "NCCL_DEBUG": "WARN",
        "SGLANG_API_KEY": "***",
        "SGLANG_EVIDENCE_MARK": "decode",
    }
    assert processes["prefill"]["environ"] == {"SGLANG_EVIDENCE_MARK": "prefill"}
    assert SECRET not in _incident_text(incident)
    assert SECRET not in (pd.state_dir / "audit.jsonl").read_text()

    # Unit properties as systemd reports them, metrics as scraped, drift in the live process.
    units = {u["role"]: u for u in json.loads((incident.path / "units.json").read_text())}
    starts = pd.start_times_us()
    for role in ("prefill", "decode", "router"):
        state = units[role]["state"]
        assert (state["active_state"], state["sub_state"]) == ("active", "running")
        assert state["main_pid"] > 0
        assert state["exec_main_start_us"] == starts[role]
    assert (
        "sglang:num_prefill_inflight_queue_reqs"
        in (incident.path / "metrics-prefill.txt").read_text()
    )
    drift = json.loads((incident.path / "drift.json").read_text())
    assert [d["expected"] for d in drift] == ["--disable-overlap-schedule"]
    # Captured without the sandbox's journal (the requests parked seconds ago left fresh batch
    # lines, which read as progress): unavailable or empty, not an error.
    items = {i["name"]: i for i in json.loads((incident.path / "items.json").read_text())}
    journal = items["journal:decode"]
    assert not journal["ok"] or "no entries" in journal["detail"], journal
    assert items["processes:decode"]["ok"]
    assert items["gpu"]["ok"]

    # The CLI lists and shows it.
    capsys.readouterr()
    assert main(["incidents", "--config", str(pd.config_path)]) == 0
    assert incident.id in capsys.readouterr().out
    assert main(["incidents", "show", incident.id, "--config", str(pd.config_path)]) == 0
    assert "**transfer_stall**" in capsys.readouterr().out


async def test_degraded_bootstrap_after_decode_only_restart(
    pd_ready: PdSandbox, systemd: SystemdClient
) -> None:
    """Decode restarted alone against a running prefill is classified degraded_bootstrap, citing
    both ExecMainStartTimestamps."""
    pd = pd_ready
    group = _group(pd)
    async with httpx.AsyncClient(trust_env=False, timeout=10) as http:
        # Two decode-only restarts, each new decode serving traffic: the simulated prefill's
        # transfer state goes stale, as in the incident (decode incarnations replaced while
        # prefill kept running). An incarnation counts once it has talked to prefill.
        body = {"model": "pdsim", "prompt": "Reply with the word ok.", "max_tokens": 4}

        async def served() -> bool:
            # Short deadline: the first request after a decode restart may hang in bootstrap.
            with contextlib.suppress(httpx.HTTPError):
                url = pd.stack.url("router") + "/v1/completions"
                return (await http.post(url, json=body, timeout=3)).status_code == 200
            return False

        # A decode restarted alone comes back long after prefill's start (its previous instance
        # loaded a model and served first); the report blames decode only past that gap, so
        # units started together at boot are not blamed. Simulated workers start in a second:
        # restart decode no earlier than a real one could come back.
        prefill_start = pd.start_times_us()["prefill"] / 1e6
        await asyncio.sleep(
            max(0.0, prefill_start + DECODE_ALONE_MIN_GAP_SECONDS + 1 - time.time())
        )
        for restart in range(2):
            await systemd.restart_unit(pd.stack.unit("decode"), timeout_seconds=30)
            await asyncio.to_thread(pd.wait_until_serving, 30.0)
            await _wait_for(served, f"a completion after decode-only restart {restart + 1}", 20)

        async def failing() -> bool:
            with contextlib.suppress(httpx.HTTPError):
                await http.post(pd.stack.url("router") + "/v1/completions", json=body)
            return await _metric(http, pd, Role.PREFILL, "transfer_failed") > 0

        state = http_json("GET", pd.stack.url("prefill") + "/_sim/state")
        await _wait_for(
            failing, f"transfer failures on the degraded prefill ({state['degraded']})", attempts=40
        )
        observation, ev = await _observe_and_capture(pd, group, systemd, http)

    store = IncidentStore(pd.state_dir, keep=10, max_mib=50)
    incident = store.open_incident(
        group=group.name,
        evidence=ev,
        observation=observation,
        verdict="decode_only_restart",
        now=time.time(),
    )
    try:
        assert incident.kind == "degraded_bootstrap", (incident.path / "report.md").read_text()
        starts = pd.start_times_us()
        assert starts["decode"] > starts["prefill"]
        reasoning = json.loads((incident.path / "summary.json").read_text())["classification"][
            "reasoning"
        ]
        text = "\n".join(reasoning)
        assert f"(prefill {_iso(starts['prefill'])}, decode {_iso(starts['decode'])})" in text
        assert "decode was restarted without prefill" in text
        assert (
            f"prefill ExecMainStartTimestamp {_iso(starts['prefill'])}, "
            f"decode {_iso(starts['decode'])}" in text
        )
        assert "prefill num_transfer_failed_reqs_total" in text
        report = (incident.path / "report.md").read_text()
        assert "| classification | **degraded_bootstrap** |" in report
        assert "decode must never restart without prefill" in report
    finally:
        # Leave a clean stack: the co-restart prefill -> decode -> router clears the degradation.
        for role in ("prefill", "decode", "router"):
            await systemd.restart_unit(pd.stack.unit(role), timeout_seconds=30)
        await asyncio.to_thread(pd.wait_until_serving, 30.0)


async def test_incident_carries_the_prefill_units_journal(
    pd_ready: PdSandbox, systemd: SystemdClient
) -> None:
    """An incident captured in the sandbox holds the prefill unit's journal lines (its batch
    lines, as journalctl prints them), and the batch-line age is read from them."""
    pd = pd_ready
    group = _group(pd)
    async with httpx.AsyncClient(trust_env=False, timeout=10) as http:
        body = {"model": "pdsim", "prompt": "Reply with the word ok.", "max_tokens": 4}
        response = await http.post(pd.stack.url("router") + "/v1/completions", json=body)
        assert response.status_code == 200, response.text
        # The unit's own words reach the journal asynchronously (a stream socket): wait for them.
        unit = pd.stack.unit("prefill")

        async def logged() -> bool:
            return "Prefill batch" in await asyncio.to_thread(pd.sandbox.journal_text, unit)

        await _wait_for(logged, "a Prefill batch line in the prefill unit's journal")
        observation, ev = await _observe_and_capture(pd, group, systemd, http, journal=True)
    store = IncidentStore(pd.state_dir, keep=10, max_mib=50)
    incident = store.open_incident(
        group=group.name,
        evidence=ev,
        observation=observation,
        verdict="silent_stall",
        now=time.time(),
    )
    items = {i["name"]: i for i in json.loads((incident.path / "items.json").read_text())}
    for role in ("prefill", "decode", "router"):
        assert items[f"journal:{role}"]["ok"], items[f"journal:{role}"]
    journal = (incident.path / "journal-prefill.txt").read_text()
    batch_lines = [line for line in journal.splitlines() if "Prefill batch" in line]
    assert batch_lines, journal[-2000:]
    # journalctl -o short-iso: "<time> <host> <identifier>[<pid>]: <message>".
    assert f"[{pd.sandbox.unit_property(unit, 'MainPID', 'Service')}]:" in batch_lines[-1]
    prefill = next(u for u in ev.units if u.role == "prefill")
    assert prefill.journal is not None
    assert prefill.journal.ok
    assert prefill.last_batch_at is not None
    assert abs(prefill.last_batch_at - time.time()) < 120
    assert "no journal files were found" not in (incident.path / "report.md").read_text()
