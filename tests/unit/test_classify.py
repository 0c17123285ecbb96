"""Classification of a wedge from its evidence: kind, reasoning and ruled-out list, as tables."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest

from tests.unit.evidence_helpers import (
    NOW,
    evidence,
    gpu,
    http,
    metrics,
    observation,
    reading,
    unit_evidence,
    unit_state,
)
from watchdog.decide import Verdict
from watchdog.evidence.classify import (
    BOOTSTRAP_VERDICTS,
    CRASH_VERDICTS,
    IncidentKind,
    classify,
)
from watchdog.evidence.records import DriftFinding, DriftKind, Evidence, ItemStatus, UnitEvidence
from watchdog.model import (
    LoadsSnapshot,
    Observation,
    ProbeFailure,
    ProbeKind,
    ProbeResult,
    Role,
)

IDLE = reading(gpu(0, 165, index=0), gpu(0, 168, index=1))
BUSY = reading(gpu(100, 610, index=0), gpu(100, 598, index=1))


def _probe(ok: bool, reason: ProbeFailure = ProbeFailure.OK, target: str = "router") -> ProbeResult:
    return ProbeResult(ProbeKind.COMPLETION, target, ok, reason, NOW - 30, 20.0)


# What every /health prints on prefill (docs/sglang.md §7.5).
HEALTH_BATCH_LINE = (
    "Prefill batch, #new-seq: 1, #new-token: 1, #cached-token: 0, token usage: 0.01, "
    "#running-req: 0, #queue-req: 0, #bootstrap-req: 0, #inflight-req: 3"
)
STUCK_PROBES = (_probe(False, ProbeFailure.TIMEOUT_BEFORE_HEADERS),) * 3
PENDING = (
    metrics(Role.PREFILL, inflight_queue=3.0, http_requests_active=5.0),
    metrics(Role.DECODE, decode_transfer_queue=2.0, http_requests_active=5.0),
    metrics(Role.ROUTER, circuit_breakers_open=0, workers_unhealthy=0),
)


def _units(
    *,
    decode_age: float | None = 312.0,
    prefill_age: float | None = 300.0,
    prefill_started: float = NOW - 3600,
    decode_started: float = NOW - 3590,
    decode_restarts: int = 0,
    health_batch: bool = False,
    decode_active: str = "active",
    decode_env: tuple[tuple[str, str], ...] = (),
    prefill_env: tuple[tuple[str, str], ...] = (),
    failures: tuple[tuple[str, int], ...] = (),
) -> tuple[UnitEvidence, ...]:
    return (
        unit_evidence(
            Role.PREFILL,
            state=unit_state(Role.PREFILL, started_at=prefill_started, pid=100),
            batch_age=prefill_age,
            batch_line=HEALTH_BATCH_LINE if health_batch else None,
            environ=prefill_env,
        ),
        unit_evidence(
            Role.DECODE,
            state=unit_state(
                Role.DECODE,
                started_at=decode_started,
                pid=200,
                restarts=decode_restarts,
                active=decode_active,
            ),
            batch_age=decode_age,
            environ=decode_env,
            failures=failures,
        ),
        unit_evidence(Role.ROUTER, state=unit_state(Role.ROUTER, pid=300)),
    )


@dataclass
class Case:
    """One row of the classification table."""

    name: str
    evidence: Evidence
    observation: Observation
    verdict: str
    kind: IncidentKind
    reasoning: tuple[str, ...] = ()  # substrings that must appear in the reasoning
    ruled_out: tuple[str, ...] = ()  # substrings that must appear in the ruled-out list
    not_ruled_out: tuple[str, ...] = field(default=())  # prefixes that must NOT be ruled out


CASES = [
    Case(
        "transfer stall caught early: decode's last batch line predates the stuck probe",
        evidence(units=_units(decode_age=16.0, prefill_age=10.0), gpu_reading=IDLE),
        observation(
            metrics=(
                *PENDING[:2],
                metrics(Role.ROUTER, circuit_breakers_open=0, workers_unhealthy=2),
            ),
            probes_in_flight=2,
            oldest_probe_in_flight_seconds=10.0,
        ),
        "silent_stall",
        IncidentKind.TRANSFER_STALL,
        reasoning=("no decode batch line since the oldest stuck probe was sent",),
    ),
    Case(
        "transfer stall while prefill keeps computing new prompts: its fresh batch lines are not progress",
        evidence(units=_units(prefill_age=4.0), gpu_reading=IDLE),
        observation(metrics=PENDING, probes=STUCK_PROBES, probes_in_flight=2),
        "silent_stall",
        IncidentKind.TRANSFER_STALL,
        reasoning=("no decode batch line for 5 min",),
    ),
    Case(
        "transfer stall: work parked, nothing moves, GPUs idle",
        evidence(units=_units(), gpu_reading=IDLE),
        observation(metrics=PENDING, probes=STUCK_PROBES, probes_in_flight=2),
        "silent_stall",
        IncidentKind.TRANSFER_STALL,
        reasoning=("prefill inflight (KV transfer) queue 3", "no decode batch line for 5 min"),
        ruled_out=(
            "not a collective hang: host GPUs: GPU 0: 0 % util, 165 W of 1000 W",
            "not a crash: prefill active/running (MainPID 100)",
            "not a router wedge: no circuit breaker open",
            "not a degraded bootstrap: decode was not restarted without prefill",
            "not overload: no progress (no prefill batch line for 5 min",
        ),
    ),
    Case(
        "transfer stall with the GPU state unknown",
        evidence(units=_units()),
        observation(metrics=PENDING, probes=STUCK_PROBES),
        "silent_stall",
        IncidentKind.TRANSFER_STALL,
        reasoning=(
            "GPUs idle: unknown (nvidia-smi not found)",
            "could not rule out a collective hang: GPU state nvidia-smi not found",
        ),
        not_ruled_out=("not a collective hang",),
    ),
    Case(
        "collective hang: no progress while GPUs spin",
        evidence(units=_units(), gpu_reading=BUSY),
        observation(
            metrics=PENDING,
            probes=STUCK_PROBES,
            loads=(LoadsSnapshot(Role.DECODE, NOW, True, timestamp=NOW - 240, version="0.5.23"),),
        ),
        "silent_stall",
        IncidentKind.COLLECTIVE_HANG,
        reasoning=(
            "GPU 0: 100 % util",
            "decode /v1/loads timestamp 4 min old on SGLang 0.5.23, which republishes it every "
            "50 ms (loop stuck)",
        ),
        ruled_out=("not a transfer stall: GPUs busy", "not overload: no progress"),
    ),
    Case(
        "transfer stall: /health's one-token prefill batch lines are not progress",
        evidence(units=_units(prefill_age=2.0, health_batch=True), gpu_reading=IDLE),
        observation(metrics=PENDING, probes=STUCK_PROBES),
        "silent_stall",
        IncidentKind.TRANSFER_STALL,
        reasoning=("no prefill batch line in the last 1 journal lines (/health's one-token",),
        ruled_out=("not overload: no progress",),
    ),
    Case(
        "the incident: decode restarted 17 h after prefill, transfer failures",
        evidence(
            units=_units(prefill_started=NOW - 17 * 3600, decode_started=NOW - 300),
            gpu_reading=IDLE,
        ),
        observation(
            metrics=(
                metrics(Role.PREFILL, inflight_queue=17.0, transfer_failed=21.0),
                metrics(Role.DECODE, http_requests_active=4.0),
            ),
            probes=STUCK_PROBES,
        ),
        "silent_stall",
        IncidentKind.DEGRADED_BOOTSTRAP,
        reasoning=(
            "decode started 16.9 h after prefill",
            "prefill num_transfer_failed_reqs_total 21",
            "unit start times: prefill ExecMainStartTimestamp",
            "the evidence also fits transfer_stall; degraded_bootstrap is preferred",
        ),
        ruled_out=("not a collective hang", "not a crash"),
    ),
    Case(
        "decode-only restart reported by the detector, seconds after prefill",
        evidence(units=_units(prefill_started=NOW - 600, decode_started=NOW - 570)),
        observation(metrics=PENDING, probes=STUCK_PROBES),
        "decode_only_restart",
        IncidentKind.DEGRADED_BOOTSTRAP,
        reasoning=("decode started 30 s after prefill",),
    ),
    Case(
        "decode started within a co-restart window: not a decode-only restart",
        evidence(
            units=_units(prefill_started=NOW - 1200, decode_started=NOW - 700), gpu_reading=IDLE
        ),
        observation(metrics=PENDING, probes=STUCK_PROBES),
        "silent_stall",
        IncidentKind.TRANSFER_STALL,
        ruled_out=("not a degraded bootstrap: decode was not restarted without prefill (prefill",),
    ),
    Case(
        "systemd restarted decode alone (NRestarts) with failures in its journal",
        evidence(units=_units(decode_restarts=10, failures=(("transfer_failed", 8),))),
        observation(metrics=PENDING, probes=STUCK_PROBES),
        "silent_stall",
        IncidentKind.DEGRADED_BOOTSTRAP,
        reasoning=(
            "systemd restarted decode 10 time(s) and prefill 0",
            "8 'transfer_failed' line(s)",
        ),
    ),
    Case(
        "router wedge: workers progress, the router path fails, a breaker is open",
        evidence(units=_units(decode_age=3.0, prefill_age=4.0), gpu_reading=BUSY),
        observation(
            metrics=(metrics(Role.ROUTER, circuit_breakers_open=1, workers_unhealthy=0),),
            probes=STUCK_PROBES,
        ),
        "silent_stall",
        IncidentKind.ROUTER_WEDGE,
        reasoning=("1 circuit breaker(s) open", "last decode batch line 3 s ago"),
        ruled_out=("not a collective hang: GPUs busy but work progresses",),
    ),
    Case(
        "router wedge: /readiness 503 while both workers answer 200",
        evidence(
            units=_units(decode_age=None, prefill_age=None),
            http_answers=(
                http("prefill_health"),
                http("decode_health"),
                http("router_readiness", 503),
            ),
        ),
        observation(probes=STUCK_PROBES),
        "silent_stall",
        IncidentKind.ROUTER_WEDGE,
        reasoning=("router /readiness 503 while both workers' /health are 200",),
    ),
    Case(
        "router symptoms caused by workers: breaker open after transfer failures",
        evidence(
            units=_units(prefill_started=NOW - 17 * 3600, decode_started=NOW - 300),
            gpu_reading=IDLE,
        ),
        observation(
            metrics=(
                metrics(Role.PREFILL, inflight_queue=2.0, transfer_failed=9.0),
                metrics(Role.ROUTER, circuit_breakers_open=2),
            ),
            probes=STUCK_PROBES,
        ),
        "silent_stall",
        IncidentKind.DEGRADED_BOOTSTRAP,
        ruled_out=("not a router wedge: the router's symptoms (2 circuit breaker(s) open) follow",),
    ),
    Case(
        "overload: slow but progressing",
        evidence(units=_units(decode_age=2.0, prefill_age=1.0), gpu_reading=BUSY),
        observation(
            metrics=(
                metrics(Role.DECODE, queue_reqs=120.0, running_reqs=256.0),
                metrics(Role.ROUTER, circuit_breakers_open=0),
            ),
            probes=(_probe(False, ProbeFailure.TIMEOUT), _probe(True)),
        ),
        "silent_stall",
        IncidentKind.OVERLOAD,
        reasoning=("last decode batch line 2 s ago", "decode waiting requests 120"),
        ruled_out=("not a transfer stall: GPUs busy",),
    ),
    Case(
        "crash: decode is not running",
        evidence(units=_units(decode_active="failed")),
        observation(),
        "crash",
        IncidentKind.CRASH,
        reasoning=("decode unit sglang-dsv4-decode.service is failed/dead (MainPID 0)",),
    ),
    Case(
        "nothing fits: no pending work, no progress signal",
        evidence(units=_units(decode_age=None, prefill_age=None)),
        observation(),
        "silent_stall",
        IncidentKind.UNCLASSIFIED,
        reasoning=("no kind fits: pending work: none seen",),
        ruled_out=("not a transfer stall: no pending work seen",),
    ),
    Case(
        "per-role GPUs: prefill GPUs spin while decode GPUs idle",
        evidence(
            units=_units(
                prefill_env=(("CUDA_VISIBLE_DEVICES", "0"),),
                decode_env=(("CUDA_VISIBLE_DEVICES", "1"),),
            ),
            gpu_reading=reading(gpu(100, 700, index=0), gpu(0, 165, index=1)),
        ),
        observation(metrics=PENDING, probes=STUCK_PROBES),
        "silent_stall",
        IncidentKind.COLLECTIVE_HANG,
        reasoning=("prefill GPUs (CUDA_VISIBLE_DEVICES=0): GPU 0: 100 % util",),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_classification_table(case: Case) -> None:
    """Each scenario yields its kind, cites its evidence and rules out the others with evidence."""
    result = classify(case.evidence, case.observation, case.verdict)
    text = "\n".join(result.reasoning)
    ruled = "\n".join(result.ruled_out)
    assert result.kind is case.kind, f"{result.kind}\n{text}\n--\n{ruled}"
    for expected in case.reasoning:
        assert expected in text, f"{expected!r} not in reasoning:\n{text}"
    for expected in case.ruled_out:
        assert expected in ruled, f"{expected!r} not in ruled out:\n{ruled}"
    for prefix in case.not_ruled_out:
        assert not any(r.startswith(prefix) for r in result.ruled_out)
    assert not any(r.startswith(f"not {case.kind}") for r in result.ruled_out)
    assert result.next_steps


def test_the_verdict_is_always_cited() -> None:
    """The detector's verdict is the first line of the reasoning."""
    result = classify(evidence(), observation(), "silent_stall")
    assert result.reasoning[0] == "decision verdict: silent_stall"


def test_drift_leads_the_next_steps() -> None:
    """Config drift appears in the reasoning and first among the next steps."""
    drift = DriftFinding(
        "sglang-dsv4-decode.service",
        DriftKind.CMDLINE_MISSING,
        "--disable-overlap-schedule",
        None,
        "sglang-dsv4-decode.service: '--disable-overlap-schedule' is not in the running "
        "process's cmdline",
    )
    units = list(_units())
    units[1] = dataclasses.replace(units[1], drift=(drift,))
    ev = evidence(units=tuple(units), gpu_reading=IDLE)
    result = classify(ev, observation(metrics=PENDING, probes=STUCK_PROBES), "silent_stall")
    assert any("config drift" in line and "--disable-overlap" in line for line in result.reasoning)
    assert result.next_steps[0].startswith("Fix the config drift first")


def test_unavailable_items_are_named_in_next_steps() -> None:
    """Evidence that could not be captured is listed so the reader knows what is missing."""
    ev = evidence(items=(ItemStatus("journal:decode", False, "no journal files were found"),))
    result = classify(ev, observation(), "silent_stall")
    assert result.next_steps[-1] == "Evidence not captured this time: journal:decode."


def test_verdict_hints_are_named_detector_verdicts() -> None:
    """Only the detector's own verdicts hint: a string that merely contains "crash" does not."""
    assert {Verdict.DECODE_ONLY_RESTART, Verdict.DEGRADED_BOOTSTRAP} == BOOTSTRAP_VERDICTS
    assert {Verdict.CRASH} == CRASH_VERDICTS
    ev, obs = evidence(), observation()
    assert classify(ev, obs, "crash").kind is IncidentKind.CRASH
    assert classify(ev, obs, "not_a_crash").kind == classify(ev, obs, "ok").kind


@pytest.mark.parametrize("verdict", ["decode_only_restart", "degraded_bootstrap", "silent_stall"])
@pytest.mark.parametrize("decode_after", [0.3, -0.3])
def test_units_started_together_do_not_blame_decode(verdict: str, decode_after: float) -> None:
    """Prefill and decode started 0.3 s apart (a normal boot, either order): whatever the verdict,
    decode is not reported as restarted without prefill."""
    units = _units(prefill_started=NOW - 3600, decode_started=NOW - 3600 + decode_after)
    obs = observation(
        metrics=(
            metrics(Role.PREFILL, inflight_queue=3.0, transfer_failed=6.0),
            metrics(Role.DECODE, http_requests_active=4.0),
        ),
        probes=STUCK_PROBES,
    )
    result = classify(evidence(units=units, gpu_reading=IDLE), obs, verdict)
    text = "\n".join(result.reasoning)
    assert "restarted without prefill" not in text
    assert "within a second of prefill" in text


def test_decode_alone_needs_more_than_a_boot_gap_even_when_the_detector_says_so() -> None:
    """With the detector's decode-only verdict, 5 s is still one boot; 30 s is a restart."""
    obs = observation(metrics=PENDING, probes=STUCK_PROBES)
    together = _units(prefill_started=NOW - 600, decode_started=NOW - 595)
    apart = _units(prefill_started=NOW - 600, decode_started=NOW - 570)
    assert "restarted without prefill" not in "\n".join(
        classify(evidence(units=together), obs, "decode_only_restart").reasoning
    )
    assert "decode was restarted without prefill" in "\n".join(
        classify(evidence(units=apart), obs, "decode_only_restart").reasoning
    )


@pytest.mark.parametrize(
    ("version", "stuck"),
    [("0.5.23", True), ("0.5.19", True), ("0.5.18", False), ("0.5.16", False), (None, False)],
)
def test_a_frozen_loads_timestamp_means_a_stuck_loop_only_where_it_is_republished(
    version: str | None, stuck: bool
) -> None:
    """0.5.19+ republishes /v1/loads every 50 ms while stalled; 0.5.16-0.5.18 freeze it while the
    loop lives, and an answer without a version proves nothing either."""
    loads = LoadsSnapshot(Role.DECODE, NOW, True, timestamp=NOW - 240, version=version)
    obs = observation(metrics=PENDING, probes=STUCK_PROBES, loads=(loads,))
    result = classify(evidence(units=_units(), gpu_reading=BUSY), obs, "silent_stall")
    assert ("loop stuck" in "\n".join(result.reasoning)) is stuck


def test_a_fresh_loads_timestamp_shows_a_live_loop_on_any_version() -> None:
    """A timestamp under a few seconds old is a live loop, whatever the version says."""
    loads = LoadsSnapshot(Role.DECODE, NOW, True, timestamp=NOW - 0.5, version="0.5.17")
    obs = observation(metrics=PENDING, probes=STUCK_PROBES, loads=(loads,))
    result = classify(evidence(units=_units(), gpu_reading=IDLE), obs, "silent_stall")
    assert "decode scheduler loop alive" in "\n".join(result.reasoning)
