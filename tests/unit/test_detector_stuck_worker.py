"""One worker of several stalled: the detector names it and acts (docs/decisions.md, "Several
workers per role").

Behind a router balancing over two prefills, a transfer stall on prefill #2 fails only the probes
routed to it: the probe run never reaches the threshold and the group's counters advance through
prefill #1. What tells is per worker: prefill #2's hand-off queue holds work and prefill #2
completes nothing of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from tests.unit.builders import group_config, health, metrics, probe
from tests.unit.test_detector_workers import CONFIG
from watchdog.config import GroupSection
from watchdog.decide.accounting import window_failures
from watchdog.decide.assess import assess
from watchdog.decide.fold import observe
from watchdog.decide.reasons import transfer_reason
from watchdog.decide.state import FailureSample, initial_state
from watchdog.decide.verdict import Verdict
from watchdog.model import Observation, Reason, Role

P, D = Role.PREFILL, Role.DECODE
T0 = 1_000_000.0
LIMIT = CONFIG.stall.no_progress_seconds


@dataclass(frozen=True)
class Case:
    """How the suspect prefill (the last one of its role) behaves, cycle after cycle."""

    name: str
    queue: tuple[float, ...]  # its inflight queue, repeated over the cycles
    finishes: float = 0.0  # requests it finishes per cycle
    aborted: float = 0.0  # of which aborted (and counted as transfer failures)
    failed: float = 0.0  # of which failed their transfer, not aborted (a waiting timeout)
    probes_fail: bool = True  # every other probe fails (those routed to it)
    config: GroupSection = CONFIG
    stuck: str | None = "prefill#2"  # the worker the verdict names (None: no worker_stalled)


CASES = [
    Case("stalled prefill #2: queue held, nothing finishes", (2.0,)),
    Case("its requests are only aborted: aborts are not completions", (2.0,), 1.0, 1.0),
    Case("its requests time out into failures: still named", (2.0,), 2.0, failed=2.0),
    Case("it completes requests while holding one: pinned, not stalled", (1.0,), 2.0, stuck=None),
    Case("its queue empties between requests: nothing stuck", (2.0, 0.0), stuck=None),
    Case("one prefill: the group's own rules judge it", (2.0,), config=group_config(), stuck=None),
]


def _cycle(i: int, case: Case, at: float) -> Observation:
    """Cycle `i`: the healthy workers progress, the suspect holds its queue."""
    several = len(case.config.workers(P)) > 1
    suspect = 1 if several else 0
    decodes = range(len(case.config.workers(D)))
    prefills = range(len(case.config.workers(P)))
    snaps = [
        replace(
            metrics(
                P,
                at=at,
                inflight_queue=case.queue[i % len(case.queue)],
                requests_total=case.finishes * i,
                aborted_requests_total=case.aborted * i,
                transfer_failed=(case.aborted + case.failed) * i,
            ),
            worker=w,
        )
        if w == suspect
        else replace(metrics(P, at=at, requests_total=5.0 * i), worker=w)
        for w in prefills
    ]
    snaps += [
        replace(
            metrics(D, at=at, requests_total=5.0 * i, generation_tokens_total=500.0 * i), worker=w
        )
        for w in decodes
    ]
    checks = tuple(
        replace(health(role.value, at=at), worker=w)
        for role, count in ((P, len(prefills)), (D, len(decodes)))
        for w in range(count)
    )
    ok = not (case.probes_fail and i % 2)
    return Observation("g", at, health=checks, metrics=tuple(snaps), probes=(probe(ok, at=at),))


def _run(case: Case, seconds: float) -> tuple[Verdict, tuple[Reason, ...], bool]:
    state = initial_state(T0)
    at = T0
    verdict, act = Verdict.OK, False
    reasons: tuple[Reason, ...] = ()
    for i in range(int(seconds) + 1):
        at = T0 + i
        state, facts = observe(state, _cycle(i, case, at), case.config, at, quiet=False)
        found = assess(state, facts, case.config, at)
        verdict, reasons, act = found.verdict, found.reasons, found.act
    return verdict, reasons, act


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_one_stalled_worker_of_several(case: Case) -> None:
    """One stalled worker of several is named and acted on; with none stalled, nothing is."""
    verdict, reasons, act = _run(case, LIMIT + 2)
    stuck = [r for r in reasons if r.code == "worker_stalled"]
    if case.stuck is None:
        assert not stuck, reasons
        assert not act, (verdict, reasons)
        return
    assert verdict is Verdict.SILENT_STALL, reasons
    assert act
    assert dict(stuck[0].values)["workers"] == case.stuck
    assert stuck[0].message.startswith(f"{case.stuck}: PD hand-off queue held work")
    pending = next(r for r in reasons if r.code == "work_pending")
    assert "prefill#2_inflight_queue" in pending.message
    assert "prefill#1" not in stuck[0].message


def test_not_before_no_progress_seconds() -> None:
    """The worker's clock must reach no_progress_seconds, as the group's flat clock must."""
    _verdict, reasons, act = _run(CASES[0], LIMIT - 2)
    assert not act
    assert all(r.code != "worker_stalled" for r in reasons)


def test_transfer_reason_names_the_workers_whose_counter_rose() -> None:
    """The transfer reason names the workers whose failure counter rose, when there are several."""
    samples = [
        FailureSample(T0, P, 4.0, worker=1),
        FailureSample(T0, D, 4.0, worker=0),
        FailureSample(T0, P, 0.0, finished=3.0, worker=0),
    ]
    why = transfer_reason(window_failures(samples, T0 - 1), CONFIG)
    assert why.message.endswith("; rose on prefill#2 +4, decode#1 +4")
    assert dict(why.values)["workers"] == "prefill#2, decode#1"
    one = transfer_reason(window_failures([FailureSample(T0, P, 4.0)], T0 - 1), group_config())
    assert "rose on" not in one.message
    assert "workers" not in dict(one.values)


def test_report_names_the_suspected_workers() -> None:
    """report.md has a 'suspected worker(s)' row only where the reasons name workers."""
    from watchdog.evidence.incident import _jsonable  # the summary's own encoding
    from watchdog.evidence.report import render_report

    stuck = Reason("worker_stalled", "prefill#2: ...", (("workers", "prefill#2"),))
    rose = Reason("transfer_failures", "...", (("workers", "prefill#2, decode#1"),))
    summary = {"decision_reasons": _jsonable([stuck, rose])}
    assert "| suspected worker(s) | prefill#2, decode#1 |" in render_report(summary)
    plain = {"decision_reasons": _jsonable([Reason("no_progress", "flat")])}
    assert "suspected" not in render_report(plain)
