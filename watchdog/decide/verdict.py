"""What the detector concludes in a cycle, and which verdicts act or alert (docs/decisions.md)."""

from __future__ import annotations

from enum import StrEnum


class Verdict(StrEnum):
    """What the detector concluded this cycle; also the `kind` label of stalls_detected_total."""

    OK = "ok"
    WARMING_UP = "warming_up"
    FAILED_START = "failed_start"
    SILENT_STALL = "silent_stall"
    DEGRADED_BOOTSTRAP = "degraded_bootstrap"
    ROUTER_WEDGE = "router_wedge"  # router probes fail, direct PD probes pass: the router alone
    TRANSFER_FAILURES_RISING = "transfer_failures_rising"
    PINNED_REQUEST = "pinned_request"
    # One DP rank's pinned probes fail while its siblings pass: alerted, not acted on (a rank
    # whose queue is only long looks the same until per-rank progress is read).
    DP_RANK_WEDGED = "dp_rank_wedged"
    OVERLOADED = "overloaded"
    STALL_SUSPECTED = "stall_suspected"  # probes failing, counters flat, not yet for long enough
    BLIP = "blip"
    MONITORING_OUTAGE = "monitoring_outage"
    WORKER_UNHEALTHY = "worker_unhealthy"  # a worker's /health fails while its unit runs
    CRASH = "crash"
    UNIT_STOPPED = "unit_stopped"
    DECODE_ONLY_RESTART = "decode_only_restart"
    # A prefill restarted alone while its decodes kept running: the survivor rung restarts them,
    # then the router (docs/decisions.md, "Restart rungs").
    PREFILL_ONLY_RESTART = "prefill_only_restart"
    # Not once healthy since its units last started (a deploy or config error): paged, never
    # restarted (docs/decisions.md, "Never healthy").
    NEVER_HEALTHY = "never_healthy"
    RESTARTING = "restarting"
    VERIFYING = "verifying"
    VERIFICATION_PASSED = "verification_passed"
    VERIFICATION_FAILED = "verification_failed"
    BUDGET_EXHAUSTED = "budget_exhausted"
    HELD = "held"
    PAUSED = "paused"
    BACKOFF = "backoff"


# Verdicts that call for a co-restart (subject to budget and backoff).
ACT_VERDICTS = frozenset(
    {
        Verdict.SILENT_STALL,
        Verdict.DEGRADED_BOOTSTRAP,
        Verdict.ROUTER_WEDGE,
        Verdict.CRASH,
        Verdict.DECODE_ONLY_RESTART,
        Verdict.PREFILL_ONLY_RESTART,
        Verdict.FAILED_START,
        Verdict.VERIFICATION_FAILED,
    }
)
# Verdicts that tell an operator without acting (once per episode).
ALERT_VERDICTS = frozenset(
    {
        Verdict.TRANSFER_FAILURES_RISING,
        Verdict.PINNED_REQUEST,
        Verdict.DP_RANK_WEDGED,
        Verdict.MONITORING_OUTAGE,
        Verdict.WORKER_UNHEALTHY,
        Verdict.CRASH,
        Verdict.UNIT_STOPPED,
        Verdict.BACKOFF,
        Verdict.NEVER_HEALTHY,
    }
)
