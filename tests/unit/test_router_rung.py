"""The router rung: router probes failing while direct PD probes pass restart the router alone.

Anything else that acts (a transfer stall, a failing pair) keeps the full co-restart, and a
router-only restart that did not help escalates to the full co-restart (README "Restart rungs").
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import structlog

from tests.unit import configs
from tests.unit.builders import Harness, Stack, group_config
from tests.unit.test_detector_workers import group_2p2d
from watchdog.act.plan import build_plan, format_outcome, format_plan, plan_as_dict
from watchdog.cli import main
from watchdog.decide import Decision, after_restart
from watchdog.decide.assess import direct_reason
from watchdog.decide.verdict import ACT_VERDICTS, Verdict
from watchdog.errors import EXIT_OK
from watchdog.model import (
    Action,
    ProbeFailure,
    ProbeKind,
    ProbeResult,
    RestartOutcome,
    Role,
    Rung,
    State,
    StepResult,
)
from watchdog.pairs import Pair, pair_name, pairs


def direct(ok: bool, *, at: float, prefill: int = 0, decode: int = 0) -> ProbeResult:
    """A direct PD probe of one pair that ended at `at`."""
    return ProbeResult(
        kind=ProbeKind.DIRECT,
        target="decode",
        ok=ok,
        reason=ProbeFailure.OK if ok else ProbeFailure.TIMEOUT_BEFORE_HEADERS,
        started_at=at - 0.3,
        duration_seconds=0.3,
        tokens=4 if ok else 0,
        worker=decode,
        peer=prefill,
        abort_sent=not ok,
    )


def router_failed(at: float) -> ProbeResult:
    """A router probe that timed out (and was aborted on the workers)."""
    return ProbeResult(
        kind=ProbeKind.COMPLETION,
        target="router",
        ok=False,
        reason=ProbeFailure.TIMEOUT_BEFORE_HEADERS,
        started_at=at - 20.0,
        duration_seconds=20.0,
    )


def wedged_cycle(h: Harness, *, direct_ok: bool | None = True, pending: float = 0.0) -> Decision:
    """One cycle of a wedged router: its probe fails; direct probes pass (or fail, or none ran);
    the workers hold `pending` requests in their hand-off queues."""
    now = h.stack.now + h.stack.cycle_seconds
    probes: list[ProbeResult] = [router_failed(now - 0.2)]
    if direct_ok is not None:
        probes += [
            direct(direct_ok, at=now - 0.1, prefill=p.prefill, decode=p.decode)
            for p in pairs(h.config)
        ]
    h.stack.inflight_queue = pending
    h.stack.transfer_queue = pending
    return h.step(probes, progress=False, in_flight=2)


def until_action(h: Harness, cycles: int = 30, **kwargs: object) -> Decision:
    """Wedged cycles until the detector acts (or alerts on verification); fails if it never does."""
    for _ in range(cycles):
        decision = wedged_cycle(h, **kwargs)  # type: ignore[arg-type]
        if decision.action is Action.CO_RESTART:
            return decision
    raise AssertionError(f"no co_restart in {cycles} cycles: {h.verdicts}")


def test_router_wedge_is_an_act_verdict() -> None:
    """A router wedge is a verdict that acts."""
    assert Verdict.ROUTER_WEDGE in ACT_VERDICTS


def test_router_failing_and_direct_passing_restarts_the_router_alone() -> None:
    """Router probes failing while direct PD probes pass restart the router alone."""
    h = Harness().warm()
    decision = until_action(h)
    assert decision.verdict is Verdict.ROUTER_WEDGE, h.verdicts
    assert decision.rung is Rung.ROUTER
    codes = [r.code for r in decision.reasons]
    assert "router_wedge" in codes
    assert "rung" in codes
    # Never a silent stall on the way: the router rung is judged first.
    assert "silent_stall" not in h.verdicts
    plan = build_plan(h.config, str(decision.verdict), rung=decision.rung)
    assert [s.role for s in plan.steps] == [Role.ROUTER]


def test_the_router_rung_waits_for_no_progress_seconds_of_failing_probes() -> None:
    """The router rung waits for no_progress_seconds of failing probes, like any stall."""
    h = Harness().warm()
    first = len(h.decisions)
    decision = until_action(h)
    cycles = len(h.decisions) - first
    stall = h.config.stall
    # The run is dated from the first failed probe's start (a probe timeout before it counted).
    seconds = cycles * h.stack.cycle_seconds + h.config.probe.timeout_seconds
    assert seconds >= stall.no_progress_seconds, (cycles, decision)
    assert cycles >= stall.probe_failures


def test_a_flat_clock_older_than_the_failing_run_does_not_beat_the_router_rung() -> None:
    """The flat clock starts at the last probe that passed; the failing run at the first failed
    probe's start, later. Every pair serving directly holds the verdict until the router rung's
    own clock runs out: never a full co-restart of a wedged router in between (a busy machine
    made exactly that race)."""
    h = Harness().warm()
    # The probes started after the wedge hang (in flight, nothing finishes) for 20 s, so the
    # flat clock runs from the warm cycle, 5 s before the failing run's first probe started.
    h.steps(4, (), progress=False, in_flight=2)
    decision = until_action(h)
    assert decision.verdict is Verdict.ROUTER_WEDGE, h.verdicts
    assert "silent_stall" not in h.verdicts
    held = [d for d in h.decisions if "router_suspected" in [r.code for r in d.reasons]]
    assert held, h.verdicts  # the race was really run: a cycle had the flat clock out first
    assert all(d.verdict is Verdict.STALL_SUSPECTED for d in held)


def test_direct_probe_tokens_are_not_progress() -> None:
    """The direct probes' own tokens are ours: they neither reset the flat clock nor make the
    router wedge look like overload."""
    h = Harness().warm()
    for _ in range(30):
        h.stack.advance(requests=1, tokens=4)  # one direct probe, 4 tokens, per cycle
        decision = wedged_cycle(h)
        if decision.action is Action.CO_RESTART:
            break
    assert decision.verdict is Verdict.ROUTER_WEDGE, h.verdicts
    assert "overloaded" not in h.verdicts


def test_transfer_stall_fails_direct_probes_too_and_takes_the_full_co_restart() -> None:
    """A transfer stall fails the direct probes too and takes the full co-restart."""
    h = Harness().warm()
    decision = until_action(h, direct_ok=False, pending=2.0)
    assert decision.verdict is Verdict.SILENT_STALL, h.verdicts
    assert decision.rung is Rung.FULL
    failed = next(r for r in decision.reasons if r.code == "direct_probe_failed")
    assert "prefill+decode" in failed.message
    assert "rung" not in [r.code for r in decision.reasons]  # the plain rung reads as before


def test_direct_passing_with_worker_queues_full_is_not_the_router() -> None:
    """Direct probes passing while worker queues hold work is a worker stall, not the router."""
    h = Harness().warm()
    decision = until_action(h, direct_ok=True, pending=3.0)
    assert decision.verdict is Verdict.SILENT_STALL, h.verdicts
    assert decision.rung is Rung.FULL


def test_one_request_of_our_own_direct_round_in_a_queue_is_not_an_overload() -> None:
    """A queue gauge showing one request (a direct probe of ours, or the last stats report's
    count of one) while every pair passes is still the router: seen on a loaded machine, where
    the stale gauge made a wedged router a full co-restart."""
    h = Harness().warm()
    decision = until_action(h, direct_ok=True, pending=1.0)
    assert decision.verdict is Verdict.ROUTER_WEDGE, h.verdicts
    assert "silent_stall" not in h.verdicts


def test_without_direct_probes_the_verdict_is_as_before() -> None:
    """Without direct probe results the verdict is the plain silent stall, as before."""
    h = Harness().warm()
    decision = until_action(h, direct_ok=None)
    assert decision.verdict is Verdict.SILENT_STALL, h.verdicts
    assert decision.rung is Rung.FULL
    assert "router_wedge" not in [r.code for r in decision.reasons]


def test_unhealthy_worker_is_not_a_router_wedge() -> None:
    """An unhealthy worker is never blamed on the router, whatever the direct probes say."""
    h = Harness().warm()
    for _ in range(12):
        now = h.stack.now + h.stack.cycle_seconds
        probes = [router_failed(now - 0.2), direct(True, at=now - 0.1)]
        decision = h.step(probes, progress=False, in_flight=2, health_ok={Role.DECODE: False})
        assert decision.verdict is not Verdict.ROUTER_WEDGE, h.verdicts


def test_one_failing_pair_of_four_is_not_the_router_and_is_named() -> None:
    """One failing pair of four is a worker fault, not the router, and the reason names it."""
    config = group_2p2d()
    h = Harness(config=config)
    h.warm()
    for _ in range(12):
        now = h.stack.now + h.stack.cycle_seconds
        probes = [router_failed(now - 0.2)] + [
            direct(p != Pair(1, 0), at=now - 0.1, prefill=p.prefill, decode=p.decode)
            for p in pairs(config)
        ]
        decision = h.step(probes, progress=False, in_flight=2)
        assert decision.verdict is not Verdict.ROUTER_WEDGE, h.verdicts
    assert h.state is not None
    failed = direct_reason(h.state, config)
    assert failed is not None
    assert "prefill#2+decode#1" in failed.message
    assert dict(failed.values)["pairs"] == "prefill#2+decode#1"
    assert pair_name(config, Pair(1, 0)) == "prefill#2+decode#1"


def test_every_pair_must_pass_before_the_router_is_blamed() -> None:
    """Direct probes of only some pairs (a round cut short) do not localise anything."""
    config = group_2p2d()
    h = Harness(config=config)
    h.warm()
    for _ in range(30):
        now = h.stack.now + h.stack.cycle_seconds
        probes = [router_failed(now - 0.2), direct(True, at=now - 0.1)]  # pair (0, 0) only
        decision = h.step(probes, progress=False, in_flight=2)
        assert decision.verdict is not Verdict.ROUTER_WEDGE
        if decision.action is Action.CO_RESTART:
            break
    assert decision.rung is Rung.FULL


def test_direct_passes_from_before_the_failing_run_do_not_count() -> None:
    """A direct pass from before the router began failing does not vouch for the workers now."""
    h = Harness().warm()
    # One direct pass long before the router began failing; none since.
    h.step([direct(True, at=h.stack.now + 4.9)])
    for _ in range(10):
        h.step((True,))
    decision = until_action(h, direct_ok=None)
    assert decision.verdict is Verdict.SILENT_STALL, h.verdicts


def _outcome(decision: Decision, h: Harness, ok: bool = True) -> RestartOutcome:
    plan = build_plan(h.config, str(decision.verdict), rung=decision.rung)
    steps = tuple(StepResult(role=s.role, unit=s.unit, ok=ok, phase="ready") for s in plan.steps)
    now = h.stack.now
    return RestartOutcome(plan, ok, False, steps, now, now)


def test_router_only_restart_that_does_not_help_escalates_to_the_full_co_restart() -> None:
    """A router-only restart that does not help escalates to the full co-restart."""
    h = Harness(config=group_config(restart={"backoff_seconds": 0, "verify_timeout_seconds": 30}))
    h.warm()
    first = until_action(h)
    assert first.rung is Rung.ROUTER
    h.state = after_restart(h.state, _outcome(first, h), h.stack.now)  # type: ignore[arg-type]
    assert h.state.state is State.VERIFYING
    # The router comes back but probes still fail: verification fails, then the next attempt
    # is the full co-restart, charged to the same budget.
    failed = None
    for _ in range(20):
        decision = wedged_cycle(h)
        if decision.verdict is Verdict.VERIFICATION_FAILED:
            failed = decision
            break
    assert failed is not None, h.verdicts
    second = until_action(h)
    assert second.verdict is Verdict.ROUTER_WEDGE
    assert second.rung is Rung.FULL
    escalation = next(r for r in second.reasons if r.code == "rung")
    assert "escalation" in escalation.message
    assert len(second.state.budget.restart_times) == 2
    plan = build_plan(h.config, str(second.verdict), rung=second.rung)
    assert [s.role for s in plan.steps] == [Role.PREFILL, Role.DECODE, Role.ROUTER]


def test_a_router_rung_that_helped_leaves_the_next_episode_a_router_rung() -> None:
    """A router restart that helped leaves the next episode starting at the router rung again."""
    h = Harness(config=group_config(restart={"verify_probes": 2}))
    h.warm()
    first = until_action(h)
    h.state = after_restart(h.state, _outcome(first, h), h.stack.now)  # type: ignore[arg-type]
    passed = h.steps(3, (True,))
    assert Verdict.VERIFICATION_PASSED in [d.verdict for d in h.decisions[-3:]], h.verdicts
    verified = next(d for d in h.decisions if d.verdict is Verdict.VERIFICATION_PASSED)
    resolved = next(r for r in verified.reasons if r.code == "resolved")
    assert "co-restart" not in resolved.message  # it was the router alone
    assert passed.state.budget.partial_tried is False
    assert until_action(h).rung is Rung.ROUTER


def test_plan_shows_the_rung_and_why() -> None:
    """The plan names its rung and why, and a router plan lists the router unit only."""
    config = group_config()
    router = build_plan(config, "router_wedge", rung=Rung.ROUTER)
    text = format_plan(router)
    assert text.splitlines()[-1].startswith("Rung router: router probes fail while direct PD")
    assert "g-router.service" in text
    assert "g-decode.service" not in text
    as_dict = plan_as_dict(router)
    assert as_dict["rung"] == "router"
    assert "direct PD probes" in str(as_dict["why"])
    full = build_plan(config, "manual")
    assert full.rung is Rung.FULL
    assert format_plan(full).splitlines()[-1].startswith("Rung full: every worker")


def test_outcome_of_a_router_rung_says_router_only() -> None:
    """The outcome of a router rung says it was a router-only restart."""
    h = Harness()
    plan = build_plan(h.config, "router_wedge", rung=Rung.ROUTER)
    step = plan.steps[0]
    outcome = RestartOutcome(
        plan, True, False, (StepResult(step.role, step.unit, True, "ready"),), 0.0, 1.0
    )
    assert format_outcome(outcome).endswith("router-only restart of group g done")
    assert replace(outcome, plan=replace(plan, rung=Rung.FULL)) != outcome


def test_stack_default_is_unchanged() -> None:
    """The builders' stack has no direct probes: existing verdict tables are untouched."""
    assert Stack().cycle().probes[0].kind is ProbeKind.COMPLETION


@pytest.fixture(autouse=True)
def _restore_structlog() -> Iterator[None]:
    """cli.main() points structlog at this test's captured stderr; undo that afterwards."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def test_plan_command_shows_either_rung(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`watchdog plan` shows the full rung by default and the router rung when asked."""
    overrides = {"watchdog": {"state_dir": str(tmp_path / "state")}, "group": [configs.group("g1")]}
    path = str(configs.write_config(tmp_path / "watchdog.toml", overrides))
    assert main(["plan", "--config", path]) == EXIT_OK
    full = capsys.readouterr().out
    assert "trigger: manual" in full
    assert "Rung full: every worker" in full
    assert main(["plan", "--config", path, "--rung", "router", "--json"]) == EXIT_OK
    (router,) = json.loads(capsys.readouterr().out)
    assert router["rung"] == "router"
    assert router["trigger"] == "router_wedge"
    assert [s["unit"] for s in router["steps"]] == ["r.service"]
    assert "direct PD probes" in router["why"]
