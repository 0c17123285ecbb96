"""The detector with several workers per role: decode-only per pair, pending work named per worker."""

from __future__ import annotations

from dataclasses import replace

from tests.unit.builders import health, metrics, unit
from watchdog.config import GroupSection
from watchdog.decide.fold import Facts, observe
from watchdog.decide.state import GroupState, initial_state
from watchdog.model import Observation, Role, UnitState

P, D, R = Role.PREFILL, Role.DECODE, Role.ROUTER
T0 = 1_000_000.0
US = 1_000_000


def group_2p2d() -> GroupSection:
    """Two prefills, two decodes, one router."""
    return GroupSection.model_validate(
        {
            "name": "g",
            "prefill": [
                {"unit": "p1.service", "url": "http://127.0.0.1:31001"},
                {"unit": "p2.service", "url": "http://127.0.0.1:31002"},
            ],
            "decode": [
                {"unit": "d1.service", "url": "http://127.0.0.1:31003"},
                {"unit": "d2.service", "url": "http://127.0.0.1:31004"},
            ],
            "router": {"unit": "r.service", "url": "http://127.0.0.1:31000"},
        }
    )


CONFIG = group_2p2d()


def units(starts: dict[tuple[Role, int], float]) -> tuple[UnitState, ...]:
    """Running units of every worker, started at the given times (seconds)."""
    return tuple(
        replace(unit(role, int(at * US)), worker=worker) for (role, worker), at in starts.items()
    )


def fold(
    state: GroupState, at: float, starts: dict[tuple[Role, int], float]
) -> tuple[GroupState, Facts]:
    """One observation with only unit states."""
    return observe(state, Observation("g", at, units=units(starts)), CONFIG, at, quiet=False)


START = {(P, 0): T0 - 5000, (P, 1): T0 - 5000, (D, 0): T0 - 4000, (D, 1): T0 - 4000, (R, 0): T0}


def test_decode_two_restarted_alone_is_decode_only_against_both_prefills() -> None:
    """Decode #2's start changes while both prefills keep theirs: decode-only, named."""
    state, facts = fold(initial_state(T0), T0, START)
    assert not facts.decode_only_new
    state, facts = fold(state, T0 + 10, {**START, (D, 1): T0 + 8})
    assert facts.decode_only_new
    assert Role.DECODE not in facts.restarted
    assert state.units.decode_only_seen_at == T0 + 10
    assert state.units.decode_only_workers == ("decode#2 (prefill#1, prefill#2)",)


def test_full_co_restart_is_not_decode_only() -> None:
    """Both prefills restarted, then both decodes: an ordinary restart of every worker."""
    state, _ = fold(initial_state(T0), T0, START)
    later = {(P, 0): T0 + 1, (P, 1): T0 + 1.5, (D, 0): T0 + 3, (D, 1): T0 + 3.2, (R, 0): T0 + 5}
    state, facts = fold(state, T0 + 10, later)
    assert not facts.decode_only_new
    assert facts.restarted == frozenset({P, D, R})
    assert state.units.decode_only_seen_at is None


def test_decodes_restarted_after_only_one_prefill_are_decode_only_against_the_other() -> None:
    """Prefill #1 and both decodes restarted, prefill #2 kept running: decode-only for #2."""
    state, _ = fold(initial_state(T0), T0, START)
    later = {**START, (P, 0): T0 + 1, (D, 0): T0 + 3, (D, 1): T0 + 3}
    state, facts = fold(state, T0 + 10, later)
    assert facts.decode_only_new
    assert state.units.decode_only_workers == ("decode#1 (prefill#2)", "decode#2 (prefill#2)")
    # Prefill #2 restarted too, within the grace window: resolved.
    state, facts = fold(state, T0 + 20, {**later, (P, 1): T0 + 15})
    assert facts.decode_only_cancelled
    assert state.units.decode_only_seen_at is None


def test_pending_work_names_the_worker_holding_it() -> None:
    """A prefill #2 inflight queue and a decode #1 transfer queue are named per worker."""
    at = T0 + 1
    obs = Observation(
        "g",
        at,
        health=tuple(
            replace(health(role.value, at=at), worker=w) for role in (P, D) for w in (0, 1)
        ),
        metrics=(
            metrics(P, at=at),
            replace(metrics(P, at=at, inflight_queue=3.0), worker=1),
            replace(metrics(D, at=at, decode_transfer_queue=2.0), worker=0),
            replace(metrics(D, at=at), worker=1),
        ),
    )
    state, facts = observe(initial_state(T0), obs, CONFIG, at, quiet=False)
    assert ("prefill#2_inflight_queue", 3.0) in facts.pending
    assert ("decode#1_decode_transfer_queue", 2.0) in facts.pending
    assert facts.metrics_fresh
    assert state.progress.handoff_busy_since == at
    assert [(b.role, b.worker) for b in state.progress.baselines] == [
        (P, 0),
        (P, 1),
        (D, 0),
        (D, 1),
    ]
    # One worker unscraped: not fresh.
    partial = replace(obs, metrics=obs.metrics[:3])
    _, facts = observe(initial_state(T0), partial, CONFIG, at, quiet=False)
    assert not facts.metrics_fresh


def test_one_failing_worker_fails_its_role() -> None:
    """Any worker's /health failing makes its role's health fail."""
    at = T0 + 1
    checks = (
        replace(health("prefill", at=at), worker=0),
        replace(health("prefill", False, at=at), worker=1),
        replace(health("decode", at=at), worker=0),
        replace(health("decode", at=at), worker=1),
    )
    _, facts = observe(
        initial_state(T0), Observation("g", at, health=checks), CONFIG, at, quiet=False
    )
    assert facts.workers_failing == (P,)
