"""Benchmark plumbing: the real watchdog daemon as a subprocess, its config, logs, metrics and cost.

The watchdog under test is always the installed console script (`<venv>/bin/watchdog`, or the
executable named by `BENCH_WATCHDOG`), run as `watchdog --log-format json --config CFG [--dry-run]`.
Its JSON log lines (stderr) are the measurement: `stall_detected` is the restart decision,
`state_changed` / `alert` the alerts, `verification_passed` the verified recovery. Timestamps come
from the log lines themselves (structlog's ISO UTC stamp), not from when the bench read them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import httpx

from bench.baselines import SeriesKey, parse_samples
from pdsim.stack import PDStack
from watchdog.configfile import Overrides, build_config, config_text

REPO_ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
# A bus path that cannot exist: a dry-run bench daemon must never see the host's units.
NO_BUS = "unix:path=/nonexistent/sglang-watchdog-bench/bus"


def watchdog_executable() -> str:
    """The watchdog console script of this interpreter's environment (or $BENCH_WATCHDOG)."""
    override = os.environ.get("BENCH_WATCHDOG")
    if override:
        return override
    return str(Path(sys.executable).with_name("watchdog"))


# --------------------------------------------------------------------------- config


# The timing keys results.json reports (settings.watchdog_timings), by config section.
REPORTED_TIMINGS: tuple[tuple[str, str], ...] = (
    ("watchdog", "cycle_seconds"),
    ("probe", "period_seconds"),
    ("probe", "timeout_seconds"),
    ("probe", "connect_timeout_seconds"),
    ("probe", "stream_idle_seconds"),
    ("probe", "health_timeout_seconds"),
    ("probe", "scrape_timeout_seconds"),
    ("probe", "multiround_every_seconds"),
    ("probe", "multiround_rounds"),
    ("probe", "max_tokens"),
    ("stall", "probe_failures"),
    ("stall", "no_progress_seconds"),
    ("stall", "window_seconds"),
    ("stall", "pinned_inflight_seconds"),
    ("stall", "startup_timeout_seconds"),
    ("stall", "decode_only_grace_seconds"),
    ("restart", "ready_timeout_seconds"),
    ("restart", "max_restarts"),
    ("restart", "budget_window_seconds"),
    ("restart", "backoff_seconds"),
    ("restart", "verify_probes"),
    ("restart", "verify_timeout_seconds"),
    ("watchdog", "evidence_timeout_seconds"),
)

# configs/example.toml's cadence: watchdog/config.py's defaults, nothing overridden.
DEFAULT_TIMINGS: Overrides = {}

# Compressed for the scenario runs (results.md states it): probe period, timeout, stream idle and
# the windows divided by 5; cycle by 10 so the decision is not quantised to a whole probe period;
# no_progress_seconds set to timeout + 2 periods (the detection target, docs/architecture.md)
# instead of 45/5.
# Budget raised so repeated bench restarts are never refused; multi-round probe off.
# Only what differs from watchdog/config.py's defaults.
COMPRESSION = 5.0
COMPRESSED_TIMINGS: Overrides = {
    "watchdog": {"cycle_seconds": 0.5, "evidence_timeout_seconds": 5.0},
    "group": {
        "probe": {
            "period_seconds": 1.0,
            "timeout_seconds": 4.0,
            "connect_timeout_seconds": 1.0,
            "stream_idle_seconds": 2.0,
            "health_timeout_seconds": 2.0,
            "scrape_timeout_seconds": 1.0,
            "multiround_every_seconds": 0.0,
        },
        "stall": {
            "no_progress_seconds": 6.0,
            "window_seconds": 60.0,
            "pinned_inflight_seconds": 120.0,
            "startup_timeout_seconds": 240.0,
            "decode_only_grace_seconds": 12.0,
        },
        "restart": {
            "ready_timeout_seconds": 60.0,
            "max_restarts": 50,
            "budget_window_seconds": 720.0,
            "backoff_seconds": 60.0,
            "verify_timeout_seconds": 60.0,
            # Verification as measured before the soak (the 8th success in a row ends it):
            # the scenarios time detection and recovery, not the soak.
            "soak_probes": 1,
            "soak_seconds": 0.0,
        },
    },
}


@dataclass(frozen=True)
class GroupTarget:
    """One PD group as the watchdog config names it."""

    name: str
    prefill_url: str
    decode_url: str
    router_url: str
    router_metrics_url: str | None = None
    model: str = "pdsim"
    # Prefill's KV bootstrap port as the router is given it: direct PD probes need the real one.
    bootstrap_port: int | None = None
    units: Mapping[str, str] = field(default_factory=dict)  # role -> unit name

    @classmethod
    def of_stack(cls, name: str, stack: PDStack) -> GroupTarget:
        """A running pdsim stack (its URLs and real bootstrap port) as the group `name`."""
        return cls(
            name=name,
            prefill_url=stack.prefill_url,
            decode_url=stack.decode_url,
            router_url=stack.router_url,
            router_metrics_url=stack.router_metrics_url,
            bootstrap_port=stack.bootstrap_port,
        )

    def unit(self, role: str) -> str:
        """The configured unit of a role (a made-up one when the bench has no systemd)."""
        return self.units.get(role, f"sglang-{self.name}-{role}.service")

    def overrides(self) -> dict[str, Any]:
        """This group as one [[group]] of a watchdog config."""
        urls = {"prefill": self.prefill_url, "decode": self.decode_url, "router": self.router_url}
        group: dict[str, Any] = {"name": self.name, "probe": {"model": self.model}}
        for role, url in urls.items():
            group[role] = {"unit": self.unit(role), "url": url}
        if self.router_metrics_url:
            group["router"]["metrics_url"] = self.router_metrics_url
        if self.bootstrap_port is not None:
            group["prefill"]["bootstrap_port"] = self.bootstrap_port
        return group


def timing_values(timings: Overrides) -> dict[str, float]:
    """Every reported timing key with its effective value (config.py's default where `timings`
    is silent), for results.json and the bench's own waits."""
    placeholder = GroupTarget("t", f"http://{HOST}:1", f"http://{HOST}:2", f"http://{HOST}:3")
    config = build_config(timings, {"group": [placeholder.overrides()]})
    group = config.group[0]
    sections = {
        "watchdog": config.watchdog,
        "probe": group.probe,
        "stall": group.stall,
        "restart": group.restart,
    }
    return {key: getattr(sections[section], key) for section, key in REPORTED_TIMINGS}


def watchdog_config_toml(
    groups: Sequence[GroupTarget],
    timings: Overrides,
    *,
    state_dir: Path,
    metrics_listen: str,
) -> str:
    """A complete watchdog config for `groups` with `timings` (validated as it is built)."""
    own = {
        "watchdog": {"state_dir": str(state_dir), "metrics_listen": metrics_listen},
        "group": [group.overrides() for group in groups],
    }
    return config_text(timings, own)


# --------------------------------------------------------------------------- log events


def parse_log_line(line: str, received_at: float) -> dict[str, Any]:
    """One stderr line as a dict with `_at` (epoch seconds of the log stamp, else receipt)."""
    try:
        event = json.loads(line)
    except json.JSONDecodeError:
        return {"event": "_raw", "text": line, "_at": received_at}
    if not isinstance(event, dict):
        return {"event": "_raw", "text": line, "_at": received_at}
    at = received_at
    stamp = event.get("timestamp")
    if isinstance(stamp, str):
        with contextlib.suppress(ValueError):
            at = datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    event["_at"] = at
    return event


# States in which the group is not judged healthy: entering one of them is an alert or a decision.
ALERT_STATES = frozenset({"degraded", "stalled", "held"})


@dataclass(frozen=True)
class WatchdogOutcome:
    """What the daemon's log says about one run, relative to the injection time `t0`."""

    decision_after_s: float | None  # first stall_detected at or after t0
    decision_verdict: str | None
    alert_after_s: float | None  # first alert / entry into degraded|stalled at or after t0
    alert_verdict: str | None
    decisions_total: int  # stall_detected over the whole run (a benign run wants 0)
    decisions_before_t0: int
    dry_run_restarts: int
    alerts_total: int
    verification_passed_after_s: float | None
    states: tuple[str, ...]
    internal_errors: int


def summarize_events(events: Iterable[Mapping[str, Any]], t0: float) -> WatchdogOutcome:
    """Reduce a run's log events to the measured quantities (pure; no clock)."""
    decision: Mapping[str, Any] | None = None
    alert: Mapping[str, Any] | None = None
    verified: Mapping[str, Any] | None = None
    decisions = before = dry_runs = alerts = errors = 0
    states: list[str] = []
    for ev in events:
        name = ev.get("event")
        at = float(ev.get("_at", 0.0))
        if name == "stall_detected":
            decisions += 1
            if at < t0:
                before += 1
            elif decision is None:
                decision = ev
        elif name == "restart_skipped_dry_run":
            dry_runs += 1
        elif name == "cycle_failed":
            errors += 1
        elif name == "verification_passed" and at >= t0 and verified is None:
            verified = ev
        is_alert = name == "alert" or (name == "state_changed" and ev.get("new") in ALERT_STATES)
        if name == "state_changed":
            states.append(str(ev.get("new")))
        if is_alert:
            alerts += 1
        if (is_alert or name == "stall_detected") and at >= t0 and alert is None:
            alert = ev
    return WatchdogOutcome(
        decision_after_s=None if decision is None else float(decision["_at"]) - t0,
        decision_verdict=None if decision is None else str(decision.get("verdict")),
        alert_after_s=None if alert is None else float(alert["_at"]) - t0,
        alert_verdict=None if alert is None else str(alert.get("verdict")),
        decisions_total=decisions,
        decisions_before_t0=before,
        dry_run_restarts=dry_runs,
        alerts_total=alerts,
        verification_passed_after_s=None if verified is None else float(verified["_at"]) - t0,
        states=tuple(states),
        internal_errors=errors,
    )


# --------------------------------------------------------------------------- /proc


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of a live process, in seconds (None when it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields_ = stat.rsplit(")", 1)[1].split()
    ticks = int(fields_[11]) + int(fields_[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def peak_rss_mib(pid: int) -> float | None:
    """VmHWM (peak resident set) of a live process, in MiB."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024.0
    return None


def system_busy_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs from /proc/stat."""
    first = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    values = [int(v) for v in first]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return sum(values) - idle, sum(values)


@dataclass
class CpuMeter:
    """Average machine utilisation (all cores) between start() and stop()."""

    started: tuple[int, int] = (0, 0)
    utilisation: float | None = None

    def start(self) -> None:
        self.started = system_busy_ticks()

    def stop(self) -> float:
        busy, total = system_busy_ticks()
        span = total - self.started[1]
        self.utilisation = (busy - self.started[0]) / span if span > 0 else 0.0
        return self.utilisation


# --------------------------------------------------------------------------- the daemon


# Daemons started and not yet reaped, by PID: an interrupted bench stops them on its way out.
ACTIVE_PIDS: set[int] = set()


def stop_leftover_watchdogs(grace_seconds: float = 5.0) -> None:
    """SIGTERM every daemon still registered, then SIGKILL what is left after the grace time."""
    for pid in list(ACTIVE_PIDS):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_seconds
    while time.monotonic() < deadline and any(_alive(pid) for pid in ACTIVE_PIDS):
        time.sleep(0.05)
    for pid in list(ACTIVE_PIDS):
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        ACTIVE_PIDS.discard(pid)


def _alive(pid: int) -> bool:
    # A zombie (exited, not yet reaped by its asyncio parent) counts as gone.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class WatchdogProcess:
    """The real daemon as a subprocess in its own session; every log line kept and parsed."""

    def __init__(
        self,
        config_path: Path,
        *,
        dry_run: bool,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        extra_args: Sequence[str] = (),
        launcher: Sequence[str] | None = None,
    ) -> None:
        # `launcher` replaces the console script, e.g. [python, -m, cProfile, -o, F, -m, watchdog].
        self.argv = [
            *(launcher if launcher is not None else [watchdog_executable()]),
            "--log-format",
            "json",
            "--config",
            str(config_path),
            *(["--dry-run"] if dry_run else []),
            *extra_args,
        ]
        self.log_path = log_path
        base = dict(os.environ if env is None else env)
        base.setdefault("DBUS_SYSTEM_BUS_ADDRESS", NO_BUS)
        base.pop("NOTIFY_SOCKET", None)
        base.pop("WATCHDOG_USEC", None)
        self.env = base
        self.events: list[dict[str, Any]] = []
        self.proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()
        self.peak_rss_mib: float | None = None
        self.cpu_seconds: float | None = None
        self.returncode: int | None = None

    @property
    def command(self) -> str:
        """The command line, as results.md prints it."""
        return " ".join(self.argv)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    async def start(self) -> None:
        """Spawn the daemon (cwd = repository root) and start reading its stderr."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv,
            cwd=REPO_ROOT,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        ACTIVE_PIDS.add(self.proc.pid)
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.proc is not None
        assert self.proc.stderr is not None
        with self.log_path.open("a", encoding="utf-8") as log:
            async for raw in self.proc.stderr:
                line = raw.decode("utf-8", errors="replace").rstrip("\n")
                log.write(line + "\n")
                self.events.append(parse_log_line(line, time.time()))
                self._changed.set()

    def sample_cost(self) -> None:
        """Remember CPU seconds and peak RSS while the process is alive (read before stop)."""
        if self.proc is None or self.proc.returncode is not None:
            return
        cpu = cpu_seconds(self.proc.pid)
        rss = peak_rss_mib(self.proc.pid)
        if cpu is not None:
            self.cpu_seconds = cpu
        if rss is not None:
            self.peak_rss_mib = rss

    def exited(self) -> bool:
        return self.proc is not None and self.proc.returncode is not None

    async def wait_for_event(
        self, predicate: Callable[[Mapping[str, Any]], bool], timeout_seconds: float
    ) -> dict[str, Any] | None:
        """The first logged event (past or future) matching `predicate`, or None on timeout."""
        deadline = time.monotonic() + timeout_seconds
        seen = 0
        while True:
            for event in self.events[seen:]:
                if predicate(event):
                    return event
            seen = len(self.events)
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self.exited():
                return None
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(remaining, 0.5)):
                    await self._changed.wait()

    async def stop(self, grace_seconds: float = 10.0) -> None:
        """SIGTERM by PID, wait, SIGKILL; then drain the log reader."""
        proc = self.proc
        if proc is None:
            return
        self.sample_cost()
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
            try:
                async with asyncio.timeout(grace_seconds):
                    await proc.wait()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                await proc.wait()
        self.returncode = proc.returncode
        ACTIVE_PIDS.discard(proc.pid)
        if self._reader is not None:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                async with asyncio.timeout(5.0):
                    await self._reader

    def tail(self, lines: int = 20) -> str:
        """The last log lines (for error messages)."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


async def read_metrics(
    url: str, names: Iterable[str], timeout_seconds: float = 3.0
) -> dict[str, dict[SeriesKey, float]] | None:
    """GET a Prometheus endpoint and return the samples of `names` (None when unreachable)."""
    try:
        async with httpx.AsyncClient(trust_env=False, timeout=timeout_seconds) as client:
            response = await client.get(url)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return parse_samples(response.text, names)


def total(samples: Mapping[SeriesKey, float], **match: str) -> float:
    """Sum of the samples whose labels include `match`."""
    return sum(v for k, v in samples.items() if all(dict(k).get(a) == b for a, b in match.items()))


# --------------------------------------------------------------------------- load


@dataclass(frozen=True)
class LoadProfile:
    """Closed-loop clients sending completions through the router."""

    clients: int = 2
    max_tokens: int = 32
    think_seconds: float = 0.2
    timeout_seconds: float = 30.0
    prompt_words: int = 20
    stream: bool = False

    def scaled(self, **changes: Any) -> LoadProfile:
        return replace(self, **changes)


@dataclass
class LoadGenerator:
    """Runs `profile.clients` loops until cancelled; counts finished and failed requests."""

    router_url: str
    profile: LoadProfile
    model: str = "pdsim"
    ok: int = 0
    failed: int = 0

    async def run(self) -> None:
        p = self.profile
        limits = httpx.Limits(max_connections=p.clients + 4, max_keepalive_connections=p.clients)
        timeout = httpx.Timeout(p.timeout_seconds, connect=3.0)
        async with (
            httpx.AsyncClient(trust_env=False, limits=limits, timeout=timeout) as client,
            asyncio.TaskGroup() as tasks,
        ):
            for index in range(p.clients):
                tasks.create_task(self._client_loop(client, index))

    async def _client_loop(self, client: httpx.AsyncClient, index: int) -> None:
        p = self.profile
        body = {
            "model": self.model,
            "prompt": " ".join(["load"] * p.prompt_words) + f" {index}",
            "max_tokens": p.max_tokens,
            "stream": p.stream,
        }
        # Stagger the clients so they do not move in lock step.
        await asyncio.sleep(index * p.think_seconds / max(1, p.clients))
        while True:
            try:
                async with asyncio.timeout(p.timeout_seconds):
                    response = await client.post(self.router_url + "/v1/completions", json=body)
                    await response.aread()
                if response.status_code == 200:
                    self.ok += 1
                else:
                    self.failed += 1
            except (httpx.HTTPError, TimeoutError, OSError):
                self.failed += 1
                await asyncio.sleep(0.5)  # a client backs off a little after an error
            await asyncio.sleep(p.think_seconds)


@dataclass
class Loads:
    """The load generators of one run: started as the run needs them, all stopped at its end."""

    generators: list[LoadGenerator] = field(default_factory=list)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def start(self, router_url: str, profile: LoadProfile) -> LoadGenerator:
        """Start a closed-loop generator against `router_url` (cancelled by stop())."""
        generator = LoadGenerator(router_url, profile)
        self.generators.append(generator)
        self.tasks.append(asyncio.create_task(generator.run()))
        return generator

    async def stop(self) -> None:
        """Cancel every generator and wait for it; their counts stay readable."""
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self.tasks.clear()


# --------------------------------------------------------------------------- machine


def _read_first(path: str, prefix: str) -> str:
    with contextlib.suppress(OSError):
        for line in Path(path).read_text().splitlines():
            if line.startswith(prefix):
                return line.split(":", 1)[1].strip()
    return "unknown"


def _pkg(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def git_revision() -> str:
    """HEAD's short hash, with `+dirty` when the working tree has changes."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def machine_info() -> dict[str, Any]:
    """The machine and software the numbers were measured on."""
    mem_kib = _read_first("/proc/meminfo", "MemTotal").split()[0]
    return {
        "cpu_model": _read_first("/proc/cpuinfo", "model name"),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)),
        "memory_gib": round(int(mem_kib) / 1024 / 1024, 1) if mem_kib.isdigit() else None,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "sglang_router": _pkg("sglang-router"),
        "prometheus_client": _pkg("prometheus-client"),
        "sglang_watchdog": _pkg("sglang-watchdog"),
        "git": git_revision(),
        "euid": os.geteuid(),
    }


def write_section(results: Path, text: str, begin: str, end: str) -> None:
    """Put `text` (which starts with `begin` and ends with `end`) in place of the section
    between those markers in results.md, or append it where there is none: bench.run rewrites
    the rest of the file, the suites that run after it add their own sections."""
    current = results.read_text() if results.exists() else "# sglang-watchdog benchmark\n"
    if begin in current and end in current:
        head, _, rest = current.partition(begin)
        _, _, tail = rest.partition(end)
        updated = head + text + tail
    else:
        updated = current.rstrip("\n") + "\n\n" + text + "\n"
    results.write_text(updated)
