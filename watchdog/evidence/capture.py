"""Capture the evidence of a wedge before a restart erases it, each item bounded, never failing.

What is captured: per unit the systemd properties, the process tree with cmdlines, the
allowlisted environ (secrets redacted), config drift, the journal tail with the age of the last
batch line, py-spy stacks; per group the last raw /metrics, worker /health, router /readiness and
/workers, and the host's GPU state. Every item has its own timeout and the whole capture stays under
`total_timeout_seconds`; an item that fails or runs out of time is recorded as unavailable with
the reason, so capture never blocks or fails the action it precedes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import shutil
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol, TypeVar

import httpx
import structlog

from watchdog.clock import Clock
from watchdog.config import GroupSection, UnitSection
from watchdog.evidence.blocking import run_command, wait_for_blocking
from watchdog.evidence.drift import check_drift, log_drift
from watchdog.evidence.gpu import read_gpus
from watchdog.evidence.journal import (
    JournalctlReader,
    JournalReader,
    summarise_journal,
)
from watchdog.evidence.procinfo import (
    DEFAULT_PROC_ROOT,
    ProcessInfo,
    filter_environ,
    read_cmdline,
    read_environ,
    read_process_tree,
)
from watchdog.evidence.records import (
    LOCAL_HOST,
    DriftFinding,
    Evidence,
    GpuReading,
    GpuSource,
    HostGpuReading,
    HttpEvidence,
    ItemStatus,
    JournalExcerpt,
    MetricsText,
    StackDump,
    UnitEvidence,
)
from watchdog.evidence.remote import (
    RemoteGpuReader,
    RemoteHost,
    RemoteJournalReader,
    read_remote_process,
    read_remote_raw,
)
from watchdog.model import Observation, Role, UnitState, Worker
from watchdog.observe.bounded import ACCEPT_ENCODING, read_capped
from watchdog.observe.observer import UnitReader

T = TypeVar("T")

_MIB = 1024 * 1024


class GpuReader(Protocol):
    """Reads the host's GPUs; returns an unavailable reading instead of raising."""

    async def read_gpus(self, timeout_seconds: float) -> GpuReading:
        """Every GPU's utilisation, power and memory."""
        ...


class StackDumper(Protocol):
    """Dumps the Python stacks of a running process."""

    async def dump_stacks(self, pid: int, timeout_seconds: float) -> StackDump:
        """The stacks of `pid` within `timeout_seconds`; unavailable instead of raising."""
        ...


class SystemGpuReader:
    """GpuReader over NVML, falling back to nvidia-smi (watchdog.evidence.gpu.read_gpus)."""

    async def read_gpus(self, timeout_seconds: float) -> GpuReading:
        """The host's GPUs, or an unavailable reading naming why."""
        return await read_gpus(timeout_seconds)


class PySpyDumper:
    """StackDumper over `py-spy dump --pid PID` (needs ptrace rights: root or CAP_SYS_PTRACE)."""

    def __init__(self, binary: str = "py-spy", max_bytes: int = 256 * 1024) -> None:
        self.binary = binary
        self.max_bytes = max_bytes

    async def dump_stacks(self, pid: int, timeout_seconds: float) -> StackDump:
        """The stacks of `pid`; py-spy's own message when it cannot attach."""
        result = await run_command(
            (self.binary, "dump", "--pid", str(pid)), timeout_seconds, self.max_bytes
        )
        if result.returncode is None:
            return StackDump(pid, ok=False, detail=result.error)
        text = result.stdout.decode("utf-8", "replace")
        if result.returncode != 0:
            message = (result.stderr or result.stdout)[:300].decode("utf-8", "replace").strip()
            return StackDump(pid, ok=False, detail=f"py-spy exited {result.returncode}: {message}")
        return StackDump(pid, ok=True, text=text, truncated=result.stdout_truncated)


def default_stack_dumper() -> StackDumper | None:
    """A PySpyDumper when py-spy is on PATH, else None (recorded as unavailable)."""
    return PySpyDumper() if shutil.which("py-spy") else None


@dataclass(frozen=True)
class EvidenceTools:
    """Where evidence comes from and how much of it is kept; tests swap in fakes."""

    # /proc of the PID namespace systemd's MainPID values belong to. The systemd test sandbox runs
    # its own PID namespace, visible from outside as /proc/<host pid of its PID 1>/root/proc.
    proc_root: Path = DEFAULT_PROC_ROOT
    journal: JournalReader = field(default_factory=JournalctlReader)
    gpu: GpuReader = field(default_factory=SystemGpuReader)
    stacks: StackDumper | None = field(default_factory=default_stack_dumper)
    item_timeout_seconds: float = 5.0  # unit properties, /proc, HTTP, journal, GPU
    stack_timeout_seconds: float = 10.0  # one py-spy dump (all run concurrently)
    max_stack_processes: int = 8  # per role; SGLang runs one scheduler per TP rank plus helpers
    max_metrics_bytes: int = 2 * _MIB  # a 3000-line SGLang payload is ~0.5 MiB
    max_http_body_bytes: int = 256 * 1024


class _Budget:
    """The shared deadline and the item log of one capture."""

    def __init__(self, total_timeout_seconds: float, tools: EvidenceTools) -> None:
        self.loop = asyncio.get_running_loop()
        # Items end slightly before the total so each records its own reason ("timed out after")
        # before the outer backstop cancels whatever is left.
        reserve_seconds = min(0.25, total_timeout_seconds / 10)
        self.deadline = self.loop.time() + total_timeout_seconds - reserve_seconds
        self.tools = tools
        self.items: dict[str, ItemStatus] = {}
        self.pending: set[str] = set()

    def timeout(self, own_seconds: float) -> float:
        return max(0.0, min(own_seconds, self.deadline - self.loop.time()))

    def record(self, name: str, ok: bool, detail: str = "", duration: float = 0.0) -> None:
        self.pending.discard(name)
        self.items[name] = ItemStatus(name, ok, detail, round(duration, 3))

    async def bounded(
        self, name: str, work: Callable[[float], Awaitable[T]], own_seconds: float
    ) -> tuple[T | None, str]:
        """(result, "") or (None, why). Never raises except on cancellation."""
        self.pending.add(name)
        timeout = self.timeout(own_seconds)
        if timeout <= 0:
            return None, "no time left in the evidence budget"
        started = self.loop.time()
        try:
            return await asyncio.wait_for(work(timeout), timeout), ""
        except TimeoutError:
            return None, f"timed out after {self.loop.time() - started:.1f} s"
        except Exception as exc:  # evidence never fails the action; the reason is kept
            return None, f"{type(exc).__name__}: {exc}"


def _read_process(
    pid: int, proc_root: Path
) -> tuple[tuple[ProcessInfo, ...], tuple[str, ...] | None, dict[str, str] | None, str]:
    """(tree, raw cmdline, full environ, environ error) of a main PID; OSError if it is gone."""
    tree = read_process_tree(pid, proc_root)
    try:
        cmdline: tuple[str, ...] | None = read_cmdline(pid, proc_root)
    except OSError:
        cmdline = None
    try:
        return tree, cmdline, read_environ(pid, proc_root), ""
    except OSError as exc:
        return tree, cmdline, None, f"environ unreadable: {exc.strerror or exc}"


async def _capture_unit(
    budget: _Budget,
    *,
    group: str,
    worker: Worker,
    section: UnitSection,
    observation: Observation,
    unit_reader: UnitReader | None,
    journal_lines: int,
    now: Clock,
    remote_host: RemoteHost | None = None,
) -> UnitEvidence:
    """One worker's items, in order under the shared deadline (its journal alongside)."""
    # A unit on another host: the same items, read over its SSH connection (its MainPID is not a
    # PID of this host, so this host's /proc, journal and py-spy are never used for it).
    journal = budget.tools.journal if remote_host is None else RemoteJournalReader(remote_host)
    journal_future = asyncio.create_task(
        _journal(budget, journal, worker, section.unit, journal_lines)
    )
    try:
        state = await _unit_state(budget, worker, section, observation, unit_reader)
        main_pid = state.main_pid if state is not None and state.ok else 0
        found = await _unit_processes(
            budget,
            group,
            worker=worker,
            section=section,
            main_pid=main_pid,
            remote_host=remote_host,
        )
        # py-spy stacks of the serving processes (not the router: its work happens in Rust).
        stacks: tuple[StackDump, ...] = ()
        if worker.role is not Role.ROUTER and remote_host is not None:
            budget.record(
                f"stacks:{worker.name}",
                False,
                f"unit on {remote_host.label}: py-spy is not run over SSH",
            )
        elif worker.role is not Role.ROUTER:
            stacks = await _capture_stacks(budget, worker.name, found.processes)
        excerpt = await journal_future
    finally:
        journal_future.cancel()
        await asyncio.gather(journal_future, return_exceptions=True)

    summary = summarise_journal(excerpt.text) if excerpt.ok else None
    last_at = summary.last_batch_at if summary else None
    return UnitEvidence(
        role=worker.role,
        unit=section.unit,
        state=state,
        processes=found.processes,
        environ=found.environ,
        drift=found.drift,
        drift_checked=found.drift_checked,
        journal=excerpt,
        last_batch_at=last_at,
        last_batch_age_seconds=None if last_at is None else round(max(0.0, now() - last_at), 1),
        last_batch_line=summary.last_batch_line if summary else "",
        journal_failures=summary.failures if summary else (),
        stacks=stacks,
        host=LOCAL_HOST if remote_host is None else remote_host.label,
        worker=worker.index,
        name=worker.name,
    )


async def _journal(
    budget: _Budget, journal: JournalReader, worker: Worker, unit: str, lines: int
) -> JournalExcerpt:
    name = f"journal:{worker.name}"
    t0 = budget.loop.time()

    async def work(limit_seconds: float) -> JournalExcerpt:
        return await journal.read_journal(unit, lines, limit_seconds)

    excerpt, why = await budget.bounded(name, work, budget.tools.item_timeout_seconds)
    if excerpt is None:
        excerpt = JournalExcerpt(unit, ok=False, detail=why)
    budget.record(name, excerpt.ok, excerpt.detail, budget.loop.time() - t0)
    return excerpt


async def _unit_state(
    budget: _Budget,
    worker: Worker,
    section: UnitSection,
    observation: Observation,
    unit_reader: UnitReader | None,
) -> UnitState | None:
    """systemd's properties: fresh when a reader is there, else the cycle's observation."""
    name = f"unit:{worker.name}"
    observed = observation.unit_of(worker.role, worker.index)
    if unit_reader is None:
        budget.record(
            name,
            observed is not None and observed.ok,
            "from the cycle's observation" if observed else "systemd is not observed",
        )
        return observed
    started = budget.loop.time()

    async def read(_: float) -> UnitState:
        return await unit_reader.read_unit(worker.role, section.unit)

    fresh, why = await budget.bounded(name, read, budget.tools.item_timeout_seconds)
    if fresh is not None and fresh.ok:
        budget.record(name, True, "", budget.loop.time() - started)
        return replace(fresh, worker=worker.index)
    reason = why or (fresh.error if fresh is not None else "") or "unreadable"
    detail = reason + ("; using the cycle's observation" if observed else "")
    budget.record(name, observed is not None, detail)
    return observed


@dataclass(frozen=True, slots=True)
class _Found:
    """What /proc says about a worker's main process."""

    processes: tuple[ProcessInfo, ...] = ()
    environ: tuple[tuple[str, str], ...] = ()
    drift: tuple[DriftFinding, ...] = ()
    drift_checked: bool = False


async def _unit_processes(
    budget: _Budget,
    group: str,
    *,
    worker: Worker,
    section: UnitSection,
    main_pid: int,
    remote_host: RemoteHost | None,
) -> _Found:
    """The process tree, cmdline and environ of MainPID, then drift."""
    processes_item, environ_item = f"processes:{worker.name}", f"environ:{worker.name}"
    if main_pid <= 0:
        reason = "no MainPID (unit not running or not observed)"
        budget.record(processes_item, False, reason)
        budget.record(environ_item, False, reason)
        return _Found()
    t0 = budget.loop.time()
    proc_root = budget.tools.proc_root

    async def proc(
        limit_seconds: float,
    ) -> tuple[tuple[ProcessInfo, ...], tuple[str, ...] | None, dict[str, str] | None, str]:
        if remote_host is not None:
            return await read_remote_process(remote_host, main_pid, limit_seconds)
        return await wait_for_blocking(lambda: _read_process(main_pid, proc_root), limit_seconds)

    result, why = await budget.bounded(processes_item, proc, budget.tools.item_timeout_seconds)
    took = budget.loop.time() - t0
    if result is None:
        budget.record(processes_item, False, f"MainPID {main_pid}: {why}", took)
        budget.record(environ_item, False, "process tree not read")
        return _Found()
    processes, cmdline, full_environ, environ_error = result
    budget.record(processes_item, True, f"{len(processes)} process(es)", took)
    if full_environ is None:
        budget.record(environ_item, False, environ_error)
        return _Found(processes)
    environ = tuple(filter_environ(full_environ).items())
    budget.record(environ_item, True, f"{len(environ)} allowlisted")
    drift = check_drift(section, cmdline or (), full_environ)
    if drift:
        log_drift(group, worker, drift)
    return _Found(processes, environ, drift, cmdline is not None)


async def _capture_stacks(
    budget: _Budget, who: str, processes: tuple[ProcessInfo, ...]
) -> tuple[StackDump, ...]:
    name = f"stacks:{who}"
    dumper = budget.tools.stacks
    if dumper is None:
        budget.record(name, False, "py-spy not installed")
        return ()
    if not processes:
        budget.record(name, False, "no process to dump")
        return ()
    t0 = budget.loop.time()
    chosen = processes[: budget.tools.max_stack_processes]

    async def one(pid: int) -> StackDump:
        async def work(limit_seconds: float) -> StackDump:
            return await dumper.dump_stacks(pid, limit_seconds)

        dump, why = await budget.bounded(name, work, budget.tools.stack_timeout_seconds)
        return dump if dump is not None else StackDump(pid, ok=False, detail=why)

    dumps = tuple(await asyncio.gather(*(one(p.pid) for p in chosen)))
    good = sum(d.ok for d in dumps)
    budget.record(
        name,
        good > 0,
        f"{good}/{len(dumps)} process(es) dumped"
        + ("" if good else f": {dumps[0].detail}" if dumps else ""),
        budget.loop.time() - t0,
    )
    return dumps


async def _fetch(budget: _Budget, client: httpx.AsyncClient, name: str, url: str) -> HttpEvidence:
    item = f"http:{name}"
    cap = budget.tools.max_http_body_bytes
    t0 = budget.loop.time()

    async def work(limit_seconds: float) -> HttpEvidence:
        async with client.stream(
            "GET", url, headers=ACCEPT_ENCODING, timeout=limit_seconds
        ) as response:
            body = await read_capped(response, cap)  # decoded bytes: a gzip bomb stops here too
            return HttpEvidence(
                name,
                url,
                ok=True,
                status_code=response.status_code,
                body=body.text(),
                truncated=body.truncated,
            )

    answer, why = await budget.bounded(item, work, budget.tools.item_timeout_seconds)
    took = budget.loop.time() - t0
    if answer is None:
        # httpx's messages are often empty ("ReadTimeout: "): the class name carries the reason.
        budget.record(item, False, why, took)
        return HttpEvidence(name, url, ok=False, detail=why, duration_seconds=round(took, 3))
    budget.record(item, True, f"HTTP {answer.status_code}", took)
    return HttpEvidence(
        answer.name,
        answer.url,
        answer.ok,
        answer.status_code,
        answer.body,
        answer.truncated,
        duration_seconds=round(took, 3),
    )


async def _capture_gpu(
    budget: _Budget, reader: GpuReader | None = None, name: str = "gpu"
) -> GpuReading:
    t0 = budget.loop.time()
    gpu = budget.tools.gpu if reader is None else reader

    async def work(limit_seconds: float) -> GpuReading:
        return await gpu.read_gpus(limit_seconds)

    reading, why = await budget.bounded(name, work, budget.tools.item_timeout_seconds)
    if reading is None:
        reading = GpuReading(GpuSource.UNAVAILABLE, (), why)
    detail = (
        reading.detail if not reading.ok else f"{reading.source}: {len(reading.devices)} GPU(s)"
    )
    budget.record(name, reading.ok, detail, budget.loop.time() - t0)
    return reading


def _expected_items(
    members: tuple[tuple[Worker, UnitSection], ...],
    endpoints: tuple[tuple[str, str], ...],
    gpu_hosts: Mapping[str, RemoteHost],
) -> set[str]:
    """Every item a capture should record: pending until recorded, so an item that never got
    its turn (its predecessor used up the budget) is still listed as unavailable, with why."""
    items = {"gpu", *(f"http:{name}" for name, _ in endpoints), *(f"gpu:{g}" for g in gpu_hosts)}
    for worker, _ in members:
        items.update(
            f"{kind}:{worker.name}" for kind in ("unit", "processes", "environ", "journal")
        )
        if worker.role is not Role.ROUTER:
            items.add(f"stacks:{worker.name}")
    return items


async def _settle(tasks: list[asyncio.Task[object]], total_timeout_seconds: float) -> None:
    """Wait for every task until the total; cancel and await what is left (none keeps running).

    Not a TaskGroup: a bug in one collector must not cancel the others. Items stop a little before
    the total (see _Budget), so this outer deadline is only a backstop against a tool slow to
    honour cancellation.
    """
    try:
        await asyncio.wait(tasks, timeout=total_timeout_seconds)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _result_of(group: str, task: asyncio.Task[T]) -> T | None:
    """A finished collector's result; None if it was cancelled or failed (a bug: logged)."""
    if task.cancelled():
        return None
    error = task.exception()
    if error is not None:
        structlog.get_logger().error(
            "internal_error", where="capture_evidence", group=group, error=repr(error)
        )
        return None
    return task.result()


def _endpoints(
    group: GroupSection, members: tuple[tuple[Worker, UnitSection], ...]
) -> tuple[tuple[str, str], ...]:
    """Every worker's /health (`prefill_health`, `prefill#2_health`), the router's answers."""
    health = tuple(
        (f"{worker.name}_health", f"{section.url}/health")
        for worker, section in members
        if worker.role is not Role.ROUTER
    )
    return (
        *health,
        ("router_readiness", f"{group.router.url}/readiness"),
        ("router_workers", f"{group.router.url}/workers"),
    )


def _metrics_texts(
    group: GroupSection, raw_metrics: Mapping[Role, bytes | None], max_bytes: int, budget: _Budget
) -> tuple[MetricsText, ...]:
    out = []
    for role in Role:
        name = f"metrics:{role}"
        if role is Role.ROUTER and group.router.metrics_url is None and role not in raw_metrics:
            budget.record(name, False, "router metrics_url not configured")
            continue
        raw = raw_metrics.get(role)
        if raw is None:
            budget.record(name, False, "no /metrics payload this cycle (scrape failed or skipped)")
            out.append(MetricsText(role, ok=False, detail="no payload"))
            continue
        text = raw[:max_bytes].decode("utf-8", "replace")
        budget.record(name, True, f"{len(raw)} bytes")
        out.append(MetricsText(role, True, text, len(raw) > max_bytes, len(raw)))
    return tuple(out)


async def capture_evidence(
    group: GroupSection,
    observation: Observation,
    *,
    raw_metrics: Mapping[Role, bytes | None],
    unit_reader: UnitReader | None,
    client: httpx.AsyncClient,
    total_timeout_seconds: float,
    journal_lines: int,
    tools: EvidenceTools | None = None,
    clock: Clock = time.time,
    remote_hosts: Mapping[str, RemoteHost] | None = None,
) -> Evidence:
    """Everything worth keeping about `group` now, within `total_timeout_seconds`; never raises.

    Items run concurrently; each has its own timeout, capped by what is left of the total. When
    the total runs out, unfinished items are recorded as unavailable and capture returns at once.
    `remote_hosts` maps the unit names on other hosts to their hosts: their items (and each such
    host's GPUs, as `gpu:<host>`) are read over SSH.
    """
    tools = tools if tools is not None else EvidenceTools()
    remote_hosts = remote_hosts or {}
    members = group.members()
    # One GPU reading per remote host of this group, however many of its units run there.
    gpu_hosts = {
        host.label: host
        for _, section in members
        if (host := remote_hosts.get(section.unit)) is not None
    }
    budget = _Budget(total_timeout_seconds, tools)
    started_at = clock()
    endpoints = _endpoints(group, members)
    metrics = _metrics_texts(group, raw_metrics, tools.max_metrics_bytes, budget)
    budget.pending.update(_expected_items(members, endpoints, gpu_hosts))

    unit_tasks = {
        worker: asyncio.create_task(
            _capture_unit(
                budget,
                group=group.name,
                worker=worker,
                section=section,
                observation=observation,
                unit_reader=unit_reader,
                journal_lines=journal_lines,
                now=clock,
                remote_host=remote_hosts.get(section.unit),
            )
        )
        for worker, section in members
    }
    http_tasks = [asyncio.create_task(_fetch(budget, client, n, u)) for n, u in endpoints]
    gpu_task = asyncio.create_task(_capture_gpu(budget))
    remote_gpu_tasks = {
        label: asyncio.create_task(_capture_gpu(budget, RemoteGpuReader(host), f"gpu:{label}"))
        for label, host in gpu_hosts.items()
    }
    tasks: list[asyncio.Task[object]] = [
        *unit_tasks.values(),
        *http_tasks,
        gpu_task,
        *remote_gpu_tasks.values(),
    ]
    await _settle(tasks, total_timeout_seconds)
    result_of = functools.partial(_result_of, group.name)
    units = tuple(
        result_of(unit_tasks[worker])
        or UnitEvidence(worker.role, section.unit, worker=worker.index, name=worker.name)
        for worker, section in members
    )
    http = tuple(h for h in (result_of(t) for t in http_tasks) if h is not None)
    gpu = result_of(gpu_task) or GpuReading(
        GpuSource.UNAVAILABLE, (), "not finished within the evidence budget"
    )
    remote_gpus = tuple(
        HostGpuReading(
            label,
            result_of(task)
            or GpuReading(GpuSource.UNAVAILABLE, (), "not finished within the evidence budget"),
        )
        for label, task in remote_gpu_tasks.items()
    )
    for name in sorted(budget.pending):
        budget.record(name, False, f"not finished within {total_timeout_seconds:g} s in total")
    finished_at = clock()
    return Evidence(
        group=group.name,
        started_at=started_at,
        finished_at=finished_at,
        total_timeout_seconds=total_timeout_seconds,
        units=units,
        metrics=metrics,
        http=http,
        gpu=gpu,
        remote_gpus=remote_gpus,
        # The caller logs `evidence_captured` once it has the incident this evidence belongs to.
        items=tuple(sorted(budget.items.values(), key=lambda i: i.name)),
    )


@dataclass(frozen=True, slots=True)
class LiveDrift:
    """The drift check of one worker's running main process (startup, `watchdog check`)."""

    role: Role
    unit: str
    checked: bool  # False: no expectations, no MainPID, or /proc unreadable (detail says which)
    findings: tuple[DriftFinding, ...] = ()
    detail: str = ""
    name: str = ""  # the worker for people: `prefill#2`, or the role alone


def _read_raw(pid: int, proc_root: Path) -> tuple[tuple[str, ...], dict[str, str]]:
    return read_cmdline(pid, proc_root), read_environ(pid, proc_root)


async def check_live_drift(
    group: GroupSection,
    unit_reader: UnitReader | None,
    *,
    observation: Observation | None = None,
    proc_root: Path = DEFAULT_PROC_ROOT,
    timeout_seconds: float = 5.0,
    remote_hosts: Mapping[str, RemoteHost] | None = None,
) -> tuple[LiveDrift, ...]:
    """Check every worker that has expectations against its live process; logs `config_drift`.

    MainPID comes from `unit_reader`, else from `observation`. Never raises: a worker that
    cannot be checked is returned with checked=False and the reason (the caller exports the
    findings per role as sglang_watchdog_config_drift).
    """
    return tuple(
        [
            await _live_drift(
                group.name,
                worker,
                section=section,
                unit_reader=unit_reader,
                observation=observation,
                proc_root=proc_root,
                timeout_seconds=timeout_seconds,
                host=(remote_hosts or {}).get(section.unit),  # its MainPID is read on that host
            )
            for worker, section in group.members()
        ]
    )


async def _live_drift(
    group: str,
    worker: Worker,
    *,
    section: UnitSection,
    unit_reader: UnitReader | None,
    observation: Observation | None,
    proc_root: Path,
    timeout_seconds: float,
    host: RemoteHost | None,
) -> LiveDrift:
    role, unit, name = worker.role, section.unit, worker.name
    if not section.expect_cmdline_contains and not section.expect_env:
        return LiveDrift(role, unit, False, detail="no expectations configured", name=name)
    state: UnitState | None = None
    if unit_reader is not None:
        with contextlib.suppress(Exception):
            state = await asyncio.wait_for(unit_reader.read_unit(role, unit), timeout_seconds)
    if (state is None or not state.ok) and observation is not None:
        state = observation.unit_of(role, worker.index)
    if state is None or not state.ok or state.main_pid <= 0:
        return LiveDrift(role, unit, False, detail="no MainPID to check", name=name)
    pid = state.main_pid
    try:
        if host is not None:
            cmdline, environ = await asyncio.wait_for(
                read_remote_raw(host, pid, timeout_seconds), timeout_seconds
            )
        else:
            cmdline, environ = await wait_for_blocking(
                functools.partial(_read_raw, pid, proc_root), timeout_seconds
            )
    except (OSError, TimeoutError) as exc:
        reason = "timed out" if isinstance(exc, TimeoutError) else exc.strerror or str(exc)
        return LiveDrift(role, unit, False, detail=f"MainPID {pid}: {reason}", name=name)
    findings = check_drift(section, cmdline, environ)
    if findings:
        log_drift(group, worker, findings)
    return LiveDrift(role, unit, True, findings, name=name)
