"""Daemon lifecycle: startup, one observe → decide → act loop per group, graceful shutdown.

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
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import httpx
import structlog
from prometheus_client import CollectorRegistry

from watchdog import __version__
from watchdog.act.restart import (
    DryRunRestarter,
    HttpReadiness,
    Restarter,
    SystemdRestarter,
    build_plan,
    execute_locked,
    guard_plan,
)
from watchdog.act.systemd import SystemdClient
from watchdog.config import Config, GroupSection
from watchdog.decide import (
    Decision,
    GroupState,
    Verdict,
    after_restart,
    decide,
    initial_state,
)
from watchdog.errors import EXIT_OK, EXIT_UNHEALTHY, LockHeld, StartupError, SystemdError
from watchdog.evidence.capture import capture_evidence, check_live_drift
from watchdog.evidence.incident import Incident, IncidentStore
from watchdog.model import Action, Observation, ProbeKind, RestartOutcome, RestartPlan, State
from watchdog.observe.observer import GroupObserver, ObservedCycle
from watchdog.observe.probes import load_api_key
from watchdog.observe.probes.scheduler import ProbeScheduler
from watchdog.run import sdnotify
from watchdog.run.metrics import MetricsServer, WatchdogMetrics, serve_metrics
from watchdog.run.recording import Recorder
from watchdog.statefiles import RestartHistory, read_operator_controls, read_refusal_counts

log = structlog.get_logger()

Clock = Callable[[], float]


@dataclass
class GroupRuntime:
    """Mutable per-group bookkeeping of the daemon (the decision state itself is immutable)."""

    config: GroupSection
    observer: GroupObserver
    scheduler: ProbeScheduler | None
    state: GroupState
    incident: Incident | None = None
    acting_since: float | None = None  # a restart sequence is running since then
    last_cycle_at: float = 0.0
    skipped_probes_seen: int = 0
    refusals_seen: dict[str, int] | None = None

    def max_sequence_seconds(self, evidence_timeout_seconds: float) -> float:
        """The longest a restart sequence can legitimately take: every bound it runs under."""
        restart = self.config.restart
        return evidence_timeout_seconds + len(restart.order) * restart.ready_timeout_seconds + 60


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
        self.watchdog_seconds = sdnotify.watchdog_interval_seconds()  # WatchdogSec=, if set
        self.liveness = sdnotify.LivenessGate(self.watchdog_seconds)
        self.incidents = IncidentStore(
            config.watchdog.state_dir,
            keep=config.watchdog.incidents_keep,
            max_mib=config.watchdog.incidents_max_mib,
            clock=clock,
        )
        self.check_passed = True
        self.metrics_server: MetricsServer | None = None
        self._systemd: SystemdClient | None = None
        self._client: httpx.AsyncClient | None = None
        self._recorder_file: TextIO | None = None
        self._recorders: dict[str, Recorder] = {}
        self._restarter: Restarter | None = None

    # ---------------------------------------------------------------- startup
    async def startup(self) -> None:
        """Acquire the state dir, metrics listener, bus and per-group state; then READY=1."""
        state_dir = self.config.watchdog.state_dir
        try:
            state_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StartupError(f"cannot create state_dir {state_dir}: {exc.strerror}") from None
        if not self.once:
            self.metrics_server = await serve_metrics(
                self.registry, self.config.watchdog.metrics_listen
            )
        await self._connect_bus()
        # trust_env=False: a proxy from the environment must never sit between us and loopback.
        self._client = httpx.AsyncClient(trust_env=False)
        if self.record_path is not None:
            try:
                self._recorder_file = self.record_path.open("a", encoding="utf-8")
            except OSError as exc:
                raise StartupError(
                    f"cannot open recording {self.record_path}: {exc.strerror}"
                ) from None
        self._restarter = self._make_restarter()
        for group in self.config.group:
            self.groups[group.name] = self._make_runtime(group, self._client)
        await self._check_drift_at_startup()
        sdnotify.ready()
        sdnotify.status(self._status_line())
        log.info(
            "watchdog_started",
            version=__version__,
            groups=[g.name for g in self.config.group],
            dry_run=self.dry_run,
            systemd=self._systemd is not None,
            metrics_listen=self.config.watchdog.metrics_listen if not self.once else None,
        )

    async def _connect_bus(self) -> None:
        client = SystemdClient(self.bus_address)
        try:
            # A rehearsal or one-shot check tries once: without a bus it goes on without units.
            await client.wait_for_connection(patient=not (self.dry_run or self.once))
            self._systemd = client
        except (SystemdError, OSError) as exc:
            await client.close()
            if not self.dry_run and not self.once:
                raise StartupError(f"cannot connect to the system bus: {exc}") from None
            # A rehearsal or a one-shot check can still observe everything but the units.
            log.warning("systemd_unavailable", error=str(exc), effect="units not observed")
            self._systemd = None

    def _make_restarter(self) -> Restarter:
        # The one place --dry-run matters: everything else runs identically in a rehearsal.
        # A one-shot check never acts on a single observation either.
        if self.dry_run or self.once:
            return DryRunRestarter(clock=self.clock)
        if self._systemd is None or self._client is None:
            raise StartupError("no system bus connection; cannot restart units")
        return SystemdRestarter(
            self._systemd,
            HttpReadiness(self._client),
            shutdown_requested=self.stop_event,
            clock=self.clock,
        )

    def _make_runtime(self, group: GroupSection, client: httpx.AsyncClient) -> GroupRuntime:
        state_dir = self.config.watchdog.state_dir
        now = self.clock()
        api_key = load_api_key(group.probe.api_key_file)
        scheduler = (
            None if self.once else ProbeScheduler(group, client, api_key=api_key, clock=self.clock)
        )
        observer = GroupObserver(
            group,
            client,
            scheduler=scheduler,
            unit_reader=self._systemd,
            operator_reader=lambda: read_operator_controls(state_dir, group.name),
            clock=self.clock,
            api_key=api_key,
        )
        history = RestartHistory.load(state_dir, group.name, now=now)
        if history.warning:
            log.error("state_file_corrupt", group=group.name, warning=history.warning)
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
        if self._recorder_file is not None:
            self._recorders[group.name] = Recorder(self._recorder_file, group.name, now)
        self.metrics.set_state(group.name, state.state)
        self.metrics.set_budget_remaining(group.name, state.budget_remaining(group, now))
        return GroupRuntime(
            config=group,
            observer=observer,
            scheduler=scheduler,
            state=state,
            refusals_seen=read_refusal_counts(state_dir, group.name, now=now),
        )

    async def _check_drift_at_startup(self) -> None:
        """The incident's first question: are the expected flags really live in each process?"""
        if self._systemd is None:
            return
        for runtime in self.groups.values():
            await self.check_drift(runtime.config)

    async def check_drift(self, group: GroupSection) -> None:
        """Compare each unit's live cmdline/environ with the config; log and export findings."""
        for drift in await check_live_drift(group, self._systemd):
            if drift.checked:
                self.metrics.set_config_drift(group.name, str(drift.role), len(drift.findings))

    # ---------------------------------------------------------------- run
    async def run(self) -> None:
        """One loop per group (plus its probe scheduler) until stop is requested."""
        async with asyncio.TaskGroup() as tasks:
            for runtime in self.groups.values():
                name = runtime.config.name
                tasks.create_task(self._group_loop(runtime), name=f"loop:{name}")
                if runtime.scheduler is not None:
                    tasks.create_task(
                        self._until_stopped(runtime.scheduler.run()), name=f"probes:{name}"
                    )
            if not self.once and self.watchdog_seconds is not None:
                tasks.create_task(self._liveness_loop(), name="liveness")

    async def _until_stopped(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run `coro` until the stop event is set, then cancel it (its own TaskGroup cleans up)."""
        async with asyncio.TaskGroup() as tasks:
            task = tasks.create_task(coro)
            await self.stop_event.wait()
            task.cancel()

    async def _group_loop(self, runtime: GroupRuntime) -> None:
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
            self._ping_if_alive(finished)
            if self.once:
                return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, cycle_seconds - (finished - started))):
                    await self.stop_event.wait()

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
        """Observe, decide, record, and act on one group."""
        group = runtime.config
        cycle: ObservedCycle = await runtime.observer.observe()
        observation = cycle.observation
        recorder = self._recorders.get(group.name)
        if recorder is not None:
            recorder.append(observation)
        self._export_observation(runtime, observation)
        previous = runtime.state
        decision = decide(previous, observation, group, self.clock())
        runtime.state = decision.state
        self._report_decision(runtime, previous, decision)
        if decision.action is Action.CO_RESTART:
            await self._act(runtime, decision, cycle)
        return decision

    def _export_observation(self, runtime: GroupRuntime, observation: Observation) -> None:
        group = runtime.config.name
        for probe in observation.probes:
            self.metrics.observe_probe(group, probe)
            if not probe.ok:
                log.warning(
                    "probe_failed",
                    group=group,
                    kind=str(probe.kind),
                    reason=str(probe.reason),
                    status_code=probe.status_code,
                    error_code=probe.error_code,
                    request_id=probe.request_id,
                    duration_seconds=round(probe.duration_seconds, 3),
                    detail=probe.detail,
                )
                self.check_passed = False
        for probe in observation.health:
            self.metrics.observe_probe(group, probe)
        for snapshot in observation.metrics:
            if not snapshot.ok:
                self.metrics.count_scrape_error(group, str(snapshot.role))
            self.metrics.observe_scrape(group, snapshot)
        if self.once and not any(p.kind is ProbeKind.COMPLETION for p in observation.probes):
            self.check_passed = False
        if runtime.scheduler is not None:
            skipped = runtime.scheduler.skipped_starts
            for _ in range(skipped - runtime.skipped_probes_seen):
                self.metrics.count_probe_skipped(group)
            runtime.skipped_probes_seen = skipped
        self._export_cli_refusals(runtime)

    def _export_cli_refusals(self, runtime: GroupRuntime) -> None:
        # `watchdog restart --unit decode` runs in another process without a metrics endpoint;
        # it counts refusals in state_dir and the daemon exports the increase.
        group = runtime.config.name
        counts = read_refusal_counts(self.config.watchdog.state_dir, group, now=self.clock())
        seen = runtime.refusals_seen or {}
        for reason, count in counts.items():
            for _ in range(max(0, count - seen.get(reason, 0))):
                self.metrics.count_refusal(group, reason)
        runtime.refusals_seen = counts

    def _report_decision(
        self, runtime: GroupRuntime, previous: GroupState, decision: Decision
    ) -> None:
        group = runtime.config
        new = decision.state
        reasons = [
            {"code": r.code, "message": r.message, **dict(r.values)} for r in decision.reasons
        ]
        now = self.clock()
        self.metrics.set_budget_remaining(group.name, new.budget_remaining(group, now))
        if new.state is not previous.state:
            self.metrics.set_state(group.name, new.state)
            log.info(
                "state_changed",
                group=group.name,
                old=str(previous.state),
                new=str(new.state),
                verdict=str(decision.verdict),
                action=str(decision.action),
                reasons=reasons,
            )
            sdnotify.status(self._status_line())
        if (
            decision.verdict is Verdict.DECODE_ONLY_RESTART
            and previous.units.decode_only_seen_at is None
        ):
            self.metrics.count_decode_only_restart(group.name)
            log.warning("decode_only_restart_detected", group=group.name, reasons=reasons)
        if decision.action is Action.CO_RESTART:
            self.metrics.count_stall(group.name, str(decision.verdict))
            log.error(
                "stall_detected", group=group.name, verdict=str(decision.verdict), reasons=reasons
            )
        elif decision.action is Action.ALERT:
            log.warning("alert", group=group.name, verdict=str(decision.verdict), reasons=reasons)
        if new.state is State.HELD and previous.state is not State.HELD:
            log.error("budget_exhausted", group=group.name, reasons=reasons)
        if decision.verdict in (Verdict.VERIFICATION_PASSED, Verdict.VERIFICATION_FAILED):
            passed = decision.verdict is Verdict.VERIFICATION_PASSED
            event = "verification_passed" if passed else "verification_failed"
            (log.info if passed else log.error)(event, group=group.name, reasons=reasons)
            if runtime.incident is not None:
                detail = "; ".join(r.message for r in decision.reasons)
                self.incidents.record_verification(runtime.incident, passed, detail, now)
                runtime.incident = None
        if decision.action is not Action.NONE or new.state is not previous.state:
            self.incidents.audit(
                "decision",
                group=group.name,
                state=str(new.state),
                verdict=str(decision.verdict),
                action=str(decision.action),
                reasons=reasons,
            )

    def _status_line(self) -> str:
        states = ", ".join(f"{name}: {rt.state.state}" for name, rt in self.groups.items())
        return f"{'dry-run; ' if self.dry_run else ''}{states}"

    # ---------------------------------------------------------------- act
    async def _act(self, runtime: GroupRuntime, decision: Decision, cycle: ObservedCycle) -> None:
        """Evidence first, then the co-restart under the group's lock, then the bookkeeping."""
        group = runtime.config
        assert self._client is not None
        plan = build_plan(group, trigger=str(decision.verdict))
        guard_plan(plan)  # defence in depth: build_plan already follows the validated order
        runtime.acting_since = self.clock()
        try:
            runtime.incident = await self._open_incident(runtime, decision, cycle)
            outcome = await self._execute(plan)
        finally:
            runtime.acting_since = None
        if runtime.incident is not None:
            self.incidents.record_action(runtime.incident, outcome)
        self.metrics.observe_restart(group.name, outcome)
        previous = runtime.state
        runtime.state = after_restart(previous, outcome, self.clock())
        self.metrics.set_state(group.name, runtime.state.state)
        # decide() logged the move into `restarting`; the move out of it happens here, outside
        # decide(), and must be logged as well: timelines are rebuilt from state_changed alone.
        self._log_restart_transition(group.name, previous, runtime.state, outcome)
        sdnotify.status(self._status_line())
        if outcome.ok and not outcome.dry_run:
            await self.check_drift(group)

    async def _open_incident(
        self, runtime: GroupRuntime, decision: Decision, cycle: ObservedCycle
    ) -> Incident | None:
        """Capture evidence and open the incident; None (logged, counted) if that fails.

        Evidence comes first but must never stand between a stall and its co-restart: the budget
        is already charged and the group is `restarting`, so an exception here would leave the
        stall unhealed until the detector gives up on the lost outcome (3 x ready_timeout).
        """
        group = runtime.config
        assert self._client is not None
        try:
            evidence = await capture_evidence(
                group,
                cycle.observation,
                raw_metrics=cycle.raw_metrics,
                unit_reader=self._systemd,
                client=self._client,
                total_timeout_seconds=self.config.watchdog.evidence_timeout_seconds,
                journal_lines=self.config.watchdog.journal_lines,
                clock=self.clock,
            )
            incident = self.incidents.open_incident(
                group=group.name,
                evidence=evidence,
                decision_reasons=decision.reasons,
                now=self.clock(),
                observation=cycle.observation,
                verdict=str(decision.verdict),
            )
        except Exception as exc:
            self.metrics.count_internal_error()
            log.error(
                "internal_error",
                where="evidence",
                group=group.name,
                error=repr(exc),
                effect="no incident is recorded; the co-restart goes ahead",
                traceback=traceback.format_exc(),
            )
            return None
        log.info(
            "evidence_captured",
            group=group.name,
            incident=incident.id,
            path=str(incident.path),
            duration_seconds=round(evidence.finished_at - evidence.started_at, 3),
            items=len(evidence.items),
            unavailable=[i.name for i in evidence.unavailable],
            drift=len(evidence.drift),
        )
        return incident

    @staticmethod
    def _log_restart_transition(
        group: str, previous: GroupState, new: GroupState, outcome: RestartOutcome
    ) -> None:
        if new.state is previous.state:
            return
        if outcome.interrupted:
            result, message = "interrupted", "co-restart interrupted by shutdown"
        elif outcome.dry_run:
            result, message = "dry_run", "dry run: nothing was restarted; verifying as if it had"
        elif outcome.ok:
            result, message = "done", "co-restart done; verifying that it helped"
        else:
            failed = outcome.failed_step
            where = f" at {failed.role} ({failed.phase})" if failed is not None else ""
            result, message = "failed", f"co-restart failed{where}"
        log.info(
            "state_changed",
            group=group,
            old=str(previous.state),
            new=str(new.state),
            verdict=str(new.verdict),
            action=str(Action.NONE),
            reasons=[{"code": "restart_outcome", "message": message, "result": result}],
        )

    async def _execute(self, plan: RestartPlan) -> RestartOutcome:
        assert self._restarter is not None
        try:
            return await execute_locked(
                plan,
                self._restarter,
                state_dir=self.config.watchdog.state_dir,
                purpose="daemon",
                clock=self.clock,
            )
        except LockHeld as exc:
            # An operator's manual co-restart is in progress: that is the action; do not overlap.
            self.metrics.count_refusal(plan.group, "lock_held")
            log.error("restart_refused", group=plan.group, reason="lock_held", error=str(exc))
            now = self.clock()
            return RestartOutcome(
                plan=plan, ok=False, dry_run=False, steps=(), started_at=now, finished_at=now
            )

    # ---------------------------------------------------------------- shutdown
    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT only set the stop event; the loops notice it at their next wait."""
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.request_stop, signum)

    def request_stop(self, signum: int | None = None) -> None:
        """Ask every loop to finish; an in-flight restart step completes its current job wait."""
        if not self.stop_event.is_set():
            log.info("shutdown_requested", signal=signum)
            sdnotify.stopping()
        self.stop_event.set()

    async def shutdown(self) -> None:
        """Release everything startup() acquired."""
        if self._client is not None:
            await self._client.aclose()
        if self._systemd is not None:
            with contextlib.suppress(Exception):
                await self._systemd.close()
        if self._recorder_file is not None:
            self._recorder_file.close()
        if self.metrics_server is not None:
            self.metrics_server.close()
        log.info("watchdog_stopped")


async def run_daemon(daemon: Daemon) -> int:
    """startup → run → shutdown with a deadline; returns the exit code."""
    try:
        # Inside the try: a startup that fails half-way (bus, recording file) must still release
        # what it already acquired, e.g. the metrics listener's port and thread.
        await daemon.startup()
        daemon.install_signal_handlers()
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
