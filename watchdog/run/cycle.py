"""One group's cycle: observe → decide → report (logs, metrics, incidents) → act on a co-restart.

The daemon owns the lifecycle and calls `CycleRunner.run` once per group per cycle; everything a
cycle does with one observation lives here, and the per-group bookkeeping it keeps in between is
a `GroupRuntime`.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import httpx
import structlog

from watchdog.act.alertmanager import GroupAlerts, HeldAlert, Silence, renewing_beside
from watchdog.act.contracts import Restarter
from watchdog.act.hosts import UnitBuses, refusal_before_lock
from watchdog.act.plan import build_plan
from watchdog.act.restarters import execute_locked
from watchdog.clock import Clock
from watchdog.config import GroupSection, WatchdogSection
from watchdog.decide import Decision, GroupState, Verdict, after_restart, decide
from watchdog.errors import LockHeld, StateFileError
from watchdog.evidence.capture import capture_evidence, check_live_drift
from watchdog.evidence.incident import Incident, IncidentStore
from watchdog.model import (
    Action,
    Observation,
    OperatorControls,
    ProbeKind,
    RestartOutcome,
    RestartPlan,
    Role,
    State,
    UnitState,
)
from watchdog.observe.observer import GroupObserver, ObservedCycle
from watchdog.observe.probes.scheduler import ProbeScheduler
from watchdog.optional_io import OptionalIO
from watchdog.run.filecache import StatCached
from watchdog.run.fleet import FleetArbiter
from watchdog.run.metrics import WatchdogMetrics
from watchdog.run.recording import Recorder
from watchdog.statefiles import read_refusal_counts, refusals_path

log = structlog.get_logger()


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
    # The refusal counts file, read per cycle but parsed only when it changed (set at first use).
    refusals_file: StatCached[dict[str, int]] | None = None
    recorder: Recorder | None = None  # --record: every observation is appended here
    check_failed: bool = False  # a probe failed (or, with --once, none ran): `--once` exits 1
    hosts_down: frozenset[str] = frozenset()  # remote hosts alerted as unreachable, until back
    # For `watchdog status` (watchdog/run/status.py): the last decision, when it was made, the
    # operator controls it saw, and the newest incident opened for the group.
    last_decision: Decision | None = None
    decided_at: float | None = None
    operator: OperatorControls = field(default_factory=OperatorControls)
    last_incident: str | None = None
    # Alertmanager: the silence held while the group restarts and verifies, the incident it
    # belongs to, and the held alert as last posted.
    silence: Silence | None = None
    silence_incident: Incident | None = None
    silence_retry_at: float = 0.0  # a failed create is asked again while verifying, from then
    held_alert: HeldAlert | None = None
    fleet_hold: str = ""  # why the fleet holds or defers the group ("" when it does not)

    def max_sequence_seconds(self, evidence_timeout_seconds: float) -> float:
        """The longest a restart sequence can legitimately take: every bound it runs under."""
        restart = self.config.restart
        return evidence_timeout_seconds + len(restart.order) * restart.ready_timeout_seconds + 60


async def export_drift(
    group: GroupSection, systemd: UnitBuses | None, metrics: WatchdogMetrics
) -> None:
    """Compare each unit's live cmdline/environ with the config; log and export findings."""
    remote = systemd.remote_units() if systemd is not None else None
    per_role: dict[Role, int] = {}
    for drift in await check_live_drift(group, systemd, remote_hosts=remote):
        if drift.checked:
            per_role[drift.role] = per_role.get(drift.role, 0) + len(drift.findings)
    for role, findings in per_role.items():  # every worker of the role counts
        metrics.set_config_drift(group.name, str(role), findings)


def report_host_outages(
    group: str, observation: Observation, systemd: UnitBuses, was_down: frozenset[str]
) -> frozenset[str]:
    """Alert once when a remote host of the group cannot be reached, log when it is back; the
    hosts down now.

    Down: a unit on it could not be read this cycle and its SSH connection failed or was lost
    (a first attempt still under way is not an outage). Its roles'
    state is unknown (a monitoring outage, never a stall: decide() goes on from the HTTP side),
    and no co-restart can start until it returns (restart_refused reason=host_unreachable).
    """
    failed: dict[str, list[UnitState]] = {}
    for unit in observation.units:
        host = systemd.ssh_host(unit.unit)
        if host is not None and not unit.ok and host.down:
            failed.setdefault(host.label, []).append(unit)
    for label, units in failed.items():
        if label in was_down:
            continue
        log.warning(
            "alert",
            group=group,
            verdict=str(Verdict.MONITORING_OUTAGE),
            reasons=[
                {
                    "code": "host_unreachable",
                    "message": f"{label} cannot be reached ({units[0].error}): the state of "
                    f"{', '.join(u.unit for u in units)} is unknown and no co-restart can start "
                    "until it is back",
                    "host": label,
                    "units": [u.unit for u in units],
                }
            ],
        )
    for label in sorted(was_down - failed.keys()):
        log.info("host_reachable_again", group=group, host=label)
    return frozenset(failed)


class CycleRunner:
    """Runs one cycle of one group with the services the daemon acquired for all of them."""

    def __init__(
        self,
        settings: WatchdogSection,
        *,
        metrics: WatchdogMetrics,
        incidents: IncidentStore,
        restarter: Restarter,
        client: httpx.AsyncClient,
        systemd: UnitBuses | None,
        once: bool,
        on_state_change: Callable[[], None],
        clock: Clock,
        optional_io: OptionalIO | None = None,
        alerts: GroupAlerts | None = None,
        fleet: FleetArbiter | None = None,
    ) -> None:
        self.settings = settings
        self.alerts = alerts  # None: no [alertmanager] section
        self.metrics = metrics
        self.incidents = incidents
        self.restarter = restarter
        self.client = client
        self.systemd = systemd
        self.once = once
        self.on_state_change = on_state_change  # e.g. refresh the STATUS= line systemd shows
        self.clock = clock
        self.optional_io = optional_io if optional_io is not None else OptionalIO()
        self.fleet = fleet  # two or more groups: their co-restarts are weighed together

    async def run(self, runtime: GroupRuntime) -> Decision:
        """Observe, decide, record, and act on one group."""
        group = runtime.config
        cycle: ObservedCycle = await runtime.observer.observe()
        observation = cycle.observation
        if runtime.recorder is not None:
            self._record(runtime.recorder, observation)
        self._export_observation(runtime, observation)
        if self.systemd is not None and self.systemd.has_remote:
            runtime.hosts_down = report_host_outages(
                group.name, observation, self.systemd, runtime.hosts_down
            )
        previous = runtime.state
        now = self.clock()
        decision = decide(previous, observation, group, now)
        if self.fleet is not None:
            decision = self.fleet.rule(group.name, previous, decision, observation.operator, now)
        runtime.state = decision.state
        runtime.last_decision, runtime.decided_at = decision, now
        # Anything but a healthy decision fetches everything next cycle (observe/cadence.py).
        runtime.observer.note_decision(
            healthy=decision.state.state is State.HEALTHY and decision.verdict is Verdict.OK
        )
        runtime.operator = observation.operator
        self._report_decision(runtime, previous, decision)
        if decision.action is Action.CO_RESTART:
            await self._act(runtime, decision, cycle)
        if self.alerts is not None:
            await self._guarded(runtime, self._follow_alertmanager(runtime, self.alerts, decision))
        return decision

    # ---------------------------------------------------------------- report
    def _record(self, recorder: Recorder, observation: Observation) -> None:
        # Before decide(): a recording that cannot be written (a full disk) must never keep a
        # stall from being detected and healed. The recorder writes what is pending next cycle.
        key = f"recording:{recorder.group}"
        try:
            recorder.append(observation)
        except OSError as exc:
            self.optional_io.failed(
                "recording",
                "recording_write_failed",
                exc,
                key=key,
                group=recorder.group,
                effect="this cycle's observation is not recorded; detection and healing go on",
            )
        else:
            self.optional_io.succeeded("recording", key=key)

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
                runtime.check_failed = True
        for probe in observation.health if observation.health_checked else ():
            self.metrics.observe_probe(group, probe)  # repeated checks are not counted again
        starts = {(u.role, u.worker): u.exec_main_start_us for u in observation.units if u.ok}
        for snapshot in observation.metrics:
            start_us = starts.get((snapshot.role, snapshot.worker), 0)
            self.metrics.observe_scrape(group, snapshot, start_us)  # counts a failed scrape, once
        if self.once and not any(p.kind is ProbeKind.COMPLETION for p in observation.probes):
            runtime.check_failed = True
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
        if runtime.refusals_file is None:
            state_dir = self.settings.state_dir
            runtime.refusals_file = StatCached(
                refusals_path(state_dir, group),
                lambda: read_refusal_counts(state_dir, group, now=self.clock()),
            )
        try:
            counts = runtime.refusals_file.get()
        except StateFileError as exc:
            self.optional_io.failed(
                "refusals",
                "refusal_counts_unreadable",
                exc,
                key=f"refusals:{group}",
                group=group,
                effect="refusals by `watchdog restart` are exported once the file reads again",
            )
            return
        self.optional_io.succeeded("refusals", key=f"refusals:{group}")
        seen = runtime.refusals_seen or {}
        for reason, count in counts.items():
            for _ in range(max(0, count - seen.get(reason, 0))):
                self.metrics.count_refusal(group, reason)
        runtime.refusals_seen = dict(counts)

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
        decreased = new.progress.counter_decreases - previous.progress.counter_decreases
        if decreased > 0 and new.progress.last_decrease is not None:
            last = new.progress.last_decrease
            log.warning(
                "counter_decreased",
                group=group.name,
                role=str(last.role),
                counter=last.counter,
                before=last.before,
                after=last.after,
                counters=decreased,
                detail="read lower with no new process: a suspect scrape, not counted, "
                "baseline kept at the higher value",
            )
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
        if (
            decision.verdict is Verdict.DECODE_ONLY_RESTART
            and previous.units.decode_only_seen_at is None
        ):
            self.metrics.count_decode_only_restart(group.name)
            log.warning("decode_only_restart_detected", group=group.name, reasons=reasons)
        if (
            decision.verdict is Verdict.PREFILL_ONLY_RESTART
            and previous.units.prefill_only_seen_at is None
        ):
            log.warning("prefill_only_restart_detected", group=group.name, reasons=reasons)
        if decision.action is Action.CO_RESTART:
            self.metrics.count_stall(group.name, str(decision.verdict))
            log.error(
                "stall_detected", group=group.name, verdict=str(decision.verdict), reasons=reasons
            )
        elif decision.action is Action.ALERT:
            log.warning("alert", group=group.name, verdict=str(decision.verdict), reasons=reasons)
        if new.state is State.HELD and previous.state is not State.HELD:
            log.error("budget_exhausted", group=group.name, reasons=reasons)
        if (
            new.state is State.VERIFYING
            and new.readiness.recovered_at is not None
            and previous.readiness.recovered_at is None
        ):
            log.info("soak_started", group=group.name, soak=soak_fields(decision))
        if decision.verdict in (Verdict.VERIFICATION_PASSED, Verdict.VERIFICATION_FAILED):
            passed = decision.verdict is Verdict.VERIFICATION_PASSED
            event = "verification_passed" if passed else "verification_failed"
            soak = soak_fields(decision)
            (log.info if passed else log.error)(
                event,
                group=group.name,
                reasons=reasons,
                soak=soak,
                relapse="relapse" in soak,
            )
            if runtime.incident is not None:
                detail = "; ".join(r.message for r in decision.reasons)
                self.incidents.record_verification(runtime.incident, passed, detail, now, soak)
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
        if new.state is not previous.state:
            # Last, once every metric of this decision is set: it refreshes the served metrics
            # page, which shows `restarting` (with its stall counted) for the whole co-restart.
            self.on_state_change()

    # ---------------------------------------------------------------- act
    async def _act(self, runtime: GroupRuntime, decision: Decision, cycle: ObservedCycle) -> None:
        """Evidence first, then the co-restart under the group's lock, then the bookkeeping."""
        group = runtime.config
        plan = build_plan(
            group,
            trigger=str(decision.verdict),
            rung=decision.rung,
            fresh_prefills=decision.fresh_prefills,
        )
        runtime.acting_since = self.clock()
        try:
            runtime.incident = await self._open_incident(runtime, decision, cycle)
            if runtime.incident is not None and runtime.incident.written:
                runtime.last_incident = runtime.incident.id
            if self.alerts is not None:  # after the evidence, before the first StopUnit
                await self._guarded(
                    runtime,
                    self._silence_before_restart(runtime, self.alerts, str(decision.verdict)),
                )
            outcome = await self._execute_renewing(runtime, plan)
        finally:
            runtime.acting_since = None
        if runtime.incident is not None:
            self.incidents.record_action(runtime.incident, outcome)
        self.metrics.observe_restart(group.name, outcome)
        previous = runtime.state
        if outcome.refused and self.fleet is not None:
            self.fleet.withdraw(group.name, previous.since)
        runtime.state = after_restart(previous, outcome, self.clock())
        self.metrics.set_state(group.name, runtime.state.state)
        # A refusal took its charge back: the gauge says so now, not one cycle later.
        self.metrics.set_budget_remaining(
            group.name, runtime.state.budget_remaining(group, self.clock())
        )
        # decide() logged the move into `restarting`; the move out of it happens here, outside
        # decide(), and must be logged as well: timelines are rebuilt from state_changed alone.
        _log_restart_transition(group.name, previous, runtime.state, outcome)
        self.on_state_change()
        if outcome.ok and not outcome.dry_run:
            await export_drift(group, self.systemd, self.metrics)

    async def _open_incident(
        self, runtime: GroupRuntime, decision: Decision, cycle: ObservedCycle
    ) -> Incident | None:
        """Capture evidence and open the incident; None (logged, counted) if that fails.

        Evidence comes first but must never stand between a stall and its co-restart: the budget
        is already charged and the group is `restarting`, so an exception here would leave the
        stall unhealed until the detector gives up on the lost outcome (3 x ready_timeout).
        """
        group = runtime.config
        try:
            evidence = await capture_evidence(
                group,
                cycle.observation,
                raw_metrics=cycle.raw_metrics,
                unit_reader=self.systemd,
                client=self.client,
                total_timeout_seconds=self.settings.evidence_timeout_seconds,
                journal_lines=self.settings.journal_lines,
                clock=self.clock,
                remote_hosts=self.systemd.remote_units() if self.systemd is not None else None,
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

    async def _execute_renewing(self, runtime: GroupRuntime, plan: RestartPlan) -> RestartOutcome:
        """The plan executed while, beside it, the group's silence is renewed once a cycle: a
        sequence may take far longer than the silence lives (ready_timeout_seconds per step)."""
        if self.alerts is None or runtime.silence is None:
            return await self._execute(plan)
        alerts = self.alerts

        async def renew() -> None:
            await self._guarded(runtime, self._keep_silence(runtime, alerts))

        async with renewing_beside(renew, self.settings.cycle_seconds):
            return await self._execute(plan)

    async def _keep_silence(self, runtime: GroupRuntime, alerts: GroupAlerts) -> None:
        if runtime.silence is not None:
            runtime.silence = await alerts.keep(runtime.silence)

    async def _guarded(self, runtime: GroupRuntime, work: Coroutine[Any, Any, None]) -> None:
        """Run Alertmanager work that must never stand in the way of healing: its requests fail
        quietly by design, and an unexpected error here is logged and counted, never raised."""
        try:
            await work
        except Exception as exc:
            self.metrics.count_internal_error()
            log.error(
                "internal_error",
                where="alertmanager",
                group=runtime.config.name,
                error=repr(exc),
                effect="the silence or alert is not sent; healing goes on",
                traceback=traceback.format_exc(),
            )

    async def _silence_before_restart(
        self, runtime: GroupRuntime, alerts: GroupAlerts, trigger: str
    ) -> None:
        group = runtime.config
        incident = runtime.incident
        runtime.silence = await alerts.silence_restart(
            group.name,
            alerts.settings.matchers_for(group),
            runtime.silence,
            incident=incident.id if incident is not None else None,
            trigger=trigger,
        )
        if runtime.silence is None:
            runtime.silence_retry_at = self.clock() + alerts.settings.silence_seconds / 4
        elif incident is not None:
            self.incidents.record_silence(incident, runtime.silence, alerts.settings.url)
            runtime.silence_incident = incident

    async def _follow_alertmanager(
        self, runtime: GroupRuntime, alerts: GroupAlerts, decision: Decision
    ) -> None:
        """Once a cycle, after any action: the silence renewed while the group restarts or
        verifies and expired once it left those states; the held alert posted while it is
        held (renewed at half its lifetime) and resolved when it is re-armed."""
        state = runtime.state.state
        name = runtime.config.name
        now = self.clock()
        if (
            runtime.silence is None
            and state is State.VERIFYING
            and not alerts.dry_run
            and now >= runtime.silence_retry_at
        ):
            # The create before the first step failed (Alertmanager down or slow then): the
            # group's alerts may still fire through the soak, so ask again, at most every
            # quarter silence_seconds (a cycle still sends at most two requests).
            await self._silence_before_restart(runtime, alerts, "retry: the first create failed")
        if runtime.silence is not None:
            if state in (State.RESTARTING, State.VERIFYING):
                runtime.silence = await alerts.keep(runtime.silence)
            else:
                why = f"{state} ({decision.verdict})"
                if await alerts.expire(runtime.silence, why) and runtime.silence_incident:
                    self.incidents.record_silence_expired(runtime.silence_incident, why)
                runtime.silence = runtime.silence_incident = None
        if state is State.HELD:
            incident = runtime.last_incident
            report = str(self.incidents.root / incident / "report.md") if incident else None
            runtime.held_alert = await alerts.hold_alert(
                name, runtime.held_alert, incident=incident, report=report
            )
        elif runtime.held_alert is not None:
            await alerts.resolve(runtime.held_alert)
            runtime.held_alert = None

    async def _execute(self, plan: RestartPlan) -> RestartOutcome:
        refused = await refusal_before_lock(self.restarter, plan)
        if refused is not None:
            return refused
        try:
            return await execute_locked(
                plan,
                self.restarter,
                state_dir=self.settings.state_dir,
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


def _log_restart_transition(
    group: str, previous: GroupState, new: GroupState, outcome: RestartOutcome
) -> None:
    if new.state is previous.state:
        return
    if outcome.refused:
        result = "refused"
        message = (
            f"co-restart refused before its first step ({outcome.refused}): nothing restarted, "
            "not charged to the restart budget; trying again after backoff_seconds"
        )
    elif outcome.interrupted:
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


def soak_fields(decision: Decision) -> dict[str, float | str]:
    """The soak's numbers (the `verification` reason's `soak_*` values), and a relapse's
    sentence and cause where there was one (docs/decisions.md, "Verification is a soak")."""
    fields: dict[str, float | str] = {}
    for found in decision.reasons:
        if found.code == "verification":
            fields.update((k, v) for k, v in found.values if k.startswith("soak_"))
        elif found.code == "relapse":
            fields["relapse"] = found.message
            fields.update(
                (f"relapse_{k}", v) for k, v in found.values if k in ("cause", "probes_passed")
            )
    return fields
