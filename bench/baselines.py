"""Baseline detectors that implement the anchors' documented defaults, fed by real HTTP polls.

Three baselines run next to the watchdog on the same stack, in the same scenario run:

- `k8s_liveness`: a Kubernetes liveness probe (httpGet) on each worker's `/health`: periodSeconds
  10, timeoutSeconds 1, failureThreshold 3 (the kubelet's defaults). It fires when either worker
  fails three probes in a row (the kubelet would restart that container).
- `router_health`: the router's own signals, probed the same way: `/health` (liveness) and
  `/readiness` (readiness). The router computes readiness from its own worker health checks.
- `prometheus_rule`: `increase(sglang:num_requests_total[1m]) == 0 and http_requests_active > 0`
  `for: 1m`, scraping both workers every 15 s and evaluating at every scrape. Written in full as
  `sum by (instance) (increase(sglang:num_requests_total[1m])) == 0 and on (instance)
  sum by (instance) (sglang:http_requests_active{endpoint!="/metrics"}) > 0`: the series of the two
  sides carry different labels, so the one-line form would never match, and SGLang counts the
  scrape itself as an active request. `prometheus_rule_literal` keeps the scrape in the sum, to
  show what the rule does when written as commonly quoted.

The rule evaluation and the consecutive-failure counting are pure (time passed in), so they are
unit-tested without sleeping; `run_baselines` is the thin async poller around them.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import httpx

from watchdog.clock import Clock

SeriesKey = tuple[tuple[str, str], ...]

REQUESTS_TOTAL = "sglang:num_requests_total"
REQUESTS_ACTIVE = "sglang:http_requests_active"


@dataclass(frozen=True)
class BaselineTimings:
    """The documented defaults, divided by `compression` for the time-based ones."""

    compression: float = 1.0
    k8s_period_seconds: float = 10.0
    # Not compressed: Kubernetes' documented default. SGLang's /health sleeps 1 s before its first
    # check (docs/sglang.md §7.1), so at this default the probe times out on healthy servers too.
    k8s_timeout_seconds: float = 1.0
    k8s_failure_threshold: int = 3
    scrape_interval_seconds: float = 15.0
    scrape_timeout_seconds: float = 10.0
    rule_range_seconds: float = 60.0
    rule_for_seconds: float = 60.0

    def compressed(self) -> BaselineTimings:
        """Every period and window divided by `compression` (thresholds and k8s timeout kept)."""
        k = self.compression
        return BaselineTimings(
            compression=1.0,
            k8s_period_seconds=self.k8s_period_seconds / k,
            k8s_timeout_seconds=self.k8s_timeout_seconds,
            k8s_failure_threshold=self.k8s_failure_threshold,
            scrape_interval_seconds=self.scrape_interval_seconds / k,
            scrape_timeout_seconds=self.scrape_timeout_seconds / k,
            rule_range_seconds=self.rule_range_seconds / k,
            rule_for_seconds=self.rule_for_seconds / k,
        )


# --------------------------------------------------------------------------- pure: probes


@dataclass
class ConsecutiveFailures:
    """A Kubernetes-style probe: fires after `threshold` failures in a row, then starts over.

    The kubelet restarts the container at that point, which resets the count; recording every
    firing (not only the first) shows a baseline that would restart over and over.
    """

    threshold: int
    failures: int = 0
    fired_at: list[float] = field(default_factory=list)

    def observe(self, ok: bool, now: float) -> bool:
        """Feed one probe result; True when this result makes the probe fire."""
        if ok:
            self.failures = 0
            return False
        self.failures += 1
        if self.failures >= self.threshold:
            self.failures = 0
            self.fired_at.append(now)
            return True
        return False


# --------------------------------------------------------------------------- pure: PromQL subset


@dataclass(frozen=True)
class Scrape:
    """One scrape of one instance: its time and samples, or `ok=False` (stale marker)."""

    at: float
    ok: bool
    requests_total: Mapping[SeriesKey, float] = field(default_factory=dict)
    active: Mapping[SeriesKey, float] = field(default_factory=dict)


def increase(samples: Sequence[tuple[float, float]], start: float, end: float) -> float | None:
    """PromQL `increase()` over the samples in (start, end]: reset-corrected and extrapolated.

    None when fewer than two samples fall in the window (Prometheus returns no series then).
    """
    points = [(t, v) for t, v in samples if start < t <= end]
    if len(points) < 2:
        return None
    delta = 0.0
    for (_, prev), (_, cur) in itertools.pairwise(points):
        # A counter that went down was reset: the new value is all increase since the reset.
        delta += cur - prev if cur >= prev else cur
    first_t, first_v = points[0]
    last_t = points[-1][0]
    sampled = last_t - first_t
    if sampled <= 0:
        return None
    # prometheus/promql/functions.go extrapolatedRate: extend to the window edges by at most
    # 1.1 average intervals, and never below zero for counters.
    average = sampled / (len(points) - 1)
    to_start = first_t - start
    to_end = end - last_t
    if delta > 0 and first_v >= 0:
        to_zero = sampled * (first_v / delta)
        to_start = min(to_start, to_zero)
    threshold = average * 1.1
    extrapolate = sampled
    extrapolate += to_start if to_start < threshold else average / 2
    extrapolate += to_end if to_end < threshold else average / 2
    return delta * (extrapolate / sampled)


@dataclass
class PrometheusRule:
    """`sum(increase(requests_total[range])) == 0 and sum(active) > 0` per instance, `for`."""

    range_seconds: float
    for_seconds: float
    count_scrape_as_active: bool = False
    history: dict[str, list[Scrape]] = field(default_factory=dict)
    active_since: float | None = None
    fired_at: list[float] = field(default_factory=list)
    firing: bool = False

    def record(self, instance: str, scrape: Scrape) -> None:
        """Append a scrape; history older than the range is dropped."""
        kept = [s for s in self.history.get(instance, []) if s.at > scrape.at - self.range_seconds]
        kept.append(scrape)
        self.history[instance] = kept

    def instance_true(self, instance: str, now: float) -> bool:
        """The rule's expression for one instance at `now`."""
        scrapes = self.history.get(instance, [])
        if not scrapes or not scrapes[-1].ok:
            return False  # no sample, or a stale marker: the instant vector is empty
        latest = scrapes[-1]
        active = sum(
            value
            for key, value in latest.active.items()
            if self.count_scrape_as_active or dict(key).get("endpoint") != "/metrics"
        )
        if not latest.active or active <= 0:
            return False
        keys: set[SeriesKey] = set()
        for s in scrapes:
            keys.update(s.requests_total)
        increases = []
        for key in keys:
            samples = [(s.at, s.requests_total[key]) for s in scrapes if key in s.requests_total]
            inc = increase(samples, now - self.range_seconds, now)
            if inc is not None:
                increases.append(inc)
        # sum() over an empty vector is empty: no series with a result, no alert.
        return bool(increases) and sum(increases) == 0

    def evaluate(self, now: float) -> bool:
        """One rule evaluation; True when the alert is firing after it (pending → firing)."""
        if not any(self.instance_true(i, now) for i in self.history):
            self.active_since = None
            self.firing = False
            return False
        if self.active_since is None:
            self.active_since = now
        if not self.firing and now - self.active_since >= self.for_seconds:
            self.firing = True
            self.fired_at.append(now)
        return self.firing


_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_samples(text: str, names: Iterable[str]) -> dict[str, dict[SeriesKey, float]]:
    """The samples of `names` in a Prometheus text exposition, keyed by sorted label pairs."""
    wanted = set(names)
    out: dict[str, dict[SeriesKey, float]] = {name: {} for name in wanted}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None or match.group(1) not in wanted:
            continue
        labels = tuple(sorted(_LABEL.findall(match.group(3) or "")))
        try:
            out[match.group(1)][labels] = float(match.group(4))
        except ValueError:
            continue
    return out


def scrape_from_text(at: float, text: str) -> Scrape:
    """A Scrape of the two series the rule reads; a body without them is still a valid scrape."""
    samples = parse_samples(text, (REQUESTS_TOTAL, REQUESTS_ACTIVE))
    return Scrape(at, True, samples[REQUESTS_TOTAL], samples[REQUESTS_ACTIVE])


@dataclass
class CounterTotal:
    """A counter's total across process restarts (a drop is a reset: the new value is all new)."""

    total: float = 0.0
    last: float | None = None

    def update(self, value: float) -> float:
        """Feed the latest scraped value; returns the running total."""
        if self.last is None:
            self.total = value
        elif value >= self.last:
            self.total += value - self.last
        else:
            self.total += value
        self.last = value
        return self.total


# --------------------------------------------------------------------------- async pollers


@dataclass(frozen=True)
class BaselineTargets:
    """The URLs the baselines poll."""

    prefill_url: str
    decode_url: str
    router_url: str


@dataclass
class BaselineSet:
    """All baselines of one scenario run; `fired_at` per baseline name after the run."""

    timings: BaselineTimings
    k8s: dict[str, ConsecutiveFailures]
    router: dict[str, ConsecutiveFailures]
    rule: PrometheusRule
    rule_literal: PrometheusRule
    served: dict[str, CounterTotal] = field(default_factory=dict)
    polls: int = 0

    @classmethod
    def create(cls, timings: BaselineTimings) -> BaselineSet:
        """Fresh detectors with the given (already compressed) timings."""
        threshold = timings.k8s_failure_threshold
        return cls(
            timings=timings,
            k8s={role: ConsecutiveFailures(threshold) for role in ("prefill", "decode")},
            router={path: ConsecutiveFailures(threshold) for path in ("/health", "/readiness")},
            served={role: CounterTotal() for role in ("prefill", "decode")},
            rule=PrometheusRule(timings.rule_range_seconds, timings.rule_for_seconds),
            rule_literal=PrometheusRule(
                timings.rule_range_seconds, timings.rule_for_seconds, count_scrape_as_active=True
            ),
        )

    def record_scrape(self, instance: str, scrape: Scrape) -> None:
        """Feed one scrape to both rule variants and to the served-requests total."""
        self.rule.record(instance, scrape)
        self.rule_literal.record(instance, scrape)
        if scrape.ok and scrape.requests_total and instance in self.served:
            self.served[instance].update(sum(scrape.requests_total.values()))

    def fired_at(self) -> dict[str, list[float]]:
        """Firing times per baseline name (each sorted)."""
        return {
            "k8s_liveness": sorted(t for p in self.k8s.values() for t in p.fired_at),
            "router_health": sorted(t for p in self.router.values() for t in p.fired_at),
            "prometheus_rule": list(self.rule.fired_at),
            "prometheus_rule_literal": list(self.rule_literal.fired_at),
        }


BASELINE_NAMES = ("k8s_liveness", "router_health", "prometheus_rule", "prometheus_rule_literal")


async def _get_ok(client: httpx.AsyncClient, url: str, deadline_seconds: float) -> bool:
    # The kubelet's httpGet probe: success is a status in [200, 400) within timeoutSeconds.
    try:
        async with asyncio.timeout(deadline_seconds):
            response = await client.get(url)
        return 200 <= response.status_code < 400
    except (httpx.HTTPError, TimeoutError, OSError):
        return False


Tick = Callable[[], Awaitable[None]]


async def scrape_instance(
    client: httpx.AsyncClient, base_url: str, deadline_seconds: float, clock: Clock = time.time
) -> Scrape:
    """GET {base_url}/metrics as Prometheus would: a failure is a stale marker, never an error."""
    at = clock()
    try:
        async with asyncio.timeout(deadline_seconds):
            response = await client.get(base_url + "/metrics")
    except (httpx.HTTPError, TimeoutError, OSError):
        return Scrape(at, False)
    if response.status_code != 200:
        return Scrape(at, False)
    return scrape_from_text(at, response.text)


async def _every(period: float, clock: Clock, tick: Tick) -> None:
    # Fixed cadence from the previous start, like the kubelet and Prometheus's scrape loop.
    next_at = clock()
    while True:
        await tick()
        next_at += period
        await asyncio.sleep(max(0.0, next_at - clock()))


async def run_baselines(
    baselines: BaselineSet,
    targets: BaselineTargets,
    *,
    clock: Clock = time.time,
) -> None:
    """Poll until cancelled: k8s probes on both workers, router probes, scrapes + rule."""
    t = baselines.timings
    rule, literal = baselines.rule, baselines.rule_literal
    limits = httpx.Limits(max_connections=20, max_keepalive_connections=0)
    async with httpx.AsyncClient(trust_env=False, limits=limits) as client:

        def k8s_tick(role: str, url: str) -> Tick:
            async def tick() -> None:
                ok = await _get_ok(client, url + "/health", t.k8s_timeout_seconds)
                baselines.k8s[role].observe(ok, clock())
                baselines.polls += 1

            return tick

        def router_tick(path: str) -> Tick:
            async def tick() -> None:
                ok = await _get_ok(client, targets.router_url + path, t.k8s_timeout_seconds)
                baselines.router[path].observe(ok, clock())
                baselines.polls += 1

            return tick

        async def scrape(instance: str, url: str) -> None:
            scrape = await scrape_instance(client, url, t.scrape_timeout_seconds, clock)
            baselines.record_scrape(instance, scrape)

        async def prom_tick() -> None:
            await asyncio.gather(
                scrape("prefill", targets.prefill_url), scrape("decode", targets.decode_url)
            )
            now = clock()
            rule.evaluate(now)
            literal.evaluate(now)
            baselines.polls += 1

        async with asyncio.TaskGroup() as tasks:
            period = t.k8s_period_seconds
            tasks.create_task(_every(period, clock, k8s_tick("prefill", targets.prefill_url)))
            tasks.create_task(_every(period, clock, k8s_tick("decode", targets.decode_url)))
            tasks.create_task(_every(period, clock, router_tick("/health")))
            tasks.create_task(_every(period, clock, router_tick("/readiness")))
            tasks.create_task(_every(t.scrape_interval_seconds, clock, prom_tick))
