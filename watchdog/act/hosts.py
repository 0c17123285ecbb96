"""Every unit on its own bus: the local system bus, or a remote host's over one SSH connection.

`UnitBuses` is what the observer, the restarter and the evidence see: the same reads and jobs as
one SystemdClient, routed by unit name to the client of the host the config puts it on. Each
remote host has one SshHost (one connection) and one SystemdClient on its forwarded bus.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass

import structlog

from watchdog.act.contracts import Restarter
from watchdog.act.ssh import REMOTE_BUS_SOCKET, HostUnreachable, SshHost
from watchdog.act.systemd import SystemdClient
from watchdog.clock import Clock
from watchdog.config import Config, GroupSection, SshTarget
from watchdog.errors import BusDisconnected
from watchdog.model import RestartOutcome, RestartPlan, Role, StepResult, UnitState

LOCAL = "local"  # the label of the local system bus in reports and plans
HOST_UNREACHABLE = "host_unreachable"  # the refusal reason (logs, metrics, RestartOutcome.refused)

log = structlog.get_logger("watchdog.act.hosts")


@dataclass(frozen=True, slots=True)
class HostCheck:
    """Whether one host's bus answers (for `watchdog check` and the pre-restart check)."""

    label: str
    ok: bool
    detail: str = ""
    uid: int | None = None  # the remote user's uid, when connected


def targets_of(groups: Iterable[GroupSection]) -> dict[str, SshTarget]:
    """unit name -> its SSH target, for every remote unit of `groups`."""
    out: dict[str, SshTarget] = {}
    for group in groups:
        for role in Role:
            for worker in group.workers(role):
                target = group.host_of(worker)
                if target is not None:
                    out[worker.unit] = target
    return out


class UnitBuses:
    """UnitReader + UnitController over the local bus and one SSH connection per remote host."""

    def __init__(
        self,
        local: SystemdClient | None,
        targets: dict[str, SshTarget],
        *,
        remote_bus_socket: str = REMOTE_BUS_SOCKET,
        backoff_max_seconds: float = 10.0,
    ) -> None:
        self.local = local
        self.hosts: dict[SshTarget, SshHost] = {}
        self.remote: dict[SshTarget, SystemdClient] = {}
        self._unit_target = dict(targets)
        for target in dict.fromkeys(targets.values()):
            host = SshHost(
                target,
                remote_bus_socket=remote_bus_socket,
                backoff_max_seconds=backoff_max_seconds,
            )
            self.hosts[target] = host
            self.remote[target] = SystemdClient(transport=host)

    @property
    def has_remote(self) -> bool:
        """True when some unit lives on another host."""
        return bool(self.hosts)

    def host_label(self, unit: str) -> str:
        """user@host:port of the unit's host, or "local"."""
        target = self._unit_target.get(unit)
        return LOCAL if target is None else target.label

    def remote_hosts(self) -> dict[str, str]:
        """unit -> user@host:port of every remote unit."""
        return {unit: target.label for unit, target in self._unit_target.items()}

    def remote_units(self) -> dict[str, SshHost]:
        """unit -> the SSH connection of its host, for every remote unit (evidence, drift)."""
        return {unit: self.hosts[target] for unit, target in self._unit_target.items()}

    def ssh_host(self, unit: str) -> SshHost | None:
        """The SSH connection of a remote unit (None for a local one)."""
        target = self._unit_target.get(unit)
        return None if target is None else self.hosts[target]

    def client_for(self, unit: str) -> SystemdClient:
        """The SystemdClient on the unit's bus; BusDisconnected when the local bus is absent."""
        target = self._unit_target.get(unit)
        if target is not None:
            return self.remote[target]
        if self.local is None:
            raise BusDisconnected("the local system bus is not connected")
        return self.local

    async def connect_remote(self, *, wait: bool) -> list[HostCheck]:
        """Open every host's connection and bus; each failure is reported, none raised."""
        checks = (self._check_once(t) if wait else self._check(t, False) for t in self.remote)
        return list(await asyncio.gather(*checks))

    async def _check(self, target: SshTarget, wait: bool) -> HostCheck:
        try:
            await self.remote[target].wait_for_connection(patient=wait)
        except BusDisconnected as exc:
            return HostCheck(target.label, False, str(exc))
        host = self.hosts[target]
        detail = f"system bus forwarded, remote uid {host.uid}"
        return HostCheck(target.label, True, detail, host.uid)

    async def unreachable(self, plan: RestartPlan) -> list[HostCheck]:
        """The hosts of `plan`'s units whose bus cannot be reached now (one attempt each)."""
        targets = dict.fromkeys(
            self._unit_target[s.unit] for s in plan.steps if s.unit in self._unit_target
        )
        checks = await asyncio.gather(*(self._check_once(t) for t in targets))
        return [c for c in checks if not c.ok]

    async def _check_once(self, target: SshTarget) -> HostCheck:
        # One SSH attempt now (bounded by its connect timeout), whatever the backoff says, then
        # one bus attempt: a refusal must not wait out the reconnect timeout.
        try:
            await self.hosts[target].ensure(wait=True)
        except BusDisconnected as exc:
            return HostCheck(target.label, False, str(exc))
        return await self._check(target, False)

    # --- UnitReader / UnitController -------------------------------------------------------------

    async def read_unit(self, role: Role, unit: str) -> UnitState:
        """As SystemdClient.read_unit, on the unit's bus; never raises."""
        try:
            client = self.client_for(unit)
        except BusDisconnected as exc:
            return UnitState(role=role, unit=unit, ok=False, error=str(exc))
        return await client.read_unit(role, unit)

    async def restart_unit(self, unit: str, *, timeout_seconds: float) -> str:
        """RestartUnit on the unit's bus and wait for its result."""
        return await self.client_for(unit).restart_unit(unit, timeout_seconds=timeout_seconds)

    async def stop_unit(self, unit: str, *, timeout_seconds: float) -> str:
        """StopUnit on the unit's bus and wait for its result."""
        return await self.client_for(unit).stop_unit(unit, timeout_seconds=timeout_seconds)

    async def start_unit(self, unit: str, *, timeout_seconds: float) -> str:
        """StartUnit on the unit's bus and wait for its result."""
        return await self.client_for(unit).start_unit(unit, timeout_seconds=timeout_seconds)

    async def unit_processes(self, unit: str) -> tuple[int, ...]:
        """GetUnitProcesses on the unit's bus."""
        return await self.client_for(unit).unit_processes(unit)

    async def wait_for_active(self, role: Role, unit: str, *, timeout_seconds: float) -> UnitState:
        """Poll the unit's bus until it is active."""
        return await self.client_for(unit).wait_for_active(
            role, unit, timeout_seconds=timeout_seconds
        )

    async def close(self) -> None:
        """Close every bus and SSH connection."""
        clients: Sequence[SystemdClient] = [*self.remote.values()]
        if self.local is not None:
            clients = [*clients, self.local]
        for client in clients:
            with contextlib.suppress(Exception):
                await client.close()
        for host in self.hosts.values():
            with contextlib.suppress(Exception):
                await host.close()


@contextlib.asynccontextmanager
async def open_unit_buses(
    config: Config, bus_address: str | None = None
) -> AsyncIterator[UnitBuses]:
    """UnitBuses for every unit of `config`, connected (the local bus only if some unit is local;
    each host gets one attempt, a down one is reported by `unreachable`), closed on exit."""
    targets = targets_of(config.group)
    local_units = any(
        section.unit not in targets for group in config.group for _, section in group.members()
    )
    buses = UnitBuses(SystemdClient(bus_address) if local_units else None, targets)
    try:
        if buses.local is not None:
            await buses.local.wait_for_connection()
        await buses.connect_remote(wait=True)
        yield buses
    finally:
        await buses.close()


def unreachable_refusal(plan: RestartPlan, down: Sequence[HostCheck], now: float) -> RestartOutcome:
    """The outcome of a plan refused before its first step because `down` cannot be reached.

    Logged as restart_refused reason=host_unreachable. A sequence that could restart prefill on
    one host but not decode on the other would leave decode holding the old prefill's bootstrap
    state, so no step starts. The outcome says `refused`: a host outage is not a failed restart,
    and charging it to the budget would hold the group through the outage and after it.
    """
    reason = "; ".join(f"{c.label}: {c.detail}" for c in down)
    detail = f"not started: host unreachable ({reason})"
    log.error(
        "restart_refused",
        group=plan.group,
        reason=HOST_UNREACHABLE,
        hosts=[c.label for c in down],
        error=reason,
    )
    steps = tuple(StepResult(s.role, s.unit, False, "not_started", detail) for s in plan.steps)
    return RestartOutcome(
        plan=plan,
        ok=False,
        dry_run=False,
        steps=steps,
        started_at=now,
        finished_at=now,
        refused=HOST_UNREACHABLE,
    )


class HostCheckedRestarter:
    """A Restarter over UnitBuses that refuses a plan whose hosts cannot be reached (one attempt
    each) before its first step; open_restarter wraps the daemon's and `watchdog restart`'s."""

    def __init__(
        self,
        inner: Restarter,
        buses: UnitBuses,
        *,
        clock: Clock = time.time,
        on_refused: Callable[[str], None] | None = None,
    ) -> None:
        self.inner = inner
        self.buses = buses
        self.clock = clock
        self.on_refused = on_refused  # (group): the daemon counts the refusal in its metrics

    async def execute(self, plan: RestartPlan) -> RestartOutcome:
        """The plan on its hosts, or a refusal naming the unreachable ones."""
        refused = await self.refusal(plan)
        return refused if refused is not None else await self.inner.execute(plan)

    async def refusal(self, plan: RestartPlan) -> RestartOutcome | None:
        """The refusal of `plan` when one of its hosts cannot be reached now, else None."""
        down = await self.buses.unreachable(plan)
        if not down:
            return None
        if self.on_refused is not None:
            self.on_refused(plan.group)
        return unreachable_refusal(plan, down, self.clock())


async def refusal_before_lock(restarter: Restarter, plan: RestartPlan) -> RestartOutcome | None:
    """The daemon's host check, before it takes the group's lock: its refusals, tried again after
    every backoff through a host outage, stay out of the restart history (a manual restart's
    refusal, checked under the lock by HostCheckedRestarter.execute, is recorded there). None
    when the restarter checks no hosts or every host of the plan answers."""
    if isinstance(restarter, HostCheckedRestarter):
        return await restarter.refusal(plan)
    return None


__all__ = [
    "HOST_UNREACHABLE",
    "LOCAL",
    "HostCheck",
    "HostCheckedRestarter",
    "HostUnreachable",
    "UnitBuses",
    "refusal_before_lock",
    "targets_of",
    "unreachable_refusal",
]
