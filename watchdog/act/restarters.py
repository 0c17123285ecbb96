"""The restarters and their one assembly: execute a plan (watchdog/act/plan.py) over systemd.

Each step is StopUnit → the old processes gone and the ports free (watchdog/act/clear.py) →
StartUnit → active → ready (worker /health 200; router /readiness 200 with every worker
registered and healthy), all within the step's ready_timeout_seconds. The sequence stops after
the first role with a failed step. `open_restarter` is the one place a restarter is assembled,
for the daemon and for `watchdog restart` alike: `DryRunRestarter` for `--dry-run` (nothing else
knows about dry runs), else `SystemdRestarter`, wrapped in `HostCheckedRestarter` when some unit
is on another host.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

import httpx
import structlog

from watchdog.act.clear import PortProbe, port_accepting, wait_until_clear
from watchdog.act.contracts import Restarter, UnitController
from watchdog.act.plan import (
    describe_step_checks,
    guard_plan,
    plan_as_dict,
    plan_stages,
    router_workers_url,
)
from watchdog.clock import Clock
from watchdog.config import Config
from watchdog.errors import StateFileError, SystemdError
from watchdog.model import RestartOutcome, RestartPlan, RestartStep, Role, StepResult
from watchdog.observe.bounded import (
    ACCEPT_ENCODING,
    CappedBody,
    parse_sized,
    read_capped,
    size_text,
)
from watchdog.statefiles import RestartHistory, RestartLock

# /health is empty and /readiness a short status: a body near this cap is not a ready answer.
READY_BODY_MAX_BYTES = 64 * 1024
# /workers lists each worker in a few hundred bytes: 1 MiB is thousands of workers.
WORKERS_BODY_MAX_BYTES = 2**20

# The logger name of the module this was split from: log consumers filter on it.
log = structlog.get_logger("watchdog.act.restart")

_T = TypeVar("_T")
# UnitController.stop_unit / start_unit
_JobCall = Callable[..., Awaitable[str]]


def _log_planned(plan: RestartPlan, dry_run: bool) -> None:
    log.info(
        "restart_planned",
        group=plan.group,
        trigger=plan.trigger,
        rung=plan.rung.value,
        dry_run=dry_run,
        sequence=[s.unit for s in plan.steps],
        steps=plan_as_dict(plan)["steps"],
    )


# --- restarters -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReadyCheck:
    """One readiness attempt of a step."""

    ok: bool
    detail: str


class ReadinessChecker(Protocol):
    """Checks whether a restarted unit serves again; never raises for a failing target."""

    async def check(self, step: RestartStep) -> ReadyCheck:
        """One attempt."""
        ...


class HttpReadiness:
    """Worker: GET /health is 200. Router: /readiness is 200 and /workers lists both, healthy.

    The router's /readiness (sglang-router 0.3.2) is 200 once *one* worker per side is healthy and
    says nothing about which ones, so /workers is checked for the configured URLs too.
    """

    def __init__(self, client: httpx.AsyncClient, *, attempt_timeout_seconds: float = 5.0) -> None:
        self._client = client
        self._timeout = attempt_timeout_seconds

    async def check(self, step: RestartStep) -> ReadyCheck:
        """One readiness attempt for `step`."""
        try:
            status, ready = await self._get(step.ready_url, READY_BODY_MAX_BYTES)
            if status != 200:
                return ReadyCheck(False, f"GET {step.ready_url} -> {status}")
            if ready.truncated:
                return ReadyCheck(False, f"GET {step.ready_url}: {_over_cap(ready)}")
            if not step.expect_workers:
                return ReadyCheck(True, f"GET {step.ready_url} -> 200")
            url = router_workers_url(step)
            status, workers = await self._get(url, WORKERS_BODY_MAX_BYTES)
            if status != 200:
                return ReadyCheck(False, f"GET {url} -> {status}")
            if workers.truncated:
                return ReadyCheck(False, f"GET {url}: {_over_cap(workers)}")
            body = await parse_sized(json.loads, workers.data, len(workers.data))
        except httpx.HTTPError as exc:
            return ReadyCheck(False, f"{type(exc).__name__}: {exc}".rstrip(": "))
        except TimeoutError:
            return ReadyCheck(False, f"no complete answer within {self._timeout:g} s")
        except ValueError:
            return ReadyCheck(False, f"GET {router_workers_url(step)}: body is not JSON")
        except RecursionError:
            return ReadyCheck(False, f"GET {router_workers_url(step)}: JSON nested too deeply")
        return _workers_registered(body, step.expect_workers)

    async def _get(self, url: str, limit: int) -> tuple[int, CappedBody]:
        # The attempt timeout bounds the whole exchange: httpx's restarts with every chunk.
        async with (
            asyncio.timeout(self._timeout),
            self._client.stream(
                "GET", url, headers=ACCEPT_ENCODING, timeout=self._timeout
            ) as response,
        ):
            return response.status_code, await read_capped(response, limit)


def _over_cap(body: CappedBody) -> str:
    return f"body exceeds the {size_text(body.limit)} cap"


def _workers_registered(body: object, expected: Sequence[str]) -> ReadyCheck:
    workers = body.get("workers") if isinstance(body, dict) else None
    if not isinstance(workers, list):
        return ReadyCheck(False, "router /workers answer has no 'workers' list")
    healthy = {
        str(w.get("url", "")).rstrip("/")
        for w in workers
        if isinstance(w, dict) and w.get("is_healthy") is True
    }
    missing = [url for url in expected if url.rstrip("/") not in healthy]
    if missing:
        return ReadyCheck(False, f"router does not list {', '.join(missing)} as healthy yet")
    return ReadyCheck(True, f"router ready with {', '.join(expected)} registered and healthy")


class _Interrupted(Exception):
    """Shutdown was requested while waiting."""


class _StepFailed(Exception):
    """A step failed in `phase`; `detail` says why (ends up in StepResult)."""

    def __init__(self, phase: str, detail: str) -> None:
        self.phase = phase
        self.detail = detail
        super().__init__(detail)


class SystemdRestarter:
    """Executes plans over systemd, per step, in order: StopUnit → the old processes gone and the
    ports free (watchdog/act/clear.py) → StartUnit → active → ready.

    `shutdown_requested` stops cooperatively: the in-flight step finishes its jobs (systemd runs
    a job anyway; abandoning the wait would only lose its result; a stopped unit is always
    started again), no further unit is restarted, and the outcome says interrupted=True.
    """

    def __init__(
        self,
        units: UnitController,
        readiness: ReadinessChecker,
        *,
        shutdown_requested: asyncio.Event | None = None,
        clock: Clock = time.time,
        poll_seconds: float = 0.5,
        port_probe: PortProbe = port_accepting,
    ) -> None:
        self._units = units
        self._readiness = readiness
        self._shutdown = shutdown_requested or asyncio.Event()
        self._clock = clock
        self._poll_seconds = poll_seconds
        self._port_probe = port_probe

    async def execute(self, plan: RestartPlan) -> RestartOutcome:
        """Run every stage in order, its steps concurrently; stop after a stage with a failed
        step, or at a shutdown request."""
        # Defence in depth, for the one executor that acts: build_plan (act/plan.py) already
        # guarded every plan of the package; tests/unit/test_restart_plan.py
        # test_restarter_refuses_unsafe_plan_before_acting hands it a hand-made decode-only plan.
        guard_plan(plan)
        _log_planned(plan, dry_run=False)
        started = self._clock()
        results: list[StepResult] = []
        interrupted = False
        stop_reason = ""
        for stage in plan_stages(plan):
            if not stop_reason and self._shutdown.is_set():
                interrupted = True
                stop_reason = "shutdown requested"
            if stop_reason:
                results += [
                    StepResult(step.role, step.unit, False, "not_started", stop_reason)
                    for step in stage
                ]
                continue
            async with asyncio.TaskGroup() as tasks:
                running = [tasks.create_task(self._run_step(plan, step)) for step in stage]
            done = [task.result() for task in running]
            results += [result for result, _ in done]
            failed = [result for result, _ in done if not result.ok]
            if any(stopped for _, stopped in done):
                interrupted = True
                stop_reason = "shutdown requested"
            elif failed:
                stop_reason = "stopped after " + ", ".join(
                    f"{result.unit} failed ({result.phase})" for result in failed
                )
        outcome = RestartOutcome(
            plan=plan,
            ok=all(r.ok for r in results) and not interrupted,
            dry_run=False,
            steps=tuple(results),
            started_at=started,
            finished_at=self._clock(),
            interrupted=interrupted,
        )
        _log_finished(outcome)
        return outcome

    async def _run_step(self, plan: RestartPlan, step: RestartStep) -> tuple[StepResult, bool]:
        started = self._clock()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + step.ready_timeout_seconds
        log.info(
            "unit_restart_started",
            group=plan.group,
            role=step.role.value,
            unit=step.unit,
            ready_timeout_seconds=step.ready_timeout_seconds,
        )
        interrupted = False
        clear: list[str] = []  # set once the stop job is done
        try:
            await self._replace_process(step, deadline, clear)
            if self._shutdown.is_set():
                raise _Interrupted
            await self._until_shutdown(
                self._units.wait_for_active(
                    step.role, step.unit, timeout_seconds=max(deadline - loop.time(), 0.0)
                ),
                "active",
                step,
            )
            detail = await self._wait_for_ready(step, deadline)
            result = StepResult(step.role, step.unit, True, "ready", detail, started, self._clock())
        except _StepFailed as exc:
            result = StepResult(
                step.role, step.unit, False, exc.phase, exc.detail, started, self._clock()
            )
        except _Interrupted:
            interrupted = True
            result = StepResult(
                step.role,
                step.unit,
                False,
                "interrupted",
                "shutdown requested: the unit was started again, readiness was not awaited",
                started,
                self._clock(),
            )
        result = dataclasses.replace(result, clear="".join(clear))
        emit = log.info if result.ok else log.error
        emit(
            "unit_restart_finished",
            group=plan.group,
            role=step.role.value,
            unit=step.unit,
            ok=result.ok,
            phase=result.phase,
            detail=result.detail,
            clear=result.clear,
            duration_seconds=round(result.finished_at - result.started_at, 3),
        )
        return result, interrupted

    async def _replace_process(self, step: RestartStep, deadline: float, clear: list[str]) -> None:
        """StopUnit, wait until the old generation is gone (watchdog/act/clear.py), StartUnit.

        Not cut short by a shutdown request once the stop job was sent: the unit is started again
        whatever happens, so the watchdog never leaves a unit stopped. A failed stop job is
        reported as the step's failure after a start was still attempted.
        """
        loop = asyncio.get_running_loop()
        try:
            await self._job("stop_job", self._units.stop_unit, step, deadline - loop.time())
        except _StepFailed as stop_failed:
            try:
                await self._job("start_job", self._units.start_unit, step, deadline - loop.time())
                after = "the unit was started again"
            except _StepFailed as start_failed:
                after = f"starting it again failed too: {start_failed.detail}"
            raise _StepFailed("stop_job", f"{stop_failed.detail}; {after}") from None
        clear.append(
            await wait_until_clear(
                self._units,
                step,
                timeout_seconds=min(step.clear_timeout_seconds, max(deadline - loop.time(), 0.0)),
                poll_seconds=self._poll_seconds,
                shutdown=self._shutdown,
                probe=self._port_probe,
            )
        )
        await self._job("start_job", self._units.start_unit, step, deadline - loop.time())

    async def _job(
        self, phase: str, run: _JobCall, step: RestartStep, timeout_seconds: float
    ) -> None:
        verb = phase.removesuffix("_job")
        try:
            job_result = await run(step.unit, timeout_seconds=max(timeout_seconds, 0.0))
        except SystemdError as exc:  # JobFailed, NoSuchUnit, AccessDenied, BusDisconnected
            raise _StepFailed(phase, str(exc)) from None
        except TimeoutError:
            raise _StepFailed(
                phase,
                f"no result for the {verb} job of {step.unit} within "
                f"{step.ready_timeout_seconds:g} s",
            ) from None
        if job_result != "done":  # a UnitController that returns instead of raising
            raise _StepFailed(phase, f"{verb} job of {step.unit} ended {job_result!r}")

    async def _until_shutdown(self, awaitable: Awaitable[_T], phase: str, step: RestartStep) -> _T:
        """Await `awaitable` unless shutdown is requested first (then raise _Interrupted)."""
        task = asyncio.ensure_future(awaitable)
        stopper = asyncio.ensure_future(self._shutdown.wait())
        try:
            await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if not task.done() or task.cancelled():
            raise _Interrupted
        try:
            return task.result()
        except TimeoutError:
            raise _StepFailed(
                phase,
                f"{step.unit} not {phase} within {step.ready_timeout_seconds:g} s",
            ) from None
        except SystemdError as exc:
            raise _StepFailed(phase, str(exc)) from None

    async def _wait_for_ready(self, step: RestartStep, deadline: float) -> str:
        loop = asyncio.get_running_loop()
        last = "no readiness attempt yet"
        while True:
            check = await self._until_shutdown(self._readiness.check(step), "ready", step)
            if check.ok:
                return check.detail
            last = check.detail
            # A unit that died after reaching active will never get ready: fail now, not at the
            # deadline (ready_timeout_seconds is sized for a model load: many minutes).
            state = await self._until_shutdown(
                self._units.read_unit(step.role, step.unit), "ready", step
            )
            if state.ok and state.active_state in ("failed", "inactive"):
                raise _StepFailed(
                    "ready",
                    f"{step.unit} became {state.active_state} ({state.sub_state}) while waiting "
                    f"for readiness; last check: {last}",
                )
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise _StepFailed(
                    "ready",
                    f"{step.unit} not ready within {step.ready_timeout_seconds:g} s; "
                    f"last check: {last}",
                )
            await self._until_shutdown(
                asyncio.sleep(min(self._poll_seconds, remaining)), "ready", step
            )


def _log_finished(outcome: RestartOutcome) -> None:
    failed = outcome.failed_step
    emit = log.info if outcome.ok else log.error
    emit(
        "restart_sequence_finished",
        group=outcome.plan.group,
        trigger=outcome.plan.trigger,
        ok=outcome.ok,
        dry_run=outcome.dry_run,
        interrupted=outcome.interrupted,
        failed_step=None if failed is None else failed.unit,
        failed_phase=None if failed is None else failed.phase,
        failed_detail=None if failed is None else failed.detail,
        duration_seconds=round(outcome.finished_at - outcome.started_at, 3),
    )


class DryRunRestarter:
    """Records and logs the full plan instead of acting (`--dry-run`); plans kept in `executed`."""

    def __init__(self, *, clock: Clock = time.time) -> None:
        self._clock = clock
        self.executed: list[RestartPlan] = []

    async def execute(self, plan: RestartPlan) -> RestartOutcome:
        """Log `restart_skipped_dry_run` with the plan and report every step as rehearsed."""
        _log_planned(plan, dry_run=True)
        now = self._clock()
        self.executed.append(plan)
        log.info(
            "restart_skipped_dry_run",
            group=plan.group,
            trigger=plan.trigger,
            sequence=[s.unit for s in plan.steps],
            plan=plan_as_dict(plan),
        )
        steps = tuple(
            StepResult(
                s.role, s.unit, True, "dry_run", "; ".join(describe_step_checks(s)), now, now
            )
            for s in plan.steps
        )
        outcome = RestartOutcome(
            plan=plan, ok=True, dry_run=True, steps=steps, started_at=now, finished_at=now
        )
        _log_finished(outcome)
        return outcome


# --- putting it together --------------------------------------------------------------------------


def has_remote_units(config: Config) -> bool:
    """Whether some unit of `config` runs on another host (reached over SSH)."""
    return any(
        group.host_of(worker) is not None
        for group in config.group
        for role in Role
        for worker in group.workers(role)
    )


@asynccontextmanager
async def open_restarter(
    *,
    dry_run: bool,
    config: Config | None = None,
    units: UnitController | None = None,
    http: httpx.AsyncClient | None = None,
    bus_address: str | None = None,
    shutdown_requested: asyncio.Event | None = None,
    poll_seconds: float = 0.5,
    clock: Clock = time.time,
    on_host_refused: Callable[[str], None] | None = None,
) -> AsyncIterator[Restarter]:
    """The one assembly of a restarter, for the daemon and `watchdog restart` alike: the only
    place where `--dry-run` picks the implementation; everything else is the same.

    Without `units`, buses are opened for the lifetime of the context: the per-unit buses of
    watchdog.act.hosts when `config` puts units on other hosts, else a SystemdClient on
    `bus_address` (DBUS_SYSTEM_BUS_ADDRESS or the system bus). Given `units` (the daemon's,
    already connected), they are used and left open; likewise `http`. Buses with remote hosts
    get the host check: HostCheckedRestarter refuses a plan whose hosts are down before its
    first step, and calls `on_host_refused(group)` (the daemon's refusal counter; the daemon
    asks it before taking the group's lock, act/hosts.py refusal_before_lock).
    """
    if dry_run:
        yield DryRunRestarter(clock=clock)
        return
    from watchdog.act.hosts import HostCheckedRestarter, UnitBuses  # noqa: PLC0415 (D-Bus, below)

    async with contextlib.AsyncExitStack() as stack:
        if units is None:
            units = await _open_units(stack, config, bus_address)
        if http is None:
            # trust_env=False: a proxy from the environment must never sit between us and loopback.
            http = await stack.enter_async_context(httpx.AsyncClient(trust_env=False))
        restarter: Restarter = SystemdRestarter(
            units,
            HttpReadiness(http),
            shutdown_requested=shutdown_requested,
            clock=clock,
            poll_seconds=poll_seconds,
        )
        if isinstance(units, UnitBuses) and units.has_remote:
            restarter = HostCheckedRestarter(
                restarter, units, clock=clock, on_refused=on_host_refused
            )
        yield restarter


async def _open_units(
    stack: contextlib.AsyncExitStack, config: Config | None, bus_address: str | None
) -> UnitController:
    """The buses `config` needs, closed with `stack`: per-unit buses when some unit is remote."""
    if config is not None and has_remote_units(config):
        from watchdog.act.hosts import open_unit_buses  # noqa: PLC0415 (dry runs never load D-Bus)

        return await stack.enter_async_context(open_unit_buses(config, bus_address))
    from watchdog.act.systemd import SystemdClient  # noqa: PLC0415 (dry runs never load D-Bus)

    return await stack.enter_async_context(SystemdClient(bus_address))


async def execute_locked(
    plan: RestartPlan,
    restarter: Restarter,
    *,
    state_dir: Path,
    purpose: str,
    clock: Clock = time.time,
) -> RestartOutcome:
    """Hold the group's restart lock for the whole sequence: record its start in the history,
    execute, then complete the record.

    LockHeld (fail fast, naming the holder) when a daemon or another operator is mid-sequence.
    The start record is written before anything is restarted, so a sequence cut by SIGKILL or
    the OOM killer is still charged to the budget and reported by the next holder of the lock.
    The lock is released on every path out of here, errors (a full disk) included.
    """
    with RestartLock(state_dir, plan.group, purpose=purpose, clock=clock):
        history = RestartHistory.load(state_dir, plan.group, now=clock())
        begun = history.begin(plan, dry_run=isinstance(restarter, DryRunRestarter), now=clock())
        try:
            history.save()
        except StateFileError as exc:
            # Healing goes ahead without its start record (a full disk): the daemon's in-memory
            # budget still counts it, and record() below tries the file again.
            log.error("restart_history_not_written", group=plan.group, error=str(exc))
        outcome = await restarter.execute(plan)
        try:
            history.record(outcome, begun=begun)
        except StateFileError as exc:
            # The restart happened; losing its record must not turn it into a failure.
            log.error("restart_history_not_written", group=plan.group, error=str(exc))
    return outcome
