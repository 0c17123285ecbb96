"""Evidence capture: /proc of a real child process, redaction, bounded items, caps, the journal."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from structlog.testing import capture_logs

from tests.unit.evidence_helpers import (
    NOW,
    UNITS,
    FakeGpu,
    FakeHost,
    FakeJournal,
    FakeUnitReader,
    gpu,
    make_group,
    observation,
    reading,
    tools,
    unit_state,
)
from watchdog.evidence.blocking import run_command, wait_for_blocking
from watchdog.evidence.capture import PySpyDumper, capture_evidence, check_live_drift
from watchdog.evidence.journal import (
    JournalctlReader,
    cap_tail,
    interpret_journalctl,
    parse_short_iso,
    summarise_journal,
)
from watchdog.evidence.procinfo import filter_environ, read_process_tree, redact_cmdline
from watchdog.evidence.records import DriftKind, Evidence, StackDump
from watchdog.model import Role

# ------------------------------------------------------------------ a real serving-like process


@pytest.fixture
def serving_process() -> Iterator[subprocess.Popen[bytes]]:
    """A shell (MainPID) with a Python child, env with allowlisted, secret and other variables."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": "/root",
        "SGLANG_FOO": "1",
        "SGLANG_API_KEY": "sk-live-hunter2",
        "NCCL_DEBUG": "INFO",
        "MY_API_KEY": "also-secret",
        "UNRELATED": "x",
    }
    child = f"{sys.executable} -c 'import time; time.sleep(60)' --api-key hunter2 --tp 8"
    proc = subprocess.Popen(["/bin/sh", "-c", f"{child} & wait"], env=env)
    try:
        # Wait until the shell's child has exec'd python (forked is not enough: until the exec
        # its cmdline is the shell's), polling for up to 30 s, no timed assertion.
        for _ in range(1500):
            if any("--api-key" in p.cmdline for p in read_process_tree(proc.pid)):
                break
            time.sleep(0.02)
        yield proc
    finally:
        for pid in [p.pid for p in read_process_tree(proc.pid)][::-1]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        proc.wait()


def _mock_client(routes: dict[str, httpx.Response] | None = None) -> httpx.AsyncClient:
    answers = routes or {}

    def handler(request: httpx.Request) -> httpx.Response:
        return answers.get(request.url.path, httpx.Response(200, text="ok"))

    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


async def _capture(
    serving_pid: int = 0, *, group_kwargs: dict[str, Any] | None = None, **kwargs: object
) -> Evidence:
    states = {
        role: unit_state(role, pid=serving_pid)
        if serving_pid
        else unit_state(role, active="failed")
        for role in Role
    }
    params: dict[str, Any] = {
        "raw_metrics": {Role.PREFILL: b"sglang:x 1\n", Role.DECODE: b"sglang:y 2\n"},
        "unit_reader": FakeUnitReader(states),
        "total_timeout_seconds": 10.0,
        "journal_lines": 50,
        "tools": tools(),
        "clock": lambda: NOW,
    }
    params.update(kwargs)
    async with _mock_client() as client:
        return await capture_evidence(
            make_group(**(group_kwargs or {})),
            observation(),
            client=client,
            **params,
        )


async def test_process_tree_cmdline_and_filtered_environ(
    serving_process: subprocess.Popen[bytes],
) -> None:
    """MainPID's tree and cmdlines are read; environ keeps allowlisted keys, secrets redacted."""
    ev = await _capture(serving_process.pid)
    decode = ev.units_of(Role.DECODE)[0]
    assert decode is not None
    assert decode.processes[0].pid == serving_process.pid
    assert len(decode.processes) >= 2
    child = decode.processes[1]
    assert child.ppid == serving_process.pid
    assert "--api-key" in child.cmdline
    assert "hunter2" not in child.cmdline
    assert child.cmdline[child.cmdline.index("--api-key") + 1] == "***"
    assert dict(decode.environ) == {
        "NCCL_DEBUG": "INFO",
        "SGLANG_API_KEY": "***",
        "SGLANG_FOO": "1",
    }
    flat = json.dumps(dataclasses.asdict(ev))
    assert "hunter2" not in flat
    assert "also-secret" not in flat


async def test_drift_is_checked_against_the_live_process(
    serving_process: subprocess.Popen[bytes],
) -> None:
    """Expectations are checked on MainPID's raw cmdline and full environ; misses are findings."""
    with capture_logs() as logs:
        ev = await _capture(
            serving_process.pid,
            group_kwargs={
                "decode": {
                    "expect_cmdline_contains": ["-c", "--disable-overlap-schedule"],
                    "expect_env": {"SGLANG_FOO": "1", "UNRELATED": "y"},
                }
            },
        )
    decode = ev.units_of(Role.DECODE)[0]
    assert decode is not None
    assert decode.drift_checked
    assert [(f.kind, f.expected) for f in decode.drift] == [
        (DriftKind.CMDLINE_MISSING, "--disable-overlap-schedule"),
        (DriftKind.ENV_MISMATCH, "UNRELATED=y"),
    ]
    assert "config_drift" in [e["event"] for e in logs]


async def test_every_item_is_listed_and_missing_tools_are_unavailable() -> None:
    """No journal, no GPU, no py-spy and a failed unit: all recorded, none raises."""
    ev = await _capture(0)
    items = {i.name: i for i in ev.items}
    assert items["journal:decode"].detail == "no journal files were found"
    assert not items["gpu"].ok
    assert items["stacks:prefill"].detail == "py-spy not installed"
    assert "stacks:router" not in items  # the router's work runs in Rust
    assert items["processes:decode"].detail.startswith("no MainPID")
    assert items["metrics:prefill"].ok
    assert not items["metrics:router"].ok  # metrics_url is configured, but nothing was scraped
    assert items["http:router_workers"].ok


async def test_observation_units_when_there_is_no_reader() -> None:
    """Without a unit reader the cycle's observed UnitState is used and said so."""
    obs_states = tuple(unit_state(r, pid=0, active="failed") for r in Role)
    async with _mock_client() as client:
        ev = await capture_evidence(
            make_group(),
            observation(units=obs_states),
            raw_metrics={},
            unit_reader=None,
            client=client,
            total_timeout_seconds=30.0,
            journal_lines=10,
            tools=tools(),
            clock=lambda: NOW,
        )
    prefill = ev.units_of(Role.PREFILL)[0]
    assert prefill is not None
    assert prefill.state == obs_states[0]
    assert {i.name: i.detail for i in ev.items}["unit:prefill"] == "from the cycle's observation"


async def test_a_hanging_item_times_out_alone() -> None:
    """A journal reader that never answers is cut at its own timeout; the rest is captured."""
    ev = await _capture(
        0,
        tools=tools(
            journal=FakeJournal(hang=True),
            gpu=FakeGpu(reading(gpu(0, 165))),
            item_timeout_seconds=0.2,
        ),
    )
    items = {i.name: i for i in ev.items}
    for role in Role:
        assert not items[f"journal:{role}"].ok
        assert items[f"journal:{role}"].detail.startswith("timed out after")
    assert items["gpu"].ok
    assert ev.gpu.devices[0].power_watts == 165


async def test_the_total_budget_bounds_everything() -> None:
    """With every source hanging, capture returns at the total budget, listing every item."""
    ev = await _capture(
        0,
        unit_reader=FakeUnitReader({}, hang=True),
        total_timeout_seconds=0.5,
        tools=tools(
            journal=FakeJournal(hang=True), gpu=FakeGpu(hang=True), item_timeout_seconds=30.0
        ),
    )
    items = {i.name: i for i in ev.items}
    assert not items["gpu"].ok
    assert not items["unit:decode"].ok
    assert not items["journal:decode"].ok
    assert not items["processes:decode"].ok  # never got its turn, still listed
    assert items["metrics:decode"].ok  # already in hand, needs no time
    assert ev.units[1].unit == UNITS[Role.DECODE]


async def test_http_answers_are_kept_and_capped() -> None:
    """Bodies are kept up to the cap; an unreachable endpoint is recorded with the error class."""

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/workers":
            return httpx.Response(200, text="w" * 5000)
        if request.url.path == "/readiness":
            raise httpx.ConnectError("connection refused")
        return httpx.Response(503, text="starting")

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        ev = await capture_evidence(
            make_group(),
            observation(),
            raw_metrics={},
            unit_reader=None,
            client=client,
            total_timeout_seconds=30.0,
            journal_lines=10,
            tools=tools(max_http_body_bytes=1000),
            clock=lambda: NOW,
        )
    workers = ev.http_for("router_workers")
    assert workers is not None
    assert (workers.status_code, len(workers.body), workers.truncated) == (200, 1000, True)
    health = ev.http_for("decode_health")
    assert health is not None
    assert (health.status_code, health.body) == (503, "starting")
    readiness = ev.http_for("router_readiness")
    assert readiness is not None
    assert not readiness.ok
    assert "ConnectError" in readiness.detail


async def test_huge_metrics_are_capped() -> None:
    """A payload over max_metrics_bytes keeps its first bytes and says how big it was."""
    big = b"sglang:num_running_reqs 1\n" * 100_000
    ev = await _capture(0, raw_metrics={Role.DECODE: big}, tools=tools(max_metrics_bytes=4096))
    text = ev.metrics_for(Role.DECODE)
    assert text is not None
    assert (len(text.text), text.truncated, text.total_bytes) == (4096, True, len(big))


async def test_journal_tail_gives_batch_age_and_failures() -> None:
    """The newest batch line's journal time gives its age; failure lines are counted."""
    journal = (
        "2026-11-29T07:40:00+0000 h python[1]: [2026-11-29 07:40:00 TP0] Decode batch, "
        "#running-req: 3, #token: 900, #prealloc-req: 0, #transfer-req: 2\n"
        "2026-11-29T07:41:00+0000 h python[1]: Decode transfer failed for request rank=0 x\n"
        "2026-11-29T07:41:00+0000 h python[1]: Decode transfer failed for request rank=1 x\n"
    )
    now = parse_short_iso("2026-11-29T07:45:12+0000 x") or 0.0
    ev = await _capture(
        0,
        tools=tools(journal=FakeJournal({UNITS[Role.DECODE]: journal})),
        clock=lambda: now,
    )
    decode = ev.units_of(Role.DECODE)[0]
    assert decode is not None
    assert decode.last_batch_age_seconds == 312.0
    assert decode.last_batch_line.startswith("2026-11-29T07:40:00")
    assert decode.journal_failures == (("transfer_failed", 2),)


async def test_evidence_is_json_serialisable() -> None:
    """The whole bundle dumps to JSON (frozen dataclasses, str enums)."""
    ev = await _capture(0, tools=tools(gpu=FakeGpu(reading(gpu(0, 165)))))
    data = json.loads(json.dumps(dataclasses.asdict(ev)))
    assert data["group"] == "dsv4"
    assert data["gpu"]["source"] == "nvidia-smi"


class _FakeStacks:
    """StackDumper answering for every PID."""

    def __init__(self) -> None:
        self.pids: list[int] = []

    async def dump_stacks(self, pid: int, timeout_seconds: float) -> StackDump:
        self.pids.append(pid)
        return StackDump(pid, True, f"Thread {pid} (idle)\n")


async def test_stacks_are_dumped_for_serving_processes_only(
    serving_process: subprocess.Popen[bytes],
) -> None:
    """py-spy runs for prefill and decode processes (capped per role), never for the router."""
    dumper = _FakeStacks()
    ev = await _capture(serving_process.pid, tools=tools(stacks=dumper, max_stack_processes=1))
    assert dumper.pids == [serving_process.pid, serving_process.pid]  # prefill and decode
    decode = ev.units_of(Role.DECODE)[0]
    assert decode is not None
    assert decode.stacks[0].ok
    assert {i.name: i.ok for i in ev.items}["stacks:decode"]


async def test_py_spy_missing_binary_is_unavailable() -> None:
    """PySpyDumper without the binary reports 'not found', never raises."""
    dump = await PySpyDumper(binary="/nonexistent/py-spy").dump_stacks(1, 1.0)
    assert not dump.ok
    assert "not found" in dump.detail


# ------------------------------------------------------------------ journal parsing


def test_journalctl_without_journal_files_is_unavailable() -> None:
    """journalctl's 'No journal files were found' (journald absent) is unavailable, not empty."""
    excerpt = interpret_journalctl(
        "u.service", 0, "-- No entries --\n", "No journal files were found.\n"
    )
    assert not excerpt.ok
    assert "journald absent" in excerpt.detail


def test_journalctl_no_entries_is_available_but_empty() -> None:
    """A journal without lines for this unit is available, with zero lines."""
    excerpt = interpret_journalctl("u.service", 0, "-- No entries --\n", "")
    assert excerpt.ok
    assert excerpt.lines == 0


def test_journalctl_failure_keeps_its_message() -> None:
    """A non-zero exit is unavailable with journalctl's stderr."""
    excerpt = interpret_journalctl("u.service", 1, "", "Failed to add filter for units\n")
    assert not excerpt.ok
    assert "exited 1: Failed to add filter" in excerpt.detail


async def test_missing_journalctl_binary_is_unavailable() -> None:
    """No journalctl on the host: unavailable, 'not found'."""
    reader = JournalctlReader(binary="/nonexistent/journalctl")
    excerpt = await reader.read_journal("u.service", 10, 1.0)
    assert not excerpt.ok
    assert "not found" in excerpt.detail


async def test_journal_directory_is_passed_to_journalctl(tmp_path: Path) -> None:
    """A reader with `directory` reads that journal (--directory), before the unit filter."""
    stand_in = tmp_path / "journalctl"
    stand_in.write_text('#!/bin/sh\necho "2026-11-29T07:45:01+0000 host args: $*"\n')
    stand_in.chmod(0o755)
    reader = JournalctlReader(binary=str(stand_in), directory=tmp_path / "journal")
    excerpt = await reader.read_journal("u.service", 10, 5.0)
    assert excerpt.ok, excerpt.detail
    assert f"args: --directory={tmp_path / 'journal'} -u u.service -n 10" in excerpt.text


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("2026-11-29T07:45:01+0000 host x: y", 1_795_938_301.0),
        ("2026-11-29T08:45:01+0100 host x: y", 1_795_938_301.0),
        ("2026-11-29T07:45:01+00:00 host x: y", 1_795_938_301.0),
        ("2026-11-29T07:45:01.250000+0000 host x: y", 1_795_938_301.25),
        ("Nov 29 07:45:01 host x: y", None),
    ],
)
def test_short_iso_timestamps(line: str, expected: float | None) -> None:
    """systemd 252's +0000 and newer +00:00 offsets both parse; other formats give None."""
    assert parse_short_iso(line) == expected


def test_batch_lines_of_every_version_are_recognised() -> None:
    """0.5.x 'Prefill batch,' and 0.4.10 'Decode batch.' lines both count as batch lines."""
    text = (
        "2026-11-29T07:00:00+0000 h p[1]: Prefill batch, #new-seq: 1, #inflight-req: 3\n"
        "2026-11-29T07:00:05+0000 h p[1]: Decode batch. #running-req: 1, #token: 5\n"
        '2026-11-29T07:00:09+0000 h p[1]: INFO:     127.0.0.1:4000 - "GET /health" 200 OK\n'
    )
    summary = summarise_journal(text)
    assert summary.last_batch_at == parse_short_iso("2026-11-29T07:00:05+0000 ")
    assert "Decode batch." in summary.last_batch_line


def test_health_sized_prefill_batches_are_not_progress() -> None:
    """Every /health prints a one-token prefill batch (docs/sglang.md §7.5): during a stall those
    keep coming, so the last batch line is the last real one, and none when only they remain."""
    health = "Prefill batch, #new-seq: 1, #new-token: 1, #cached-token: 0, #inflight-req: 7"
    text = (
        "2026-11-29T07:00:00+0000 h p[1]: Prefill batch, #new-seq: 4, #new-token: 812, "
        "#cached-token: 0, #inflight-req: 7\n"
        f"2026-11-29T07:05:00+0000 h p[1]: {health}\n"
        f"2026-11-29T07:05:10+0000 h p[1]: {health.replace('batch,', 'batch [9],')}\n"
    )
    summary = summarise_journal(text)
    assert summary.last_batch_at == parse_short_iso("2026-11-29T07:00:00+0000 ")
    assert "#new-token: 812" in summary.last_batch_line
    only_health = summarise_journal(f"2026-11-29T07:05:00+0000 h p[1]: {health}\n")
    assert only_health.last_batch_at is None
    # One new token on top of a cached prefix is a real request's batch.
    cached = health.replace("#cached-token: 0", "#cached-token: 4096")
    real = summarise_journal(f"2026-11-29T07:06:00+0000 h p[1]: {cached}\n")
    assert real.last_batch_at == parse_short_iso("2026-11-29T07:06:00+0000 ")


def test_cap_tail_keeps_the_newest_whole_lines() -> None:
    """Capping drops the oldest lines and never leaves half a line."""
    text = "".join(f"line {i}\n" for i in range(1000))
    capped, truncated = cap_tail(text, 100)
    assert truncated
    assert capped.endswith("line 999\n")
    assert capped.splitlines()[0].startswith("line ")
    assert len(capped.encode()) <= 100


# ------------------------------------------------------------------ /proc helpers


def test_filter_environ_allowlist_and_redaction() -> None:
    """Only the six prefixes survive; TOKEN/KEY/SECRET/PASSWORD values are redacted."""
    env = {
        "SGLANG_X": "1",
        "NCCL_IB_HCA": "mlx5",
        "NIXL_AUTH_TOKEN": "t",
        "CUDA_VISIBLE_DEVICES": "4,5",
        "UCX_TLS": "rc",
        "MC_SECRET": "s",
        "MC_DB_PASSWORD": "p",
        "AWS_SECRET_ACCESS_KEY": "a",
        "PATH": "/bin",
    }
    assert filter_environ(env) == {
        "CUDA_VISIBLE_DEVICES": "4,5",
        "MC_DB_PASSWORD": "***",
        "MC_SECRET": "***",
        "NCCL_IB_HCA": "mlx5",
        "NIXL_AUTH_TOKEN": "***",
        "SGLANG_X": "1",
        "UCX_TLS": "rc",
    }


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["sglang", "--api-key", "k", "--tp", "8"], ("sglang", "--api-key", "***", "--tp", "8")),
        (["sglang", "--api-key=k"], ("sglang", "--api-key=***")),
        (["router", "--admin-token", "t"], ("router", "--admin-token", "***")),
        (["sglang", "--tp", "8"], ("sglang", "--tp", "8")),
        (
            ["/bin/sh", "-c", "exec python -m sglang --api-key 'k 1' --tp 8"],
            ("/bin/sh", "-c", "exec python -m sglang --api-key *** --tp 8"),
        ),
    ],
)
def test_redact_cmdline(argv: list[str], expected: tuple[str, ...]) -> None:
    """The value of a secret-looking option is redacted in both spellings and in scripts."""
    assert redact_cmdline(argv) == expected


def test_gone_process_raises_oserror() -> None:
    """Reading the tree of a PID that does not exist raises OSError (recorded by the caller)."""
    with pytest.raises(FileNotFoundError):
        read_process_tree(999_999_999)


async def test_run_command_kills_a_hanging_child() -> None:
    """A command past its deadline is killed and reaped, with 'timed out' as the reason."""
    result = await run_command(["sleep", "30"], 0.2)
    assert result.returncode is None
    assert "timed out" in result.error


async def test_run_command_caps_output() -> None:
    """Output beyond the cap is dropped and flagged; the command still completes."""
    result = await run_command([sys.executable, "-c", "print('x' * 100000)"], 10.0, 1000)
    assert result.ok
    assert len(result.stdout) == 1000
    assert result.stdout_truncated


async def test_blocking_call_times_out_without_blocking_the_loop() -> None:
    """A blocking call that never returns is abandoned at its deadline."""
    import threading

    gate = threading.Event()
    with pytest.raises(TimeoutError):
        await wait_for_blocking(gate.wait, 0.1)
    gate.set()  # release the abandoned daemon thread
    assert await wait_for_blocking(lambda: 42, 30.0) == 42  # must not time out, even when busy


# ------------------------------------------------------------------ live drift (startup, check)


async def test_live_drift_of_a_running_process(
    serving_process: subprocess.Popen[bytes],
) -> None:
    """Units with expectations are checked on their MainPID; others are skipped with a reason."""
    group = make_group(
        decode={
            "expect_cmdline_contains": ["-c", "--disable-overlap-schedule"],
            "expect_env": {"SGLANG_FOO": "1"},
        },
        router={"expect_env": {"SGLANG_FOO": "1"}},
    )
    states = {
        Role.DECODE: unit_state(Role.DECODE, pid=serving_process.pid),
        Role.ROUTER: unit_state(Role.ROUTER, active="failed"),
    }
    with capture_logs() as logs:
        results = await check_live_drift(group, FakeUnitReader(states))
    prefill, decode, router = results
    assert (prefill.checked, prefill.detail) == (False, "no expectations configured")
    assert decode.checked
    assert [f.expected for f in decode.findings] == ["--disable-overlap-schedule"]
    assert (router.checked, router.detail) == (False, "no MainPID to check")
    assert [e["event"] for e in logs] == ["config_drift"]


async def test_live_drift_falls_back_to_the_observation() -> None:
    """Without a reader the observed MainPID is used; a vanished process is reported, not raised."""
    group = make_group(prefill={"expect_env": {"SGLANG_FOO": "1"}})
    obs = observation(units=(unit_state(Role.PREFILL, pid=999_999_999),))
    (prefill, _, _) = await check_live_drift(group, None, observation=obs)
    assert not prefill.checked
    assert prefill.detail.startswith("MainPID 999999999: ")


async def test_a_remote_unit_never_reads_this_hosts_proc_or_journal() -> None:
    """A unit on another host: its MainPID is not ours, so this host's /proc, journal and py-spy
    are never used for it; every read goes to its host (tests/unit/test_remote_evidence.py)."""
    group = make_group()
    obs_states = tuple(unit_state(r, pid=os.getpid()) for r in Role)
    host = FakeHost("w@10.0.0.12:22", {})  # answers nothing: every command fails there
    async with _mock_client() as client:
        ev = await capture_evidence(
            group,
            observation(units=obs_states),
            raw_metrics={},
            unit_reader=None,
            client=client,
            total_timeout_seconds=30.0,
            journal_lines=10,
            tools=tools(),
            clock=lambda: NOW,
            remote_hosts={group.decode.unit: host},
        )
    decode = ev.units_of(Role.DECODE)[0]
    assert decode is not None
    assert decode.processes == ()
    assert decode.state == obs_states[1]
    assert decode.host == "w@10.0.0.12:22"
    assert {argv[0] for argv in host.calls} == {"cat", "journalctl", "nvidia-smi"}
    items = {i.name: i for i in ev.items}
    for name in ("processes:decode", "environ:decode", "journal:decode", "stacks:decode"):
        assert not items[name].ok
    assert "w@10.0.0.12:22" in items["stacks:decode"].detail
    assert "w@10.0.0.12:22" in items["processes:decode"].detail
    assert items["processes:prefill"].ok  # local units as before
