"""The fleet arbiter (watchdog/decide/fleet.py) and its daemon side (watchdog/run/fleet.py): the
fleet budget, the storm verdict, holds and their release, one group unchanged."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import pytest
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from tests.unit import configs
from tests.unit.builders import T0, Harness, group_config
from watchdog.commands.status import format_table
from watchdog.config import FleetSection, GroupSection, load_config, parse_config
from watchdog.decide.fleet import (
    FLEET_BUDGET,
    STORM,
    FleetState,
    GroupView,
    Noted,
    Ruling,
    Storm,
    arbitrate,
    fleet_state,
    note,
    refused,
    suspects,
    topology,
    withdrawn,
)
from watchdog.errors import ConfigError
from watchdog.model import Action, OperatorControls, State
from watchdog.observe.observer import GroupObserver
from watchdog.run import status as run_status
from watchdog.run.cycle import GroupRuntime
from watchdog.run.fleet import FleetArbiter
from watchdog.run.metrics import WatchdogMetrics

STALLED = GroupView(State.STALLED, stalled=True, busy=False, rearmed_at=None)
ACTING = GroupView(State.RESTARTING, stalled=True, busy=True, rearmed_at=None)
HEALTHY = GroupView(State.HEALTHY, stalled=False, busy=False, rearmed_at=None)
VERIFYING = GroupView(State.VERIFYING, stalled=False, busy=True, rearmed_at=None)


def groups(count: int, *, shared_router: bool = False) -> list[GroupSection]:
    """`count` groups on distinct ports of 127.0.0.1 (a router shared by all, if asked)."""
    out = []
    for i in range(count):
        base = 31000 + 10 * i
        router = "http://127.0.0.1:30001" if shared_router else f"http://127.0.0.1:{base + 1}"
        out.append(
            group_config(
                f"g{i}",
                prefill={"unit": f"g{i}-p.service", "url": f"http://127.0.0.1:{base}"},
                decode={"unit": f"g{i}-d.service", "url": f"http://10.0.0.{i + 1}:{base + 2}"},
                router={"unit": f"g{i}-r.service", "url": router},
            )
        )
    return out


def fleet(count: int) -> FleetState:
    """A fresh arbiter state for `count` groups."""
    return fleet_state(groups(count))


def config(**values: Any) -> FleetSection:
    """The [fleet] section with `values` over its defaults."""
    return FleetSection(**values)


def stall_all(state: FleetState, names: Sequence[str], cfg: FleetSection, at: float) -> Noted:
    """Note a stall verdict of each group in `names` at `at`; the last note()'s result."""
    noted = Noted(state)
    for name in names:
        noted = note(noted.fleet, name, STALLED, cfg, at)
    return noted


def test_more_than_the_share_is_a_storm_and_exactly_the_share_is_not() -> None:
    """8 groups, storm_share 0.5: 4 stalled groups (exactly half) are no storm, a 5th is."""
    cfg = config()
    noted = stall_all(fleet(8), ["g0", "g1", "g2", "g3"], cfg, T0)
    assert noted.declared is None
    assert noted.fleet.storm is None
    noted = note(noted.fleet, "g4", STALLED, cfg, T0 + 1)
    assert noted.declared is not None
    assert noted.declared.groups == ("g0", "g1", "g2", "g3", "g4")
    assert noted.declared.held == ("g0", "g1", "g2", "g3", "g4")
    assert noted.declared.total == 8


def test_no_storm_with_fewer_stalled_groups_than_storm_min_groups() -> None:
    """Both groups of a 2-group daemon stalled (100 % > 50 %) is no storm below min groups 3; one
    stalled group of 2 neither; 3 of 4 with min 3 is."""
    cfg = config(storm_min_groups=3)
    assert stall_all(fleet(2), ["g0", "g1"], cfg, T0).fleet.storm is None
    assert stall_all(fleet(2), ["g0"], cfg, T0).fleet.storm is None
    assert stall_all(fleet(4), ["g0", "g1", "g2"], cfg, T0).declared is not None


def test_only_stall_verdicts_inside_the_window_count() -> None:
    """A stall verdict older than storm_window_seconds does not count toward a storm; the window's
    lower edge is inclusive."""
    cfg = config(storm_window_seconds=120)
    noted = stall_all(fleet(5), ["g0", "g1"], cfg, T0)
    late = note(noted.fleet, "g2", STALLED, cfg, T0 + 120.5)
    assert late.fleet.storm is None
    edge = note(noted.fleet, "g2", STALLED, cfg, T0 + 120)
    assert edge.declared is not None


def test_a_storm_ends_when_the_stalled_share_falls_back_but_holds_stay() -> None:
    """Groups serving again end the storm once the stalled share is no longer above it (their
    stall verdicts no longer count); a group still stalled and held stays held (until it
    recovers or is re-armed)."""
    cfg = config()
    noted = stall_all(fleet(4), ["g0", "g1", "g2"], cfg, T0)
    assert noted.fleet.storm is not None
    ruling = arbitrate(noted.fleet, "g0", cfg, T0)  # the one the storm acts on
    assert ruling.refused is None
    held = arbitrate(ruling.fleet, "g1", cfg, T0)
    assert held.refused == STORM
    state = held.fleet
    ended = []
    for name, seen in (("g0", HEALTHY), ("g2", HEALTHY), ("g1", STALLED)):
        noted = note(state, name, seen, cfg, T0 + 60)
        state = noted.fleet
        ended.append(noted.ended is not None)
    assert ended == [True, False, False]  # 2 of 4 stalled, exactly the share: no more a storm
    after = note(state, "g1", STALLED, cfg, T0 + 200)
    assert after.fleet.storm is None
    assert after.fleet.hold_of("g1") is not None
    assert arbitrate(after.fleet, "g1", cfg, T0 + 300).refused == STORM


def test_concurrency_one_refuses_a_second_group_until_the_first_serves_again() -> None:
    """max_concurrent_restarts 1: while g0 is down for its co-restart (restarting, then verifying
    before it serves), g1's co-restart is refused for the fleet budget, logged once; when g0
    serves again, g1 acts."""
    cfg = config(max_concurrent_restarts=1)
    state = note(fleet(8), "g0", ACTING, cfg, T0).fleet
    first = arbitrate(state, "g0", cfg, T0)
    assert first.refused is None
    state = note(first.fleet, "g1", ACTING, cfg, T0 + 1).fleet
    refused_once = arbitrate(state, "g1", cfg, T0 + 1)
    assert (refused_once.refused, refused_once.first) == (FLEET_BUDGET, True)
    state = note(refused_once.fleet, "g0", VERIFYING, cfg, T0 + 60).fleet
    again = arbitrate(note(state, "g1", ACTING, cfg, T0 + 61).fleet, "g1", cfg, T0 + 61)
    assert (again.refused, again.first) == (FLEET_BUDGET, False)
    state = note(again.fleet, "g0", HEALTHY, cfg, T0 + 120).fleet
    acts = arbitrate(note(state, "g1", ACTING, cfg, T0 + 121).fleet, "g1", cfg, T0 + 121)
    assert acts.refused is None
    assert acts.fleet.busy == ("g1",)
    assert acts.fleet.hold_of("g1") is None


def test_concurrency_two_lets_two_groups_restart_at_once() -> None:
    """max_concurrent_restarts 2: two groups act together, a third waits."""
    cfg = config(max_concurrent_restarts=2)
    state = fleet(8)
    results: list[Ruling] = []
    for i, name in enumerate(("g0", "g1", "g2")):
        ruling = arbitrate(note(state, name, ACTING, cfg, T0 + i).fleet, name, cfg, T0 + i)
        results.append(ruling)
        state = ruling.fleet
    assert [r.refused for r in results] == [None, None, FLEET_BUDGET]


def test_the_hourly_budget_is_a_rolling_hour() -> None:
    """max_restarts_per_hour 2: a third co-restart within the hour is refused; it acts once the
    first is more than an hour old (the window's lower edge is inclusive)."""
    cfg = config(max_concurrent_restarts=8, max_restarts_per_hour=2)
    state = fleet(8)
    for i, name in enumerate(("g0", "g1")):
        ruling = arbitrate(state, name, cfg, T0 + 100 * i)
        assert ruling.refused is None
        state = ruling.fleet
    for name in ("g0", "g1"):
        state = note(state, name, HEALTHY, cfg, T0 + 200).fleet  # both served again
    assert arbitrate(state, "g2", cfg, T0 + 3600).refused == FLEET_BUDGET
    late = arbitrate(state, "g2", cfg, T0 + 3600.5)
    assert late.refused is None
    assert [g for g, _ in late.fleet.restarts] == ["g1", "g2"]


def test_a_storm_acts_on_at_most_the_budget_and_holds_the_rest() -> None:
    """6 of 8 groups stall together: one co-restart (max_concurrent_restarts 1) in all, even once
    it is over; every other stalled group is refused for the storm and named as held, and so is
    the one it acted on once it stalls again."""
    cfg = config(max_concurrent_restarts=1, max_restarts_per_hour=100)
    names = [f"g{i}" for i in range(6)]
    state = stall_all(fleet(8), names, cfg, T0).fleet
    assert state.storm is not None
    acted = []
    for round_ in range(3):  # the groups ask again and again; the canary has long finished
        for i, name in enumerate(names):
            now = T0 + 10 * round_ + i * 0.1
            state = note(state, name, STALLED, cfg, now).fleet
            ruling = arbitrate(state, name, cfg, now)
            state = ruling.fleet
            if ruling.refused is None:
                acted.append(name)
                state = note(state, name, HEALTHY, cfg, now).fleet  # done at once: not busy
                state = note(state, name, STALLED, cfg, now).fleet  # and stalled again
            else:
                assert ruling.refused == STORM, ruling
    assert acted == ["g0"]
    assert state.storm is not None
    assert state.storm.acted == ("g0",)
    assert set(state.storm.held) == set(names)


def test_a_storm_names_its_groups_in_the_configs_order() -> None:
    """The storm's groups come in the order the config lists them, whatever order they
    stalled in (they are ordered once the storm is declared, not at every decision)."""
    noted = stall_all(fleet(6), ["g5", "g2", "g0", "g4"], config(), T0)
    assert noted.declared is not None
    assert noted.declared.groups == ("g0", "g2", "g4", "g5")


def test_a_group_verifying_still_counts_and_one_serving_again_does_not() -> None:
    """A stall verdict counts for the window while the group verifies after its co-restart; a
    group that serves again no longer counts, and its earlier co-restart is not the storm's."""
    cfg = config()
    state = note(fleet(6), "g5", ACTING, cfg, T0).fleet
    state = arbitrate(state, "g5", cfg, T0).fleet
    state = note(state, "g5", HEALTHY, cfg, T0 + 10).fleet  # g5 was alone, and is back
    state = note(state, "g0", ACTING, cfg, T0 + 20).fleet
    state = arbitrate(state, "g0", cfg, T0 + 20).fleet
    state = note(state, "g0", VERIFYING, cfg, T0 + 30).fleet
    noted = stall_all(state, ["g1", "g2", "g3"], cfg, T0 + 40)
    storm = noted.declared
    assert storm is not None
    assert storm.groups == ("g0", "g1", "g2", "g3")
    assert (storm.acted, storm.held) == (("g0",), ("g1", "g2", "g3"))


def test_groups_waiting_for_the_fleet_budget_are_held_when_the_storm_is_declared() -> None:
    """g0 acts, g1 and g2 wait for the fleet budget; the stall of g3 and g4 makes a storm (5 of
    8): the storm names g0 as acted and holds g1..g4, the waiting ones from now on."""
    cfg = config()
    state = note(fleet(8), "g0", ACTING, cfg, T0).fleet
    state = arbitrate(state, "g0", cfg, T0).fleet
    for name in ("g1", "g2"):
        state = note(state, name, ACTING, cfg, T0 + 1).fleet
        assert arbitrate(state, name, cfg, T0 + 1).refused == FLEET_BUDGET
        state = arbitrate(state, name, cfg, T0 + 1).fleet
    noted = stall_all(state, ["g3", "g4"], cfg, T0 + 2)
    storm = noted.declared
    assert storm is not None
    assert (storm.acted, storm.held) == (("g0",), ("g1", "g2", "g3", "g4"))
    hold = noted.fleet.hold_of("g1")
    assert hold is not None
    assert hold.reason == STORM


def test_recovery_on_its_own_releases_a_storm_hold() -> None:
    """A storm-held group whose probes pass again (healthy) leaves the hold, and is judged alone
    again: with the storm over, its next co-restart acts within the fleet budget."""
    cfg = config()
    state = stall_all(fleet(4), ["g0", "g1", "g2"], cfg, T0).fleet
    state = arbitrate(state, "g0", cfg, T0).fleet
    state = arbitrate(state, "g1", cfg, T0).fleet
    noted = note(state, "g1", HEALTHY, cfg, T0 + 30)
    assert noted.released is not None
    hold, why = noted.released
    assert (hold.group, hold.reason, why) == ("g1", STORM, "recovered")
    state = noted.fleet
    for name in ("g0", "g2"):
        state = note(state, name, HEALTHY, cfg, T0 + 200).fleet
    state = note(state, "g1", ACTING, cfg, T0 + 400).fleet
    assert state.storm is None
    assert arbitrate(state, "g1", cfg, T0 + 400).refused is None


def test_an_operator_reset_releases_a_storm_hold_and_exempts_the_group() -> None:
    """`watchdog reset` newer than the hold releases it; the group then acts within the fleet
    budget even while the storm stands. A reset older than the hold releases nothing."""
    cfg = config()
    state = stall_all(fleet(6), ["g0", "g1", "g2", "g3", "g4"], cfg, T0 + 10).fleet
    state = arbitrate(state, "g0", cfg, T0 + 10).fleet
    state = note(state, "g0", HEALTHY, cfg, T0 + 11).fleet  # the canary is back; 4 of 6 are not
    state = arbitrate(state, "g1", cfg, T0 + 12).fleet
    old = GroupView(State.STALLED, stalled=True, busy=False, rearmed_at=T0)
    assert note(state, "g1", old, cfg, T0 + 20).released is None
    reset = GroupView(State.STALLED, stalled=True, busy=False, rearmed_at=T0 + 30)
    noted = note(state, "g1", reset, cfg, T0 + 31)
    assert noted.released is not None
    assert noted.released[1] == "operator"
    assert noted.fleet.storm is not None
    assert arbitrate(noted.fleet, "g1", cfg, T0 + 32).refused is None
    assert arbitrate(noted.fleet, "g2", cfg, T0 + 32).refused == STORM


def test_a_group_held_by_its_own_budget_or_paused_leaves_the_fleet_hold() -> None:
    """decide()'s own hold (budget exhausted) or a maintenance lease ends the fleet's refusal
    episode: the group is not the fleet's to hold any more."""
    cfg = config()
    base = stall_all(fleet(4), ["g0", "g1", "g2"], cfg, T0).fleet
    base = arbitrate(arbitrate(base, "g0", cfg, T0).fleet, "g1", cfg, T0).fleet
    for state, why in ((State.HELD, "held"), (State.PAUSED, "paused")):
        seen = GroupView(state, stalled=False, busy=False, rearmed_at=None)
        noted = note(base, "g1", seen, cfg, T0 + 5)
        assert noted.released is not None
        assert noted.released[1] == why


def test_one_group_is_never_refused_nor_a_storm() -> None:
    """A daemon with one group: even with storm_min_groups 1 and every budget at 1, the group
    stalls into no storm and every co-restart acts."""
    cfg = config(storm_min_groups=1, max_concurrent_restarts=1, max_restarts_per_hour=1)
    state = fleet(1)
    for i in range(5):
        noted = note(state, "g0", ACTING, cfg, T0 + i)
        assert noted.declared is None
        ruling = arbitrate(noted.fleet, "g0", cfg, T0 + i)
        assert ruling.refused is None
        state = ruling.fleet


def test_suspects_name_what_stalled_groups_share() -> None:
    """The router URL, host and prefill URL shared by two or more stalled groups, most shared
    first; a host only one group uses is no suspect."""
    tops = [topology(g) for g in groups(4, shared_router=True)]
    found = suspects(["g0", "g1", "g2"], tops)
    pairs = [(s.kind, s.value, s.groups) for s in found]
    assert pairs[:2] == [
        ("host", "127.0.0.1", ("g0", "g1", "g2")),
        ("router", "http://127.0.0.1:30001", ("g0", "g1", "g2")),
    ]
    assert not any(s.value.startswith("10.0.0.") for s in found)


def test_a_topology_includes_ssh_hosts() -> None:
    """A remote group's SSH host is one of its hosts."""
    group = group_config("r")
    assert topology(group).hosts == ("127.0.0.1",)


def test_a_refused_co_restart_takes_the_charge_back_and_backs_off() -> None:
    """The group's co-restart decision, refused by the fleet: no action, stalled, nothing charged
    to its budget, the next try after one backoff_seconds, the refusal in the reasons."""
    h = Harness().warm()
    previous = h.state
    decision = h.stall()
    while decision.action is not Action.CO_RESTART:
        previous = h.state
        decision = h.stall()
    assert previous is not None
    assert decision.state.budget.restart_times == (h.stack.now,)
    out = refused(previous, decision, STORM, "held", h.stack.now)
    assert out.action is Action.NONE
    assert out.state.state is State.STALLED
    assert out.state.budget.restart_times == ()
    assert out.state.budget.backoff_until == h.stack.now + h.config.restart.backoff_seconds
    assert out.reasons[-1].code == "fleet_refused"


def test_a_refusal_before_the_first_step_gives_the_fleet_budget_back() -> None:
    """A co-restart the fleet allowed but a down host refused used no fleet budget."""
    cfg = config(max_restarts_per_hour=1)
    state = arbitrate(fleet(3), "g0", cfg, T0).fleet
    state = withdrawn(state, "g0", T0)
    assert state.restarts == ()
    assert state.busy == ()
    assert arbitrate(state, "g1", cfg, T0 + 1).refused is None


class _Stormy:
    """Collects the storms a FleetArbiter reports."""

    def __init__(self) -> None:
        self.storms: list[Storm] = []

    def __call__(self, storm: Storm) -> None:
        self.storms.append(storm)


def _samples(registry: CollectorRegistry, name: str) -> dict[str, float]:
    return {
        s.labels.get("reason", "") + s.labels.get("group", ""): s.value
        for family in registry.collect()
        for s in family.samples
        if s.name == name
    }


def test_the_daemon_side_logs_a_refusal_once_per_episode_and_counts_each() -> None:
    """FleetArbiter: a group refused twice for the fleet budget logs fleet_restart_refused once
    and counts restart_refusals_total{reason=fleet_budget} twice; its decision is rewritten."""
    registry = CollectorRegistry()
    metrics = WatchdogMetrics(registry, groups=["g0", "g1"])
    stormy = _Stormy()
    arbiter = FleetArbiter(config(), groups(4), metrics=metrics, on_storm=stormy)
    h0, h1 = Harness(config=groups(4)[0]).warm(), Harness(config=groups(4)[1]).warm()
    controls = OperatorControls()
    with capture_logs() as logs:
        for _ in range(100):  # 500 s: g1 asks again after its backoff (300 s)
            for name, h in (("g0", h0), ("g1", h1)):
                previous = h.state
                assert previous is not None
                decision = h.stall()
                ruled = arbiter.rule(name, previous, decision, controls, h.stack.now)
                h.state = ruled.state
                if ruled.action is Action.CO_RESTART:
                    assert name == "g0"  # and it stays restarting: no outcome comes back
    refusals = [e for e in logs if e["event"] == "fleet_restart_refused"]
    assert [(e["group"], e["reason"]) for e in refusals] == [("g1", FLEET_BUDGET)]
    counted = _samples(registry, "sglang_watchdog_restart_refusals_total")
    assert counted.get(f"{FLEET_BUDGET}g1", 0) >= 2
    assert stormy.storms == []  # 2 of 4 stalled: no storm
    hold = arbiter.hold_text("g1")
    assert hold.startswith("fleet budget")


def test_the_daemon_side_reports_a_storm_once_with_the_acting_group_named() -> None:
    """FleetArbiter: the storm is reported once through the daemon's hook, after the ruling, so
    the group the storm acts on is named as acted, not held; the gauge says a storm stands."""
    registry = CollectorRegistry()
    metrics = WatchdogMetrics(registry, groups=[f"g{i}" for i in range(4)])
    stormy = _Stormy()
    configs = groups(4)
    arbiter = FleetArbiter(config(), configs, metrics=metrics, on_storm=stormy)
    harnesses = {g.name: Harness(config=g).warm() for g in configs[:3]}
    with capture_logs():
        for _ in range(40):
            for name, h in harnesses.items():
                previous = h.state
                assert previous is not None
                ruled = arbiter.rule(name, previous, h.stall(), OperatorControls(), h.stack.now)
                h.state = ruled.state
    assert len(stormy.storms) == 1
    storm = stormy.storms[0]
    assert len(storm.acted) == 1
    assert set(storm.acted) | set(storm.held) == {"g0", "g1", "g2"}
    assert _samples(registry, "sglang_watchdog_fleet_storm_active") == {"": 1.0}
    assert _samples(registry, "sglang_watchdog_fleet_storms_total") == {"": 1.0}
    held = next(iter(storm.held))
    assert arbiter.hold_text(held).startswith("storm (3 of 4 stalled")


def test_status_shows_a_storm_held_group_as_held_with_the_reason() -> None:
    """`watchdog status`: a group the storm holds (decide() keeps it stalled) is written as held
    with the storm as its hold reason, and the table shows `held (storm)` and the reason first;
    one waiting for the fleet budget is not held but says why it waits."""
    group = groups(1)[0]
    h = Harness(config=group).warm()
    assert h.state is not None
    runtime = GroupRuntime(
        config=group,
        observer=cast(GroupObserver, None),
        scheduler=None,
        state=replace(h.state, state=State.STALLED),
        fleet_hold="storm (6 of 8 stalled; shared host 127.0.0.1): held until it recovers",
    )
    status = run_status.group_status(runtime, h.stack.now)
    assert status.held
    assert status.hold_reason.startswith("storm (6 of 8 stalled")
    table = format_table([status], [])
    row = next(line for line in table.splitlines() if line.startswith("g0"))
    assert "held (storm)" in row
    assert "storm (6 of 8 stalled; shared host 127.0.0.1)" in row
    waiting = run_status.group_status(
        replace(runtime, fleet_hold="fleet budget: waiting for its turn"), h.stack.now
    )
    assert not waiting.held
    assert "waiting (fleet budget)" in format_table([waiting], [])


def test_a_reset_storm_held_group_acts_at_its_next_stall_verdict() -> None:
    """FleetArbiter: a group the storm holds, re-armed by `watchdog reset`, leaves the hold
    (fleet_hold_released, by operator) and co-restarts at its next stall verdict, without waiting
    out the backoff its refusal started; the others stay held."""
    registry = CollectorRegistry()
    configs = groups(4)
    arbiter = FleetArbiter(config(), configs, metrics=WatchdogMetrics(registry), on_storm=_Stormy())
    harnesses = {g.name: Harness(config=g).warm() for g in configs[:3]}
    controls = {name: OperatorControls() for name in harnesses}
    acted: list[tuple[str, float]] = []

    def cycle() -> None:
        for name, h in harnesses.items():
            previous = h.state
            assert previous is not None
            decision = h.stall(operator=controls[name])
            ruled = arbiter.rule(name, previous, decision, controls[name], h.stack.now)
            h.state = ruled.state
            if ruled.action is Action.CO_RESTART:
                acted.append((name, h.stack.now))
                h.restarted(ok=False)  # the canary did not help: stalled again, backing off

    with capture_logs() as logs:
        for _ in range(40):
            cycle()
        assert [name for name, _ in acted] == ["g0"]
        held = [n for n in ("g1", "g2") if arbiter.hold(n) is not None]
        assert held == ["g1", "g2"]
        reset_at = harnesses["g1"].stack.now
        controls["g1"] = OperatorControls(rearmed_at=reset_at)
        for _ in range(3):
            cycle()
    assert [name for name, _ in acted] == ["g0", "g1"]
    assert acted[1][1] - reset_at <= 3 * 5.0  # not one backoff_seconds (300 s) later
    released = [e for e in logs if e["event"] == "fleet_hold_released"]
    assert [(e["group"], e["released_by"]) for e in released] == [("g1", "operator")]
    assert arbiter.hold("g2") is not None


def test_the_fleet_section_is_strict_and_documented_with_its_defaults() -> None:
    """[fleet]: unknown keys and out-of-range values are errors naming the key; the defaults are
    the ones configs/example.toml documents."""
    base = {"group": [configs.group("g1")]}
    assert parse_config(base, "t.toml").fleet == FleetSection()
    example = load_config(Path(__file__).parents[2] / "configs" / "example.toml")
    assert example.fleet == FleetSection()
    bad: list[dict[str, Any]] = [
        {"storm_share": 0},
        {"storm_share": 1.5},
        {"max_concurrent_restarts": 0},
        {"storm_window_seconds": -1},
        {"storm_min_groups": 0},
        {"storm_groups": 3},
    ]
    for fleet_values in bad:
        with pytest.raises(ConfigError) as raised:
            parse_config({**base, "fleet": fleet_values}, "t.toml")
        assert f"fleet.{next(iter(fleet_values))}" in str(raised.value)
