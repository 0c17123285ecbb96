"""The daemon in-process: per-cycle errors, `--once`, `--record`, startup failure, liveness rule."""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import socket
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from pdsim.payloads import sglang_payload
from pdsim.stack import free_ports
from tests.unit import configs
from tests.unit.fakerouter import FakeStack, fake_in_thread
from tests.unit.rawhttp import refused_url
from tests.unit.stall_once import stall_once
from watchdog.cli import main
from watchdog.config import Config, load_config
from watchdog.decide import Decision, initial_state
from watchdog.errors import StartupError, StateFileError
from watchdog.observe.observer import HEALTH_LEAD_SECONDS, GroupObserver
from watchdog.run import cycle
from watchdog.run.cycle import GroupRuntime
from watchdog.run.daemon import Daemon, run_daemon
from watchdog.run.recording import (
    RecordedObservation,
    Recorder,
    RecordingHeader,
    read_entries,
)

NO_BUS = "unix:path=/nonexistent/sglang-watchdog-test/bus"


@pytest.fixture(autouse=True)
def _no_systemd(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test here talks to a real bus or to a notify socket of whoever runs pytest."""
    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", NO_BUS)
    for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def fake() -> Iterator[FakeStack]:
    """A healthy fake router + workers on its own thread and loop (the CLI runs asyncio.run())."""
    with fake_in_thread(sglang_payload("0.5.23", "prefill", tp=2)) as stack:
        yield stack


# A refused or fake stack answers (or fails) at once: nothing here waits for a timeout to fire, so
# the timeouts are generous (a machine whose cores are busy with other work cannot make them fire).
FAST = {
    "probe": {
        "timeout_seconds": 20,  # under restart.ready_timeout_seconds, as the config requires
        "stream_idle_seconds": 10,
        "connect_timeout_seconds": 10,
        "health_timeout_seconds": 30,
        "scrape_timeout_seconds": 30,
        "multiround_every_seconds": 0,
    },
    "restart": {"ready_timeout_seconds": 30},
}


def write_config(
    tmp_path: Path,
    base_url: str,
    *,
    name: str = "g1",
    cycle_seconds: float = 1.0,
    metrics_port: int | None = None,
    more_groups: Sequence[dict[str, Any]] = (),
) -> Path:
    """A config whose group's three roles point at `base_url` (plus `more_groups`), state in
    tmp_path."""
    port = metrics_port if metrics_port is not None else free_ports(1)[0]
    settings = {
        "state_dir": str(tmp_path / "state"),
        "metrics_listen": f"127.0.0.1:{port}",
        "cycle_seconds": cycle_seconds,
        "shutdown_timeout_seconds": 5,
    }
    groups = [configs.group(name, url=base_url), *more_groups]
    return configs.write_config(
        tmp_path / f"{name}.toml", {"watchdog": settings, "group": groups}, {"group": FAST}
    )


# --- the main loop survives its own errors --------------------------------------------------------


class FlakyDaemon(Daemon):
    """A daemon whose first cycle raises; it asks to stop after its third."""

    cycles = 0

    async def run_cycle(self, runtime: GroupRuntime) -> Decision:
        self.cycles += 1
        if self.cycles == 1:
            raise RuntimeError("boom in cycle one")
        if self.cycles >= 3:
            self.request_stop()
        return await super().run_cycle(runtime)


async def test_cycle_exception_is_logged_counted_and_the_loop_goes_on(tmp_path: Path) -> None:
    """An exception in one cycle is logged (cycle_failed), counted, and later cycles still run."""
    config = load_config(write_config(tmp_path, refused_url(), cycle_seconds=0.05))
    registry = CollectorRegistry()
    daemon = FlakyDaemon(config, dry_run=True, registry=registry, bus_address=NO_BUS)
    with capture_logs() as logs:
        code = await run_daemon(daemon)
    assert code == 0
    assert daemon.cycles >= 3
    failed = [e for e in logs if e["event"] == "cycle_failed"]
    assert len(failed) == 1
    assert failed[0]["group"] == "g1"
    assert failed[0]["error"] == "RuntimeError('boom in cycle one')"
    assert "boom in cycle one" in failed[0]["traceback"]
    assert failed[0]["log_level"] == "error"
    assert registry.get_sample_value("sglang_watchdog_internal_errors_total") == 1.0
    assert registry.get_sample_value("sglang_watchdog_cycle_duration_seconds_count") == float(
        daemon.cycles
    )
    assert [e["event"] for e in logs][-1] == "watchdog_stopped"


class StopAfter(Daemon):
    """A daemon that asks to stop once it has run `limit` cycles."""

    limit = 2
    cycles = 0

    async def run_cycle(self, runtime: GroupRuntime) -> Decision:
        self.cycles += 1
        if self.cycles >= self.limit:
            self.request_stop()
        return await super().run_cycle(runtime)


async def test_failing_evidence_capture_does_not_stop_the_co_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Evidence that raises is logged and counted; the (dry-run) co-restart still runs."""
    stall_once(monkeypatch)

    async def broken_capture(*args: object, **kwargs: object) -> None:
        raise RuntimeError("evidence collector bug")

    monkeypatch.setattr(cycle, "capture_evidence", broken_capture)
    config = load_config(write_config(tmp_path, refused_url(), cycle_seconds=0.05))
    registry = CollectorRegistry()
    daemon = StopAfter(config, dry_run=True, registry=registry, bus_address=NO_BUS)
    with capture_logs() as logs:
        assert await run_daemon(daemon) == 0
    errors = [e for e in logs if e["event"] == "internal_error"]
    assert [(e["where"], e["error"]) for e in errors] == [
        ("evidence", "RuntimeError('evidence collector bug')")
    ]
    assert registry.get_sample_value("sglang_watchdog_internal_errors_total") == 1.0
    assert [e["event"] for e in logs if e["event"] == "restart_skipped_dry_run"] == [
        "restart_skipped_dry_run"
    ]
    labels = {"group": "g1", "result": "dry_run"}
    assert registry.get_sample_value("sglang_watchdog_restarts_total", labels) == 1.0
    # Leaving `restarting` happens outside decide(); it is logged like every other change.
    changes = [(e["old"], e["new"]) for e in logs if e["event"] == "state_changed"]
    assert ("restarting", "verifying") in changes
    assert not (tmp_path / "state" / "incidents").exists()


def full_disk(*args: object, **kwargs: object) -> None:
    """A write that fails as a full disk would."""
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def unreadable(*args: object, **kwargs: object) -> dict[str, int]:
    """A state-file read that fails as an unreadable file would."""
    raise StateFileError("cannot read state file g1.refusals.json: Input/output error")


# (the optional file that fails, what patches it in, the event logged once, file_errors' label)
OPTIONAL_FAILURES = {
    "recording": (Recorder, "append", full_disk, "recording_write_failed"),
    "refusals": (cycle, "read_refusal_counts", unreadable, "refusal_counts_unreadable"),
}


@pytest.mark.parametrize("what", sorted(OPTIONAL_FAILURES))
async def test_a_failing_optional_file_does_not_stop_the_stall_from_being_healed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, what: str
) -> None:
    """A recording on a full disk (--record) or unreadable CLI refusal counts, failing every
    cycle before decide(): the first cycle still decides, its stall is acted on (dry run), the
    failure is counted every cycle and logged once, and no cycle fails."""
    stall = stall_once(monkeypatch)
    owner, name, failing, event = OPTIONAL_FAILURES[what]
    monkeypatch.setattr(owner, name, failing)
    config = load_config(write_config(tmp_path, refused_url(), cycle_seconds=0.05))
    registry = CollectorRegistry()
    daemon = StopAfter(
        config,
        dry_run=True,
        registry=registry,
        bus_address=NO_BUS,
        record_path=tmp_path / "rec.jsonl",
    )
    daemon.limit = 3
    with capture_logs() as logs:
        assert await run_daemon(daemon) == 0
    events = [e["event"] for e in logs]
    assert len(stall.decided) == daemon.cycles  # every cycle reached decide()
    assert events.count("stall_detected") == 1
    labels = {"group": "g1", "result": "dry_run"}
    assert registry.get_sample_value("sglang_watchdog_restarts_total", labels) == 1.0
    assert "cycle_failed" not in events
    assert registry.get_sample_value("sglang_watchdog_internal_errors_total") == 0.0
    assert events.count(event) == 1  # once per episode, not once per cycle
    errors = registry.get_sample_value("sglang_watchdog_file_errors_total", {"what": what})
    assert errors == float(daemon.cycles)


async def test_each_failed_scrape_is_counted_once(tmp_path: Path) -> None:
    """scrape_errors_total grows by one per failed scrape of a target, not two."""
    config = load_config(write_config(tmp_path, refused_url(), cycle_seconds=0.05))
    registry = CollectorRegistry()
    daemon = StopAfter(config, dry_run=True, registry=registry, bus_address=NO_BUS)
    assert await run_daemon(daemon) == 0
    for target in ("prefill", "decode"):
        labels = {"group": "g1", "target": target}
        errors = registry.get_sample_value("sglang_watchdog_scrape_errors_total", labels)
        assert errors == float(daemon.cycles), target


async def test_failed_startup_releases_the_metrics_listener(tmp_path: Path) -> None:
    """A startup that fails after binding the metrics port (recording unopenable) frees it again."""
    port = free_ports(1)[0]
    config = load_config(write_config(tmp_path, refused_url(), metrics_port=port))
    daemon = Daemon(
        config, dry_run=True, record_path=tmp_path / "no-such-dir" / "rec.jsonl", bus_address=NO_BUS
    )
    with pytest.raises(StartupError, match="cannot open recording"):
        await run_daemon(daemon)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))  # would raise EADDRINUSE if the listener were left open


async def test_history_with_a_nan_time_is_set_aside_at_startup(tmp_path: Path) -> None:
    """An unfinished history record started at NaN (a torn or hand-edited file) no longer ends
    every start: the daemon sets the file aside, says so, and cycles."""
    config = load_config(write_config(tmp_path, refused_url(), cycle_seconds=0.05))
    state_dir = config.watchdog.state_dir
    state_dir.mkdir(parents=True)
    planted = (
        b'{"version": 1, "group": "g1", "restarts": [{"started_at": NaN, "finished_at": 0.0, '
        b'"trigger": "silent_stall", "dry_run": false, "ok": false, "finished": false, "pid": 7}]}'
    )
    (state_dir / "g1.history.json").write_bytes(planted)
    daemon = StopAfter(config, dry_run=True, bus_address=NO_BUS)
    with capture_logs() as logs:
        assert await run_daemon(daemon) == 0
    assert daemon.cycles >= daemon.limit
    assert "state_file_corrupt" in [e["event"] for e in logs]
    [aside] = state_dir.glob("g1.history.json.corrupt-*")
    assert aside.read_bytes() == planted


# --- --once and --record through the command line -------------------------------------------------


def test_once_exits_0_against_a_healthy_stack(
    fake: FakeStack, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`watchdog --once` runs one cycle and exits 0 when the probe through the router passed."""
    code = main(["--config", str(write_config(tmp_path, fake.base_url)), "--once"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert fake.requests_to("/v1/completions")
    assert '"event": "watchdog_started"' in err
    assert '"event": "systemd_unavailable"' in err  # no bus: units are simply not observed


def test_once_exits_1_against_a_broken_stack(
    fake: FakeStack, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`watchdog --once` exits 1 when the router answers the probe with a 503."""
    fake.mode = "http_error"
    code = main(["--config", str(write_config(tmp_path, fake.base_url)), "--once"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert '"event": "probe_failed"' in err


def test_once_exits_1_when_nothing_listens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`watchdog --once` exits 1 when the stack refuses connections."""
    code = main(["--config", str(write_config(tmp_path, refused_url())), "--once"])
    err = capsys.readouterr().err
    assert code == 1
    assert "connect_refused" in err


def test_record_writes_a_recording_that_replay_reads(
    fake: FakeStack, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--record FILE` appends the cycle's observation; `watchdog replay` reads it back."""
    config = write_config(tmp_path, fake.base_url)
    recording = tmp_path / "incident.jsonl"
    assert main(["--config", str(config), "--once", "--record", str(recording)]) == 0
    entries = list(read_entries(recording))
    assert [type(e) for e in entries] == [RecordingHeader, RecordedObservation]
    header, observed = entries
    assert isinstance(header, RecordingHeader)
    assert header.group == "g1"
    assert isinstance(observed, RecordedObservation)
    assert [p.ok for p in observed.observation.probes] == [True]
    capsys.readouterr()
    assert main(["replay", "--config", str(config), str(recording)]) == 0
    assert "replayed 1 cycles of group 'g1'" in capsys.readouterr().out


# --- the liveness rule behind WATCHDOG=1 ----------------------------------------------------------


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client for observers that are built but never run."""
    async with httpx.AsyncClient() as http:
        yield http


def liveness_daemon(tmp_path: Path, cycle_seconds: float, watchdog_seconds: float | None) -> Daemon:
    """A daemon (never started) with two groups and the given WatchdogSec."""
    url = refused_url()
    second = configs.group("g2", url=url, units=("p2.service", "d2.service", "r2.service"))
    path = write_config(tmp_path, url, cycle_seconds=cycle_seconds, more_groups=[second])
    daemon = Daemon(load_config(path), bus_address=NO_BUS)
    daemon.watchdog_seconds = watchdog_seconds
    return daemon


def set_runtimes(
    daemon: Daemon,
    client: httpx.AsyncClient,
    loops: dict[str, tuple[float, float | None]],
) -> None:
    """Per group: (seconds since its last completed cycle, seconds since it began acting)."""
    config: Config = daemon.config
    for group in config.group:
        last_ago, acting_ago = loops[group.name]
        daemon.groups[group.name] = GroupRuntime(
            config=group,
            observer=GroupObserver(group, client),
            scheduler=None,
            state=initial_state(0.0),
            last_cycle_at=NOW - last_ago,
            acting_since=None if acting_ago is None else NOW - acting_ago,
        )


NOW = 1_000_000.0
# cycle_seconds 1, WatchdogSec 10: a loop is stale after max(10 / 2, 2 * 1) = 5 s without a cycle.
# A sequence may take evidence 15 + 3 steps x ready 30 + 60 = 165 s.
LIVENESS_TABLE = [
    # (id, cycle_seconds, WatchdogSec, {group: (last cycle ago, acting since ago)}, alive)
    ("both-fresh", 1.0, 10.0, {"g1": (1.0, None), "g2": (4.9, None)}, True),
    ("one-stale", 1.0, 10.0, {"g1": (1.0, None), "g2": (5.1, None)}, False),
    ("acting-within-bounds", 1.0, 10.0, {"g1": (100.0, 100.0), "g2": (1.0, None)}, True),
    ("acting-at-the-bound", 1.0, 10.0, {"g1": (165.0, 165.0), "g2": (1.0, None)}, True),
    ("acting-beyond-bounds", 1.0, 10.0, {"g1": (166.0, 166.0), "g2": (1.0, None)}, False),
    ("acting-but-other-stale", 1.0, 10.0, {"g1": (100.0, 100.0), "g2": (30.0, None)}, False),
    ("never-cycled", 1.0, 10.0, {"g1": (NOW, None), "g2": (1.0, None)}, False),
    # A slow cycle_seconds sets the bound: late only after two of the loop's own cycles.
    ("slow-cycles", 5.0, 2.0, {"g1": (9.0, None), "g2": (9.9, None)}, True),
    ("slow-cycles-stale", 5.0, 2.0, {"g1": (10.1, None), "g2": (1.0, None)}, False),
    # Without WatchdogSec= nobody listens for pings; staleness is not judged.
    ("no-watchdog-sec", 1.0, None, {"g1": (1000.0, None), "g2": (1.0, None)}, True),
]


@pytest.mark.parametrize("row", LIVENESS_TABLE, ids=[row[0] for row in LIVENESS_TABLE])
async def test_loops_alive(
    tmp_path: Path,
    client: httpx.AsyncClient,
    row: tuple[str, float, float | None, dict[str, tuple[float, float | None]], bool],
) -> None:
    """Alive: every loop cycled recently or acts within its sequence's bounds; else not."""
    _, cycle_seconds, watchdog_seconds, loops, alive = row
    daemon = liveness_daemon(tmp_path, cycle_seconds, watchdog_seconds)
    set_runtimes(daemon, client, loops)
    assert daemon.loops_alive(NOW) is alive


async def test_the_next_cycles_health_is_asked_ahead_between_cycles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between two cycles the loop asks the next observation's /health ahead (at once here,
    the cycle being shorter than the lead); none after the last cycle, and whatever is still
    pending is cancelled when the loop ends."""
    events: list[str] = []
    ask, cancel = GroupObserver.start_health_ahead, GroupObserver.cancel_ahead

    def asked_ahead(observer: GroupObserver) -> None:
        events.append("ahead")
        ask(observer)

    def cancelled(observer: GroupObserver) -> None:
        events.append("cancel")
        cancel(observer)

    class Recording(StopAfter):
        limit = 3

        async def run_cycle(self, runtime: GroupRuntime) -> Decision:
            events.append("cycle")
            return await super().run_cycle(runtime)

    monkeypatch.setattr(GroupObserver, "start_health_ahead", asked_ahead)
    monkeypatch.setattr(GroupObserver, "cancel_ahead", cancelled)
    config = load_config(write_config(tmp_path, refused_url(), cycle_seconds=0.05))
    assert await run_daemon(Recording(config, dry_run=True, bus_address=NO_BUS)) == 0
    assert events == ["cycle", "ahead", "cycle", "ahead", "cycle", "cancel"]


async def test_the_wait_between_cycles_is_split_at_the_lead_never_lengthened(
    tmp_path: Path, client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What is left of the cycle is slept in two parts, /health asked between them a lead
    before the next cycle (at once when less is left): together never more than what was
    left."""
    daemon = liveness_daemon(tmp_path, 5.0, None)
    set_runtimes(daemon, client, {"g1": (0.0, None), "g2": (0.0, None)})
    runtime = daemon.groups["g1"]
    steps: list[object] = []

    async def sleep(seconds: float) -> None:
        steps.append(seconds)

    monkeypatch.setattr(daemon, "_wait_stop", sleep)
    monkeypatch.setattr(runtime.observer, "start_health_ahead", lambda: steps.append("ahead"))
    await daemon._until_next_cycle(runtime, 4.5)
    await daemon._until_next_cycle(runtime, 0.25)
    assert steps == [
        pytest.approx(4.5 - HEALTH_LEAD_SECONDS),
        "ahead",
        pytest.approx(HEALTH_LEAD_SECONDS),
        0.0,
        "ahead",
        0.25,
    ]


async def test_group_loops_start_spread_over_the_first_cycle(
    tmp_path: Path, client: httpx.AsyncClient
) -> None:
    """Group i of n starts i/n of a cycle late: their fetches and probes never all coincide."""
    daemon = liveness_daemon(tmp_path, 4.0, None)
    set_runtimes(daemon, client, {"g1": (0.0, None), "g2": (0.0, None)})
    assert [daemon._start_offset(i) for i in range(2)] == [0.0, 2.0]
    daemon.once = True  # a one-shot check runs every group at once
    assert [daemon._start_offset(i) for i in range(2)] == [0.0, 0.0]


# --- signals ----------------------------------------------------------------------------------------


async def test_sighup_is_logged_and_ignored(tmp_path: Path) -> None:
    """SIGHUP logs `sighup_ignored` (no reload) and neither stops nor kills the daemon."""
    daemon = Daemon(load_config(write_config(tmp_path, refused_url())), bus_address=NO_BUS)
    loop = asyncio.get_running_loop()
    daemon.install_signal_handlers()
    try:
        # Checked before sending: without a handler the signal's default action ends pytest.
        assert signal.getsignal(signal.SIGHUP) is not signal.SIG_DFL
        with capture_logs() as logs:
            os.kill(os.getpid(), signal.SIGHUP)
            async with asyncio.timeout(30):
                while not any(e["event"] == "sighup_ignored" for e in logs):
                    await asyncio.sleep(0.01)
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(signum)
    [event] = [e for e in logs if e["event"] == "sighup_ignored"]
    assert "reload is not supported" in event["effect"]
    assert not daemon.stop_event.is_set()
