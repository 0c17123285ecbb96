"""Evidence of a unit on another host: fixed commands over its connection, local parsing/redaction."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import httpx
import pytest

from tests.unit.evidence_helpers import (
    NOW,
    FakeHost,
    FakeUnitReader,
    make_group,
    observation,
    tools,
    unit_state,
)
from watchdog.evidence.blocking import CommandResult
from watchdog.evidence.capture import capture_evidence, check_live_drift
from watchdog.evidence.gpu import NVIDIA_SMI_ARGS
from watchdog.evidence.incident import IncidentStore
from watchdog.evidence.records import Evidence, GpuSource
from watchdog.evidence.remote import RemoteGpuReader, RemoteJournalReader, plain_word
from watchdog.model import Role

HOST = "sglang@10.0.0.12:22"
PID = 4242
SECRET = "sk-remote-never-stored"
DECODE_UNIT = make_group().decode.unit
BATCH = (
    "2026-11-29T07:45:01+0000 b sglang[4242]: Decode batch, #running-req: 12, #token: 9000, "
    "gen throughput (token/s): 512.3\n"
)


def _ok(stdout: bytes) -> CommandResult:
    return CommandResult(0, stdout)


def _journal_argv(unit: str, lines: int) -> tuple[str, ...]:
    return ("journalctl", "-u", unit, "-n", str(lines), "-o", "short-iso", "--no-pager")


def remote_decode_host() -> FakeHost:
    """Host B: the decode unit's process, journal and one GPU."""
    cmdline = b"\0".join(
        [b"python3", b"-m", b"sglang.launch_server", b"--api-key", SECRET.encode()]
    )
    environ = b"\0".join(
        [b"SGLANG_DISAGGREGATION_MODE=decode", f"SGLANG_API_KEY={SECRET}".encode(), b"HOME=/x"]
    )
    answers = {
        ("cat", "--", f"/proc/{PID}/stat"): _ok(f"{PID} (python3) S 1 {PID} 0".encode()),
        ("cat", "--", f"/proc/{PID}/cmdline"): _ok(cmdline + b"\0"),
        ("cat", "--", f"/proc/{PID}/environ"): _ok(environ + b"\0"),
        _journal_argv(DECODE_UNIT, 50): _ok(
            b"-- Journal begins at Sun 2026-11-29 --\n" + BATCH.encode()
        ),
        ("nvidia-smi", *NVIDIA_SMI_ARGS): _ok(
            b"0, GPU-aaaa, NVIDIA B200, 0, 140.5, 1000, 150000, 183000\n"
        ),
    }
    return FakeHost(HOST, answers)


async def _capture(host: FakeHost, **group_kwargs: dict[str, object]) -> Evidence:
    states = {role: unit_state(role, pid=PID) for role in Role}
    async with httpx.AsyncClient(transport=httpx.MockTransport(lambda _: httpx.Response(200))) as c:
        return await capture_evidence(
            make_group(**group_kwargs),
            observation(),
            raw_metrics={},
            unit_reader=FakeUnitReader(states),
            client=c,
            total_timeout_seconds=30.0,
            journal_lines=50,
            tools=tools(),
            clock=lambda: NOW + 30,
            remote_hosts={DECODE_UNIT: host},
        )


async def test_remote_process_journal_and_gpu_come_over_the_host_filtered_and_redacted() -> None:
    """A remote unit's processes, journal and GPUs come over its host, filtered and redacted."""
    host = remote_decode_host()
    ev = await _capture(host)
    decode = ev.units_of(Role.DECODE)[0]
    assert decode is not None
    assert decode.host == HOST
    (main,) = decode.processes
    assert (main.pid, main.ppid, main.name) == (PID, 1, "python3")
    assert main.cmdline == ("python3", "-m", "sglang.launch_server", "--api-key", "***")
    assert decode.environ == (("SGLANG_API_KEY", "***"), ("SGLANG_DISAGGREGATION_MODE", "decode"))
    assert decode.journal is not None
    assert decode.journal.ok
    assert decode.journal.lines == 1  # journalctl's "-- ..." line dropped, as locally
    assert decode.last_batch_age_seconds is not None
    (remote_gpu,) = ev.remote_gpus
    assert remote_gpu.host == HOST
    assert remote_gpu.reading.source is GpuSource.NVIDIA_SMI
    assert ev.gpu_of(ev.units_of(Role.DECODE)[0]) is remote_gpu.reading
    assert ev.gpu_of(ev.units_of(Role.PREFILL)[0]) is ev.gpu
    items = {i.name: i for i in ev.items}
    assert items[f"gpu:{HOST}"].ok
    assert items["journal:decode"].ok
    assert items["processes:decode"].ok
    assert items["environ:decode"].ok
    # Every command is a fixed argv: a PID or the validated unit name is the only variable part.
    assert all(argv[0] in ("cat", "journalctl", "nvidia-smi") for argv in host.calls)
    assert SECRET not in repr(ev)


async def test_the_incident_report_names_each_roles_host(tmp_path: Path) -> None:
    """The incident report names each role's host, so a reader knows where to look."""
    ev = await _capture(remote_decode_host())
    store = IncidentStore(tmp_path, keep=5, max_mib=10, clock=lambda: NOW)
    incident = store.open_incident(group="dsv4", evidence=ev, now=NOW, observation=observation())
    summary = json.loads((incident.path / "summary.json").read_text())
    hosts = {row["role"]: row for row in summary["hosts"]}
    assert hosts["decode"]["host"] == HOST
    assert hosts["prefill"]["host"] == "local"
    assert hosts["decode"]["journal"] == "1 line(s)"
    assert "sglang.launch_server" in hosts["decode"]["main_process"]
    report = (incident.path / "report.md").read_text()
    assert "## Hosts" in report
    assert f"| decode | {DECODE_UNIT} | {HOST} | 1 line(s) |" in report
    assert "Decode batch" in (incident.path / "journal-decode.txt").read_text()
    assert (incident.path / f"gpu-{HOST.replace('@', '_').replace(':', '_')}.json").exists()
    units = json.loads((incident.path / "units.json").read_text())
    assert {u["role"]: u["host"] for u in units}["decode"] == HOST
    assert any(line.startswith(f"GPUs on {HOST} (nvidia-smi)") for line in summary["symptoms"])
    assert SECRET not in "".join(p.read_text() for p in incident.path.iterdir())


async def test_one_host_evidence_has_no_hosts_section(tmp_path: Path) -> None:
    """Single-host incidents are written as before: no `hosts` key, no Hosts heading."""
    async with httpx.AsyncClient(transport=httpx.MockTransport(lambda _: httpx.Response(200))) as c:
        ev = await capture_evidence(
            make_group(),
            observation(),
            raw_metrics={},
            unit_reader=None,
            client=c,
            total_timeout_seconds=30.0,
            journal_lines=5,
            tools=tools(),
            clock=lambda: NOW,
        )
    incident = IncidentStore(tmp_path, keep=5, max_mib=10).open_incident(
        group="dsv4", evidence=ev, now=NOW
    )
    assert "hosts" not in json.loads((incident.path / "summary.json").read_text())
    assert "## Hosts" not in (incident.path / "report.md").read_text()


async def test_a_host_without_nvidia_smi_reads_as_unavailable_naming_the_host() -> None:
    """A host without nvidia-smi reads as GPUs unavailable, naming the host; the capture goes on."""
    reading = await RemoteGpuReader(FakeHost(HOST, {})).read_gpus(1.0)
    assert reading.source is GpuSource.UNAVAILABLE
    assert reading.detail == f"{HOST}: nvidia-smi: nvidia-smi not found"


async def test_a_gone_remote_process_is_unavailable_with_the_reason() -> None:
    """A remote process gone mid-capture is an unavailable item with the host's own reason."""
    host = FakeHost(HOST, {})
    host.answers[("cat", "--", f"/proc/{PID}/stat")] = CommandResult(
        1, b"", b"cat: /proc/4242/stat: No such file or directory\n"
    )
    ev = await _capture(host)
    items = {i.name: i for i in ev.items}
    assert not items["processes:decode"].ok
    assert "No such file or directory" in items["processes:decode"].detail
    assert not items["journal:decode"].ok  # journalctl absent there: exit 127, with its message
    assert "journalctl exited 127" in items["journal:decode"].detail


@pytest.mark.parametrize("unit", ["a;reboot.service", "a b.service", "$(id).service", ""])
async def test_a_unit_name_that_is_not_a_plain_word_never_reaches_the_host(unit: str) -> None:
    """A unit name that is not a plain word is refused before any command reaches the host."""
    host = FakeHost(HOST, {})
    excerpt = await RemoteJournalReader(host).read_journal(unit, 10, 1.0)
    assert not excerpt.ok
    assert "not a plain word" in excerpt.detail
    assert host.calls == []
    with pytest.raises(ValueError, match="not a plain word"):
        plain_word(unit)


def test_the_remote_journal_command_is_a_fixed_shlex_joined_list() -> None:
    """The remote journal command is a fixed argument list that survives shell quoting unchanged."""
    argv = _journal_argv(DECODE_UNIT, 50)
    assert shlex.split(shlex.join(argv)) == list(argv)
    assert plain_word(DECODE_UNIT) == DECODE_UNIT


async def test_live_drift_of_a_remote_unit_is_checked_on_its_host() -> None:
    """Live drift of a remote unit is read from its own host's /proc, not the local one."""
    group = make_group(decode={"expect_env": {"SGLANG_DISAGGREGATION_MODE": "prefill"}})
    reader = FakeUnitReader({role: unit_state(role, pid=PID) for role in Role})
    host = remote_decode_host()
    results = await check_live_drift(group, reader, remote_hosts={DECODE_UNIT: host})
    decode = results[1]
    assert decode.checked
    assert [f.kind for f in decode.findings] == ["env_mismatch"]
    assert ("cat", "--", f"/proc/{PID}/environ") in host.calls
