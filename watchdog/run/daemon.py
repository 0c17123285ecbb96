"""Daemon lifecycle: startup, one loop per group (each cycle in cycle.py), liveness, shutdown.

Shape borrowed from uvicorn's server: `startup()` acquires everything (metrics listener, bus,
state), `run()` drives the loops inside one asyncio.TaskGroup (no fire-and-forget tasks), signal
handlers only set an event, and shutdown waits up to a deadline before cancelling.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
import traceback
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import httpx
import structlog
from prometheus_client import CollectorRegistry

from watchdog import __version__
from watchdog.act.alertmanager import GroupAlerts, group_alerts
from watchdog.act.contracts import Restarter
from watchdog.act.hosts import HOST_UNREACHABLE, UnitBuses, targets_of
from watchdog.act.restarters import open_restarter
from watchdog.act.systemd import SystemdClient
from watchdog.clock import Clock
from watchdog.config import Config, GroupSection
from watchdog.decide import Decision, initial_state
from watchdog.decide.fleet import Storm
from watchdog.errors import (
    EXIT_OK,
    EXIT_UNHEALTHY,
    ConfigError,
    LockHeld,
    StartupError,
    StateFileError,
    SystemdError,
)
from watchdog.evidence.incident import IncidentStore
from watchdog.observe.observer import HEALTH_LEAD_SECONDS, GroupObserver
from watchdog.observe.pool import make_client
from watchdog.observe.probes import load_admin_api_key, load_api_key
from watchdog.observe.probes.scheduler import ProbeScheduler
from watchdog.optional_io import OptionalIO
from watchdog.run import sdnotify
from watchdog.run.cycle import CycleRunner, GroupRuntime, export_drift
from watchdog.run.filecache import StatCached
from watchdog.run.fleet import FleetArbiter
from watchdog.run.fleetpace import AfterCycles
from watchdog.run.metrics import MetricsServer, WatchdogMetrics, serve_metrics
from watchdog.run.recording import AppendFile, Recorder
from watchdog.run.status import StatusWriter
from watchdog.run.stormalert import StormAlert
from watchdog.statefiles import (
    InstanceLock,
    RestartHistory,
    operator_path,
    read_operator_controls,
    read_refusal_counts,
    report_abandoned,
)

log = structlog.get_logger()


class Daemon:
    """The long-running watchdog: one instance per process."""

    def __init__(
        self,
        config: Config,
        *,
        dry_run: bool = False,
        once: bool = False,
        record_path: Path | None = None,
        registry: CollectorRegistry | None = None,
        bus_address: str | None = None,
        clock: Clock = time.time,
    ) -> None:
        self.config = config
        self.dry_run = dry_run
        self.once = once
        self.record_path = record_path
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = WatchdogMetrics(self.registry, groups=[g.name for g in config.group])
        self.bus_address = bus_address
        self.clock = clock
        self.stop_event = asyncio.Event()
        self.groups: dict[str, GroupRuntime] = {}
        self._refresh_pace = AfterCycles(len(config.group))  # /metrics page and status.json
        self.watchdog_seconds = sdnotify.watchdog_interval_seconds()  # WatchdogSec=, if set
        self.liveness = sdnotify.LivenessGate(self.watchdog_seconds)
        # The recording, incident files, audit log and refusal counts: failures counted, logged
        # once per episode, never the end of a cycle (watchdog/optional_io.py).
        self.optional_io = OptionalIO(self.metrics.count_file_error)
        self.incidents = IncidentStore(
            config.watchdog.state_dir,
            keep=config.watchdog.incidents_keep,
            max_mib=config.watchdog.incidents_max_mib,
            clock=clock,
            optional_io=self.optional_io,
        )
        self.metrics_server: MetricsServer | None = None
        self._instance_lock: InstanceLock | None = None
        self._systemd: UnitBuses | None = None
        self._client: httpx.AsyncClient | None = None
        self._recorder_file: AppendFile | None = None
        self._cycle: CycleRunner | None = None
        self._storm_alert: StormAlert | None = None  # with [alertmanager] and a fleet
        # Two or more groups: their co-restarts are weighed together (docs/decisions.md, "Fleet
        # budget and storms"); one group is governed by its own budget alone.
        self.fleet: FleetArbiter | None = (
            FleetArbiter(
                config.fleet,
                config.group,
                metrics=self.metrics,
                on_storm=self.report_storm,
                on_storm_ended=self._storm_ended,
            )
            if len(config.group) > 1
            else None
        )
        # `watchdog status` reads what this writes; a --once check leaves a running daemon's file.
        self._status: StatusWriter | None = (
            None
            if once
            else StatusWriter(
                config.watchdog.state_dir, dry_run=dry_run, optional_io=self.optional_io
            )
        )
        self._exits = contextlib.AsyncExitStack()  # what startup() entered, left at shutdown()

    @property
    def check_passed(self) -> bool:
        """For `--once`: every group ran its completion probe and no probe failed."""
        return not any(runtime.check_failed for runtime in self.groups.values())

    # ---------------------------------------------------------------- startup
    async def startup(self) -> None:
        """Acquire the state dir, metrics listener, bus and per-group state; then READY=1."""
        state_dir = self.config.watchdog.state_dir
        try:
            state_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StartupError(f"cannot create state_dir {state_dir}: {exc.strerror}") from None
        if not self.once:
            # First, before the metrics port: a second daemon is refused for what it is.
            self._instance_lock = self._lock_instance(state_dir)
            self.metrics_server = await serve_metrics(
                self.registry, self.config.watchdog.metrics_listen
            )
        await self._connect_bus()
        # One pool per target origin, no proxy from the environment (watchdog/observe/pool.py).
        self._client = make_client()
        if self.record_path is not None:
            try:
                self._recorder_file = AppendFile(self.record_path)
            except OSError as exc:
                raise StartupError(
                    f"cannot open recording {self.record_path}: {exc.strerror}"
                ) from None
        alerts = self._group_alerts(self._client)
        if alerts is not None and self.fleet is not None:
            fleet = self.fleet
            self._storm_alert = StormAlert(
                alerts, lambda: fleet.state.storm, self.metrics.count_internal_error
            )
        self._cycle = CycleRunner(
            self.config.watchdog,
            metrics=self.metrics,
            incidents=self.incidents,
            restarter=await self._open_restarter(),
            client=self._client,
            systemd=self._systemd,
            once=self.once,
            on_state_change=self._report_status,
            clock=self.clock,
            optional_io=self.optional_io,
            alerts=alerts,
            fleet=self.fleet,
        )
        incidents = self._status.previous_incidents() if self._status is not None else {}
        for group in self.config.group:
            self.groups[group.name] = self._make_runtime(group, self._client)
            self.groups[group.name].last_incident = incidents.get(group.name)
        await self._check_drift_at_startup()
        sdnotify.ready()
        self._report_status()
        log.info(
            "watchdog_started",
            version=__version__,
            groups=[g.name for g in self.config.group],
            dry_run=self.dry_run,
            systemd=self._systemd is not None,
            metrics_listen=self.config.watchdog.metrics_listen if not self.once else None,
        )

    def _group_alerts(self, client: httpx.AsyncClient) -> GroupAlerts | None:
        """Silences and the watchdog's own alerts, with [alertmanager] (on the daemon's pool);
        a rehearsal (dry run, --once) logs what it would send."""
        settings = self.config.alertmanager
        if settings is None:
            return None
        return group_alerts(
            settings,
            client,
            clock=self.clock,
            dry_run=self.dry_run or self.once,
            count_error=self.metrics.count_alertmanager_error,
        )

    def _lock_instance(self, state_dir: Path) -> InstanceLock:
        """One daemon per state_dir: a second one would act on the same groups (exit 3)."""
        lock = InstanceLock(state_dir, clock=self.clock)
        try:
            lock.acquire()
        except (LockHeld, StateFileError) as exc:  # StateFileError: a symlink, the wrong user
            raise StartupError(str(exc)) from None
        return lock

    def _report_abandoned(self, state_dir: Path, group: str) -> None:
        """Sequences cut by a kill of an earlier daemon: logged (restart_sequence_interrupted by
        the history) and audited; they stay charged to the budget loaded next."""
        try:
            found = report_abandoned(state_dir, group, clock=self.clock)
        except StateFileError as exc:
            log.error("restart_history_not_written", group=group, error=str(exc))
            return
        for record in found:
            self.incidents.audit(
                "restart_sequence_interrupted",
                group=group,
                started_at=record.started_at,
                trigger=record.trigger,
                pid=record.pid,
            )

    async def _connect_bus(self) -> None:
        remote = targets_of(self.config.group)
        patient = not (self.dry_run or self.once)
        local: SystemdClient | None = None
        if any(section.unit not in remote for g in self.config.group for _, section in g.members()):
            local = SystemdClient(self.bus_address)
            try:
                # A rehearsal or one-shot check tries once: without a bus it goes on without units.
                await local.wait_for_connection(patient=patient)
            except (SystemdError, OSError) as exc:
                await local.close()
                local = None
                if not self.dry_run and not self.once:
                    raise StartupError(f"cannot connect to the system bus: {exc}") from None
                # A rehearsal or a one-shot check can still observe everything but the units.
                log.warning("systemd_unavailable", error=str(exc), effect="units not observed")
                if not remote:
                    return
        self._systemd = UnitBuses(local, remote)
        # A remote host that is down is a monitoring outage of its roles, not a startup error:
        # its reads say "unknown" and reconnects go on with backoff (watchdog.act.ssh).
        for check in await self._systemd.connect_remote(wait=patient):
            if not check.ok:
                log.warning("ssh_host_unavailable_at_startup", host=check.label, error=check.detail)

    async def _open_restarter(self) -> Restarter:
        """The restarter of act/restarters.py's one assembly, on the daemon's bus and HTTP pool,
        open until shutdown. A one-shot check never acts on a single observation either."""
        rehearsal = self.dry_run or self.once
        if not rehearsal and (self._systemd is None or self._client is None):
            raise StartupError("no system bus connection; cannot restart units")
        return await self._exits.enter_async_context(
            open_restarter(
                dry_run=rehearsal,
                units=self._systemd,
                http=self._client,
                shutdown_requested=self.stop_event,
                clock=self.clock,
                on_host_refused=self._count_host_refusal,
            )
        )

    def _count_host_refusal(self, group: str) -> None:
        self.metrics.count_refusal(group, HOST_UNREACHABLE)

    def _make_runtime(self, group: GroupSection, client: httpx.AsyncClient) -> GroupRuntime:
        state_dir = self.config.watchdog.state_dir
        now = self.clock()
        api_key = load_api_key(group.probe.api_key_file)
        with contextlib.suppress(ConfigError):  # read again at each abort; known to redact now
            load_admin_api_key(group.probe)
        scheduler = (
            None if self.once else ProbeScheduler(group, client, api_key=api_key, clock=self.clock)
        )
        observer = GroupObserver(
            group,
            client,
            scheduler=scheduler,
            unit_reader=self._systemd,
            # Read every cycle, parsed only when the file changed (watchdog/run/filecache.py).
            operator_reader=StatCached(
                operator_path(state_dir, group.name),
                lambda: read_operator_controls(state_dir, group.name),
            ).get,
            clock=self.clock,
            api_key=api_key,
        )
        history = RestartHistory.load(state_dir, group.name, now=now)
        if history.warning:
            log.error("state_file_corrupt", group=group.name, warning=history.warning)
        if not self.once:
            self._report_abandoned(state_dir, group.name)  # `history` already counts them
        if history.records and history.records[-1].interrupted:
            last = history.records[-1]
            log.warning(
                "previous_restart_interrupted",
                group=group.name,
                started_at=last.started_at,
                steps=[f"{s.role}:{'ok' if s.ok else s.phase}" for s in last.steps],
            )
        rearmed_at = read_operator_controls(state_dir, group.name).rearmed_at
        state = initial_state(
            now,
            restart_times=history.restart_times(
                group.restart.budget_window_seconds, now, since=rearmed_at
            ),
            consecutive_failures=history.consecutive_failures(since=rearmed_at),
            backoff_seconds=group.restart.backoff_seconds,
        )
        recorder = (
            Recorder(self._recorder_file, group.name, now)
            if self._recorder_file is not None
            else None
        )
        self.metrics.set_state(group.name, state.state)
        self.metrics.set_budget_remaining(group.name, state.budget_remaining(group, now))
        return GroupRuntime(
            config=group,
            observer=observer,
            scheduler=scheduler,
            state=state,
            refusals_seen=read_refusal_counts(state_dir, group.name, now=now),
            recorder=recorder,
        )

    async def _check_drift_at_startup(self) -> None:
        """The incident's first question: are the expected flags really live in each process?"""
        if self._systemd is None:
            return
        for runtime in self.groups.values():
            await export_drift(runtime.config, self._systemd, self.metrics)

    # ---------------------------------------------------------------- run
    async def run(self) -> None:
        """One loop per group (plus its probe scheduler) until stop is requested."""
        async with asyncio.TaskGroup() as tasks:
            for index, runtime in enumerate(self.groups.values()):
                name = runtime.config.name
                offset = self._start_offset(index)
                tasks.create_task(self._group_loop(runtime, offset), name=f"loop:{name}")
                if runtime.scheduler is not None:
                    tasks.create_task(
                        self._until_stopped(runtime.scheduler.run(), offset),
                        name=f"probes:{name}",
                    )
            if not self.once and self.watchdog_seconds is not None:
                tasks.create_task(self._liveness_loop(), name="liveness")

    def _start_offset(self, index: int) -> float:
        """When group `index` starts, spread over the first cycle (none for `--once`).

        Groups started together would fetch, parse and probe in the same instant every cycle:
        each cycle would then last as long as all of them together. Spread evenly, each runs
        nearly alone. Probe starts follow their group's loop.
        """
        if self.once or not self.groups:
            return 0.0
        return index * self.config.watchdog.cycle_seconds / len(self.groups)

    async def _wait_stop(self, seconds: float) -> None:
        """Sleep `seconds`, or less when stop is requested meanwhile."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, seconds)):
                await self.stop_event.wait()

    async def _until_stopped(self, coro: Coroutine[Any, Any, None], delay: float = 0.0) -> None:
        """After `delay`, run `coro` until the stop event is set, then cancel it (its own TaskGroup
        cleans up)."""
        if delay > 0:
            await self._wait_stop(delay)
        if self.stop_event.is_set():
            coro.close()  # never started: closing it avoids a "never awaited" warning
            return
        async with asyncio.TaskGroup() as tasks:
            task = tasks.create_task(coro)
            await self.stop_event.wait()
            task.cancel()

    async def _group_loop(self, runtime: GroupRuntime, delay: float = 0.0) -> None:
        if delay > 0:
            await self._wait_stop(delay)
        try:
            await self._cycles(runtime)
        finally:
            runtime.observer.cancel_ahead()

    async def _cycles(self, runtime: GroupRuntime) -> None:
        cycle_seconds = self.config.watchdog.cycle_seconds
        while not self.stop_event.is_set():
            started = self.clock()
            try:
                await self.run_cycle(runtime)
            except Exception as exc:  # the loop never dies of a per-cycle error
                self.metrics.count_internal_error()
                log.error(
                    "cycle_failed",
                    group=runtime.config.name,
                    error=repr(exc),
                    traceback=traceback.format_exc(),
                )
            finished = self.clock()
            runtime.last_cycle_at = finished
            self.metrics.observe_cycle(finished - started)
            if self._refresh_pace.cycle_done():
                # Here, rather than per scrape on the listener's thread; once per cycle in a
                # large fleet (run/fleetpace.py).
                if self.metrics_server is not None:
                    self.metrics_server.refresh()
                self._write_status()
            self._ping_if_alive(finished)
            if self.once:
                return
            await self._until_next_cycle(runtime, cycle_seconds - (finished - started))

    async def _until_next_cycle(self, runtime: GroupRuntime, left: float) -> None:
        """Sleep the `left` seconds of the cycle in two parts, asking the next observation's
        /health between them HEALTH_LEAD_SECONDS before it (at once when less is left), so that
        its decision need not wait ~1 s for SGLang's answer (observe/observer.py,
        docs/decisions.md "/health asked ahead")."""
        ahead_in = max(0.0, left - HEALTH_LEAD_SECONDS)
        await self._wait_stop(ahead_in)
        if not self.stop_event.is_set():
            runtime.observer.start_health_ahead()
        await self._wait_stop(left - ahead_in)

    def loops_alive(self, now: float) -> bool:
        """True when every group's loop completed a cycle recently, or is inside a restart
        sequence that is still within the bounds that sequence runs under."""
        interval = self.watchdog_seconds or float("inf")
        evidence = self.config.watchdog.evidence_timeout_seconds
        cycle_seconds = self.config.watchdog.cycle_seconds
        for runtime in self.groups.values():
            if runtime.acting_since is not None:
                if now - runtime.acting_since > runtime.max_sequence_seconds(evidence):
                    return False
            elif now - runtime.last_cycle_at > max(interval / 2, 2 * cycle_seconds):
                return False
        return True

    def _ping_if_alive(self, now: float) -> None:
        # WATCHDOG=1 only on evidence that the loops progress (never from a free-running timer),
        # so a wedged loop stops the pings and systemd's WatchdogSec= restarts us.
        if self.loops_alive(now):
            self.liveness.cycle_completed(now)
        if self.liveness.should_ping(now):
            sdnotify.watchdog_ping()

    async def _liveness_loop(self) -> None:
        # During a long restart sequence no cycle completes; this loop still pings, but only
        # while loops_alive() holds (every sequence is within its own timeouts).
        interval = self.watchdog_seconds or 30.0
        while not self.stop_event.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval / 4):
                    await self.stop_event.wait()
            if any(r.acting_since is not None for r in self.groups.values()):
                self._ping_if_alive(self.clock())

    # ---------------------------------------------------------------- one cycle
    async def run_cycle(self, runtime: GroupRuntime) -> Decision:
        """One group's observe → decide → report → act (see watchdog/run/cycle.py)."""
        assert self._cycle is not None, "run_cycle before startup"
        return await self._cycle.run(runtime)

    def _status_line(self) -> str:
        states = ", ".join(f"{name}: {rt.state.state}" for name, rt in self.groups.items())
        return f"{'dry-run; ' if self.dry_run else ''}{states}"

    def report_storm(self, storm: Storm) -> None:
        """The one place a storm verdict is reported: logged, audited, counted by the arbiter.

        With [alertmanager], the storm alert (SGLangWatchdogStorm) names the stalled groups, what
        they share, the ones co-restarted for it and the ones held; resolved when it ends.
        """
        suspects = [
            {"kind": s.kind, "value": s.value, "groups": list(s.groups)} for s in storm.suspects
        ]
        fields = {
            "groups": list(storm.groups),
            "stalled": len(storm.groups),
            "total": storm.total,
            "suspects": suspects,
            "acted": list(storm.acted),
            "held": list(storm.held),
        }
        log.error(
            "storm_detected",
            **fields,
            effect=f"at most {self.config.fleet.max_concurrent_restarts} co-restarted; the held "
            "groups wait until they recover on their own or `watchdog reset`",
        )
        self.incidents.audit("storm_detected", **fields)
        if self._storm_alert is not None:
            self._storm_alert.declared(storm)

    def _storm_ended(self, storm: Storm) -> None:
        if self._storm_alert is not None:
            self._storm_alert.ended()

    def _write_status(self) -> None:
        if self.fleet is not None:
            for name, runtime in self.groups.items():
                runtime.fleet_hold = self.fleet.hold_text(name)
        if self._status is not None:
            self._status.write(self.groups.values(), self.clock())

    def _report_status(self) -> None:
        sdnotify.status(self._status_line())
        self._write_status()
        if self.metrics_server is not None:
            # A state change shows at once: a co-restart (minutes) ends its cycle only when it is
            # over, and `restarting` must be scrapable while it runs.
            self.metrics_server.refresh()

    # ---------------------------------------------------------------- shutdown
    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT only set the stop event; the loops notice it at their next wait.

        SIGHUP is logged and ignored: its default action would end the process at once, without
        the shutdown path (recording closed, instance lock released, an in-flight restart step
        finished), and `systemctl reload` or a closed terminal sends it.
        """
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.request_stop, signum)
        loop.add_signal_handler(signal.SIGHUP, self.hangup_ignored)

    def hangup_ignored(self) -> None:
        """SIGHUP: the configuration is read once at start; a reload needs a restart."""
        log.warning(
            "sighup_ignored",
            signal=int(signal.SIGHUP),
            effect="configuration reload is not supported; the daemon keeps running with the "
            "configuration it started with (restart the service to apply a new one)",
        )

    def request_stop(self, signum: int | None = None) -> None:
        """Ask every loop to finish; an in-flight restart step completes its current job wait."""
        if not self.stop_event.is_set():
            log.info("shutdown_requested", signal=signum)
            sdnotify.stopping()
        self.stop_event.set()

    async def shutdown(self) -> None:
        """Release everything startup() acquired."""
        if self._storm_alert is not None:
            await self._storm_alert.close()  # before the pool it posts through closes
        with contextlib.suppress(Exception):
            await self._exits.aclose()
        if self._client is not None:
            await self._client.aclose()
        if self._systemd is not None:
            with contextlib.suppress(Exception):
                await self._systemd.close()
        if self._recorder_file is not None:
            self._recorder_file.close()
        if self.metrics_server is not None:
            self.metrics_server.close()
        if self._instance_lock is not None:
            self._instance_lock.release()
        log.info("watchdog_stopped")


async def run_daemon(daemon: Daemon) -> int:
    """startup → run → shutdown with a deadline; returns the exit code."""
    try:
        # Before startup: a SIGTERM during it (systemd is told READY, and may stop the unit, before
        # startup returns) takes the shutdown path once startup is done, instead of the default
        # action killing the process with its recording unclosed (a busy-machine run lost a clean
        # exit so).
        daemon.install_signal_handlers()
        # Inside the try: a startup that fails half-way (bus, recording file) must still release
        # what it already acquired, e.g. the metrics listener's port and thread.
        await daemon.startup()
        runner = asyncio.ensure_future(daemon.run())
        stopper = asyncio.ensure_future(daemon.stop_event.wait())
        await asyncio.wait({runner, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if not runner.done():
            deadline = daemon.config.watchdog.shutdown_timeout_seconds
            done, _ = await asyncio.wait({runner}, timeout=deadline)
            if not done:
                log.error("shutdown_deadline_exceeded", deadline_seconds=deadline)
                runner.cancel()
        stopper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await runner
    finally:
        await daemon.shutdown()
    if daemon.once:
        return EXIT_OK if daemon.check_passed else EXIT_UNHEALTHY
    return EXIT_OK
