"""The co-restart: plan from the configured order, guard (never decode alone), and the restarters.

A plan is built only from a group's validated `restart.order` (prefill → decode → router), one
step per unit: every worker of a role, then every worker of the next. The steps of one role run
concurrently. Each step is RestartUnit → job "done" → unit active → ready (worker /health 200;
router /readiness 200 with every worker registered and healthy), all within the step's
ready_timeout_seconds. The sequence stops after the first role with a failed step.
`DryRunRestarter` is swapped in for `--dry-run`; nothing else knows about dry runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn, Protocol, TypeVar
from urllib.parse import urlsplit

import httpx
import structlog

from watchdog.act.clear import PortProbe, port_accepting, wait_until_clear
from watchdog.act.contracts import Restarter, UnitController
from watchdog.clock import Clock
from watchdog.config import (
    DECODE_ONLY_EXPLANATION,
    Config,
    GroupSection,
    PrefillSection,
    UnitSection,
)
from watchdog.errors import RestartRefused, StateFileError, SystemdError, UsageError
from watchdog.model import (
    RUNG_ACTIONS,
    RestartOutcome,
    RestartPlan,
    RestartStep,
    Role,
    Rung,
    StepResult,
    worker_name,
)
from watchdog.observe.bounded import (
    ACCEPT_ENCODING,
    CappedBody,
    parse_sized,
    read_capped,
    size_text,
)
from watchdog.pairs import decodes_paired_with, prefills_kept_running
from watchdog.statefiles import RestartHistory, RestartLock

RefusalCallback = Callable[[str, str], None]  # (group, reason): e.g. a metrics counter increment

WORKER_READY_PATH = "/health"
ROUTER_READY_PATH = "/readiness"
ROUTER_WORKERS_PATH = "/workers"
# /health is empty and /readiness a short status: a body near this cap is not a ready answer.
READY_BODY_MAX_BYTES = 64 * 1024
# /workers lists each worker in a few hundred bytes: 1 MiB is thousands of workers.
WORKERS_BODY_MAX_BYTES = 2**20

REASON_DECODE_WITHOUT_PREFILL = "decode_without_prefill"
REASON_PREFILL_WITHOUT_DECODE = "prefill_without_decode"
REASON_PARTIAL = "partial_restart"
REASON_SURVIVOR_SHAPE = "survivor_not_decodes_then_router"

PREFILL_ONLY_EXPLANATION = (
    "a prefill restarted without decode after it leaves decode holding KV-transfer bootstrap state "
    "for the old prefill instance; SGLang PD needs decode restarted after prefill, so the safe "
    "action is the co-restart prefill -> decode -> router"
)
PARTIAL_EXPLANATION = (
    "only the full co-restart prefill -> decode -> router (or the router alone, which holds no "
    "bootstrap state) is safe, with every worker of each role; restarting the workers without "
    "the router leaves the router's "
    "worker health and connection state from before the restart"
)

log = structlog.get_logger("watchdog.act.restart")

_T = TypeVar("_T")
# UnitController.stop_unit / start_unit
_JobCall = Callable[..., Awaitable[str]]


# --- plans ----------------------------------------------------------------------------------------


def _steps(group: GroupSection, role: Role) -> tuple[RestartStep, ...]:
    """One step per unit of `role` (every worker of a role; the router alone)."""
    timeout = group.restart.ready_timeout_seconds
    clear = group.restart.clear_timeout_seconds
    if role is Role.ROUTER:
        workers = (*group.workers(Role.PREFILL), *group.workers(Role.DECODE))
        return (
            RestartStep(
                role=role,
                unit=group.router.unit,
                ready_url=group.router.url + ROUTER_READY_PATH,
                ready_timeout_seconds=timeout,
                expect_workers=tuple(w.url for w in workers),
                ports=(_url_port(group.router.url),),
                clear_timeout_seconds=clear,
            ),
        )
    return tuple(
        RestartStep(
            role=role,
            unit=worker.unit,
            ready_url=worker.url + WORKER_READY_PATH,
            ready_timeout_seconds=timeout,
            ports=_worker_ports(worker),
            clear_timeout_seconds=clear,
        )
        for worker in group.workers(role)
    )


def _url_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)


def _worker_ports(worker: UnitSection) -> tuple[tuple[str, int], ...]:
    """The worker's HTTP port, and a prefill's bootstrap port where the config names it (the
    unnamed default would be a guess: another process may own 8998 on that host)."""
    http = _url_port(worker.url)
    if isinstance(worker, PrefillSection) and worker.bootstrap_port is not None:
        return http, (http[0], worker.bootstrap_port)
    return (http,)


RUNG_WHY = {
    Rung.FULL: "every worker of the group, in the configured order (the default for every "
    "verdict but router_wedge and prefill_only_restart, and after a router-only or survivor "
    "restart that did not help)",
    Rung.ROUTER: "router probes fail while direct PD probes of every prefill/decode pair pass "
    "and no worker queue holds work (verdict router_wedge): the router alone, which holds no "
    "KV bootstrap state; the full co-restart follows if it does not help",
    Rung.SURVIVOR: "a prefill was restarted alone while its decodes kept running (verdict "
    "prefill_only_restart): the decodes that pair with it hold KV bootstrap state for its old "
    "process, so they are restarted, after any other prefill they pair with (one that kept "
    "running would otherwise see a decode-only restart), then the router; the prefill restarted "
    "alone is not restarted again (it is already fresher than them); the full co-restart "
    "follows if this does not help",
}


def build_plan(
    group: GroupSection,
    trigger: str,
    *,
    rung: Rung = Rung.FULL,
    why: str = "",
    fresh_prefills: Sequence[int] = (),
) -> RestartPlan:
    """The restart of a group for `rung`, guarded before returning.

    Rung full: the co-restart in the group's configured (validated) order. Rung router: the
    router alone. Rung survivor: the decodes that pair with `fresh_prefills` (the prefills
    restarted alone, by index; every decode pairs with every prefill), after the prefills that
    kept running and pair with them, then the router (README "Restart rungs").
    """
    if rung is Rung.ROUTER:
        steps = _steps(group, Role.ROUTER)
    elif rung is Rung.SURVIVOR:
        if not fresh_prefills:
            raise ValueError("a survivor plan needs the prefills restarted alone")
        prefills, decodes = _steps(group, Role.PREFILL), _steps(group, Role.DECODE)
        steps = (
            *(prefills[p] for p in prefills_kept_running(group, fresh_prefills)),
            *(decodes[d] for d in decodes_paired_with(group, fresh_prefills)),
            *_steps(group, Role.ROUTER),
        )
    else:
        steps = tuple(step for role in group.restart.order for step in _steps(group, role))
    plan = RestartPlan(
        group=group.name,
        trigger=trigger,
        steps=steps,
        rung=rung,
        why=why or _why(group, rung, fresh_prefills),
    )
    guard_plan(plan)
    return plan


def _why(group: GroupSection, rung: Rung, fresh_prefills: Sequence[int]) -> str:
    """The rung's explanation, naming the prefills a survivor plan follows."""
    if rung is not Rung.SURVIVOR:
        return RUNG_WHY[rung]
    count = len(group.workers(Role.PREFILL))
    names = ", ".join(worker_name(Role.PREFILL, j, count) for j in sorted(fresh_prefills))
    kept = prefills_kept_running(group, fresh_prefills)
    also = ", ".join(worker_name(Role.PREFILL, j, count) for j in kept)
    return f"{RUNG_WHY[rung]} (restarted alone: {names}" + (
        f"; kept running, restarted first: {also})" if kept else ")"
    )


def plan_stages(plan: RestartPlan) -> tuple[tuple[RestartStep, ...], ...]:
    """The plan's steps by role, in order: the steps of one stage run concurrently."""
    stages: list[list[RestartStep]] = []
    for step in plan.steps:
        if stages and stages[-1][0].role is step.role:
            stages[-1].append(step)
        else:
            stages.append([step])
    return tuple(tuple(stage) for stage in stages)


def guard_plan(plan: RestartPlan) -> None:
    """Raise RestartRefused if a plan would start a decode before a prefill it pairs with.

    Defence in depth: config validation already forces the order, but no code path may hand the
    restarter a plan that leaves decode and prefill out of step. Every decode must start after
    every prefill it pairs with (docs/decisions.md, "Restart rungs"): a plan that restarts
    decode restarts prefill before it, and one that restarts prefill restarts decode after it.
    The one exception is explicit: a survivor plan leaves out the prefills restarted alone. It
    follows them, already running and fresher than every decode, and restarts the other
    prefills those decodes pair with before the decodes, so each decode it starts starts after
    every prefill it pairs with; a survivor plan that is not prefills (maybe none), then one or
    more decodes, then the router, is refused.
    """
    roles = [step.role for step in plan.steps]
    if plan.rung is Rung.SURVIVOR:
        _guard_survivor(plan, roles)
        return
    for index, role in enumerate(roles):
        if role is Role.DECODE and Role.PREFILL not in roles[:index]:
            reason, why = REASON_DECODE_WITHOUT_PREFILL, DECODE_ONLY_EXPLANATION
        elif role is Role.PREFILL and Role.DECODE not in roles[index + 1 :]:
            reason, why = REASON_PREFILL_WITHOUT_DECODE, PREFILL_ONLY_EXPLANATION
        else:
            continue
        _refuse(plan, reason, f"refusing plan {_names(roles)} for group {plan.group!r}: {why}")


def _guard_survivor(plan: RestartPlan, roles: Sequence[Role]) -> None:
    """A survivor plan is prefills (maybe none), one or more decodes, then the router."""
    prefills = [role for role in roles if role is Role.PREFILL]
    decodes = [role for role in roles if role is Role.DECODE]
    if decodes and roles == [*prefills, *decodes, Role.ROUTER]:
        return
    _refuse(
        plan,
        REASON_SURVIVOR_SHAPE,
        f"refusing survivor plan {_names(roles)} for group {plan.group!r}: a survivor plan "
        "restarts the prefills that kept running, then the decodes that pair with a prefill "
        "restarted alone, then the router",
    )


def _refuse(plan: RestartPlan, reason: str, message: str) -> NoReturn:
    """Log `restart_refused` and raise RestartRefused: the one way a plan is refused."""
    log.error(
        "restart_refused",
        group=plan.group,
        reason=reason,
        trigger=plan.trigger,
        sequence=[s.unit for s in plan.steps],
    )
    raise RestartRefused(reason, message)


def _names(roles: Iterable[Role]) -> str:
    return " -> ".join(r.value for r in roles) or "(empty)"


def _resolve(group: GroupSection, requested: Sequence[str]) -> tuple[set[Role], set[str]]:
    """The roles named, and the units named (a role's name names all its units)."""
    by_name = {role.value: role for role in Role}
    by_unit = {w.unit: role for role in Role for w in group.workers(role)}
    roles: set[Role] = set()
    units: set[str] = set()
    for item in requested:
        role = by_name.get(item)
        if role is not None:
            units.update(w.unit for w in group.workers(role))
        else:
            unit = item if item in by_unit else f"{item}.service"
            role = by_unit.get(unit)
            units.add(unit)
        if role is None:
            known = ", ".join([*by_name, *by_unit])
            raise UsageError(
                f"--unit {item!r} is not a role or unit of group {group.name!r} (known: {known})"
            )
        roles.add(role)
    return roles, units


def resolve_roles(group: GroupSection, requested: Sequence[str]) -> tuple[Role, ...]:
    """`--unit` values (role or unit names) as roles in the group's order; UsageError if unknown."""
    roles, _ = _resolve(group, requested)
    return tuple(role for role in group.restart.order if role in roles)


def leaves_workers_out(group: GroupSection, requested: Sequence[str]) -> bool:
    """Whether `--unit` values name some workers of a role but not all of them.

    A decode left running while a prefill restarts keeps bootstrap state for the old prefill,
    and a decode restarted while any prefill keeps running is a decode-only restart for that
    prefill: only every worker of a role together is safe.
    """
    roles, units = _resolve(group, requested)
    return any(w.unit not in units for role in roles for w in group.workers(role))


def refusal_reason(roles: Sequence[Role], *, some_workers_only: bool = False) -> str | None:
    """Why a restart of exactly these roles is unsafe, or None when it is allowed.

    `some_workers_only`: the request names only some of the workers of one of the roles.
    """
    wanted = set(roles)
    if Role.DECODE in wanted and Role.PREFILL not in wanted:
        return REASON_DECODE_WITHOUT_PREFILL
    if Role.PREFILL in wanted and Role.DECODE not in wanted:
        return REASON_PREFILL_WITHOUT_DECODE
    if some_workers_only:
        return REASON_PARTIAL
    if wanted == set(Role) or wanted == {Role.ROUTER}:
        return None
    return REASON_PARTIAL


def refusal_message(group: GroupSection, roles: Sequence[Role], reason: str, config: str) -> str:
    """The operator-facing explanation of a refused partial restart, offering the co-restart."""
    why = {
        REASON_DECODE_WITHOUT_PREFILL: DECODE_ONLY_EXPLANATION,
        REASON_PREFILL_WITHOUT_DECODE: PREFILL_ONLY_EXPLANATION,
    }.get(reason, PARTIAL_EXPLANATION)
    return (
        f"refused to restart {', '.join(r.value for r in roles)} of group {group.name!r} "
        f"({reason}): {why}.\n"
        f"Run the safe co-restart instead: watchdog restart --config {config} --group {group.name}"
    )


def refuse_partial(
    group: GroupSection,
    roles: Sequence[Role],
    reason: str,
    *,
    config: str,
    on_refused: RefusalCallback | None = None,
) -> NoReturn:
    """Log and count a refused partial restart, then raise RestartRefused (exit 3)."""
    log.warning(
        "restart_refused",
        group=group.name,
        reason=reason,
        roles=[r.value for r in roles],
    )
    if on_refused is not None:
        on_refused(group.name, reason)
    raise RestartRefused(reason, refusal_message(group, roles, reason, config))


def plan_for_request(
    group: GroupSection,
    roles: Sequence[Role],
    trigger: str,
    *,
    config: str,
    on_refused: RefusalCallback | None = None,
    some_workers_only: bool = False,
) -> RestartPlan:
    """The plan for `watchdog restart [--unit ...]`: co-restart, router alone, or a refusal."""
    reason = refusal_reason(roles, some_workers_only=some_workers_only)
    if reason is not None:
        refuse_partial(group, roles, reason, config=config, on_refused=on_refused)
    if set(roles) == {Role.ROUTER}:
        return build_plan(group, trigger, rung=Rung.ROUTER, why="asked for the router alone")
    return build_plan(group, trigger)


def router_workers_url(step: RestartStep) -> str:
    """The router's GET /workers URL, next to its /readiness."""
    return step.ready_url.removesuffix(ROUTER_READY_PATH) + ROUTER_WORKERS_PATH


def describe_step_checks(step: RestartStep) -> list[str]:
    """The checks of one step in words, as `watchdog plan` and the dry run show them."""
    ports = "".join(f", {host}:{port} refusing connections" for host, port in step.ports)
    checks = [
        f'StopUnit("{step.unit}", "replace"), wait for JobRemoved result "done"',
        f"wait up to {step.clear_timeout_seconds:g} s for no process left in the unit{ports}",
        f'StartUnit("{step.unit}", "replace"), wait for JobRemoved result "done"',
        'wait for ActiveState "active"',
        f"wait for GET {step.ready_url} -> 200",
    ]
    if step.expect_workers:
        listed = " and ".join(step.expect_workers)
        checks.append(f"wait for GET {router_workers_url(step)} to list {listed} as healthy")
    return checks


def plan_as_dict(plan: RestartPlan) -> dict[str, object]:
    """A JSON-ready description of a plan (for logs, `watchdog plan --json` and the dry run)."""
    stage_of = {s.unit: n for n, stage in enumerate(plan_stages(plan), 1) for s in stage}
    return {
        "group": plan.group,
        "trigger": plan.trigger,
        "rung": plan.rung.value,
        "why": plan.why,
        "steps": [
            {
                "stage": stage_of[s.unit],
                "role": s.role.value,
                "unit": s.unit,
                "ready_url": s.ready_url,
                "expect_workers": list(s.expect_workers),
                "ready_timeout_seconds": s.ready_timeout_seconds,
                "checks": describe_step_checks(s),
            }
            for s in plan.steps
        ],
    }


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
        guard_plan(plan)
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
    units: UnitController | None = None,
    bus_address: str | None = None,
    shutdown_requested: asyncio.Event | None = None,
    poll_seconds: float = 0.5,
    config: Config | None = None,
) -> AsyncIterator[Restarter]:
    """The one place where `--dry-run` picks the implementation; everything else is the same.

    Without `units`, a SystemdClient is connected to `bus_address` (DBUS_SYSTEM_BUS_ADDRESS or the
    system bus) for the lifetime of the context; when `config` puts units on other hosts, the
    daemon's per-unit buses instead (watchdog.act.hosts), refusing a plan whose hosts are down.
    """
    if dry_run:
        yield DryRunRestarter()
        return
    async with contextlib.AsyncExitStack() as stack:
        buses = None
        if units is None and config is not None and has_remote_units(config):
            from watchdog.act.hosts import open_unit_buses  # noqa: PLC0415 (as below)

            buses = await stack.enter_async_context(open_unit_buses(config, bus_address))
            units = buses
        if units is None:
            from watchdog.act.systemd import SystemdClient  # noqa: PLC0415 (dry runs never load D-Bus)

            units = await stack.enter_async_context(SystemdClient(bus_address))
        # trust_env=False: a proxy from the environment must never sit between us and loopback.
        http = await stack.enter_async_context(httpx.AsyncClient(trust_env=False))
        restarter: Restarter = SystemdRestarter(
            units,
            HttpReadiness(http),
            shutdown_requested=shutdown_requested,
            poll_seconds=poll_seconds,
        )
        if buses is not None:
            from watchdog.act.hosts import HostCheckedRestarter  # noqa: PLC0415

            restarter = HostCheckedRestarter(restarter, buses)
        yield restarter


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


def format_plan(plan: RestartPlan) -> str:
    """The plan as `watchdog plan` and the confirmation prompt show it."""
    timeouts = sorted({s.ready_timeout_seconds for s in plan.steps})
    within = " / ".join(f"{t:g} s" for t in timeouts)
    stages = plan_stages(plan)
    lines = [
        f"group {plan.group} (trigger: {plan.trigger}): restart {len(plan.steps)} unit(s) in this "
        f"order, each step within {within} (restart.ready_timeout_seconds)"
    ]
    if len(stages) < len(plan.steps):
        lines.append(
            f"  in {len(stages)} steps: the units of one step restart concurrently, each gated "
            "on its own readiness; the next step starts when all of them are ready"
        )
    for index, stage in enumerate(stages, 1):
        for step in stage:
            lines.append(f"  {index}. {step.role.value:<8} {step.unit}")
            lines += [f"       {check}" for check in describe_step_checks(step)]
    lines.append(
        "The sequence stops at the first failed step. Decode is never restarted without prefill "
        "before it."
        if plan.rung is not Rung.SURVIVOR
        else "The sequence stops at the first failed step. The prefills restarted alone are not "
        "restarted again: every decode starts after every prefill it pairs with."
    )
    lines.append(f"Rung {plan.rung}: {plan.why}.")
    return "\n".join(lines)


def format_outcome(outcome: RestartOutcome) -> str:
    """One line per step, then the verdict."""
    lines = []
    for step in outcome.steps:
        took = step.finished_at - step.started_at if step.finished_at else 0.0
        mark = "ok  " if step.ok else "FAIL" if step.phase != "not_started" else "skip"
        lines.append(f"  {mark} {step.role.value:<8} {step.unit}  [{step.phase}, {took:.1f} s]")
        if step.clear:
            lines.append(f"       stopped, before its start: {step.clear}")
        if step.detail and not step.ok:
            lines.append(f"       {step.detail}")
    failed = outcome.failed_step
    what = RUNG_ACTIONS[outcome.plan.rung]
    if outcome.dry_run:
        verdict = "dry run: nothing was restarted"
    elif outcome.ok:
        verdict = f"{what} of group {outcome.plan.group} done"
    elif outcome.interrupted:
        verdict = f"{what} of group {outcome.plan.group} interrupted by shutdown"
    else:
        assert failed is not None
        verdict = (
            f"{what} of group {outcome.plan.group} FAILED at {failed.role.value} "
            f"({failed.unit}, phase {failed.phase})"
        )
    return "\n".join([*lines, verdict])
