"""The progress rule as properties (hypothesis): decode's tokens beyond the ones we can prove ours.

docs/decisions.md, "Progress": decode's per-iteration counters are progress when, since the last
progress, they grew by more than the tokens our probes received (counted exactly, at the edge)
and one slack. Health checks (ours and the router's) add no decode tokens on SGLang (decode's fake
health request finishes in the prebuilt step: tests/conformance checks it on real 0.5.23), so
they are not in the account.

- A slow decode serving others: however our probes fare (timing out in its queue, stalling
  mid-stream, raising), if decode's counters grow by more than that each cycle, no verdict with an
  action is reached.
- Its twin: a decode whose counters grow by no more than our own tokens while work is pending and
  probes fail is a silent stall, decided as soon as it has been flat for no_progress_seconds.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.builders import T0, group_config, health, metrics, probe
from watchdog.config import GroupSection
from watchdog.decide import ACT_VERDICTS, Decision, GroupState, Verdict, decide, initial_state
from watchdog.decide.fold import TOKENS_SLACK
from watchdog.model import (
    Action,
    LoadsSnapshot,
    Observation,
    OwnTokens,
    ProbeFailure,
    ProbeKind,
    ProbeResult,
    Role,
)

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NO_PROGRESS_SECONDS = 15.0
PROBE_FAILURES = 2
ANY_FAILURE = [
    ProbeFailure.TIMEOUT_BEFORE_HEADERS,
    ProbeFailure.STALLED_MIDSTREAM,
    ProbeFailure.HTTP_ERROR,
    ProbeFailure.MALFORMED,
    ProbeFailure.EMPTY_OUTPUT,
    ProbeFailure.INTERNAL_ERROR,
]


def config() -> GroupSection:
    """The group config the properties are stated against."""
    return group_config(
        stall={"no_progress_seconds": NO_PROGRESS_SECONDS, "probe_failures": PROBE_FAILURES}
    )


@dataclass(frozen=True)
class Cycle:
    """One cycle as generated: what our probes did and received, and what decode counted."""

    seconds: float
    probes: tuple[tuple[bool, ProbeKind, ProbeFailure, int], ...]  # ok, kind, why, tokens
    in_flight: int
    streamed: int  # tokens in-flight probes received this cycle, beyond the finished ones'
    during: float  # the share of this cycle's own tokens received while the fetches ran
    share: float  # decode's growth: beyond the bound (slow) or a share of it (stalled)
    loads: bool  # /v1/loads decode_moments read too


def cycle_st(*, failing: bool, min_seconds: float = 0.5) -> st.SearchStrategy[Cycle]:
    """Cycles of probe outcomes, kinds and token counts; all failing when failing is set."""
    outcome = (
        st.tuples(st.just(False), st.sampled_from(ANY_FAILURE))
        if failing
        else st.one_of(
            st.tuples(st.just(True), st.just(ProbeFailure.OK)),
            st.tuples(st.just(False), st.sampled_from(ANY_FAILURE)),
        )
    )
    one_probe = st.tuples(
        outcome,
        st.sampled_from([ProbeKind.COMPLETION, ProbeKind.MULTIROUND, ProbeKind.DIRECT]),
        st.integers(min_value=0, max_value=20),
    ).map(lambda t: (t[0][0], t[1], t[0][1], t[2]))
    return st.builds(
        Cycle,
        seconds=st.floats(min_value=min_seconds, max_value=30.0),
        probes=st.lists(one_probe, min_size=1 if failing else 0, max_size=3).map(tuple),
        in_flight=st.integers(min_value=1, max_value=6),
        streamed=st.integers(min_value=0, max_value=40),
        during=st.floats(min_value=0.0, max_value=1.0),
        share=st.floats(min_value=0.0, max_value=1.0),
        loads=st.booleans(),
    )


@dataclass
class Decode:
    """The simulated decode's counters and the watchdog's clock."""

    now: float = T0
    realtime: float = 1000.0
    moments: float = 1000.0
    ttft: float = 100.0
    generated: float = 1000.0
    decisions: list[Decision] | None = None

    def observe(
        self, cycle: Cycle, grow: float, own: OwnTokens, results: tuple[ProbeResult, ...]
    ) -> Observation:
        self.realtime += grow
        self.moments += grow
        during = OwnTokens(
            received=int(own.received * cycle.during),
            first=int(own.first * cycle.during),
            finished=int(own.finished * cycle.during),
        )
        loads = (
            (
                LoadsSnapshot(
                    Role.DECODE,
                    self.now,
                    ok=True,
                    running_reqs=8,
                    waiting_reqs=4,
                    decode_tokens_total=self.moments,
                ),
            )
            if cycle.loads
            else ()
        )
        return Observation(
            group="g",
            at=self.now,
            probes=results,
            probes_in_flight=cycle.in_flight,
            oldest_probe_in_flight_seconds=1.0,
            health=(health("prefill", at=self.now), health("decode", at=self.now)),
            metrics=tuple(
                metrics(
                    role,
                    at=self.now,
                    requests_total=100.0,
                    generation_tokens_total=self.generated,
                    realtime_tokens_total=self.realtime,
                    ttft_count=self.ttft,
                    http_requests_active=8.0,
                    # Every slot busy, and more waiting (our probes among them).
                    running_reqs=8.0 if role is Role.DECODE else 0.0,
                    queue_reqs=4.0 if role is Role.DECODE else 0.0,
                )
                for role in (Role.PREFILL, Role.DECODE)
            ),
            loads=loads,
            own_tokens=own,
            own_tokens_during=during,
        )


def results_of(cycle: Cycle, end: float) -> tuple[ProbeResult, ...]:
    """The probe results of a generated cycle, finished just before its end."""
    out = []
    for i, (ok, kind, why, tokens) in enumerate(cycle.probes):
        base = probe(ok, at=end - 0.01 * (len(cycle.probes) - i), kind=kind, reason=why)
        out.append(replace(base, tokens=tokens))
    return tuple(out)


def own_of(cycle: Cycle, results: tuple[ProbeResult, ...]) -> OwnTokens:
    """The own tokens the probes of a cycle received, in flight and finished."""
    finished = sum(r.tokens for r in results)
    first = sum(r.tokens > 0 for r in results) + min(cycle.streamed, cycle.in_flight)
    return OwnTokens(received=finished + cycle.streamed, first=first, finished=finished)


def feed(state: GroupState, obs: Observation, group: GroupSection) -> Decision:
    """One decide() call at the observation's time."""
    return decide(state, obs, group, obs.at)


def warm(decode: Decode, group: GroupSection) -> GroupState:
    """One healthy cycle: a probe succeeds and decode is read for the first time."""
    state = initial_state(decode.now)
    decode.now += 5.0
    ok = probe(True, at=decode.now)
    first = Cycle(5.0, (), 1, 0, 0.0, 0.0, loads=True)
    decision = feed(state, decode.observe(first, 100.0, own_of(first, (ok,)), (ok,)), group)
    return decision.state


@SETTINGS
@given(
    cycles=st.lists(cycle_st(failing=False), min_size=1, max_size=40),
    excess=st.floats(min_value=0.01, max_value=50.0),
)
def test_a_decode_growing_beyond_our_tokens_is_never_acted_on(
    cycles: list[Cycle], excess: float
) -> None:
    """Every cycle decode's counters grow by more than our exactly-counted tokens since the
    previous scrape began and the slack: a slow decode serving others. No action, whatever the
    probes do."""
    group = config()
    decode = Decode()
    state = warm(decode, group)
    during_before = 0  # own tokens received while the previous observation's fetches ran
    for cycle in cycles:
        decode.now += cycle.seconds
        results = results_of(cycle, decode.now)
        own = own_of(cycle, results)
        bound = own.received + during_before + TOKENS_SLACK
        obs = decode.observe(cycle, bound + excess, own, results)
        during_before = obs.own_tokens_during.received
        decision = feed(state, obs, group)
        state = decision.state
        assert decision.verdict not in ACT_VERDICTS, decision
        assert decision.action is not Action.CO_RESTART, decision
        assert state.progress.progress_at == decode.now  # this scrape was progress


@SETTINGS
@given(
    cycles=st.lists(cycle_st(failing=True), min_size=1, max_size=8),
)
def test_a_decode_growing_only_by_our_tokens_is_a_silent_stall(cycles: list[Cycle]) -> None:
    """Decode's counters (per-iteration, decode_moments, the TTFT count, generated tokens) grow
    by no more than our own probes' tokens explain, while probes fail and work is pending: a
    silent stall, decided at the first cycle flat for no_progress_seconds."""
    group = config()
    decode = Decode()
    state = warm(decode, group)
    last_progress = decode.now
    failures = 0
    for cycle in itertools.cycle(cycles):
        decode.now += cycle.seconds
        results = results_of(cycle, decode.now)
        own = own_of(cycle, results)
        decode.ttft += int(own.first * cycle.share)
        decode.generated += int(own.finished * cycle.share)
        grow = cycle.share * own.received
        decision = feed(state, decode.observe(cycle, grow, own, results), group)
        state = decision.state
        failures += sum(
            r.kind is not ProbeKind.DIRECT and r.reason is not ProbeFailure.INTERNAL_ERROR
            for r in results
        )  # the run of failed router probes (direct probes and our own errors are not in it)
        assert state.progress.progress_at == last_progress  # none of it read as progress
        if decode.now - last_progress > 20 * NO_PROGRESS_SECONDS:
            assert failures < PROBE_FAILURES  # only probes that raised: not a failure run
            return
        if failures >= PROBE_FAILURES and decode.now - last_progress >= NO_PROGRESS_SECONDS:
            assert decision.verdict is Verdict.SILENT_STALL, decision
            assert decision.action is Action.CO_RESTART, decision
            return
        assert decision.verdict not in ACT_VERDICTS, decision
