"""Classify a wedge from its evidence, with the reasoning and the ruled-out list written out.

Pure: (evidence, observation, verdict) -> Classification. No I/O, no clock. The kinds and what
tells them apart (the SGLang facts behind them: docs/sglang.md §1, §4–§7):

    crash               a unit is not running (failed, inactive, no MainPID)
    router_wedge        the router path fails while the workers progress, or the router itself
                        complains (circuit breaker open, /readiness not 200) with healthy workers
    degraded_bootstrap  decode (re)started after a long-running prefill, with transfer/bootstrap
                        failures: the incident's root cause
    collective_hang     no progress while GPUs are busy: ranks spinning in a TP collective
    transfer_stall      work pending, no progress, GPUs idle or unknown: requests parked between
                        prefill and decode, where SGLang has no timeout
    overload            slow but progressing (batch lines keep coming, GPUs busy)
    unclassified        the evidence fits none of the above
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum

from watchdog.decide.verdict import Verdict
from watchdog.evidence.batchlines import is_health_batch_line
from watchdog.evidence.gpu_activity import describe_devices, gpu_busy, select_devices
from watchdog.evidence.records import Evidence, GpuDevice
from watchdog.model import Observation, ProbeKind, Role, UnitState

# A batch line this recent is progress; SGLang prints one per prefill batch and every 40 decode
# steps while requests run, i.e. every second or two under load.
RECENT_BATCH_SECONDS = 30.0
# No batch line for this long is "no progress" (when work is pending).
STALE_BATCH_SECONDS = 60.0
# From SGLang 0.5.19 on, /v1/loads is republished every 50 ms by a live scheduler loop even while a
# PD stall keeps it busy; there an older timestamp means the loop itself is stuck (inside a
# collective, or a hung kernel launch). 0.5.16-0.5.18 do not republish during a PD stall, so their
# timestamp freezes while the loop is alive (docs/sglang.md §7.6): an old timestamp from them, or
# from an answer without a `version`, is not read as a stuck loop. A fresh one is alive everywhere.
LOADS_FROZEN_SECONDS = 5.0
LOADS_REFRESHED_WHILE_STALLED_FROM = (0, 5, 19)
_VERSION = re.compile(r"^v?(\d+)\.(\d+)\.(\d+)")
# A decode that started this long after prefill did not come up in the same co-restart: the
# watchdog's own co-restart starts decode as soon as prefill is ready, within ready_timeout.
DECODE_AFTER_PREFILL_SECONDS = 900.0
# When the detector itself saw decode come back alone (DECODE_ONLY_RESTART), a shorter gap will do,
# but not none: units started together (one systemd transaction at boot, a target, `systemctl
# restart` of both) start within a second or two of each other, in either order, while a decode
# restarted alone comes back only after its previous instance loaded a model, served and exited,
# i.e. far more than this. A degraded-bootstrap verdict comes from transfer failures, not from
# seeing a restart, so it gets the co-restart gap above.
DECODE_ALONE_MIN_GAP_SECONDS = 10.0
# Detector verdicts that say decode came back alone against a running prefill, or that the
# KV-transfer bootstrap state is degraded.
BOOTSTRAP_VERDICTS = frozenset({Verdict.DECODE_ONLY_RESTART, Verdict.DEGRADED_BOOTSTRAP})
# Detector verdicts that say a unit is down (or hung like one).
CRASH_VERDICTS = frozenset({Verdict.CRASH})


class IncidentKind(StrEnum):
    """What kind of wedge the evidence points to."""

    CRASH = "crash"
    ROUTER_WEDGE = "router_wedge"
    DEGRADED_BOOTSTRAP = "degraded_bootstrap"
    COLLECTIVE_HANG = "collective_hang"
    TRANSFER_STALL = "transfer_stall"
    OVERLOAD = "overload"
    UNCLASSIFIED = "unclassified"


@dataclass(frozen=True, slots=True)
class Classification:
    """The verdict on the evidence, and why, in sentences a person can check."""

    kind: IncidentKind
    reasoning: tuple[str, ...]
    ruled_out: tuple[str, ...]
    next_steps: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class GpuFinding:
    """What the GPUs of one role (or of the whole host) say."""

    label: str  # "decode GPUs (CUDA_VISIBLE_DEVICES=4,5)", "host GPUs"
    busy: bool | None
    description: str


@dataclass(frozen=True, slots=True)
class Signals:
    """The facts the classification rests on, each already phrased for the report."""

    verdict: str
    units_down: tuple[str, ...]
    units_up: tuple[str, ...]
    pending: tuple[str, ...]  # work waiting somewhere
    progress: tuple[str, ...]  # positive evidence that work moves
    no_progress: tuple[str, ...]  # evidence that it does not
    gpus: tuple[GpuFinding, ...]
    gpu_unavailable: str  # why there is no GPU reading ("" when there is one)
    failures: tuple[str, ...]  # transfer/bootstrap failures seen (counters, journal)
    decode_restart: str  # decode (re)started after prefill: the sentence, "" if not
    start_times: str  # both start times, for the record either way ("" when unknown)
    router_problems: tuple[str, ...]
    router_fine: tuple[str, ...]
    scheduler_frozen: tuple[str, ...]  # /v1/loads timestamp stale
    scheduler_alive: tuple[str, ...]
    drift: tuple[str, ...]

    @property
    def gpus_busy(self) -> tuple[GpuFinding, ...]:
        """Findings of busy GPUs."""
        return tuple(g for g in self.gpus if g.busy is True)

    @property
    def gpus_idle(self) -> bool:
        """True when there is a reading and every role's GPUs are idle."""
        return bool(self.gpus) and all(g.busy is False for g in self.gpus)


def _as_verdict(text: str) -> Verdict | None:
    """The detector's verdict named by `text` (any case), or None for anything else."""
    try:
        return Verdict(text.lower())
    except ValueError:
        return None


def _iso(unix: float) -> str:
    return datetime.fromtimestamp(unix, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _num(value: float | None) -> str:
    return "?" if value is None else f"{value:g}"


def _pending_work(observation: Observation) -> list[str]:
    out = []
    gauges = (
        (Role.PREFILL, "inflight_queue", "prefill inflight (KV transfer) queue"),
        (Role.PREFILL, "bootstrap_queue", "prefill bootstrap queue"),
        (Role.DECODE, "decode_prealloc_queue", "decode prealloc queue"),
        (Role.DECODE, "decode_transfer_queue", "decode transfer queue"),
        (Role.PREFILL, "running_reqs", "prefill running requests"),
        (Role.DECODE, "running_reqs", "decode running requests"),
        (Role.PREFILL, "queue_reqs", "prefill waiting requests"),
        (Role.DECODE, "queue_reqs", "decode waiting requests"),
        (Role.PREFILL, "http_requests_active", "prefill HTTP requests active"),
        (Role.DECODE, "http_requests_active", "decode HTTP requests active"),
    )
    for role, attr, label in gauges:
        snapshot = observation.metrics_for(role)
        value = getattr(snapshot, attr) if snapshot is not None and snapshot.ok else None
        if value:
            out.append(f"{label} {value:g}")
    for loads in observation.loads:
        if not loads.ok:
            continue
        for attr in (
            "prefill_inflight_queue_reqs",
            "prefill_bootstrap_queue_reqs",
            "decode_prealloc_queue_reqs",
            "decode_transfer_queue_reqs",
        ):
            value = getattr(loads, attr)
            if value:
                out.append(f"/v1/loads {attr} {value} on {loads.role}")
    if observation.probes_in_flight:
        out.append(
            f"{observation.probes_in_flight} probe(s) in flight, oldest "
            f"{_duration(observation.oldest_probe_in_flight_seconds)}"
        )
    return out


def _probe_facts(observation: Observation) -> tuple[list[str], list[str], list[str]]:
    """(router probes ok, router probes failed, direct worker probes ok) as sentences."""
    through_router = [
        p
        for p in observation.probes
        if p.kind in (ProbeKind.COMPLETION, ProbeKind.MULTIROUND) and p.target == "router"
    ]
    direct_ok = [
        f"a direct {p.kind} probe to {p.target} succeeded"
        for p in observation.probes
        if p.kind in (ProbeKind.COMPLETION, ProbeKind.MULTIROUND)
        and p.target in ("prefill", "decode")
        and p.ok
    ]
    ok = [p for p in through_router if p.ok]
    failed = [p for p in through_router if not p.ok]
    ok_lines = [f"{len(ok)} probe(s) through the router succeeded"] if ok else []
    failed_lines = []
    if failed:
        reasons: dict[str, int] = {}
        for p in failed:
            reasons[str(p.reason)] = reasons.get(str(p.reason), 0) + 1
        detail = ", ".join(f"{n}× {r}" for r, n in sorted(reasons.items()))
        failed_lines.append(f"{len(failed)} probe(s) through the router failed ({detail})")
    return ok_lines, failed_lines, direct_ok


def _stuck_since(observation: Observation) -> float | None:
    """When the oldest end-to-end probe still stuck (in flight, or failed this cycle) was sent."""
    starts = [p.started_at for p in observation.probes if not p.ok]
    if observation.probes_in_flight:
        starts.append(observation.at - observation.oldest_probe_in_flight_seconds)
    return min(starts, default=None)


def _batch_facts(evidence: Evidence, observation: Observation) -> tuple[list[str], list[str]]:
    progress, stale = [], []
    stuck_since = _stuck_since(observation)
    for unit in (*evidence.units_of(Role.PREFILL), *evidence.units_of(Role.DECODE)):
        role, who = unit.role, unit.label
        if unit.journal is None or not unit.journal.ok:
            continue
        age = unit.last_batch_age_seconds
        if age is not None and is_health_batch_line(unit.last_batch_line):
            # Evidence captured before health batches were left out: that line is not progress.
            age = None
        if age is None:
            if unit.journal.lines:
                stale.append(
                    f"no {who} batch line in the last {unit.journal.lines} journal lines "
                    "(/health's one-token batches aside)"
                )
        elif age >= STALE_BATCH_SECONDS:
            stale.append(f"no {who} batch line for {_duration(age)}")
        elif role is not Role.DECODE:
            # Not progress: during a transfer stall prefill keeps computing newly arrived prompts,
            # which then wait in its inflight queue (docs/sglang.md §1, §5); only decode delivers.
            continue
        elif (
            stuck_since is not None
            and unit.last_batch_at is not None
            and unit.last_batch_at < stuck_since
        ):
            # Decoded before the stuck probe was even sent: that says nothing about since then.
            stale.append(
                f"no {who} batch line since the oldest stuck probe was sent "
                f"(last one {_duration(age)} ago)"
            )
        elif age <= RECENT_BATCH_SECONDS:
            progress.append(f"last {who} batch line {_duration(age)} ago")
    return progress, stale


def _gpu_findings(evidence: Evidence) -> tuple[list[GpuFinding], str]:
    if evidence.remote_gpus:
        return _gpu_findings_by_host(evidence)
    reading = evidence.gpu
    if not reading.ok:
        return [], reading.detail or "GPU state unavailable"
    if not reading.devices:
        return [], f"{reading.source} reported no GPUs"
    findings: list[GpuFinding] = []
    for unit in (*evidence.units_of(Role.PREFILL), *evidence.units_of(Role.DECODE)):
        visible = unit.env("CUDA_VISIBLE_DEVICES")
        chosen = select_devices(reading.devices, visible)
        if chosen:
            label = f"{unit.label} GPUs (CUDA_VISIBLE_DEVICES={visible})"
            findings.append(_finding(label, chosen))
    if not findings:
        findings.append(_finding("host GPUs", reading.devices))
    return findings, ""


def _gpu_findings_by_host(evidence: Evidence) -> tuple[list[GpuFinding], str]:
    # A group over several hosts: each role's GPUs are those of the host its unit runs on.
    findings: list[GpuFinding] = []
    missing: list[str] = []
    for unit in (*evidence.units_of(Role.PREFILL), *evidence.units_of(Role.DECODE)):
        reading, host, who = evidence.gpu_of(unit), unit.host, unit.label
        if not reading.ok or not reading.devices:
            missing.append(f"{who} host {host}: {reading.detail or 'no GPUs reported'}")
            continue
        visible = unit.env("CUDA_VISIBLE_DEVICES")
        chosen = select_devices(reading.devices, visible) or reading.devices
        findings.append(_finding(f"{who} GPUs on {host} (CUDA_VISIBLE_DEVICES={visible})", chosen))
    return findings, "" if findings else "; ".join(missing)


def _finding(label: str, devices: tuple[GpuDevice, ...]) -> GpuFinding:
    return GpuFinding(label, gpu_busy(devices), describe_devices(devices))


def _failure_facts(observation: Observation, evidence: Evidence) -> list[str]:
    out = []
    for role in (Role.PREFILL, Role.DECODE):
        snapshot = observation.metrics_for(role)
        if snapshot is None or not snapshot.ok:
            continue
        if snapshot.transfer_failed:
            out.append(f"{role} num_transfer_failed_reqs_total {snapshot.transfer_failed:g}")
        if snapshot.bootstrap_failed:
            out.append(f"{role} num_bootstrap_failed_reqs_total {snapshot.bootstrap_failed:g}")
    for unit in evidence.units:
        for name, count in unit.journal_failures:
            if name in ("transfer_failed", "bootstrap_failed", "kvpoll_timeout"):
                out.append(f"{count} '{name}' line(s) in the {unit.role} journal")
    return out


def _start_facts(
    evidence: Evidence,
    observation: Observation,
    decode_after_prefill_seconds: float,
    detector_saw_decode_alone: bool,
) -> tuple[str, str]:
    """(decode-restarted sentence or "", start-times sentence or "")."""
    prefill = _unit_state(evidence, observation, Role.PREFILL)
    decode = _unit_state(evidence, observation, Role.DECODE)
    if prefill is None or decode is None or not (prefill[0] and decode[0]):
        return "", ""
    (p_start, p_restarts), (d_start, d_restarts) = prefill, decode
    gap = d_start - p_start
    if abs(gap) < 1:
        relation = "within a second of prefill"
    else:
        relation = f"{_duration(abs(gap))} {'after' if gap > 0 else 'before'} prefill"
    times = (
        f"prefill ExecMainStartTimestamp {_iso(p_start)}, decode {_iso(d_start)} "
        f"({relation}); NRestarts prefill {p_restarts}, decode {d_restarts}"
    )
    restarted = ""
    # The detector knows the watchdog's own co-restarts and its grace; when it reports a decode-only
    # restart, a decode start clearly after prefill's (not the same boot) is that restart. Without
    # it, only a gap longer than a co-restart can take counts.
    threshold = (
        DECODE_ALONE_MIN_GAP_SECONDS if detector_saw_decode_alone else decode_after_prefill_seconds
    )
    if d_start - p_start > threshold:
        restarted = (
            f"decode started {_duration(d_start - p_start)} after prefill "
            f"(prefill {_iso(p_start)}, decode {_iso(d_start)}): "
            "decode was restarted without prefill"
        )
    elif d_restarts > p_restarts:
        restarted = (
            f"systemd restarted decode {d_restarts} time(s) and prefill {p_restarts}: "
            "decode came back alone against a running prefill"
        )
    return restarted, times


def _unit_state(
    evidence: Evidence, observation: Observation, role: Role
) -> tuple[float, int] | None:
    # The first worker of each role: the decode-only restart the incident is about (1P1D).
    unit = next(iter(evidence.units_of(role)), None)
    state = (
        unit.state if unit is not None and unit.state is not None else observation.unit_of(role, 0)
    )
    if state is None or not state.ok:
        return None
    return state.exec_main_start_us / 1e6, state.n_restarts


def _units(evidence: Evidence, observation: Observation) -> tuple[list[str], list[str]]:
    down, up = [], []
    seen = {(u.role, u.worker): u for u in evidence.units}
    for state in _unit_states(evidence, observation):
        unit = seen.get((state.role, state.worker))
        who = unit.label if unit is not None else str(state.role)
        if state.active_state != "active" or state.main_pid <= 0:
            down.append(
                f"{who} unit {state.unit} is {state.active_state or '?'}"
                f"/{state.sub_state or '?'} (MainPID {state.main_pid})"
            )
        else:
            up.append(f"{who} {state.active_state}/{state.sub_state} (MainPID {state.main_pid})")
    return down, up


def _unit_states(evidence: Evidence, observation: Observation) -> list[UnitState]:
    """Every worker's readable unit state: the evidence's, else the cycle's observation."""
    states: dict[tuple[Role, int], UnitState] = {(u.role, u.worker): u for u in observation.units}
    for unit in evidence.units:
        if unit.state is not None:
            states[(unit.role, unit.worker)] = unit.state
    order = list(Role)  # prefill, decode, router: as reports list them
    ranked = sorted(states.items(), key=lambda item: (order.index(item[0][0]), item[0][1]))
    return [state for _, state in ranked if state.ok]


def _router_workers_count(body: str) -> int | None:
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if isinstance(data, dict):
        data = data.get("workers")
    return len(data) if isinstance(data, list) else None


def _router_facts(evidence: Evidence, observation: Observation) -> tuple[list[str], list[str]]:
    problems, fine = [], []
    router_metrics = observation.metrics_for(Role.ROUTER)
    if router_metrics is not None and router_metrics.ok:
        if router_metrics.circuit_breakers_open:
            problems.append(f"{router_metrics.circuit_breakers_open} circuit breaker(s) open")
        elif router_metrics.circuit_breakers_open == 0:
            fine.append("no circuit breaker open")
        if router_metrics.workers_unhealthy:
            problems.append(f"router marks {router_metrics.workers_unhealthy} worker(s) unhealthy")
        elif router_metrics.workers_unhealthy == 0:
            fine.append("router marks every worker healthy")
    workers_ok = all(
        (h := evidence.http_for(f"{role}_health")) is not None and h.status_code == 200
        for role in ("prefill", "decode")
    )
    readiness = evidence.http_for("router_readiness")
    if readiness is not None and readiness.ok:
        if readiness.status_code == 200:
            fine.append("router /readiness 200")
        elif workers_ok:
            problems.append(
                f"router /readiness {readiness.status_code} while both workers' /health are 200"
            )
    workers = evidence.http_for("router_workers")
    if workers is not None and workers.ok and workers.status_code == 200:
        count = _router_workers_count(workers.body)
        if count == 0:
            problems.append("router /workers lists no worker")
        elif count is not None:
            fine.append(f"router /workers lists {count} worker(s)")
    return problems, fine


def loads_refreshed_while_stalled(version: str | None) -> bool:
    """Whether SGLang `version` republishes /v1/loads while a PD stall keeps its loop busy."""
    match = _VERSION.match(version or "")
    if match is None:
        return False
    return tuple(int(part) for part in match.groups()) >= LOADS_REFRESHED_WHILE_STALLED_FROM


def _loads_facts(observation: Observation) -> tuple[list[str], list[str]]:
    frozen, alive = [], []
    for loads in observation.loads:
        if not loads.ok or loads.timestamp is None:
            continue
        age = max(0.0, loads.fetched_at - loads.timestamp)  # the two clocks may differ slightly
        if age > LOADS_FROZEN_SECONDS:
            if loads_refreshed_while_stalled(loads.version):
                frozen.append(
                    f"{loads.role} /v1/loads timestamp {_duration(age)} old on SGLang "
                    f"{loads.version}, which republishes it every 50 ms (loop stuck)"
                )
        else:
            alive.append(f"{loads.role} scheduler loop alive (/v1/loads {age:.1f} s old)")
    return frozen, alive


def gather_signals(
    evidence: Evidence,
    observation: Observation,
    verdict: str,
    *,
    decode_after_prefill_seconds: float = DECODE_AFTER_PREFILL_SECONDS,
) -> Signals:
    """Extract every fact the classification uses, phrased for the report."""
    down, up = _units(evidence, observation)
    router_ok, router_failed, direct_ok = _probe_facts(observation)
    batch_progress, batch_stale = _batch_facts(evidence, observation)
    gpus, gpu_why = _gpu_findings(evidence)
    decode_restart, start_times = _start_facts(
        evidence,
        observation,
        decode_after_prefill_seconds,
        _as_verdict(verdict) is Verdict.DECODE_ONLY_RESTART,
    )
    router_problems, router_fine = _router_facts(evidence, observation)
    frozen, alive = _loads_facts(observation)
    return Signals(
        verdict=verdict,
        units_down=tuple(down),
        units_up=tuple(up),
        pending=tuple(_pending_work(observation)),
        progress=tuple(batch_progress + router_ok + direct_ok),
        no_progress=tuple(batch_stale + router_failed),
        gpus=tuple(gpus),
        gpu_unavailable=gpu_why,
        failures=tuple(_failure_facts(observation, evidence)),
        decode_restart=decode_restart,
        start_times=start_times,
        router_problems=tuple(router_problems),
        router_fine=tuple(router_fine),
        scheduler_frozen=tuple(frozen),
        scheduler_alive=tuple(alive),
        drift=tuple(f.message for f in evidence.drift),
    )


def _join(items: tuple[str, ...] | list[str]) -> str:
    return "; ".join(items)


def _gpu_text(findings: tuple[GpuFinding, ...]) -> str:
    return "; ".join(f"{g.label}: {g.description}" for g in findings)


_NEXT_STEPS: dict[IncidentKind, tuple[str, ...]] = {
    IncidentKind.CRASH: (
        "Read the unit's journal around its exit (`journalctl -u UNIT -n 500`) for the exit reason "
        "(OOM, CUDA error, assertion).",
        "Check `systemctl status UNIT` for the exit code and signal, and dmesg for Xid errors.",
    ),
    IncidentKind.ROUTER_WEDGE: (
        "Compare a direct request to decode (with a bootstrap_room) with one through the router.",
        "Check the router's circuit breakers (`smg_worker_cb_state`) and `/workers` after the "
        "restart; consider --request-timeout-secs below the default 1800 s.",
    ),
    IncidentKind.DEGRADED_BOOTSTRAP: (
        "Find who restarted decode alone (systemd Restart=, an operator, another tool) and stop "
        "it: decode must never restart without prefill.",
        "After the co-restart, confirm num_transfer_failed_reqs_total stays flat and the prefill "
        "inflight queue drains to 0.",
    ),
    IncidentKind.COLLECTIVE_HANG: (
        "Look at the py-spy stacks (or take `py-spy dump --native`) for ranks waiting in NCCL.",
        "Check dmesg for Xid/NVLink errors and NCCL_* settings (NCCL_TIMEOUT, "
        "TORCH_NCCL_ASYNC_ERROR_HANDLING) in the captured environ.",
    ),
    IncidentKind.TRANSFER_STALL: (
        "Read the last Prefill batch #inflight-req and Decode batch #transfer-req in the journal "
        "excerpt: requests parked in KV transfer have no SGLang timeout.",
        "Check the transfer backend (NIXL/Mooncake/UCX) logs and the captured NIXL_/UCX_/MC_ "
        "environment; if the stall survives the co-restart, suspect a request-specific cause "
        "(long multi-round contexts, decode kernel settings) rather than bootstrap state.",
    ),
    IncidentKind.OVERLOAD: (
        "The group was progressing: review whether a restart was warranted (probe timeout vs. "
        "real latency, max_in_flight).",
        "Check queue depth, token usage and gen throughput in the metrics snapshot.",
    ),
    IncidentKind.UNCLASSIFIED: (
        "Read the evidence files by hand; note what was unavailable and add the missing signal.",
    ),
}


def classify(
    evidence: Evidence,
    observation: Observation,
    decision_verdict: str,
    *,
    decode_after_prefill_seconds: float = DECODE_AFTER_PREFILL_SECONDS,
) -> Classification:
    """The incident kind, the reasoning behind it, what was ruled out (with evidence), next steps.

    `decision_verdict` is the detector's verdict ("silent_stall", "decode_only_restart", ...): a
    hint, never the answer; the kind follows from the evidence. `decode_after_prefill_seconds` is
    how much later than prefill decode may start and still count as one co-restart.
    """
    s = gather_signals(
        evidence,
        observation,
        decision_verdict,
        decode_after_prefill_seconds=decode_after_prefill_seconds,
    )
    verdict = _as_verdict(decision_verdict)
    verdict_bootstrap = verdict in BOOTSTRAP_VERDICTS
    no_progress_known = bool(s.no_progress) or not s.progress
    worker_trouble = bool(s.failures or s.decode_restart or (s.pending and not s.progress))

    # Evaluated in order; the first that holds wins, the others go to ruled-out or stay open.
    candidates: list[tuple[IncidentKind, bool, list[str]]] = [
        (IncidentKind.CRASH, bool(s.units_down) or verdict in CRASH_VERDICTS, list(s.units_down)),
        (
            IncidentKind.ROUTER_WEDGE,
            bool(s.router_problems) and (bool(s.progress) or not worker_trouble),
            [*s.router_problems, *s.progress],
        ),
        (
            IncidentKind.DEGRADED_BOOTSTRAP,
            (bool(s.decode_restart) and (bool(s.failures) or verdict_bootstrap or bool(s.pending)))
            or (verdict_bootstrap and bool(s.failures)),
            [s.decode_restart, *s.failures] if s.decode_restart else list(s.failures),
        ),
        (
            IncidentKind.COLLECTIVE_HANG,
            bool(s.gpus_busy) and not s.progress,
            [f"{_gpu_text(s.gpus_busy)}", *s.no_progress, *s.scheduler_frozen],
        ),
        (
            IncidentKind.TRANSFER_STALL,
            bool(s.pending) and not s.progress and not s.gpus_busy,
            [*s.pending, *s.no_progress, *s.scheduler_alive],
        ),
        (
            IncidentKind.OVERLOAD,
            bool(s.progress) and bool(s.pending),
            [*s.progress, *s.pending],
        ),
    ]
    kind = next((k for k, holds, _ in candidates if holds), IncidentKind.UNCLASSIFIED)
    facts = next((f for k, holds, f in candidates if holds), [])

    reasoning = [f"decision verdict: {decision_verdict or 'none given'}"]
    reasoning += [f"{kind}: {fact}" for fact in facts if fact]
    # Kinds later in the order whose conditions also hold (a degraded bootstrap looks like a
    # transfer stall from outside): say so, and that the earlier kind explains more.
    reasoning += [
        f"the evidence also fits {other}; {kind} is preferred because it names the cause"
        for other, holds, _ in candidates
        if holds and other is not kind and other is not IncidentKind.OVERLOAD
    ]
    if kind is IncidentKind.TRANSFER_STALL:
        reasoning.append(
            "GPUs idle: "
            + (_gpu_text(s.gpus) if s.gpus else f"unknown ({s.gpu_unavailable})")
            + " — nothing computes while work waits"
        )
    if s.start_times:
        reasoning.append(f"unit start times: {s.start_times}")
    reasoning += [f"config drift: {d}" for d in s.drift]
    if kind is IncidentKind.UNCLASSIFIED:
        reasoning.append(
            "no kind fits: "
            + _join(
                [
                    f"pending work: {_join(s.pending) or 'none seen'}",
                    f"progress: {_join(s.progress) or 'none seen'}",
                    f"GPUs: {_gpu_text(s.gpus) or s.gpu_unavailable}",
                ]
            )
        )

    ruled_out, open_questions = _ruled_out(kind, s, no_progress_known, worker_trouble)
    reasoning += open_questions
    steps = list(_NEXT_STEPS[kind])
    if s.drift:
        steps.insert(0, "Fix the config drift first: the running process lacks expected settings.")
    unavailable = [i.name for i in evidence.unavailable]
    if unavailable:
        steps.append(f"Evidence not captured this time: {', '.join(unavailable)}.")
    return Classification(kind, tuple(reasoning), tuple(ruled_out), tuple(steps))


# One rule-out per incident kind: (ruled out with evidence, could not rule out), either or none.
_RuleOut = tuple[str | None, str | None]


def _not_crash(s: Signals, _no_progress_known: bool, _worker_trouble: bool) -> _RuleOut:
    if s.units_up and not s.units_down:
        return f"not a crash: {_join(s.units_up)}", None
    if not s.units_up:
        return None, "could not rule out a crash: systemd unit state unavailable"
    return None, None


def _not_router_wedge(s: Signals, _no_progress_known: bool, worker_trouble: bool) -> _RuleOut:
    if not s.router_problems:
        return f"not a router wedge: {_join(s.router_fine) or 'no router-side symptom seen'}", None
    if worker_trouble and not s.progress:
        return (
            f"not a router wedge: the router's symptoms ({_join(s.router_problems)}) follow "
            "from worker-side trouble with no worker progress"
        ), None
    return None, None


def _not_degraded_bootstrap(
    s: Signals, _no_progress_known: bool, _worker_trouble: bool
) -> _RuleOut:
    if s.start_times and not s.decode_restart:
        failures = _join(s.failures) or "no transfer/bootstrap failures"
        return (
            f"not a degraded bootstrap: decode was not restarted without prefill "
            f"({s.start_times}); {failures}"
        ), None
    if s.decode_restart and not s.failures:
        return None, f"decode restarted without prefill ({s.decode_restart}), no failures yet"
    if not s.start_times:
        return None, (
            "could not rule out a degraded bootstrap: unit start times unavailable"
            + (f"; {_join(s.failures)}" if s.failures else "")
        )
    return None, None


def _not_collective_hang(s: Signals, _no_progress_known: bool, _worker_trouble: bool) -> _RuleOut:
    if s.gpus and not s.gpus_busy and s.gpus_idle:
        extra = f"; {_join(s.scheduler_alive)}" if s.scheduler_alive else ""
        return f"not a collective hang: {_gpu_text(s.gpus)} (idle){extra}", None
    if s.gpus_busy and s.progress:
        return f"not a collective hang: GPUs busy but work progresses ({_join(s.progress)})", None
    if not s.gpus:
        return None, f"could not rule out a collective hang: GPU state {s.gpu_unavailable}"
    return None, f"could not rule out a collective hang: {_gpu_text(s.gpus)}"


def _not_transfer_stall(s: Signals, _no_progress_known: bool, _worker_trouble: bool) -> _RuleOut:
    if s.gpus_busy:
        return f"not a transfer stall: GPUs busy ({_gpu_text(s.gpus_busy)})", None
    if s.progress:
        return f"not a transfer stall: work progresses ({_join(s.progress)})", None
    if not s.pending:
        return "not a transfer stall: no pending work seen (queues empty, nothing in flight)", None
    return None, None


def _not_overload(s: Signals, no_progress_known: bool, _worker_trouble: bool) -> _RuleOut:
    if not s.progress and no_progress_known:
        evidence = _join(s.no_progress) or "no batch line, probe or counter shows progress"
        return f"not overload: no progress ({evidence})", None
    if s.gpus_idle:
        return f"not overload: GPUs idle ({_gpu_text(s.gpus)})", None
    if not s.pending:
        return "not overload: no queue or request waiting", None
    return None, None


# In the order the report lists them.
_RULE_OUTS = (
    (IncidentKind.CRASH, _not_crash),
    (IncidentKind.ROUTER_WEDGE, _not_router_wedge),
    (IncidentKind.DEGRADED_BOOTSTRAP, _not_degraded_bootstrap),
    (IncidentKind.COLLECTIVE_HANG, _not_collective_hang),
    (IncidentKind.TRANSFER_STALL, _not_transfer_stall),
    (IncidentKind.OVERLOAD, _not_overload),
)


def _ruled_out(
    kind: IncidentKind, s: Signals, no_progress_known: bool, worker_trouble: bool
) -> tuple[list[str], list[str]]:
    """(ruled out with evidence, could-not-rule-out sentences) for every kind but `kind`."""
    out: list[str] = []
    unsure: list[str] = []
    for other, rule_out in _RULE_OUTS:
        if other is kind:
            continue
        ruled, open_question = rule_out(s, no_progress_known, worker_trouble)
        out.extend([ruled] if ruled is not None else [])
        unsure.extend([open_question] if open_question is not None else [])
    return out, unsure
