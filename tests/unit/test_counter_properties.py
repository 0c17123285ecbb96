"""Counter accounting never fabricates failures (docs/decisions.md, "Failure accounting").

Scrapes can be wrong in many ways: a body cut mid-value (a failed scrape now), a series or a
rank missing (absent, or a lower sum or max), NaN, infinite or negative values, a failure series
absent at the first scrape of a process that has long been failing. None of them is a failure.
Two levels, each with hypothesis over arbitrary sequences:
- one counter through `step` as fold.py drives it: the counted increase never exceeds the true
  one, at any point of the sequence, across new processes too; without a real increase it is 0;
- whole cycles through decide(), the pages written as SGLang writes them and read by
  extract_snapshot: no sequence of glitches without a real failure yields a failure or an
  acting verdict, with probes passing or an overloaded group progressing; with real failures
  the counted ones never exceed them.
One glitch is left out where no accounting can catch it: a lower value at the scrape that sets
the baseline of a process found running (nothing read before it, so nothing says it is low; the
next true reading looks like growth). A lower value is generated only once a value is known, or
in a process we saw start (whose every value counts from zero). The scrape layer is what keeps
such pages out: a body must end at a line boundary, a gzip stream at its end, HTTP framing
complete (test_truncated_scrapes.py, test_scrape.py).
The examples the attack run found close the file.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.test_counter_semantics import SERIES, WORKER_ROLES, Run, payload
from watchdog.decide import ACT_VERDICTS, Decision
from watchdog.decide.counters import readable, step
from watchdog.model import Action, Role, ScrapeFailure
from watchdog.observe.sglang_metrics import extract_snapshot

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# How one scrape can misread a counter whose true value is v.
GLITCHES = ("ok", "absent", "lower", "nan", "inf", "negative", "cut")
LIFETIME = st.integers(0, 1_000_000).map(float)


def reading(true: float, glitch: str, fraction: float) -> float | None:
    """What a scrape of a counter at `true` reads under `glitch` (cut: a failed scrape)."""
    values: dict[str, float | None] = {
        "ok": true,
        "absent": None,
        "lower": float(int(true * fraction)),
        "nan": float("nan"),
        "inf": float("inf"),
        "negative": -5.0,
        "cut": None,
    }
    return values[glitch]


# --- one counter through step() ----------------------------------------------------------------


@dataclass(frozen=True)
class Scrape:
    """One scrape: how much the true counter grew before it, and how it was misread."""

    growth: float
    glitch: str
    fraction: float  # for "lower": the share of the true value read
    restart: bool = False  # a new process (seen: its unit start time changed) before it


scrapes = st.builds(
    Scrape,
    growth=st.one_of(st.just(0.0), st.integers(0, 50).map(float)),
    glitch=st.sampled_from(GLITCHES),
    fraction=st.floats(0.0, 0.999),
    restart=st.booleans(),
)


def fold(lifetime: float, first: Scrape, rest: Sequence[Scrape]) -> list[tuple[float, float]]:
    """(counted, true) increase after each scrape, driven the way fold.py drives a failure
    counter: the first scrape of the process found running is the baseline; after that each
    reading steps, a new process counts from zero, and so does a series first seen in it. A
    failed scrape (cut) steps nothing: a restart before it shows at the next one."""
    true = lifetime
    first_glitch = "ok" if first.glitch == "lower" else first.glitch  # see the module docstring
    known = readable(reading(true, first_glitch, first.fraction))
    seen_start = restarted = False
    counted = truth = 0.0
    out = []
    for scrape in rest:
        if scrape.restart:
            true = 0.0
        true += scrape.growth
        truth += scrape.growth
        seen_start = seen_start or scrape.restart
        restarted = restarted or scrape.restart
        glitch = scrape.glitch
        if glitch == "lower" and known is None and not seen_start:
            glitch = "ok"  # no value known in a process found running: see the module docstring
        if glitch == "cut":
            out.append((counted, truth))
            continue
        result = step(
            known,
            reading(true, glitch, scrape.fraction),
            new_process=restarted,
            from_zero=seen_start,
        )
        restarted = False
        known = result.known
        counted += result.increase
        out.append((counted, truth))
    return out


@SETTINGS
@given(lifetime=LIFETIME, first=scrapes, rest=st.lists(scrapes, max_size=30))
def test_step_never_counts_more_than_the_true_increase(
    lifetime: float, first: Scrape, rest: list[Scrape]
) -> None:
    """At every scrape of any sequence, the counted increase is at most the true one."""
    for counted, truth in fold(lifetime, first, rest):
        assert counted <= truth, (counted, truth)


@SETTINGS
@given(
    lifetime=LIFETIME,
    first=scrapes,
    rest=st.lists(scrapes.map(lambda s: replace(s, growth=0.0, restart=False)), max_size=30),
)
def test_step_without_increase_counts_nothing(
    lifetime: float, first: Scrape, rest: list[Scrape]
) -> None:
    """A counter that does not move counts nothing, however its scrapes misread it."""
    assert all(counted == 0.0 for counted, _ in fold(lifetime, first, rest))


# --- whole cycles through decide() -------------------------------------------------------------


def page(counters: Mapping[str, float], glitch: str, fraction: float, pending: float) -> str:
    """A worker's /metrics page with its transfer-failure line misread as `glitch`; the failure
    line is last, so a cut page ends inside its value, after its first digit."""
    text = payload(counters, ("failed",), pending)
    if glitch == "cut":
        first_digit = f"{counters['failed']:.1f}"[0]
        return f"{text}{SERIES['failed']} {first_digit}"
    value = reading(counters["failed"], glitch, fraction)
    if value is None:
        return text
    return f"{text}{SERIES['failed']} {value}\n"


def without_unknowable(sequence: Sequence[Cycle]) -> list[Cycle]:
    """The cycles with each "lower" before any value was read for that worker made "ok" (see
    the module docstring); there is no restart here, every process was found running."""
    known = [False, False]
    out = []
    for cycle in sequence:
        glitches = list(cycle.glitches)
        for i, glitch in enumerate(glitches):
            if glitch == "lower" and not known[i]:
                glitches[i] = "ok"
            known[i] = known[i] or glitches[i] in ("ok", "lower")
        out.append(replace(cycle, glitches=(glitches[0], glitches[1])))
    return out


@dataclass(frozen=True)
class Cycle:
    """One cycle: failures before it, and how each worker's scrape misreads its counter."""

    failures: float
    glitches: tuple[str, str]
    fraction: float


cycles = st.builds(
    Cycle,
    failures=st.one_of(st.just(0.0), st.integers(1, 20).map(float)),
    glitches=st.tuples(st.sampled_from(GLITCHES), st.sampled_from(GLITCHES)),
    fraction=st.floats(0.0, 0.999),
)


def run_cycles(
    lifetime: float, sequence: Sequence[Cycle], *, probes_pass: bool
) -> tuple[Run, list[Decision]]:
    """Feed the cycles through decide(): probes pass (a healthy group), or time out while the
    group progresses with work pending (overloaded)."""
    run = Run()
    run.set(failed=lifetime)
    decisions = []
    for cycle in without_unknowable(sequence):
        run.grow(failed=cycle.failures)
        if not probes_pass:
            run.grow(requests=30.0, tokens=3000.0)
        pending = 0.0 if probes_pass else 8.0
        obs = run.h.stack.cycle((probes_pass,), progress=False)
        glitch = dict(zip(WORKER_ROLES, cycle.glitches, strict=True))
        metrics = tuple(
            extract_snapshot(
                page(run.counters[m.role], glitch[m.role], cycle.fraction, pending),
                m.role,
                m.scraped_at,
            )
            for m in obs.metrics
        )
        decisions.append(run.h.feed(replace(obs, metrics=metrics)))
    return run, decisions


@SETTINGS
@given(
    lifetime=LIFETIME,
    sequence=st.lists(cycles.map(lambda c: replace(c, failures=0.0)), min_size=1, max_size=10),
    probes_pass=st.booleans(),
)
def test_glitches_without_failures_never_act(
    lifetime: float, sequence: list[Cycle], probes_pass: bool
) -> None:
    """No sequence of misread scrapes of an unmoving failure counter counts a failure or acts."""
    run, decisions = run_cycles(lifetime, sequence, probes_pass=probes_pass)
    assert run.raw_failures() == 0.0
    acted = [d for d in decisions if d.verdict in ACT_VERDICTS or d.action is Action.CO_RESTART]
    assert not acted, run.h.verdicts


@SETTINGS
@given(
    lifetime=LIFETIME,
    sequence=st.lists(cycles, min_size=1, max_size=10),
    probes_pass=st.booleans(),
)
def test_counted_failures_never_exceed_the_true_ones(
    lifetime: float, sequence: list[Cycle], probes_pass: bool
) -> None:
    """With real failures among the glitches, the window never holds more than happened."""
    run, _ = run_cycles(lifetime, sequence, probes_pass=probes_pass)
    assert run.raw_failures() <= sum(c.failures for c in sequence)


# --- the attack run's examples -----------------------------------------------------------------


def healthy(run: Run, cycles: int, glitches: tuple[str, str] = ("ok", "ok")) -> None:
    """Cycles of a healthy group: every probe passes, requests finish."""
    for _ in range(cycles):
        run.grow(requests=30.0, tokens=3000.0)
        run_glitched(run, (True,), glitches, pending=0.0)


def run_glitched(
    run: Run, probes: tuple[bool, ...], glitches: tuple[str, str], *, pending: float
) -> Decision:
    """One cycle with each worker's failure line misread as its glitch."""
    obs = run.h.stack.cycle(probes, progress=False)
    glitch = dict(zip(WORKER_ROLES, glitches, strict=True))
    metrics = tuple(
        extract_snapshot(
            page(run.counters[m.role], glitch[m.role], 0.0, pending), m.role, m.scraped_at
        )
        for m in obs.metrics
    )
    return run.h.feed(replace(obs, metrics=metrics))


def test_cut_scrape_of_a_healthy_group_is_a_failed_scrape_not_a_co_restart() -> None:
    """993,500 failures from long ago, one page cut after the value's first digit: the scrape
    fails (it read 9, then +993,491 at the next one), every probe passes, nothing acts."""
    run = Run()
    run.set(failed=993_500.0)
    healthy(run, 2)
    cut = extract_snapshot(page(run.counters[Role.PREFILL], "cut", 0.0, 0.0), Role.PREFILL, 0.0)
    assert (cut.ok, cut.error) == (False, ScrapeFailure.TRUNCATED)
    decision = run_glitched(run, (True,), ("cut", "cut"), pending=0.0)
    assert decision.state.progress.scrape_failures == 1
    healthy(run, 3)
    assert run.raw_failures() == 0.0
    assert Action.CO_RESTART not in run.h.actions, run.h.verdicts


def test_one_lower_reading_is_ignored_not_a_re_base() -> None:
    """One scrape missing the busiest rank reads 993,000 of 993,500: ignored, so the true value
    back next is +0, not +500."""
    run = Run()
    run.set(failed=993_500.0)
    healthy(run, 2)
    run.set(failed=993_000.0)
    healthy(run, 1)
    run.set(failed=993_500.0)
    healthy(run, 3)
    assert run.raw_failures() == 0.0
    assert Action.CO_RESTART not in run.h.actions, run.h.verdicts


def test_failure_series_absent_at_the_first_scrape_adds_nothing_when_it_appears() -> None:
    """A process found running, its failure series missing from the first scrape (a body cut
    before it): when it shows 123,456 that is its life before we watched, not new failures."""
    run = Run()
    run.set(failed=123_456.0)
    healthy(run, 1, ("absent", "absent"))
    healthy(run, 3)
    assert run.raw_failures() == 0.0
    assert Action.CO_RESTART not in run.h.actions, run.h.verdicts


def test_cut_scrape_of_an_overloaded_progressing_group_does_not_co_restart() -> None:
    """Probes time out in a busy decode's queue while requests and tokens keep finishing; one
    cut page among them is a failed scrape, not a burst of failures."""
    run = Run()
    run.set(failed=50_000.0)
    healthy(run, 1)
    for glitches in [("ok", "ok"), ("cut", "ok"), ("ok", "cut"), ("ok", "ok"), ("ok", "ok")]:
        run.grow(requests=30.0, tokens=3000.0)
        decision = run_glitched(run, (False,), glitches, pending=8.0)
    assert run.raw_failures() == 0.0
    assert decision.verdict not in ACT_VERDICTS, run.h.verdicts
    assert Action.CO_RESTART not in run.h.actions, run.h.verdicts


def test_series_first_seen_in_a_process_we_saw_start_counts_from_zero() -> None:
    """After a restart we saw, failures are all new: a series created there counts whole."""
    run = Run()
    run.set(failed=21.0)
    healthy(run, 2)
    for role in WORKER_ROLES:
        run.h.stack.restart(role, reset_counters=False)
    run.set(failed=0.0, requests=0.0, tokens=0.0)
    healthy(run, 1, ("absent", "absent"))
    run.set(failed=4.0)
    healthy(run, 1)
    assert run.raw_failures() == 4.0


def test_real_failures_after_a_lower_reading_still_count() -> None:
    """Ignoring a lower reading loses no real failure: growth past the known value counts."""
    run = Run()
    run.set(failed=100.0)
    healthy(run, 2)
    healthy(run, 1, ("lower", "lower"))
    run.grow(failed=7.0)
    healthy(run, 1)
    assert run.raw_failures() == 7.0
