"""No role restarts alone: the survivor rung after a prefill restarted alone, and the other roles.

A prefill restarted alone (systemd's Restart=, an operator) leaves the decodes that pair with it
holding KV-transfer bootstrap state for its old process. Once it serves, the survivor rung
restarts those decodes, then the router, and never the prefill again. A decode restarted alone
keeps the decode-only handling; a router restarted alone restarts no worker (docs/decisions.md,
"Restart rungs").
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import structlog

from tests.unit import configs
from tests.unit.builders import Harness, group_config, health, probe
from tests.unit.test_detector_workers import group_2p2d, units
from watchdog.act.plan import (
    REASON_SURVIVOR_SHAPE,
    build_plan,
    format_outcome,
    format_plan,
    guard_plan,
    plan_as_dict,
)
from watchdog.cli import main
from watchdog.decide import Decision, after_restart, decide, initial_state
from watchdog.decide.state import GroupState
from watchdog.decide.verdict import ACT_VERDICTS, Verdict
from watchdog.errors import EXIT_OK, EXIT_USAGE, RestartRefused
from watchdog.model import (
    Action,
    Observation,
    OperatorControls,
    RestartOutcome,
    Role,
    Rung,
    State,
    StepResult,
)
from watchdog.pairs import decodes_paired_with

P, D, R = Role.PREFILL, Role.DECODE, Role.ROUTER
GRACE_SECONDS = 60.0  # stall.decode_only_grace_seconds, the default


def codes(decision: Decision) -> list[str]:
    """The reason codes of a decision, in order."""
    return [r.code for r in decision.reasons]


def values(decision: Decision, code: str) -> dict[str, float | str]:
    """The values of a decision's reason with the given code."""
    return dict(next(r for r in decision.reasons if r.code == code).values)


def prefill_alone(h: Harness, *, by_systemd: bool = True) -> Decision:
    """A warm group whose prefill is restarted alone; the decision of the cycle that sees it."""
    h.warm()
    h.stack.restart(P)
    if by_systemd:
        h.stack.n_restarts[P] += 1
    return h.step((True,))


# --- the decision -----------------------------------------------------------------------------


def test_prefill_restarted_alone_is_named_at_once_with_when_and_who() -> None:
    """The cycle that reads the new start says which prefill, when, and that systemd did it."""
    h = Harness()
    first = prefill_alone(h)
    assert first.verdict is Verdict.PREFILL_ONLY_RESTART
    assert first.action is Action.NONE
    assert first.state.state is State.WARMING
    assert codes(first)[:2] == ["prefill_only_restart", "grace"]
    why = values(first, "prefill_only_restart")
    assert why["workers"] == "prefill"
    assert why["started_at"] == h.stack.starts_us[P] / 1e6
    assert (why["by"], why["n_restarts"]) == ("systemd", 1)
    message = first.reasons[0].message
    assert "prefill started 5s ago (" in message  # restarted at the start of the cycle
    assert "by systemd's Restart= (NRestarts 1)" in message
    assert "decode kept running" in message
    assert first.state.units.prefill_only_seen_at == h.stack.now


def test_a_restart_by_someone_else_says_so() -> None:
    """NRestarts unchanged: not systemd's Restart= (an operator's RestartUnit never adds to it)."""
    first = prefill_alone(Harness(), by_systemd=False)
    assert values(first, "prefill_only_restart")["by"] == "other"
    assert "an operator or another tool" in first.reasons[0].message


def test_how_the_old_process_ended_is_reported_where_systemd_showed_it() -> None:
    """A cycle that saw the unit failed with Result 'signal' carries that to the verdict."""
    h = Harness()
    h.warm()
    h.stack.active[P] = "failed"
    h.stack.results[P] = "signal"
    h.step((False,), progress=False, health_ok={P: False})
    h.stack.restart(P)
    h.stack.n_restarts[P] += 1
    h.stack.results[P] = "success"  # systemd resets Result when it starts the unit again
    first = h.step((True,))
    assert first.verdict is Verdict.PREFILL_ONLY_RESTART
    assert values(first, "prefill_only_restart")["ended"] == "signal"
    assert "ended with Result 'signal'" in first.reasons[0].message


def test_survivor_rung_acts_once_the_prefill_has_served_for_the_grace() -> None:
    """Decode and router, not the prefill: charged to the budget like every action."""
    h = Harness()
    prefill_alone(h)
    waiting = h.steps(11, (True,))
    assert (waiting.verdict, waiting.action) == (Verdict.PREFILL_ONLY_RESTART, Action.NONE)
    acted = h.step((True,))
    assert acted.action is Action.CO_RESTART
    assert (acted.verdict, acted.rung, acted.fresh_prefills) == (
        Verdict.PREFILL_ONLY_RESTART,
        Rung.SURVIVOR,
        (0,),
    )
    assert acted.state.state is State.RESTARTING
    assert acted.state.budget.restart_times == (h.stack.now,)
    assert "rung survivor" in next(r.message for r in acted.reasons if r.code == "rung")
    assert h.actions.count(Action.CO_RESTART) == 1
    assert Verdict.PREFILL_ONLY_RESTART in ACT_VERDICTS
    plan = build_plan(
        h.config, str(acted.verdict), rung=acted.rung, fresh_prefills=acted.fresh_prefills
    )
    assert [s.role for s in plan.steps] == [D, R]


def test_grace_counts_from_the_first_cycle_the_prefill_serves() -> None:
    """A prefill still loading is waited for; the grace starts when its /health passes."""
    h = Harness()
    h.warm()
    h.stack.restart(P)
    loading = h.steps(20, (False,), progress=False, health_ok={P: False})
    assert (loading.verdict, loading.action) == (Verdict.PREFILL_ONLY_RESTART, Action.NONE)
    assert "waiting_for_prefill" in codes(loading)
    assert loading.state.units.prefill_only_ready_at is None
    serving = h.steps(12, (True,))
    assert serving.action is Action.NONE
    assert h.step((True,)).rung is Rung.SURVIVOR


def test_a_prefill_that_never_serves_is_never_healthy_and_not_restarted() -> None:
    """Past startup_timeout_seconds without /health, warm-up judges: the group has not served
    since the prefill started, so it is paged as never healthy, with no restart at all."""
    h = Harness(config=group_config(stall={"startup_timeout_seconds": 60}))
    h.warm()
    h.stack.restart(P)
    decision = h.steps(40, (False,), progress=False, health_ok={P: False})
    assert Action.CO_RESTART not in h.actions, h.verdicts
    paged = [d for d in h.decisions if d.verdict is Verdict.NEVER_HEALTHY]
    assert paged, h.verdicts
    assert [d.action for d in paged].count(Action.ALERT) == 1
    assert decision.state.state is State.DEGRADED


def test_decode_restarted_after_the_prefill_within_the_grace_resolves_it() -> None:
    """An operator restarting in order by hand: prefill, then decode once prefill serves."""
    h = Harness()
    prefill_alone(h)
    h.steps(3, (True,))
    h.stack.restart(D)
    resolved = h.step((True,))
    assert (resolved.verdict, resolved.action) == (Verdict.WARMING_UP, Action.NONE)
    assert "external_restart" in codes(resolved)
    assert resolved.state.units.prefill_only == ()
    h.steps(20, (True,))
    assert Action.CO_RESTART not in h.actions


def test_prefill_and_decode_restarted_in_one_cycle_is_an_external_co_restart() -> None:
    """Prefill and decode restarted in one cycle is an external co-restart, not prefill-only."""
    h = Harness()
    h.warm()
    h.stack.restart(P)
    h.stack.restart(D, at=h.stack.now + 1)
    decision = h.step((True,))
    assert "external_restart" in codes(decision)
    assert Verdict.PREFILL_ONLY_RESTART not in [d.verdict for d in h.decisions]


def test_our_own_restart_is_never_a_prefill_only_restart() -> None:
    """Our co-restart restarts prefill first: absorbed (quiet), units forgotten after it."""
    h = Harness()
    h.warm()
    h.stall(9)
    h.restarted(roles=(P,))  # even if only prefill's start had changed by the next cycle
    h.steps(20, (True,))
    assert Verdict.PREFILL_ONLY_RESTART not in [d.verdict for d in h.decisions]


def test_a_prefill_restart_during_a_pause_is_absorbed() -> None:
    """A prefill restarted during an operator's pause is absorbed, never acted on after it."""
    h = Harness()
    h.warm()
    h.stack.restart(P)
    lease = OperatorControls(paused_until=h.stack.now + 30)
    h.steps(3, (True,), operator=lease)
    h.steps(20, (True,))
    assert Verdict.PREFILL_ONLY_RESTART not in [d.verdict for d in h.decisions]
    assert Action.CO_RESTART not in h.actions


def test_decode_unreadable_defers_the_judgement() -> None:
    """Whether decode restarted too is unknown while its unit cannot be read: judged later."""
    h = Harness()
    h.warm()
    h.stack.restart(P)
    observation = h.stack.cycle((True,))
    blind = replace(observation, units=tuple(u for u in observation.units if u.role is not D))
    deferred = h.feed(blind)
    assert deferred.verdict is not Verdict.PREFILL_ONLY_RESTART
    assert "external_restart" not in codes(deferred)
    assert h.step((True,)).verdict is Verdict.PREFILL_ONLY_RESTART


def survivor_done(h: Harness) -> GroupState:
    """Prefill alone, the survivor rung acted, decode and router restarted by it."""
    prefill_alone(h)
    acted = h.steps(12, (True,))
    assert acted.rung is Rung.SURVIVOR
    return h.restarted(roles=(D, R))


def test_survivor_restart_is_verified_like_any_action() -> None:
    """A survivor restart is verified like any action; passing clears the partial attempt."""
    h = Harness()
    assert survivor_done(h).state is State.VERIFYING
    passed = h.steps(8, (True,))  # restart.verify_probes
    assert passed.verdict is Verdict.VERIFICATION_PASSED
    assert passed.state.budget.partial_tried is False
    assert Verdict.PREFILL_ONLY_RESTART not in [d.verdict for d in h.decisions[-3:]]


def test_survivor_restart_that_does_not_help_escalates_to_the_full_co_restart() -> None:
    """A survivor restart that does not help escalates to the full co-restart."""
    h = Harness(config=group_config(restart={"backoff_seconds": 0}))
    survivor_done(h)
    h.stack.fail_transfers(5)
    failed = h.step((False,), progress=False)
    assert failed.verdict is Verdict.VERIFICATION_FAILED
    h.stall(12)
    acted = next(d for d in reversed(h.decisions) if d.action is Action.CO_RESTART)
    assert acted.verdict is Verdict.DEGRADED_BOOTSTRAP  # the failures it saw
    assert acted.rung is Rung.FULL
    assert "escalation" in next(r.message for r in acted.reasons if r.code == "rung")


def test_budget_exhausted_holds_instead_of_the_survivor_restart() -> None:
    """With the budget spent, a prefill restarted alone is held, not given the survivor restart."""
    h = Harness(config=group_config(restart={"max_restarts": 1}))
    h.state = replace(
        initial_state(h.stack.now, restart_times=(h.stack.now - 10,)), state=State.HEALTHY
    )
    prefill_alone(h)
    decision = h.steps(12, (True,))
    assert decision.verdict is Verdict.BUDGET_EXHAUSTED
    assert decision.state.state is State.HELD


# --- the other roles alone ----------------------------------------------------------------------


def test_decode_restarted_alone_keeps_the_decode_only_handling() -> None:
    """Decode restarted alone keeps its own handling: grace, then the full co-restart."""
    h = Harness()
    h.warm()
    h.stack.restart(D)
    first = h.step((True,))
    assert first.verdict is Verdict.DECODE_ONLY_RESTART
    acted = h.steps(12, (True,))
    assert (acted.action, acted.rung) == (Action.CO_RESTART, Rung.FULL)


def test_router_restarted_alone_restarts_no_worker() -> None:
    """Verification only: warm-up waits for a probe through the new router; nothing planned."""
    h = Harness()
    h.warm()
    h.stack.restart(R)
    first = h.step((False,), progress=False)
    assert (first.verdict, first.action) == (Verdict.WARMING_UP, Action.NONE)
    assert "router_restarted_alone" in codes(first)
    assert "no worker is restarted" in first.reasons[0].message
    ready = h.step((True,))
    assert ready.state.state is State.HEALTHY
    h.steps(30, (True,))
    assert Action.CO_RESTART not in h.actions


# --- several workers per role -------------------------------------------------------------------

CONFIG = group_2p2d()
T0 = 1_000_000.0
START = {(P, 0): T0 - 5000, (P, 1): T0 - 5000, (D, 0): T0 - 4000, (D, 1): T0 - 4000, (R, 0): T0}


def cycle_2p2d(
    state: GroupState, at: float, starts: dict[tuple[Role, int], float], n_restarts: int = 0
) -> Decision:
    """One healthy cycle of the 2P2D group; prefill #2's NRestarts as given."""
    observed = tuple(
        replace(u, n_restarts=n_restarts) if (u.role, u.worker) == (P, 1) else u
        for u in units(starts)
    )
    observation = Observation(
        "g",
        at,
        probes=(probe(True, at=at - 0.1),),
        health=(health("prefill", at=at), health("decode", at=at)),
        units=observed,
    )
    return decide(state, observation, CONFIG, at)


def _until_action(first: Decision, starts: dict[tuple[Role, int], float]) -> Decision:
    decision = first
    for n in range(1, 14):
        decision = cycle_2p2d(decision.state, T0 + 10 + 5 * n, starts, n_restarts=1)
        if decision.action is Action.CO_RESTART:
            return decision
    raise AssertionError(f"no co-restart: {decision}")


def test_xpyd_prefill_two_alone_restarts_prefill_one_then_the_decodes_not_prefill_two() -> None:
    """Every decode pairs with every prefill: restarting the decodes alone would restart them
    under prefill #1, which kept running (the decode-only restart refused), so prefill #1 goes
    first; prefill #2, restarted alone, is not restarted again."""
    state = cycle_2p2d(initial_state(T0), T0, START).state
    later = {**START, (P, 1): T0 + 8}
    first = cycle_2p2d(state, T0 + 10, later, n_restarts=1)
    assert first.verdict is Verdict.PREFILL_ONLY_RESTART
    why = values(first, "prefill_only_restart")
    assert why["workers"] == "prefill#2"
    assert "every decode kept running" in first.reasons[0].message
    decision = _until_action(first, later)
    assert (decision.rung, decision.fresh_prefills) == (Rung.SURVIVOR, (1,))
    assert values(decision, "rung")["stale_prefills"] == "prefill#1"
    assert decodes_paired_with(CONFIG, (0,)) == decodes_paired_with(CONFIG, (1,)) == (0, 1)
    plan = build_plan(CONFIG, "prefill_only_restart", rung=Rung.SURVIVOR, fresh_prefills=(1,))
    assert [s.unit for s in plan.steps] == ["p1.service", "d1.service", "d2.service", "r.service"]
    assert "(restarted alone: prefill#2; kept running, restarted first: prefill#1)" in plan.why


def test_xpyd_every_prefill_restarted_alone_restarts_every_decode_then_the_router() -> None:
    """Both prefills restarted alone: no prefill kept running, so the survivor rung applies."""
    state = cycle_2p2d(initial_state(T0), T0, START).state
    later = {**START, (P, 0): T0 + 7, (P, 1): T0 + 8}
    first = cycle_2p2d(state, T0 + 10, later, n_restarts=1)
    assert first.verdict is Verdict.PREFILL_ONLY_RESTART
    decision = _until_action(first, later)
    assert (decision.rung, decision.fresh_prefills) == (Rung.SURVIVOR, (0, 1))
    plan = build_plan(CONFIG, "prefill_only_restart", rung=Rung.SURVIVOR, fresh_prefills=(0, 1))
    assert [s.unit for s in plan.steps] == ["d1.service", "d2.service", "r.service"]
    assert "(restarted alone: prefill#1, prefill#2)" in plan.why


def test_xpyd_one_decode_restarted_after_the_prefill_leaves_it_pending() -> None:
    """Only when every decode started after the fresh prefill is it resolved."""
    state = cycle_2p2d(initial_state(T0), T0, START).state
    later = {**START, (P, 1): T0 + 8}
    state = cycle_2p2d(state, T0 + 10, later).state
    one = {**later, (D, 0): T0 + 12}
    decision = cycle_2p2d(state, T0 + 15, one)
    # decode#1 restarted while prefill#1 kept running: decode-only, the full co-restart's case.
    assert decision.verdict is Verdict.DECODE_ONLY_RESTART
    both = {**one, (D, 1): T0 + 18}
    resolved = cycle_2p2d(decision.state, T0 + 20, both)
    assert resolved.state.units.prefill_only == ()


# --- the plan and its guard ---------------------------------------------------------------------


def test_survivor_plan_is_the_decodes_then_the_router_and_says_why() -> None:
    """The survivor plan restarts the decodes then the router, and needs the fresh prefills."""
    config = group_config()
    plan = build_plan(config, "prefill_only_restart", rung=Rung.SURVIVOR, fresh_prefills=(0,))
    assert [s.role for s in plan.steps] == [D, R]
    assert plan.steps[-1].expect_workers  # the router waits for every worker, prefill included
    text = format_plan(plan)
    assert "The prefills restarted alone are not restarted again" in text
    assert text.splitlines()[-1].startswith("Rung survivor: a prefill was restarted alone")
    assert plan_as_dict(plan)["rung"] == "survivor"
    with pytest.raises(ValueError, match="prefills restarted alone"):
        build_plan(config, "prefill_only_restart", rung=Rung.SURVIVOR)


def test_guard_refuses_a_survivor_plan_out_of_order_or_not_the_router_last() -> None:
    """A survivor plan is prefills (maybe none), decodes, then the router; nothing else."""
    config = group_config()
    full = build_plan(config, "manual")
    p, d, r = full.steps
    for steps in ((d,), (r,), (r, d), (d, p, r), (p, r), (d, r, p)):
        with pytest.raises(RestartRefused) as refused:
            guard_plan(replace(full, rung=Rung.SURVIVOR, steps=steps))
        assert refused.value.reason == REASON_SURVIVOR_SHAPE
    # The full rung still refuses decode without prefill before it.
    with pytest.raises(RestartRefused):
        guard_plan(replace(full, steps=full.steps[1:]))
    guard_plan(replace(full, rung=Rung.SURVIVOR, steps=full.steps[1:]))  # decode, router: fine
    guard_plan(replace(full, rung=Rung.SURVIVOR))  # a prefill that kept running first: fine


def test_outcome_and_after_restart_of_a_survivor_restart() -> None:
    """A survivor restart's outcome is named as such and is followed by verification."""
    h = Harness()
    plan = build_plan(h.config, "prefill_only_restart", rung=Rung.SURVIVOR, fresh_prefills=(0,))
    steps = tuple(StepResult(s.role, s.unit, True, "ready") for s in plan.steps)
    outcome = RestartOutcome(plan, True, False, steps, 0.0, 1.0)
    assert format_outcome(outcome).endswith("survivor restart of group g done")
    assert h.state is not None
    assert after_restart(h.state, outcome, 1.0).state is State.VERIFYING


@pytest.fixture(autouse=True)
def _restore_structlog() -> Iterator[None]:
    """cli.main() points structlog at this test's captured stderr; undo that afterwards."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def test_plan_command_shows_the_survivor_rung(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`plan --rung survivor` shows decodes then router, and refuses an unknown prefill."""
    overrides = {"watchdog": {"state_dir": str(tmp_path / "state")}, "group": [configs.group("g1")]}
    path = str(configs.write_config(tmp_path / "watchdog.toml", overrides))
    assert main(["plan", "--config", path, "--rung", "survivor"]) == EXIT_OK
    text = capsys.readouterr().out
    assert "trigger: prefill_only_restart" in text
    assert "(restarted alone: prefill)" in text
    assert main(["plan", "--config", path, "--rung", "survivor", "--json"]) == EXIT_OK
    (survivor,) = json.loads(capsys.readouterr().out)
    assert survivor["rung"] == "survivor"
    assert [s["unit"] for s in survivor["steps"]] == ["d.service", "r.service"]
    assert main(["plan", "--config", path, "--rung", "survivor", "--prefill", "2"]) == EXIT_USAGE
    assert "has 1 prefill worker(s)" in capsys.readouterr().err
