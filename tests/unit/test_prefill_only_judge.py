"""A prefill restarted alone, judged instead of assumed (`stall.on_prefill_only_restart`).

With "judge", the survivor rung is replaced by an alert when, after the grace, every affected
pair passes a direct PD probe started after the fresh prefill served and its decodes run an
SGLang that refreshes stale prefill bootstrap metadata by itself (0.5.19+, docs/sglang.md §7.11).
Anything else takes the rung as before; the default "act" always does.
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from tests.unit.builders import Harness, group_config
from tests.unit.test_detector_workers import group_2p2d
from watchdog.config import GroupSection
from watchdog.decide import Decision
from watchdog.decide.judge import affected_pairs, refreshes_stale_prefill
from watchdog.decide.verdict import Verdict
from watchdog.model import (
    Action,
    LoadsSnapshot,
    ProbeFailure,
    ProbeKind,
    ProbeResult,
    Role,
    Rung,
)
from watchdog.pairs import Pair

P = Role.PREFILL
JUDGE_STALL: dict[str, Any] = {"on_prefill_only_restart": "judge"}
PERIODIC: dict[str, Any] = {"direct_every_seconds": 10.0}  # "judge" needs periodic direct probes
GRACE_CYCLES = 11  # cycles of 5 s still inside the 60 s grace after the first one


def direct(ok: bool, *, at: float) -> ProbeResult:
    """A direct PD probe of prefill+decode that started at `at`."""
    return ProbeResult(
        kind=ProbeKind.DIRECT,
        target="decode",
        ok=ok,
        reason=ProbeFailure.OK if ok else ProbeFailure.HTTP_ERROR,
        started_at=at,
        duration_seconds=0.2,
        tokens=4 if ok else 0,
        status_code=200 if ok else 500,
    )


def decode_loads(version: str, *, at: float) -> LoadsSnapshot:
    """Decode's /v1/loads answer naming its SGLang version."""
    return LoadsSnapshot(role=Role.DECODE, fetched_at=at, ok=True, timestamp=at, version=version)


def after_grace(h: Harness, *, pair_ok: bool = True, version: str | None = "0.5.23") -> Decision:
    """A prefill restarted alone; direct probes each cycle through the grace; the deciding cycle."""
    h.warm()
    h.stack.restart(P)
    h.stack.n_restarts[P] += 1
    h.step((True,))
    for _ in range(GRACE_CYCLES):
        h.step((True, direct(pair_ok, at=h.stack.now + 1.0)))
    loads = () if version is None else (decode_loads(version, at=h.stack.now + 5.0),)
    return h.step((True, direct(pair_ok, at=h.stack.now + 1.0)), loads=loads)


def codes(decision: Decision) -> list[str]:
    """The reason codes of a decision, in order."""
    return [r.code for r in decision.reasons]


def test_judge_alerts_when_the_pair_passes_on_a_self_refreshing_version() -> None:
    """Passing pair, decode 0.5.23: an alert naming the pair and the version, no restart."""
    h = Harness(config=group_config(stall=JUDGE_STALL, probe=PERIODIC))
    decided = after_grace(h)
    assert (decided.verdict, decided.action) == (Verdict.PREFILL_ONLY_RESTART, Action.ALERT)
    assert codes(decided) == ["prefill_only_restart", "prefill_only_recovered"]
    why = dict(decided.reasons[1].values)
    assert why == {"pairs": "prefill+decode", "version": "0.5.23"}
    assert Action.CO_RESTART not in h.actions
    later = h.steps(3, (True,))
    assert later.action is Action.NONE
    assert later.state.units.prefill_only == ()
    assert Action.CO_RESTART not in h.actions


@pytest.mark.parametrize("version", ["0.5.16", "0.5.18", "0.5.19rc0", None])
def test_judge_takes_the_rung_on_an_older_or_unknown_version(version: str | None) -> None:
    """A decode before 0.5.19 (or of unknown version) keeps stale metadata: the survivor rung."""
    h = Harness(config=group_config(stall=JUDGE_STALL, probe=PERIODIC))
    decided = after_grace(h, version=version)
    assert (decided.action, decided.rung) == (Action.CO_RESTART, Rung.SURVIVOR)
    judged = next(r for r in decided.reasons if r.code == "prefill_only_judged")
    assert dict(judged.values)["version"] == (version or "unknown")


def test_judge_takes_the_rung_when_the_pair_fails() -> None:
    """A failing direct probe of the pair after the grace: the survivor rung."""
    h = Harness(config=group_config(stall=JUDGE_STALL, probe=PERIODIC))
    decided = after_grace(h, pair_ok=False)
    assert (decided.action, decided.rung) == (Action.CO_RESTART, Rung.SURVIVOR)
    judged = next(r for r in decided.reasons if r.code == "prefill_only_judged")
    assert "prefill+decode" in judged.message


def test_judge_ignores_a_pass_from_before_the_prefill_served() -> None:
    """Only probes started after the fresh prefill served count."""
    h = Harness(config=group_config(stall=JUDGE_STALL, probe=PERIODIC))
    h.warm()
    early = direct(True, at=h.stack.now - 1.0)  # before the restart is seen
    h.stack.restart(P)
    h.step((True, early))
    h.steps(GRACE_CYCLES, (True,))
    decided = h.step((True,), loads=(decode_loads("0.5.23", at=h.stack.now + 5.0),))
    assert (decided.action, decided.rung) == (Action.CO_RESTART, Rung.SURVIVOR)


def test_default_act_takes_the_rung_even_when_the_pair_passes() -> None:
    """The default is "act": unchanged, the survivor rung after the grace."""
    h = Harness(config=group_config(probe={"direct_every_seconds": 10.0}))
    assert h.config.stall.on_prefill_only_restart == "act"
    decided = after_grace(h)
    assert (decided.action, decided.rung) == (Action.CO_RESTART, Rung.SURVIVOR)
    assert not {"prefill_only_recovered", "prefill_only_judged"} & set(codes(decided))


def test_judge_needs_periodic_direct_probes() -> None:
    """Router retries may hide the failed room, so "judge" requires direct_every_seconds > 0."""
    with pytest.raises(ValidationError, match="direct_every_seconds"):
        group_config(stall={"on_prefill_only_restart": "judge"})
    with pytest.raises(ValidationError):
        group_config(stall={"on_prefill_only_restart": "maybe"})


@pytest.mark.parametrize(
    ("version", "fixed"),
    [
        ("0.5.19", True),
        ("0.5.23", True),
        ("0.5.23.post1", True),
        ("0.6.0", True),
        ("0.5.18", False),
        ("0.4.10", False),
        ("0.5.19rc1", False),
        ("0.5.19.dev3", False),
        ("", False),
    ],
)
def test_which_versions_refresh_by_themselves(version: str, fixed: bool) -> None:
    """0.5.19 is the first release with the fix; pre-releases are not trusted."""
    assert refreshes_stale_prefill(version) is fixed


def test_affected_pairs_in_xpyd_are_the_fresh_prefill_with_every_decode() -> None:
    """Prefill #2 restarted alone affects its pairs with both decodes, not prefill #1's."""
    config: GroupSection = group_2p2d()
    assert affected_pairs(config, (1,)) == (Pair(1, 0), Pair(1, 1))
