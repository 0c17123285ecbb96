"""Verification as a soak: enough passing probes over a long enough window, no relapse inside it.

docs/decisions.md, "Verification is a soak": a relapse inside the soak is the same incident, a
failed attempt of the same streak (backoff, budget, held), reported with how far the soak got.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from tests.unit.builders import Harness, group_config
from tests.unit.evidence_helpers import NOW, evidence
from watchdog.decide import Decision, Verdict
from watchdog.evidence.incident import IncidentStore
from watchdog.model import Action, Reason, State
from watchdog.run.cycle import soak_fields

VERIFY_PROBES = 3
SOAK_PROBES = 20
SOAK_SECONDS = 120.0  # 24 cycles of 5 s: the window, not the probe count, ends this soak
CYCLES_TO_PASS = int(SOAK_SECONDS // 5)


def soaking(**restart: Any) -> Harness:
    """A group co-restarted for a silent stall, its verification begun."""
    settings = {
        "verify_probes": VERIFY_PROBES,
        "soak_probes": SOAK_PROBES,
        "soak_seconds": SOAK_SECONDS,
        "backoff_seconds": 60,
        **restart,
    }
    h = Harness(config=group_config(restart=settings))
    h.warm()
    for _ in range(20):
        if h.stall().action is Action.CO_RESTART:
            break
    h.restarted()
    h.stack.http_active = 0.0  # the new processes hold none of the stalled requests
    return h


def reason_of(decision: Decision, code: str) -> Reason:
    """The first reason of a decision with the given code."""
    return next(r for r in decision.reasons if r.code == code)


def values(decision: Decision, code: str) -> dict[str, float | str]:
    """The values of a decision's reason with the given code."""
    return dict(reason_of(decision, code).values)


def test_a_soak_passes_only_after_its_probes_and_its_window() -> None:
    """A soak passes only after both its probe count and its window, not at the first passes."""
    h = soaking()
    came_back = h.steps(VERIFY_PROBES, (True,))
    # Before the soak, this was verification_passed.
    assert (came_back.verdict, came_back.state.state) == (Verdict.VERIFYING, State.VERIFYING)
    assert came_back.state.readiness.recovered_at is not None
    h.steps(CYCLES_TO_PASS - VERIFY_PROBES - 1, (True,))
    assert set(h.verdicts[-(CYCLES_TO_PASS - 1) :]) == {"verifying"}
    passed = h.step((True,))
    assert (passed.verdict, passed.state.state) == (Verdict.VERIFICATION_PASSED, State.HEALTHY)
    soak = values(passed, "verification")
    assert soak["soak_probes_passed"] == CYCLES_TO_PASS >= SOAK_PROBES
    assert float(soak["soak_seconds"]) >= SOAK_SECONDS
    assert soak["soak_transfer_failures_net"] == 0
    assert float(soak["soak_decode_tokens"]) > 0
    assert soak["successes"] == CYCLES_TO_PASS  # the earlier fields stay
    assert passed.state.budget.consecutive_failures == 0
    assert h.actions.count(Action.CO_RESTART) == 1


def test_the_probe_count_holds_a_soak_whose_window_is_over() -> None:
    """soak_seconds passed but fewer than soak_probes probes passed: still soaking."""
    h = soaking(soak_seconds=10.0)
    h.steps(VERIFY_PROBES, (True,))
    h.steps(10, ())  # nothing finishes, nothing pending: idle by right, no relapse
    assert h.verdicts[-1] == "verifying"
    passed = h.steps(SOAK_PROBES - VERIFY_PROBES, (True,))
    assert passed.verdict is Verdict.VERIFICATION_PASSED


@pytest.mark.parametrize("passed_first", [VERIFY_PROBES, 10])
def test_a_stall_returning_inside_the_soak_is_a_relapse_of_the_same_incident(
    passed_first: int,
) -> None:
    """A stall back inside the soak is a relapse of the same incident, saying how far it got."""
    h = soaking()
    h.steps(passed_first, (True,))
    for _ in range(20):
        failed = h.stall()
        if failed.verdict is not Verdict.VERIFYING:
            break
    assert (failed.verdict, failed.action) == (Verdict.VERIFICATION_FAILED, Action.ALERT)
    relapse = reason_of(failed, "relapse")
    assert relapse.message.startswith(f"relapse during soak after {passed_first} probes / ")
    assert dict(relapse.values)["probes_passed"] == passed_first
    assert dict(relapse.values)["cause"] == "relapse_probes_failing"
    # Counted as a failed attempt of the same streak: stalled, backing off, no new episode.
    assert failed.state.state is State.STALLED
    assert failed.state.budget.consecutive_failures == 1
    assert failed.state.budget.backoff_until > h.stack.now
    assert h.actions.count(Action.CO_RESTART) == 1
    fields = soak_fields(failed)
    assert fields["relapse"] == relapse.message
    assert fields["soak_probes_passed"] == passed_first
    assert fields["relapse_cause"] == "relapse_probes_failing"


def test_the_next_attempt_after_a_relapse_continues_the_streak_and_ends_held() -> None:
    """Each co-restart comes back and relapses: failed attempts, backoff, then held."""
    h = soaking(max_restarts=2, backoff_seconds=10)
    for _ in range(2):
        h.steps(VERIFY_PROBES + 2, (True,))  # came back; the soak begins
        decision = h.stall()
        for _ in range(50):
            if decision.action is Action.CO_RESTART or decision.state.state is State.HELD:
                break
            decision = h.stall()  # the relapse, then the backoff, then the next attempt
        if decision.action is Action.CO_RESTART:
            h.restarted()
    assert h.state is not None
    assert h.state.state is State.HELD
    assert h.actions.count(Action.CO_RESTART) == 2
    relapses = [d for d in h.decisions if any(r.code == "relapse" for r in d.reasons)]
    assert [d.verdict for d in relapses] == [Verdict.VERIFICATION_FAILED] * 2


def test_transfer_failures_rising_inside_the_soak_are_a_relapse() -> None:
    """A new transfer failure inside the soak is a relapse, with its cause."""
    h = soaking()
    h.steps(VERIFY_PROBES + 2, (True,))
    h.stack.fail_transfers(1)
    failed = h.step((True,))
    assert failed.verdict is Verdict.VERIFICATION_FAILED
    assert "relapse" in [r.code for r in failed.reasons]
    assert values(failed, "relapse")["cause"] == "new_transfer_failures"
    assert values(failed, "verification")["soak_transfer_failures_net"] == 1


def test_transfer_failures_before_the_group_came_back_fail_as_before() -> None:
    """A transfer failure before the group came back fails verification as before the soak."""
    h = soaking()
    h.step((True,))
    h.stack.fail_transfers(1)
    failed = h.step((True,))
    assert failed.verdict is Verdict.VERIFICATION_FAILED
    assert [r.code for r in failed.reasons][:1] == ["new_transfer_failures"]


def test_decode_tokens_flat_with_work_pending_inside_the_soak_are_a_relapse() -> None:
    """Probes hang in flight (none fails yet) while decode's tokens stay flat: decode stopped."""
    h = soaking()
    h.steps(VERIFY_PROBES, (True,))
    for _ in range(30):
        failed = h.step((), progress=False, in_flight=4, oldest_in_flight_seconds=1.0)
        if failed.verdict is not Verdict.VERIFYING:
            break
    assert failed.verdict is Verdict.VERIFICATION_FAILED
    assert values(failed, "relapse")["cause"] == "relapse_decode_flat"


def test_a_soak_that_never_gathers_its_probes_times_out() -> None:
    """A soak that never gathers its probes fails at the verify timeout instead of waiting on."""
    h = soaking()
    h.steps(VERIFY_PROBES, (True,))
    for _ in range(200):
        decision = h.step(())  # nothing finishes, nothing pending
        if decision.verdict is not Verdict.VERIFYING:
            break
    assert decision.verdict is Verdict.VERIFICATION_FAILED
    assert "soak_timeout" in [r.code for r in decision.reasons]


def test_the_group_not_coming_back_is_a_verify_timeout_not_a_relapse() -> None:
    """A group that never comes back is a verify timeout, not a relapse."""
    h = soaking()
    for _ in range(200):
        decision = h.stall()
        if decision.verdict is not Verdict.VERIFYING:
            break
    assert decision.verdict is Verdict.VERIFICATION_FAILED
    codes = [r.code for r in decision.reasons]
    assert "verify_timeout" in codes
    assert "relapse" not in codes


def test_soak_probes_that_cannot_fit_the_soak_are_refused() -> None:
    """Soak probes that cannot fit inside the soak window are refused at config time."""
    with pytest.raises(ValidationError, match="take longer than the soak may last"):
        group_config(
            restart={"soak_probes": 200, "soak_seconds": 600, "verify_timeout_seconds": 300}
        )


def test_the_shipped_defaults_soak_across_a_hundred_requests() -> None:
    """At the shipped probe period the soak lasts at least 100 probes and 500 s."""
    config = group_config()
    defaults = type(config.restart)()
    assert defaults.soak_probes >= 100
    assert defaults.soak_seconds / config.probe.period_seconds >= 100


def test_the_incident_report_tells_the_relapse_and_the_soak(tmp_path: Path) -> None:
    """The incident report tells the relapse and how far the soak got."""
    h = soaking()
    h.steps(6, (True,))
    failed = h.stall(10)
    failed = next(d for d in h.decisions if d.verdict is Verdict.VERIFICATION_FAILED)
    store = IncidentStore(tmp_path / "state", keep=50, max_mib=200, clock=lambda: NOW)
    incident = store.open_incident(
        group="g", evidence=evidence(), decision_reasons=(), now=NOW, verdict="silent_stall"
    )
    detail = "; ".join(r.message for r in failed.reasons)
    store.record_verification(incident, False, detail, NOW + 60, soak_fields(failed))
    summary = json.loads((incident.path / "summary.json").read_text())
    assert summary["verification"]["soak"]["soak_probes_passed"] == 6
    report = (incident.path / "report.md").read_text()
    assert "relapse during soak after 6 probes / " in report
    assert "Soak: 6 of 20 probes passed over " in report
