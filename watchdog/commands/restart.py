"""`watchdog restart`: the safe co-restart by hand, under the group's lock, recorded in history."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from pathlib import Path

import httpx
import structlog

from watchdog.act.alertmanager import (
    GroupAlerts,
    Silence,
    group_alerts,
    renewing_beside,
    rfc3339,
)
from watchdog.act.contracts import Restarter
from watchdog.act.plan import (
    format_outcome,
    format_plan,
    leaves_workers_out,
    plan_for_request,
    resolve_roles,
)
from watchdog.act.restarters import execute_locked, open_restarter
from watchdog.commands.common import (
    add_config_argument,
    add_group_argument,
    config_from_args,
    single_group,
)
from watchdog.commands.plan import hosts_of, with_hosts
from watchdog.config import Config, GroupSection
from watchdog.errors import EXIT_OK, EXIT_UNHEALTHY, StateFileError, UsageError
from watchdog.model import RestartOutcome, RestartPlan, Role
from watchdog.redact import redact_text
from watchdog.statefiles import read_operator_controls, record_refusal, utc_iso

log = structlog.get_logger("watchdog.commands.restart")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `restart` subcommand."""
    parser = subparsers.add_parser(
        "restart",
        help="co-restart a group (prefill -> decode -> router); decode alone is refused",
        description=(
            "Restart a group's units in the configured order, each ready before the next. "
            "Partial restarts that include decode without prefill are refused (exit 3); the "
            "router alone is allowed."
        ),
    )
    add_config_argument(parser)
    add_group_argument(parser)
    parser.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    parser.add_argument(
        "--unit",
        action="append",
        default=[],
        metavar="ROLE",
        help="restart only this role or unit (repeatable); only 'router' alone or all three "
        "are allowed",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="log and print the plan instead of acting"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Plan (or refuse), confirm, lock, execute, record; exit 0 when every step got ready."""
    config = config_from_args(args)
    group = single_group(config, args.group)
    state_dir: Path = config.watchdog.state_dir
    roles = resolve_roles(group, args.unit) if args.unit else tuple(Role)

    def count_refusal(group_name: str, reason: str) -> None:
        try:
            record_refusal(state_dir, group_name, reason, now=time.time())
        except StateFileError as exc:  # the refusal stands even if it cannot be counted
            log.warning("refusal_not_recorded", group=group_name, error=str(exc))

    plan = plan_for_request(
        group,
        roles,
        "manual",
        config=str(args.config),
        on_refused=count_refusal,
        some_workers_only=bool(args.unit) and leaves_workers_out(group, args.unit),
    )
    hosts = hosts_of(group, {step.role for step in plan.steps})
    print(redact_text(with_hosts(format_plan(plan), hosts)))
    _note_pause(group, state_dir)
    if not args.yes and not args.dry_run:
        _confirm(plan)
    outcome = asyncio.run(_execute(plan, state_dir, dry_run=args.dry_run, config=config))
    print(redact_text(format_outcome(outcome)))
    return EXIT_OK if outcome.ok else EXIT_UNHEALTHY


def _note_pause(group: GroupSection, state_dir: Path) -> None:
    now = time.time()
    controls = read_operator_controls(state_dir, group.name, now=now)
    if controls.paused_until is not None and controls.paused_until > now:
        print(
            f"note: group {group.name} is paused until {utc_iso(controls.paused_until)} "
            f"({controls.pause_reason or 'no reason given'}); a manual restart proceeds anyway"
        )


def _confirm(plan: RestartPlan) -> None:
    if not sys.stdin.isatty():
        raise UsageError("stdin is not a terminal, so the restart cannot be confirmed: pass --yes")
    answer = input(f"Restart {len(plan.steps)} unit(s) of group {plan.group} now? [y/N] ")
    if answer.strip().lower() not in ("y", "yes"):
        raise UsageError("restart not confirmed; nothing was done")


async def _execute(
    plan: RestartPlan, state_dir: Path, *, dry_run: bool, config: Config | None = None
) -> RestartOutcome:
    # SIGINT/SIGTERM stop cooperatively: the running job wait finishes, no further unit starts.
    shutdown = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, shutdown.set)
    try:
        # The daemon's per-unit buses: a unit on another host is restarted over its SSH connection.
        async with (
            open_restarter(dry_run=dry_run, shutdown_requested=shutdown, config=config) as inner,
            httpx.AsyncClient(trust_env=False) as http,
        ):
            restarter: Restarter = inner
            if config is not None and config.alertmanager is not None:
                alerts = group_alerts(config.alertmanager, http, clock=time.time, dry_run=False)
                group = config.group_named(plan.group)
                if dry_run:
                    print(_rehearsed_silence(alerts, group))
                else:
                    restarter = SilencedRestarter(inner, alerts, group)
            return await execute_locked(
                plan, restarter, state_dir=state_dir, purpose="manual: watchdog restart"
            )
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def _rehearsed_silence(alerts: GroupAlerts, group: GroupSection) -> str:
    matchers = ", ".join(m.text() for m in alerts.settings.matchers_for(group))
    return (
        f"dry run: no silence is created; a restart would hold one at {alerts.settings.url} "
        f"for {matchers} while it runs"
    )


class SilencedRestarter:
    """A manual co-restart under the group's Alertmanager silence ([alertmanager]).

    Created once the group's restart lock is held (execute_locked calls execute() then), so a
    refused restart silences nothing; renewed at half its life while the steps run. There is no
    verification after a manual restart: a sequence that failed expires the silence at once, so
    the team's own alerts speak for the broken group; one that succeeded leaves it to lapse
    silence_seconds after its last renewal, the grace a co-restart's after-effects get.
    """

    LIFECYCLE = "Renewed while `watchdog restart` runs; expired if it fails, else left to lapse"

    def __init__(self, inner: Restarter, alerts: GroupAlerts, group: GroupSection) -> None:
        self._inner = inner
        self._alerts = alerts
        self._group = group

    async def execute(self, plan: RestartPlan) -> RestartOutcome:
        """`plan` executed by the wrapped restarter, the group's silence held around it."""
        silence = await self._alerts.silence_restart(
            self._group.name,
            self._alerts.settings.matchers_for(self._group),
            None,
            incident=None,
            trigger="manual: watchdog restart",
            lifecycle=self.LIFECYCLE,
        )
        if silence is None:
            return await self._inner.execute(plan)
        print(f"silence {silence.id} held at {self._alerts.settings.url} while the units restart")
        held = [silence]

        async def renew() -> None:
            held[0] = await self._alerts.keep(held[0])

        failed = True
        try:
            async with renewing_beside(renew, self._alerts.settings.silence_seconds / 4):
                outcome = await self._inner.execute(plan)
            failed = not outcome.ok
            return outcome
        finally:
            await self._end(held[0], failed=failed)  # held[0]: a renewal may have replaced it

    async def _end(self, silence: Silence, *, failed: bool) -> None:
        if failed:
            await self._alerts.expire(silence, "manual restart failed")
        else:
            print(f"silence {silence.id} lapses at {rfc3339(silence.ends_at)}")
