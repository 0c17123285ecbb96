"""The pure restart plan: built from the configured order, guarded where it is made, formatted.

A plan is built only from a group's validated `restart.order` (prefill → decode → router), one
step per unit: every worker of a role, then every worker of the next. The steps of one role run
concurrently (`plan_stages`). `build_plan` is the only constructor of a RestartPlan in the package
(tests/unit/test_plan_module.py scans for others) and applies the order guard before returning,
so every plan the restarters (watchdog/act/restarters.py) see has passed it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import NoReturn
from urllib.parse import urlsplit

import structlog

from watchdog.config import (
    DECODE_ONLY_EXPLANATION,
    GroupSection,
    PrefillSection,
    UnitSection,
)
from watchdog.errors import RestartRefused, UsageError
from watchdog.model import (
    RUNG_ACTIONS,
    RestartOutcome,
    RestartPlan,
    RestartStep,
    Role,
    Rung,
    worker_name,
)
from watchdog.pairs import decodes_paired_with, prefills_kept_running

RefusalCallback = Callable[[str, str], None]  # (group, reason): e.g. a metrics counter increment

WORKER_READY_PATH = "/health"
ROUTER_READY_PATH = "/readiness"
ROUTER_WORKERS_PATH = "/workers"
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

# The logger name of the module this was split from: log consumers filter on it.
log = structlog.get_logger("watchdog.act.restart")


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


def replayed_plan(group: str, trigger: str) -> RestartPlan:
    """The plan of a co-restart that `watchdog replay` only simulates: no steps, nothing to run
    (its outcome carries the simulated steps), so there is nothing for the guard to refuse."""
    return RestartPlan(group=group, trigger=trigger, steps=())


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
