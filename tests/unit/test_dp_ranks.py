"""One DP rank of a decode wedged, its other ranks serving: found by the pinned probes, named."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.unit.builders import Harness, group_config
from watchdog.decide.ranks import fold_ranks, wedged_ranks
from watchdog.decide.state import RankRun
from watchdog.decide.verdict import Verdict
from watchdog.evidence.report import suspects
from watchdog.model import Action, ProbeFailure, ProbeKind, ProbeResult

T = 1_000_000.0


def pinned(rank: int, ok: bool, at: float, *, decode: int = 0) -> ProbeResult:
    """A finished direct PD probe pinned to `rank` of decode `decode`, started at `at`."""
    return ProbeResult(
        kind=ProbeKind.DIRECT,
        target="decode",
        ok=ok,
        reason=ProbeFailure.OK if ok else ProbeFailure.TIMEOUT_BEFORE_HEADERS,
        started_at=at,
        duration_seconds=0.5,
        worker=decode,
        dp_rank=rank,
        detail="" if ok else f"prefill+decode dp_rank {rank}: no headers",
    )


def _runs(rounds: list[dict[int, bool]]) -> tuple[RankRun, ...]:
    runs: tuple[RankRun, ...] = ()
    for i, results in enumerate(rounds):
        runs = fold_ranks(runs, [pinned(r, ok, T + 60 * i) for r, ok in results.items()])
    return runs


OK4 = {0: True, 1: True, 2: True, 3: True}
RANK2 = {0: True, 1: True, 2: False, 3: True}
ALL_FAIL = dict.fromkeys(range(4), False)


@pytest.mark.parametrize(
    ("rounds", "wedged"),
    [
        ([OK4, OK4, OK4], []),
        ([RANK2, RANK2], []),  # two in a row: under probe_failures (3)
        ([RANK2, RANK2, RANK2], [2]),
        ([OK4, RANK2, RANK2, RANK2], [2]),
        ([RANK2, RANK2, OK4, RANK2], []),  # a pass breaks the run
        ([ALL_FAIL, ALL_FAIL, ALL_FAIL], []),  # the whole decode: the other rules' case
        ([RANK2, RANK2, {**ALL_FAIL}], []),  # the others failing too now: not one rank's
        ([RANK2, RANK2, {2: False}], [2]),  # the others' latest passes still count
        ([{2: False, 3: False}, {2: False, 3: False}, {0: True, 2: False, 3: False}], [2, 3]),
    ],
)
def test_which_ranks_are_wedged(rounds: list[dict[int, bool]], wedged: list[int]) -> None:
    """A rank is wedged after probe_failures failed rounds in a row while its siblings pass."""
    assert [r.dp_rank for r in wedged_ranks(_runs(rounds), 3)] == wedged


def test_ranks_of_another_decode_do_not_vouch_for_this_one() -> None:
    """A passing probe pinned to a rank of another decode does not clear this decode's rank."""
    runs: tuple[RankRun, ...] = ()
    for i in range(3):
        at = T + 60 * i
        runs = fold_ranks(
            runs, [pinned(0, False, at), pinned(1, False, at), pinned(0, True, at, decode=1)]
        )
    assert wedged_ranks(runs, 3) == ()


def test_unpinned_internal_errors_and_late_results_are_left_out() -> None:
    """Unpinned probes, internal errors and stale results do not count for a rank."""
    runs = fold_ranks((), [pinned(1, False, T), pinned(1, False, T + 60)])
    assert runs[0].failures == 2
    unpinned = replace(pinned(1, False, T + 120), dp_rank=None)
    raised = replace(pinned(1, False, T + 120), reason=ProbeFailure.INTERNAL_ERROR)
    late = pinned(1, True, T + 30)  # started before the latest known result
    assert fold_ranks(runs, [unpinned, raised, late]) == runs


def _dp_group() -> Harness:
    config = group_config(
        decode={"unit": "g-decode.service", "url": "http://127.0.0.1:30002", "dp_size": 4}
    )
    return Harness(config=config).warm()


def test_a_wedged_rank_is_named_in_an_alert_and_never_restarted() -> None:
    """Its pinned probes fail while its siblings pass: named and alerted once. A rank whose queue
    is only long fails them alike and per-rank progress is not read, so never a restart."""
    h = _dp_group()
    decisions = []
    for _ in range(20):
        # Router probes pass (they land on the healthy ranks); the pinned round fails on rank 2.
        obs = h.stack.cycle((True,))
        at = obs.at - 1
        obs = replace(obs, probes=(*obs.probes, *(pinned(r, r != 2, at) for r in range(4))))
        decisions.append(h.feed(obs))
    decision = decisions[2]
    assert decision.verdict is Verdict.DP_RANK_WEDGED
    assert decision.action is Action.ALERT
    assert decision.state.direct == ()  # pinned results stay out of the pairs' (the router rung)
    first = decision.reasons[0]
    assert first.code == "dp_rank_stalled"
    assert dict(first.values)["workers"] == "decode dp_rank 2"
    assert decision.reasons[1].code == "rank_progress_unknown"
    summary = {"decision_reasons": [{"code": first.code, "values": list(first.values)}]}
    assert suspects(summary) == ["decode dp_rank 2"]
    assert [d.action for d in decisions].count(Action.ALERT) == 1
    assert Action.CO_RESTART not in [d.action for d in decisions]
    assert all(d.verdict is Verdict.DP_RANK_WEDGED for d in decisions[2:])


def test_two_in_a_row_are_not_yet_a_stall() -> None:
    """Two failed rounds pinned to one rank are not yet a stall: the group stays OK."""
    h = _dp_group()
    for _ in range(2):
        obs = h.stack.cycle((True,))
        obs = replace(obs, probes=(*obs.probes, *(pinned(r, r != 2, obs.at - 1) for r in range(4))))
        decision = h.feed(obs)
    assert decision.verdict is Verdict.OK
