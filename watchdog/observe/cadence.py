"""Which of a cycle's fetches to make: all of them while something is in doubt, else each on its
cadence (pure).

A cycle's HTTP requests are most of the daemon's CPU (bench/profile.md), and each worker /health
costs SGLang a generation. While nothing is in doubt a passing end-to-end probe already proves
what /health would (prefill, the KV transfer and decode served a request through the router), so
/health is checked only every `health_every_cycles`, and the scrapes an operator puts on a cadence
likewise. Anything in doubt fetches everything, every cycle (docs/decisions.md, "Fetch cadence").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from watchdog.config import ProbeSection
from watchdog.model import ProbeKind, ProbeResult


@dataclass(frozen=True, slots=True)
class Cadences:
    """Fetch each kind every N observations while nothing is in doubt (1: every one)."""

    health: int = 1
    worker_metrics: int = 1
    router_metrics: int = 1
    loads: int = 1

    @classmethod
    def of(cls, probe: ProbeSection) -> Cadences:
        """The cadences configured in a group's probe section."""
        return cls(
            health=probe.health_every_cycles,
            worker_metrics=probe.metrics_every_cycles,
            router_metrics=probe.router_metrics_every_cycles,
            loads=probe.loads_every_cycles,
        )


@dataclass(frozen=True, slots=True)
class FetchPlan:
    """What one observation fetches."""

    health: bool = True  # every worker /health and the router /readiness
    worker_metrics: bool = True  # every prefill and decode /metrics
    router_metrics: bool = True
    loads: bool = True  # every prefill and decode /v1/loads


FETCH_ALL = FetchPlan()


@dataclass(frozen=True, slots=True)
class Ages:
    """Observations since each kind was last fetched (None: never fetched)."""

    health: int | None = None
    worker_metrics: int | None = None
    router_metrics: int | None = None
    loads: int | None = None

    def after(self, plan: FetchPlan) -> Ages:
        """The ages once an observation fetched `plan`: 0 where fetched, one older elsewhere."""
        return Ages(
            health=_aged(self.health, fetched=plan.health),
            worker_metrics=_aged(self.worker_metrics, fetched=plan.worker_metrics),
            router_metrics=_aged(self.router_metrics, fetched=plan.router_metrics),
            loads=_aged(self.loads, fetched=plan.loads),
        )


def _aged(age: int | None, *, fetched: bool) -> int | None:
    if fetched:
        return 0
    return None if age is None else age + 1


@dataclass(frozen=True, slots=True)
class Calm:
    """What must all hold at an observation's start for anything to be skipped."""

    decided_healthy: bool  # the last decision: state healthy, verdict ok (not warm-up, verifying)
    probes_passed: bool  # a completion probe finished within about a cycle, none failed
    none_late: bool  # no probe pending longer than a probe period
    answers_ok: bool  # the previous observation: every /health, scrape and /v1/loads ok

    @property
    def in_doubt(self) -> bool:
        """Whether anything at all leaves doubt: then everything is fetched."""
        return not (
            self.decided_healthy and self.probes_passed and self.none_late and self.answers_ok
        )


def probes_passed(finished: Sequence[ProbeResult]) -> bool:
    """A completion probe finished and no probe of any kind failed: end-to-end service proven."""
    return any(p.kind is ProbeKind.COMPLETION for p in finished) and all(p.ok for p in finished)


def plan_fetches(
    cadences: Cadences, ages: Ages, *, in_doubt: bool, live_progress: bool = False
) -> FetchPlan:
    """Everything while in doubt or never fetched; otherwise each kind when its cadence is due.

    Worker /metrics go on their cadence only with `live_progress`: every decode's last
    /v1/loads carried its decode-step tokens, which then read progress in the cycles between
    scrapes (decide/fold.py). Without them a scrape is the only reading of decode's tokens,
    and a skipped one would date the last tokens before a stall a cycle later.
    """
    if in_doubt:
        return FETCH_ALL
    return FetchPlan(
        health=_due(cadences.health, ages.health),
        worker_metrics=not live_progress or _due(cadences.worker_metrics, ages.worker_metrics),
        router_metrics=_due(cadences.router_metrics, ages.router_metrics),
        loads=_due(cadences.loads, ages.loads),
    )


def _due(every: int, age: int | None) -> bool:
    """Due when never fetched, or when `every` observations will have passed by this one."""
    return age is None or age + 1 >= every
