"""The watchdog's own Prometheus metrics (a contract: docs/architecture.md) and their HTTP listener.

Every series is named `sglang_watchdog_*` and registered on a registry that is passed in, so tests
build a fresh one. Per-group series carry the label `group`.

`observed_transfer_failed_total{group,role}` is a *gauge* that only rises while the watchdog runs:
the transfer failures the watchdog counted from SGLang's `sglang:num_transfer_failed_reqs_total`
(max over TP ranks), summed over the role's workers. It counts as the detector does
(watchdog/decide/counters.py, docs/decisions.md "Failure accounting"), per worker: the first
scrape of a worker, and a series first seen in a process found running, only start the baseline;
a lower reading in the same process counts nothing and keeps the baseline; a new process (a
changed unit start time) counts from zero. So the exported value never drops nor jumps by a
lifetime's count, and `increase()` on it reads what was counted; it resets to 0 only when the
watchdog itself restarts, which `increase()` treats as a counter reset. Failed scrapes, and scrapes
without the series, count nothing. It keeps the `_total` name and gauge type of its first release.
"""

from __future__ import annotations

import asyncio
import gzip
import socket
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, exposition
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, choose_encoder, gzip_accepted

from watchdog import __version__
from watchdog.act.alertmanager import OPERATIONS as ALERTMANAGER_OPERATIONS
from watchdog.decide.counters import readable, step
from watchdog.errors import StartupError
from watchdog.model import MetricsSnapshot, ProbeKind, ProbeResult, RestartOutcome, Role, State

PREFIX = "sglang_watchdog_"

RESTART_RESULTS: tuple[str, ...] = ("done", "failed", "dry_run")
# The optional files whose failures file_errors_total counts (watchdog/optional_io.py).
FILE_KINDS: tuple[str, ...] = ("recording", "audit", "incident", "refusals", "status")

# Probes run from a 50 ms health check to a multi-round conversation capped by timeout_seconds
# (20 s by default, 60 s a generous operator setting); the buckets resolve both ends of the range.
PROBE_BUCKETS_SECONDS: tuple[float, ...] = (
    0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0,
)  # fmt: skip
# A first token normally arrives within a second; a slow prefill under load takes several.
TTFT_BUCKETS_SECONDS: tuple[float, ...] = (
    0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0,
)  # fmt: skip
# One cycle is a few concurrent scrapes and a decision: milliseconds normally, seconds when a target
# answers at its timeout.
CYCLE_BUCKETS_SECONDS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class _Family:
    """One family of the contract's series: its name after PREFIX, help text, labels, buckets.

    The definitions are a table, apart from the code that records into them, so the contract
    (watchdog/catalog.py, checked against a live registry by tests/unit/test_metrics.py) reads
    in one place; the typed constructors keep each recording method's series a Counter, Gauge or
    Histogram to mypy.
    """

    name: str
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()  # histograms only

    def counter(self, registry: CollectorRegistry) -> Counter:
        """This family as a Counter on `registry`."""
        return Counter(PREFIX + self.name, self.help, self.labels, registry=registry)

    def gauge(self, registry: CollectorRegistry) -> Gauge:
        """This family as a Gauge on `registry`."""
        return Gauge(PREFIX + self.name, self.help, self.labels, registry=registry)

    def histogram(self, registry: CollectorRegistry) -> Histogram:
        """This family as a Histogram with its buckets on `registry`."""
        return Histogram(
            PREFIX + self.name, self.help, self.labels, buckets=self.buckets, registry=registry
        )


# What the detector saw: the group's state, its probes and its stall verdicts.
_STATE = _Family(
    "state", "1 for the group's current state, 0 for every other state.", ("group", "state")
)
_PROBES = _Family(
    "probes_total",
    "Finished probes by kind and result (ok, or the failure reason).",
    ("group", "kind", "result"),
)
_PROBE_DURATION = _Family(
    "probe_duration_seconds",
    "Wall time of every finished probe, failed ones included.",
    ("group", "kind"),
    PROBE_BUCKETS_SECONDS,
)
_PROBE_TTFT = _Family(
    "probe_ttft_seconds",
    "Time to the first non-empty token of completion probes through the router.",
    ("group",),
    TTFT_BUCKETS_SECONDS,
)
_PROBES_SKIPPED = _Family(
    "probes_skipped_total",
    "Probe starts skipped because max_in_flight probes were still pending.",
    ("group",),
)
_STALLS = _Family("stalls_detected_total", "Stall verdicts by kind.", ("group", "kind"))

# What acting did: restarts, refusals, the budget.
_RESTARTS = _Family(
    "restarts_total",
    "Co-restart sequences by result (done, failed, dry_run).",
    ("group", "result"),
)
_REFUSALS = _Family(
    "restart_refusals_total",
    "Restarts the watchdog refused to perform, by reason.",
    ("group", "reason"),
)
_BUDGET_REMAINING = _Family(
    "restart_budget_remaining",
    "Co-restarts still allowed in the current budget window.",
    ("group",),
)
_LAST_RESTART = _Family(
    "last_restart_timestamp_seconds",
    "Unix time at which the last (non-dry-run) co-restart sequence finished.",
    ("group",),
)
_STORMS = _Family(
    "fleet_storms_total",
    "Storm verdicts: more than [fleet] storm_share of the groups stalled together.",
)
_STORM_ACTIVE = _Family(
    "fleet_storm_active",
    "1 while a storm verdict stands (from storm_detected to storm_ended), else 0.",
)
_DECODE_ONLY = _Family(
    "decode_only_restarts_detected_total",
    "Restarts of decode without prefill (by systemd's Restart= or a person).",
    ("group",),
)

# What the watched processes showed: scrapes, the transfer failures counted, drift.
_SCRAPE_ERRORS = _Family(
    "scrape_errors_total", "Failed /metrics scrapes by target.", ("group", "target")
)
_TRANSFER_FAILED = _Family(
    "observed_transfer_failed_total",
    "Transfer failures counted from SGLang's num_transfer_failed_reqs_total (max over TP "
    "ranks), summed over the role's workers; only rises while the watchdog runs.",
    ("group", "role"),
)
_CONFIG_DRIFT = _Family(
    "config_drift",
    "Drift findings (cmdline flags or environment not as configured) by role.",
    ("group", "role"),
)

# The daemon itself: its cycles, its own failures, its version.
_CYCLE_DURATION = _Family(
    "cycle_duration_seconds",
    "Wall time of one completed observe-decide-act cycle.",
    buckets=CYCLE_BUCKETS_SECONDS,
)
_INTERNAL_ERRORS = _Family(
    "internal_errors_total",
    "Unexpected exceptions caught by the main loop (logged, then the loop continued).",
)
_FILE_ERRORS = _Family(
    "file_errors_total",
    "Failed optional file I/O by what (recording, audit, incident, refusals, status); "
    "healing goes on and the next attempt tries again.",
    ("what",),
)
_ALERTMANAGER_ERRORS = _Family(
    "alertmanager_errors_total",
    "Failed Alertmanager requests by operation (create, extend, expire, post_alert); "
    "healing goes on without them.",
    ("operation",),
)
_BUILD_INFO = _Family(
    "build_info", "Always 1; the label carries the running sglang-watchdog version.", ("version",)
)


@dataclass(frozen=True, slots=True)
class _TransferBaseline:
    """What is known of one worker's transfer-failure counter."""

    known: float | None  # last trusted reading (None: nothing known of this process yet)
    start_us: int  # the unit start time it was read in (0: unknown)
    seen_start: bool  # we saw this process start, so its first series counts from zero


class TransferFailureTally:
    """Transfer failures counted per worker, as the detector counts them, summed per role.

    The sum only grows: each worker adds what decide/counters.py's step() counts for it, never
    a raw reading, so a suspect lower scrape, a series first seen in a running process, or a
    worker restart cannot make it drop or jump.
    """

    def __init__(self) -> None:
        self._workers: dict[tuple[str, Role, int], _TransferBaseline] = {}
        self._totals: dict[tuple[str, Role], float] = {}

    def fold(self, group: str, snapshot: MetricsSnapshot, start_us: int) -> float:
        """Fold one good scrape of a worker; return the role's total counted so far."""
        absent = "transfer_failed" in snapshot.absent_counters
        reading = None if absent else snapshot.transfer_failed
        key = (group, snapshot.role, snapshot.worker)
        total = self._totals.get((group, snapshot.role), 0.0)
        old = self._workers.get(key)
        if old is None:
            # Found running: whatever it shows happened before we watched.
            self._workers[key] = _TransferBaseline(readable(reading), start_us, False)
        else:
            if start_us <= 0:
                start_us = old.start_us  # unit not read this cycle: still the process last seen
            new_process = bool(old.start_us and start_us and old.start_us != start_us)
            seen_start = new_process or old.seen_start
            counted = step(old.known, reading, new_process=new_process, from_zero=seen_start)
            self._workers[key] = _TransferBaseline(counted.known, start_us, seen_start)
            total += counted.increase
        self._totals[(group, snapshot.role)] = total
        return total


class WatchdogMetrics:
    """The contract's series, with one intention-revealing method per thing the daemon records."""

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        groups: Iterable[str] = (),
        version: str = __version__,
    ) -> None:
        self._state = _STATE.gauge(registry)
        self._probes = _PROBES.counter(registry)
        self._probe_duration = _PROBE_DURATION.histogram(registry)
        self._probe_ttft = _PROBE_TTFT.histogram(registry)
        self._probes_skipped = _PROBES_SKIPPED.counter(registry)
        self._stalls = _STALLS.counter(registry)
        self._restarts = _RESTARTS.counter(registry)
        self._refusals = _REFUSALS.counter(registry)
        self._budget_remaining = _BUDGET_REMAINING.gauge(registry)
        self._last_restart = _LAST_RESTART.gauge(registry)
        self._storms = _STORMS.counter(registry)
        self._storm_active = _STORM_ACTIVE.gauge(registry)
        self._decode_only = _DECODE_ONLY.counter(registry)
        self._scrape_errors = _SCRAPE_ERRORS.counter(registry)
        self._transfer_failed = _TRANSFER_FAILED.gauge(registry)
        self._config_drift = _CONFIG_DRIFT.gauge(registry)
        self._cycle_duration = _CYCLE_DURATION.histogram(registry)
        self._internal_errors = _INTERNAL_ERRORS.counter(registry)
        self._file_errors = _FILE_ERRORS.counter(registry)
        self._alertmanager_errors = _ALERTMANAGER_ERRORS.counter(registry)
        self._build_info = _BUILD_INFO.gauge(registry)
        self._transfer_tally = TransferFailureTally()
        for what in FILE_KINDS:  # at 0 from the start: increase() sees the first failure
            self._file_errors.labels(what=what)
        for operation in ALERTMANAGER_OPERATIONS:
            self._alertmanager_errors.labels(operation=operation)
        self.set_build_info(version)
        for group in groups:
            self.add_group(group)

    def add_group(self, group: str) -> None:
        """Create a group's fixed series up front.

        A counter series that appears for the first time at 1 is invisible to increase() and rate();
        created at 0, its first increment is seen by dashboards and alerts.
        """
        for state in State:
            self._state.labels(group=group, state=state.value)
        for result in RESTART_RESULTS:
            self._restarts.labels(group=group, result=result)
        self._decode_only.labels(group=group)
        self._probes_skipped.labels(group=group)

    def set_build_info(self, version: str) -> None:
        """Expose `version` as the one build_info series."""
        self._build_info.clear()
        self._build_info.labels(version=version).set(1)

    def set_state(self, group: str, state: State) -> None:
        """Mark `state` as the group's current state (1) and every other state 0."""
        for candidate in State:
            self._state.labels(group=group, state=candidate.value).set(
                1 if candidate is state else 0
            )

    def observe_probe(self, group: str, result: ProbeResult) -> None:
        """Count a finished probe, record its duration, and its TTFT for completion probes."""
        self._probes.labels(group=group, kind=result.kind.value, result=result.reason.value).inc()
        self._probe_duration.labels(group=group, kind=result.kind.value).observe(
            result.duration_seconds
        )
        # Only the single-round completion: a multi-round probe's TTFT grows with its context by
        # design and would blur the one latency an operator compares against SGLang's own TTFT.
        if result.kind is ProbeKind.COMPLETION and result.ttft_seconds is not None:
            self._probe_ttft.labels(group=group).observe(result.ttft_seconds)

    def count_probe_skipped(self, group: str) -> None:
        """A probe was due but max_in_flight probes were still pending."""
        self._probes_skipped.labels(group=group).inc()

    def count_stall(self, group: str, kind: str) -> None:
        """A stall verdict of `kind` (the detector's reason code)."""
        self._stalls.labels(group=group, kind=kind).inc()

    def count_restart(self, group: str, result: str, finished_at: float | None = None) -> None:
        """A co-restart sequence ended with `result` (done, failed or dry_run) at `finished_at`.

        A real sequence (not dry_run) with a `finished_at` also sets the last-restart time.
        """
        if result not in RESTART_RESULTS:
            raise ValueError(f"restart result {result!r} is not one of {RESTART_RESULTS}")
        self._restarts.labels(group=group, result=result).inc()
        if finished_at is not None and result != "dry_run":
            self.set_last_restart(group, finished_at)

    def set_last_restart(self, group: str, timestamp_seconds: float) -> None:
        """When the group's units were last co-restarted (unix seconds)."""
        self._last_restart.labels(group=group).set(timestamp_seconds)

    def observe_restart(self, group: str, outcome: RestartOutcome) -> None:
        """Count a finished sequence; a real one (not a rehearsal) also sets the last restart.

        A sequence refused before its first step restarted nothing: count_refusal counts it.
        """
        if outcome.refused:
            return
        result = "dry_run" if outcome.dry_run else ("done" if outcome.ok else "failed")
        self.count_restart(group, result, outcome.finished_at)

    def count_refusal(self, group: str, reason: str) -> None:
        """A restart was refused (decode_only, budget_exhausted, held, paused, locked, ...)."""
        self._refusals.labels(group=group, reason=reason).inc()

    def count_storm(self) -> None:
        """A storm verdict was declared."""
        self._storms.inc()

    def set_storm_active(self, active: bool) -> None:
        """Whether a storm verdict stands now."""
        self._storm_active.set(1 if active else 0)

    def set_budget_remaining(self, group: str, n: int) -> None:
        """Co-restarts still allowed in the current budget window."""
        self._budget_remaining.labels(group=group).set(n)

    def count_decode_only_restart(self, group: str) -> None:
        """Decode was seen restarted without prefill."""
        self._decode_only.labels(group=group).inc()

    def count_scrape_error(self, group: str, target: str) -> None:
        """A scrape of `target` (prefill, decode, router) failed."""
        self._scrape_errors.labels(group=group, target=target).inc()

    def set_observed_transfer_failed(self, group: str, role: str, value: float) -> None:
        """Set the transfer failures counted on `role` (prefill, decode) of `group`.

        Prefer observe_scrape(), which counts as the detector does and skips failed scrapes.
        """
        self._transfer_failed.labels(group=group, role=role).set(value)

    def observe_scrape(self, group: str, snapshot: MetricsSnapshot, start_us: int = 0) -> None:
        """Record one /metrics scrape: an error count, or the transfer failures it counts.

        `start_us` is the worker's unit start time (0: unknown), which tells a new process from
        a lower reading in the same one. Routers have no transfer counter, so only prefill and
        decode are counted.
        """
        if not snapshot.ok:
            self.count_scrape_error(group, snapshot.role.value)
            return
        if snapshot.role is Role.ROUTER:
            return
        total = self._transfer_tally.fold(group, snapshot, start_us)
        self.set_observed_transfer_failed(group, snapshot.role, total)

    def set_config_drift(self, group: str, role: str, findings: int) -> None:
        """How many drift findings the last check of `role` produced (0 = as configured)."""
        self._config_drift.labels(group=group, role=role).set(findings)

    def observe_cycle(self, duration_seconds: float) -> None:
        """One main-loop cycle completed in `duration_seconds`."""
        self._cycle_duration.observe(duration_seconds)

    def count_internal_error(self) -> None:
        """The main loop caught an unexpected exception and carried on."""
        self._internal_errors.inc()

    def count_file_error(self, what: str) -> None:
        """An optional file (`what`: recording, audit, incident, refusals, status) failed to be
        written or read; the cycle went on without it."""
        self._file_errors.labels(what=what).inc()

    def count_alertmanager_error(self, operation: str) -> None:
        """An Alertmanager request (`operation`: create, extend, expire, post_alert) failed."""
        self._alertmanager_errors.labels(operation=operation).inc()


@dataclass(frozen=True, slots=True)
class ListenAddress:
    """A parsed `host:port` (IPv6 hosts in brackets: `[::1]:9464`)."""

    host: str
    port: int

    @classmethod
    def parse(cls, listen: str) -> ListenAddress:
        """Split `host:port`; ValueError names the string when it is not one."""
        host, sep, port = listen.rpartition(":")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
            raise ValueError(f"{listen!r} is not HOST:PORT (e.g. 127.0.0.1:9464)")
        return cls(host, int(port))


# The listener is an asyncio server on an event loop of its own, in one thread. prometheus_client's
# server started a thread per connection and read without a timeout, so a few hundred idle local
# connections exhausted TasksMax and real scrapes got empty replies. One loop holds a connection
# for a few kilobytes, whatever their number; its own thread keeps answering when the daemon's
# loop is wedged (the cycle histogram that stops moving then shows the wedge), which a server on
# the daemon's loop would not. Every connection gets one request: its head within a deadline and
# a size cap, the answer, then the close. At the connection cap the oldest connection still
# sending its request is dropped for the new one, so idle or slow clients cannot lock scrapes out.


@dataclass(frozen=True, slots=True)
class ListenerLimits:
    """How much one client may hold of the metrics listener."""

    max_connections: int = 64  # open at once; a scrape takes milliseconds
    head_timeout_seconds: float = 5.0  # the whole request head, however slowly it trickles in
    write_timeout_seconds: float = 10.0  # for a client that does not read its answer
    max_head_bytes: int = 8192  # request line and headers (a scraper sends a few hundred)
    backlog: int = 128


def _response(status: str, headers: Iterable[tuple[str, str]] = (), body: bytes = b"") -> bytes:
    lines = [f"HTTP/1.1 {status}", *(f"{k}: {v}" for k, v in headers)]
    lines += [f"Content-Length: {len(body)}", "Connection: close", "", ""]
    return "\r\n".join(lines).encode("latin-1") + body


# Rendering the registry takes milliseconds of Python under the GIL. Done per request on the
# listener's thread, a flood of scrapes took the GIL from the daemon's loop and slowed detection
# about a hundredfold. So the page is rendered off the hot path: the daemon renders it once per
# cycle (MetricsPage.refresh) and the listener serves those bytes. What a scraper may vary (an
# OpenMetrics Accept, name[] filters, gzip) is produced from the registry or the cached bytes at
# most once per rendering and kept with it, for at most MAX_PAGE_VARIANTS variants; beyond that
# the default page answers (a superset of any filter, in the format every scraper accepts).
MAX_PAGE_VARIANTS = 16


@dataclass(frozen=True, slots=True)
class _Rendering:
    """One rendering of the registry; `variants` fills in on the listener's thread only."""

    text: bytes | None  # the default page; None when a collector raised (served as a 500)
    variants: dict[tuple[str, tuple[str, ...], bool], bytes | None]


@dataclass(frozen=True, slots=True)
class ServedPage:
    """What one scrape gets: the bytes, their Content-Type, whether they are gzip-compressed."""

    body: bytes
    content_type: str
    gzipped: bool = False


class MetricsPage:
    """The /metrics page, rendered at most once per refresh() (the daemon's, once per cycle) and
    served as bytes.

    The rendering is made by the first scrape after a refresh, on the listener's thread (the
    registry's metrics take their own locks, as for prometheus_client's own server), and served to
    every scrape until the next refresh: a flood of scrapes renders once per cycle, and a cycle
    nobody scrapes renders nothing. Rendered per cycle instead, the page was the largest cost left
    at 32 groups (bench/profile.md, "An aiohttp transport"): ~2000 lines every 5 s, read by a
    Prometheus every 15-60 s.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self._rendering = self._render()
        self._stale = False  # set by refresh(), on the daemon's thread; cleared by the renderer

    def _render(self) -> _Rendering:
        try:
            text: bytes | None = exposition.generate_latest(self._registry)
        except Exception:  # a collector that raises: scrapes get a 500, the daemon goes on
            text = None
        return _Rendering(text, {})

    def refresh(self) -> None:
        """The registry changed: the next scrape renders it, once, and later ones serve that."""
        self._stale = True

    def _current(self) -> _Rendering:
        # Cleared before rendering: a refresh() while it renders leaves the page stale again, so
        # nothing recorded after the render started waits past the next scrape.
        if self._stale:
            self._stale = False
            self._rendering = self._render()
        return self._rendering

    def serve(self, accept: str, names: tuple[str, ...], gzipped: bool) -> ServedPage | None:
        """The page for one request (Accept, name[] filters, gzip accepted); None when rendering
        failed. Called on the listener's thread only (the one thread that renders)."""
        rendering = self._current()  # one rendering per request, its variants with it
        encoder, content_type = choose_encoder(accept)
        key = (content_type, names, gzipped)
        default = content_type == CONTENT_TYPE_PLAIN_0_0_4 and not names and not gzipped
        if not default and key not in rendering.variants:
            if len(rendering.variants) >= MAX_PAGE_VARIANTS:
                default, content_type, gzipped = True, CONTENT_TYPE_PLAIN_0_0_4, False
            else:
                rendering.variants[key] = _variant(self._registry, rendering, encoder, key)
        page = rendering.text if default else rendering.variants[key]
        return None if page is None else ServedPage(page, content_type, gzipped)


def _variant(
    registry: CollectorRegistry,
    rendering: _Rendering,
    encoder: Callable[[CollectorRegistry], bytes],
    key: tuple[str, tuple[str, ...], bool],
) -> bytes | None:
    content_type, names, gzipped = key
    try:
        if content_type == CONTENT_TYPE_PLAIN_0_0_4 and not names:
            page = rendering.text
        else:
            source = registry.restricted_registry(list(names)) if names else registry
            page = encoder(source)  # type: ignore[arg-type]
    except Exception:
        return None
    if not gzipped or page is None:
        return page
    # Level 1: a fifth of the default level's CPU on these pages for ~35 % more bytes, on a
    # loopback or LAN scrape (bench/profile.md, "The client's own layers").
    return gzip.compress(page, compresslevel=1)


def metrics_response(page: MetricsPage, head: bytes) -> bytes:
    """The answer to one request head, as prometheus_client's own server gives it.

    GET on any path serves the page (/favicon.ico: empty), honouring Accept (OpenMetrics),
    Accept-Encoding (gzip) and `name[]` filters; OPTIONS lists the methods; others get 405.
    """
    request_line, _, header_block = head.decode("latin-1").partition("\r\n")
    parts = request_line.split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        return _response("400 Bad Request", body=b"# HTTP 400: not an HTTP request\n")
    method, target, _ = parts
    headers: dict[str, str] = {}
    for line in header_block.split("\r\n"):
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    allow = ("Allow", "OPTIONS,GET")
    if method == "OPTIONS":
        return _response("200 OK", [allow])
    if method != "GET":
        body = f"# HTTP 405 Method Not Allowed: {method}; use OPTIONS or GET\n".encode()
        return _response("405 Method Not Allowed", [allow], body)
    try:
        url = urlsplit(target)
    except ValueError:
        return _response("400 Bad Request", body=b"# HTTP 400: not a request target\n")
    if url.path == "/favicon.ico":
        return _response("200 OK")
    names = tuple(sorted(set(parse_qs(url.query).get("name[]", []))))
    gzipped = gzip_accepted(headers.get("accept-encoding", ""))
    served = page.serve(headers.get("accept", ""), names, gzipped)
    if served is None:
        return _response("500 Internal Server Error")
    out = [("Content-Type", served.content_type)]
    if served.gzipped:
        out.append(("Content-Encoding", "gzip"))
    return _response("200 OK", out, served.body)


class _Connections:
    """The listener's connections: served one request each, capped, the oldest idle one dropped."""

    def __init__(self, page: MetricsPage, limits: ListenerLimits) -> None:
        self._page = page
        self._limits = limits
        self._open: set[asyncio.StreamWriter] = set()
        self._reading: dict[
            asyncio.StreamWriter, None
        ] = {}  # still sending their head, oldest first

    def _drop(self, writer: asyncio.StreamWriter) -> None:
        self._open.discard(writer)
        self._reading.pop(writer, None)
        writer.transport.abort()

    def drop_all(self) -> None:
        """Abort every connection (the listener is closing)."""
        for writer in list(self._open):
            self._drop(writer)

    def _answer(self, head: bytes) -> bytes:
        if not head:
            return _response("431 Request Header Fields Too Large")
        try:
            return metrics_response(self._page, head)
        except Exception:  # whatever goes wrong: the scraper sees a 500, the listener lives
            return _response("500 Internal Server Error")

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection: read the head in time, answer, close."""
        limits = self._limits
        if len(self._open) >= limits.max_connections:
            oldest = next(iter(self._reading), None)
            if oldest is None:  # every slot is writing an answer: this client tries again
                writer.transport.abort()
                return
            self._drop(oldest)
        self._open.add(writer)
        self._reading[writer] = None
        try:
            try:
                async with asyncio.timeout(limits.head_timeout_seconds):
                    head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.LimitOverrunError:
                head = b""
            self._reading.pop(writer, None)
            writer.write(self._answer(head))
            async with asyncio.timeout(limits.write_timeout_seconds):
                await writer.drain()
                writer.close()
                await writer.wait_closed()
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError):
            pass  # too slow, gone, or dropped for a newer connection: nothing to answer
        finally:
            self._drop(writer)


class MetricsServer:
    """The metrics listener: an asyncio server on its own loop and thread, serving the page of one
    registry as last rendered (refresh() renders it again)."""

    def __init__(
        self, sock: socket.socket, registry: CollectorRegistry, limits: ListenerLimits
    ) -> None:
        self._address = sock.getsockname()
        self._sock = sock
        self._limits = limits
        self.page = MetricsPage(registry)
        self._connections = _Connections(self.page, limits)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="metrics-listener", daemon=True)

    def start(self) -> None:
        """Start serving; raises what starting the server raised."""
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error

    def _run(self) -> None:
        loop = self._loop
        asyncio.set_event_loop(loop)
        try:
            server = loop.run_until_complete(
                asyncio.start_server(
                    self._connections.serve, sock=self._sock, limit=self._limits.max_head_bytes
                )
            )
        except BaseException as exc:  # handed to start(), which raises it in the caller
            self._error = exc
            self._ready.set()
            self._sock.close()
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            server.close()
            self._connections.drop_all()
            loop.run_until_complete(server.wait_closed())
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.close()

    def refresh(self) -> None:
        """The daemon, after each cycle: the next scrape renders the page, later ones serve it."""
        self.page.refresh()

    @property
    def port(self) -> int:
        """The bound port (the real one when asked for port 0)."""
        port: int = self._address[1]
        return port

    @property
    def host(self) -> str:
        """The bound address."""
        return str(self._address[0])

    def close(self) -> None:
        """Stop serving and release the port; waits for the serving thread (milliseconds)."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()


def _bind(host: str, port: int, backlog: int) -> socket.socket:
    """A listening socket on host:port, of the family the host resolves to."""
    family, _, _, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


async def serve_metrics(
    registry: CollectorRegistry, listen: str, *, limits: ListenerLimits | None = None
) -> MetricsServer:
    """Serve `registry` on `listen` (HOST:PORT) over HTTP; StartupError names the address if not.

    The server answers scrapes from its own thread, so a wedged event loop still reports its last
    values (and the cycle counter that stops moving shows the wedge). It renders the registry at
    most once per refresh(), for the first scrape after it, never per scrape (see MetricsPage).
    """
    limits = limits or ListenerLimits()
    try:
        address = ListenAddress.parse(listen)
    except ValueError as exc:
        raise StartupError(f"cannot serve metrics: {exc}") from None
    try:
        # Binding resolves the host name and may block: keep it off the event loop.
        sock = await asyncio.to_thread(_bind, address.host, address.port, limits.backlog)
        server = MetricsServer(sock, registry, limits)
        await asyncio.to_thread(server.start)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise StartupError(f"cannot serve metrics on {listen}: {reason}") from None
    except (UnicodeError, ValueError) as exc:  # a host name the resolver refuses outright
        raise StartupError(f"cannot serve metrics on {listen}: {exc}") from None
    return server
