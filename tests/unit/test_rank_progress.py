"""Per-DP-rank progress: a wedged rank is acted on, a busy one is not (docs/decisions.md,
"DP-attention ranks").

A rank whose pinned probes fail while its siblings pass is a silent stall once its own decode
tokens (`realtime_tokens_total{mode="decode",dp_rank=...}` or its /v1/loads row's decode_moments)
have not grown beyond what our probes pinned to it received, plus one slack, for
no_progress_seconds while it holds work. A rank whose tokens grow stays an alert, and so does one
whose tokens are not read. Only pinned probes' tokens are ours on a rank: router probes' are
never charged to any rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.builders import Harness, group_config
from tests.unit.test_dp_ranks import pinned
from watchdog.decide import ACT_VERDICTS, Decision
from watchdog.decide.fold import TOKENS_SLACK
from watchdog.decide.verdict import Verdict
from watchdog.model import (
    Action,
    LoadsSnapshot,
    Observation,
    OwnTokens,
    RankLoad,
    RankTokens,
    Role,
)

DP_SIZE = 4
WEDGED = 2
NO_PROGRESS = 45.0  # the timeline's no_progress_seconds (builders.TIMELINE_TIMINGS)


def _dp_group() -> Harness:
    config = group_config(
        decode={"unit": "g-decode.service", "url": "http://127.0.0.1:30002", "dp_size": DP_SIZE}
    )
    return Harness(config=config).warm()


@dataclass
class Ranks:
    """Each rank's decode tokens as SGLang reports them, and the work each holds."""

    tokens: dict[int, float] = field(default_factory=lambda: dict.fromkeys(range(DP_SIZE), 100.0))
    work: dict[int, float] = field(default_factory=lambda: dict.fromkeys(range(DP_SIZE), 3.0))

    def grow(self, by: Mapping[int, float]) -> None:
        for rank, tokens in by.items():
            self.tokens[rank] += tokens

    def loads(self, *, null_moments: bool = False) -> tuple[RankLoad, ...]:
        return tuple(
            RankLoad(
                rank,
                0.0 if null_moments else self.tokens[rank],
                running_reqs=self.work[rank],
                waiting_reqs=0.0,
            )
            for rank in range(DP_SIZE)
        )


def _cycle(
    h: Harness,
    ranks: Ranks,
    *,
    source: str = "metrics",
    own_rank: int = 0,
    own_router: int = 0,
    wedged_fails: bool = True,
) -> Decision:
    """One cycle: router probes pass (other ranks serve them), one pinned round in which the
    wedged rank fails (or not), each rank's tokens and work read from `source`."""
    obs = h.stack.cycle((True,))
    probes = tuple(pinned(r, not (wedged_fails and r == WEDGED), obs.at - 1) for r in range(4))
    metrics = obs.metrics
    loads = obs.loads
    if source in ("metrics", "both"):
        metrics = tuple(
            replace(m, ranks=ranks.loads()) if m.role is Role.DECODE else m for m in metrics
        )
    else:
        live = LoadsSnapshot(Role.DECODE, obs.at, ok=True, ranks=ranks.loads())
        loads = (*loads, live)
    own = obs.own_tokens + OwnTokens(received=own_router + own_rank)
    obs = replace(
        obs,
        probes=(*obs.probes, *probes),
        metrics=metrics,
        loads=loads,
        own_tokens=own,
        own_rank_tokens=(RankTokens(0, WEDGED, own_rank),) if own_rank else (),
    )
    return h.feed(obs)


def _run(h: Harness, ranks: Ranks, cycles: int, grow: Mapping[int, float], **kw: object) -> None:
    for _ in range(cycles):
        ranks.grow(grow)
        _cycle(h, ranks, **kw)  # type: ignore[arg-type]


SIBLINGS = {r: 40.0 for r in range(DP_SIZE) if r != WEDGED}


def test_a_wedged_rank_whose_tokens_are_flat_is_a_silent_stall_naming_it() -> None:
    """A wedged rank with flat tokens is alerted, then a silent stall naming it once time is up."""
    h, ranks = _dp_group(), Ranks()
    _run(h, ranks, 14, SIBLINGS)
    verdicts = [d.verdict for d in h.decisions[1:]]
    # The pinned run reaches probe_failures at the third round: alerted while the rank's own
    # flat clock (from its first read) runs, then acted on once it reaches no_progress_seconds.
    assert verdicts[2] is Verdict.DP_RANK_WEDGED
    assert h.decisions[3].reasons[1].code == "rank_not_flat"
    stall = next(d for d in h.decisions if d.verdict is Verdict.SILENT_STALL)
    assert stall.action is Action.CO_RESTART
    named, flat = stall.reasons[:2]
    assert named.code == "dp_rank_stalled"
    assert dict(named.values)["workers"] == f"decode dp_rank {WEDGED}"
    assert flat.code == "dp_rank_tokens_flat"
    assert float(dict(flat.values)["flat_seconds"]) >= NO_PROGRESS
    first_read = h.decisions[1].state.progress.rank_marks[WEDGED].at
    assert stall.state.since - first_read >= NO_PROGRESS


def test_a_busy_rank_whose_tokens_grow_is_never_acted_on() -> None:
    """A rank whose queue is long: its pinned probes time out, but it makes a token a cycle
    beyond ours."""
    h, ranks = _dp_group(), Ranks()
    _run(h, ranks, 30, {**SIBLINGS, WEDGED: TOKENS_SLACK + 1}, own_rank=0)
    assert Action.CO_RESTART not in h.actions
    assert all(d.verdict not in ACT_VERDICTS for d in h.decisions)
    assert h.decisions[-1].verdict is Verdict.DP_RANK_WEDGED
    assert h.decisions[-1].reasons[1].code == "rank_not_flat"
    assert h.actions.count(Action.ALERT) == 1


def test_only_the_tokens_our_pinned_probes_received_on_the_rank_are_subtracted() -> None:
    """The rank's tokens grow by exactly what our probes pinned to it received: that is ours,
    not progress."""
    h, ranks = _dp_group(), Ranks()
    _run(h, ranks, 12, {**SIBLINGS, WEDGED: 6.0}, own_rank=6)
    assert "silent_stall" in h.verdicts
    assert Action.CO_RESTART in h.actions


def test_router_probe_tokens_are_never_charged_to_a_rank() -> None:
    """Router probes received far more than the rank grew, but on an unknown rank: the rank's
    growth is progress, never written off against them."""
    h, ranks = _dp_group(), Ranks()
    _run(h, ranks, 30, {**SIBLINGS, WEDGED: 5.0}, own_router=100)
    assert Action.CO_RESTART not in h.actions
    assert h.decisions[-1].verdict is Verdict.DP_RANK_WEDGED


def test_a_rank_holding_no_work_is_not_acted_on() -> None:
    """A rank whose pinned probes fail but that holds no work is not acted on."""
    h, ranks = _dp_group(), Ranks()
    ranks.work[WEDGED] = 0.0
    _run(h, ranks, 30, SIBLINGS)
    assert Action.CO_RESTART not in h.actions
    assert "holds no work" in h.decisions[-1].reasons[1].message


def test_decode_moments_alone_never_show_a_rank_flat() -> None:
    """Per-rank /v1/loads rows without the dp_rank series: decode_moments skip every step of
    2 s or more (STEP_MAX_US), so a very slow rank adds nothing there. Alerted, never acted on."""
    h, ranks = _dp_group(), Ranks()
    _run(h, ranks, 30, SIBLINGS, source="loads")
    assert Action.CO_RESTART not in h.actions
    assert h.decisions[-1].verdict is Verdict.DP_RANK_WEDGED
    assert h.decisions[-1].reasons[1].code == "rank_progress_unknown"


def test_decode_moments_growing_are_progress_even_with_the_series_flat() -> None:
    """Growing decode moments on a rank are progress even while its token series stays flat."""
    h, ranks = _dp_group(), Ranks()
    for _ in range(30):
        ranks.grow(SIBLINGS)
        moments = Ranks(tokens={**ranks.tokens}, work=ranks.work)
        moments.tokens[WEDGED] += 10.0 * len(h.decisions)  # decode_moments grow, the series not
        obs = h.stack.cycle((True,))
        obs = replace(
            obs,
            probes=(*obs.probes, *(pinned(r, r != WEDGED, obs.at - 1) for r in range(4))),
            metrics=tuple(
                replace(m, ranks=ranks.loads()) if m.role is Role.DECODE else m for m in obs.metrics
            ),
            loads=(LoadsSnapshot(Role.DECODE, obs.at, ok=True, ranks=moments.loads()),),
        )
        h.feed(obs)
    assert Action.CO_RESTART not in h.actions
    assert h.decisions[-1].verdict is Verdict.DP_RANK_WEDGED


def test_without_per_rank_readings_the_alert_says_progress_is_unknown() -> None:
    """Without per-rank readings a failing rank is alerted as progress unknown, never acted on."""
    h = _dp_group()
    for _ in range(20):
        obs = h.stack.cycle((True,))
        obs = replace(obs, probes=(*obs.probes, *(pinned(r, r != 2, obs.at - 1) for r in range(4))))
        h.feed(obs)
    assert h.decisions[-1].verdict is Verdict.DP_RANK_WEDGED
    assert h.decisions[-1].reasons[1].code == "rank_progress_unknown"
    assert Action.CO_RESTART not in h.actions


# --- Both directions as properties ---

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass(frozen=True)
class RankCycle:
    seconds: float
    pinned: int  # tokens our probes pinned to the wedged rank received this cycle
    during: float  # the share of them received while this observation's fetches ran
    router: int  # tokens router probes received (on some rank: unknown which)
    share: float  # the flat rank's growth as a share of its pinned tokens


def rank_cycle_st() -> st.SearchStrategy[RankCycle]:
    """Cycles of tokens around the wedged rank: ours pinned to it, the router's, its growth."""
    return st.builds(
        RankCycle,
        seconds=st.floats(min_value=0.5, max_value=30.0),
        pinned=st.integers(min_value=0, max_value=20),
        during=st.floats(min_value=0.0, max_value=1.0),
        router=st.integers(min_value=0, max_value=200),
        share=st.floats(min_value=0.0, max_value=1.0),
    )


# Where the ranks' tokens are read: the dp_rank series, the /v1/loads rows, or both. Only the
# series can show a rank flat (decode_moments skip slow steps).
SOURCES = st.sampled_from(["metrics", "loads", "both"])
FLAT_SOURCES = st.sampled_from(["metrics", "both"])


def _property_cycle(h: Harness, ranks: Ranks, c: RankCycle, grow: float, source: str) -> Decision:
    ranks.grow({**SIBLINGS, WEDGED: grow})
    obs = h.stack.cycle((True,), seconds=c.seconds)
    probes = tuple(pinned(r, r != WEDGED, obs.at - 1) for r in range(4))
    during = int(c.pinned * c.during)
    metrics, loads = obs.metrics, obs.loads
    if source in ("metrics", "both"):
        metrics = tuple(
            replace(m, ranks=ranks.loads()) if m.role is Role.DECODE else m for m in metrics
        )
    if source in ("loads", "both"):
        loads = (LoadsSnapshot(Role.DECODE, obs.at, ok=True, ranks=ranks.loads()),)
    obs = replace(
        obs,
        probes=(*obs.probes, *probes),
        metrics=metrics,
        loads=loads,
        own_tokens=obs.own_tokens + OwnTokens(received=c.router + c.pinned),
        own_rank_tokens=(RankTokens(0, WEDGED, c.pinned),),
        own_rank_tokens_during=(RankTokens(0, WEDGED, during),),
    )
    return h.feed(obs)


@SETTINGS
@given(
    cycles=st.lists(rank_cycle_st(), min_size=1, max_size=30),
    excess=st.floats(min_value=0.01, max_value=50.0),
    source=SOURCES,
)
def test_a_rank_growing_beyond_its_pinned_tokens_is_never_acted_on(
    cycles: list[RankCycle], excess: float, source: str
) -> None:
    """Every cycle the rank's tokens grow by more than our pinned tokens on it since the previous
    read began, and the slack: a busy rank. No action, however its pinned probes and the router's
    tokens fare."""
    h, ranks = _dp_group(), Ranks()
    during_before = 0
    for c in cycles:
        bound = c.pinned + during_before + TOKENS_SLACK
        decision = _property_cycle(h, ranks, c, bound + excess, source)
        during_before = int(c.pinned * c.during)
        assert decision.verdict not in ACT_VERDICTS, decision
        assert decision.action is not Action.CO_RESTART, decision


@SETTINGS
@given(cycles=st.lists(rank_cycle_st(), min_size=1, max_size=8), source=FLAT_SOURCES)
def test_a_rank_growing_only_by_its_pinned_tokens_is_a_silent_stall(
    cycles: list[RankCycle], source: str
) -> None:
    """The rank's tokens grow by no more than our pinned probes on it received while they fail
    and it holds work: a silent stall, once flat for no_progress_seconds from its first read."""
    h, ranks = _dp_group(), Ranks()
    first_read: float | None = None
    for rounds, c in enumerate(cycles * 100, start=1):
        decision = _property_cycle(h, ranks, c, c.share * c.pinned, source)
        marks = decision.state.progress.rank_marks
        if first_read is None:
            first_read = marks[WEDGED].at
        assert marks[WEDGED].at == first_read  # none of it read as progress
        if rounds >= 3 and h.stack.now - first_read >= NO_PROGRESS:
            assert decision.verdict is Verdict.SILENT_STALL, decision
            assert decision.action is Action.CO_RESTART, decision
            return
        assert decision.verdict not in ACT_VERDICTS, decision
    raise AssertionError("never decided")


def test_observation_fields_default_to_no_ranks() -> None:
    """An observation without rank readings has none, so older callers need not pass them."""
    obs = Observation(group="g", at=0.0)
    assert obs.own_rank_tokens == () == obs.own_rank_tokens_during
