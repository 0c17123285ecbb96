"""Verification as a soak: how far it got, and whether the group relapsed (docs/decisions.md).

A server can pass /health and a few requests after a forced restart and still hang after about a
hundred completions, so verification does not end at the first few passing probes: it lasts
until `soak_probes` probes passed and `soak_seconds` went by, and a relapse inside it fails the
attempt it verifies.
"""

from __future__ import annotations

from dataclasses import dataclass

from watchdog.config import GroupSection
from watchdog.decide.accounting import WindowFailures
from watchdog.decide.assess import assess
from watchdog.decide.fold import Facts
from watchdog.decide.reasons import known_flat_seconds, pending_reason, reason
from watchdog.decide.state import GroupState
from watchdog.model import Reason


@dataclass(frozen=True, slots=True)
class Soak:
    """Where a verification stands, from the co-restart to now."""

    started_at: float
    elapsed_seconds: float
    passes: int  # probes passed since the co-restart
    recovered_at: float | None  # verify_probes successes in a row first seen (the soak proper)
    failures: WindowFailures  # transfer/bootstrap failures since the co-restart
    decode_tokens: float  # decode tokens counted since the co-restart, ours included

    def held_long_enough(self, config: GroupSection) -> bool:
        """Enough passing probes over a long enough window: the soak passes (if no relapse)."""
        restart = config.restart
        return (
            self.recovered_at is not None
            and self.passes >= restart.soak_probes
            and self.elapsed_seconds >= restart.soak_seconds
        )

    def reason(self, mem: GroupState, config: GroupSection) -> Reason:
        """The `verification` reason: its earlier numbers, and the soak's added after them."""
        restart = config.restart
        need, timeout = restart.verify_probes, restart.verify_timeout_seconds
        successes = mem.readiness.verify_successes
        phase = "soaking" if self.recovered_at is not None else "coming back"
        return reason(
            "verification",
            f"{successes}/{need} consecutive probe successes, {self.elapsed_seconds:.0f}s of "
            f"{timeout:g}s; soak ({phase}): {self.passes}/{restart.soak_probes} probes passed, "
            f"{self.elapsed_seconds:.0f}s of {restart.soak_seconds:g}s, transfer failures "
            f"+{self.failures.net:g} net (raw +{self.failures.raw:g}), decode tokens "
            f"+{self.decode_tokens:g}",
            successes=successes,
            required=need,
            elapsed_seconds=self.elapsed_seconds,
            timeout_seconds=timeout,
            soak_phase=phase,
            soak_probes_passed=self.passes,
            soak_probes_required=restart.soak_probes,
            soak_seconds=self.elapsed_seconds,
            soak_seconds_required=restart.soak_seconds,
            soak_transfer_failures_net=self.failures.net,
            soak_transfer_failures_raw=self.failures.raw,
            soak_decode_tokens=self.decode_tokens,
        )


def relapse(mem: GroupState, facts: Facts, config: GroupSection, now: float) -> Reason | None:
    """Why the group relapsed inside the soak, or None: the stall verdict is back, probes failed
    `probe_failures` in a row, or decode's tokens were flat with work pending for
    `no_progress_seconds` (decode's progress as the detector judges it).

    Rising transfer failures fail verification from its first cycle on (handlers.verifying).
    Judged once the group came back (verify_probes successes in a row): before that, the
    probes failing is what `verify_timeout_seconds` waits out.
    """
    stall = config.stall
    failures = mem.probes.failures
    if failures >= stall.probe_failures:
        return reason(
            "relapse_probes_failing",
            f"{failures} probes failed in a row (probe_failures {stall.probe_failures})",
            consecutive=failures,
            threshold=stall.probe_failures,
        )
    assessment = assess(mem, facts, config, now)
    if assessment.act:
        first = assessment.reasons[0].message if assessment.reasons else ""
        return reason(
            "relapse_stall_verdict",
            f"the stall verdict is back: {assessment.verdict} ({first})",
            verdict=str(assessment.verdict),
        )
    flat = known_flat_seconds(mem)
    if facts.pending and flat is not None and flat >= stall.no_progress_seconds:
        return reason(
            "relapse_decode_flat",
            f"decode's tokens flat for {flat:.0f}s with work pending (no_progress_seconds "
            f"{stall.no_progress_seconds:g}; {pending_reason(facts).message})",
            flat_seconds=flat,
            no_progress_seconds=stall.no_progress_seconds,
        )
    return None


def relapsed(soak: Soak, cause: Reason) -> Reason:
    """The `relapse` reason: the same incident, with how far the soak had got."""
    return reason(
        "relapse",
        f"relapse during soak after {soak.passes} probes / {soak.elapsed_seconds:.0f} seconds: "
        f"{cause.message}",
        probes_passed=soak.passes,
        soak_seconds=soak.elapsed_seconds,
        cause=cause.code,
    )
