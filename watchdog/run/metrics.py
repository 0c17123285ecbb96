"""The watchdog's own Prometheus metrics (a contract: docs/architecture.md) and their HTTP listener.

Every series is named `sglang_watchdog_*` and registered on a registry that is passed in, so tests
build a fresh one. Per-group series carry the label `group`.

`observed_transfer_failed_total{group,role}` is a *gauge* that mirrors SGLang's
`sglang:num_transfer_failed_reqs_total` (max over TP ranks) as last scraped: the same number an
operator sees on the server, from the first scrape on. It keeps the `_total` name of the counter it
mirrors; a restarted server resets it to 0, which PromQL's increase()/rate() treat as a counter
reset, so alerts use `increase()` on it. Only successful scrapes update it (a failed scrape keeps
the last value instead of dropping to 0), and only where the series was in the payload: a series
missing from one scrape keeps the last value too, so its return is no "reset plus its full value"
to increase(). It starts at 0 when the first scrape has no series (SGLang creates it at the
first failure).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from watchdog import __version__
from watchdog.errors import StartupError
from watchdog.model import MetricsSnapshot, ProbeKind, ProbeResult, RestartOutcome, Role, State

PREFIX = "sglang_watchdog_"

RESTART_RESULTS: tuple[str, ...] = ("done", "failed", "dry_run")

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


class WatchdogMetrics:
    """The contract's series, with one intention-revealing method per thing the daemon records."""

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        groups: Iterable[str] = (),
        version: str = __version__,
    ) -> None:
        self._state = Gauge(
            PREFIX + "state",
            "1 for the group's current state, 0 for every other state.",
            ["group", "state"],
            registry=registry,
        )
        self._probes = Counter(
            PREFIX + "probes_total",
            "Finished probes by kind and result (ok, or the failure reason).",
            ["group", "kind", "result"],
            registry=registry,
        )
        self._probe_duration = Histogram(
            PREFIX + "probe_duration_seconds",
            "Wall time of every finished probe, failed ones included.",
            ["group", "kind"],
            buckets=PROBE_BUCKETS_SECONDS,
            registry=registry,
        )
        self._probe_ttft = Histogram(
            PREFIX + "probe_ttft_seconds",
            "Time to the first non-empty token of completion probes through the router.",
            ["group"],
            buckets=TTFT_BUCKETS_SECONDS,
            registry=registry,
        )
        self._probes_skipped = Counter(
            PREFIX + "probes_skipped_total",
            "Probe starts skipped because max_in_flight probes were still pending.",
            ["group"],
            registry=registry,
        )
        self._stalls = Counter(
            PREFIX + "stalls_detected_total",
            "Stall verdicts by kind.",
            ["group", "kind"],
            registry=registry,
        )
        self._restarts = Counter(
            PREFIX + "restarts_total",
            "Co-restart sequences by result (done, failed, dry_run).",
            ["group", "result"],
            registry=registry,
        )
        self._refusals = Counter(
            PREFIX + "restart_refusals_total",
            "Restarts the watchdog refused to perform, by reason.",
            ["group", "reason"],
            registry=registry,
        )
        self._budget_remaining = Gauge(
            PREFIX + "restart_budget_remaining",
            "Co-restarts still allowed in the current budget window.",
            ["group"],
            registry=registry,
        )
        self._last_restart = Gauge(
            PREFIX + "last_restart_timestamp_seconds",
            "Unix time at which the last (non-dry-run) co-restart sequence finished.",
            ["group"],
            registry=registry,
        )
        self._decode_only = Counter(
            PREFIX + "decode_only_restarts_detected_total",
            "Restarts of decode without prefill (by systemd's Restart= or a person).",
            ["group"],
            registry=registry,
        )
        self._scrape_errors = Counter(
            PREFIX + "scrape_errors_total",
            "Failed /metrics scrapes by target.",
            ["group", "target"],
            registry=registry,
        )
        self._transfer_failed = Gauge(
            PREFIX + "observed_transfer_failed_total",
            "SGLang's num_transfer_failed_reqs_total (max over TP ranks) as last scraped, by role.",
            ["group", "role"],
            registry=registry,
        )
        self._config_drift = Gauge(
            PREFIX + "config_drift",
            "Drift findings (cmdline flags or environment not as configured) by role.",
            ["group", "role"],
            registry=registry,
        )
        self._cycle_duration = Histogram(
            PREFIX + "cycle_duration_seconds",
            "Wall time of one completed observe-decide-act cycle.",
            buckets=CYCLE_BUCKETS_SECONDS,
            registry=registry,
        )
        self._internal_errors = Counter(
            PREFIX + "internal_errors_total",
            "Unexpected exceptions caught by the main loop (logged, then the loop continued).",
            registry=registry,
        )
        self._build_info = Gauge(
            PREFIX + "build_info",
            "Always 1; the label carries the running sglang-watchdog version.",
            ["version"],
            registry=registry,
        )
        self._mirrored: set[tuple[str, str]] = set()  # (group, role) transfer mirrors set
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
        """Count a finished sequence; a real one (not a rehearsal) also sets the last restart."""
        result = "dry_run" if outcome.dry_run else ("done" if outcome.ok else "failed")
        self.count_restart(group, result, outcome.finished_at)

    def count_refusal(self, group: str, reason: str) -> None:
        """A restart was refused (decode_only, budget_exhausted, held, paused, locked, ...)."""
        self._refusals.labels(group=group, reason=reason).inc()

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
        """Mirror SGLang's transfer-failure counter (max over TP ranks) of `role` (prefill, decode).

        Prefer observe_scrape(), which also skips failed scrapes and the router.
        """
        self._transfer_failed.labels(group=group, role=role).set(value)

    def observe_scrape(self, group: str, snapshot: MetricsSnapshot) -> None:
        """Record one /metrics scrape: an error count, or the mirrored transfer-failure counter.

        A failed scrape, or one without the series, leaves the mirror at its last value: the
        snapshot's 0.0 is not a reading then. Routers have no transfer counter, so only prefill
        and decode are mirrored.
        """
        if not snapshot.ok:
            self.count_scrape_error(group, snapshot.role.value)
            return
        if snapshot.role is Role.ROUTER:
            return
        key = (group, snapshot.role.value)
        if "transfer_failed" not in snapshot.absent_counters or key not in self._mirrored:
            self.set_observed_transfer_failed(group, snapshot.role, snapshot.transfer_failed)
            self._mirrored.add(key)

    def set_config_drift(self, group: str, role: str, findings: int) -> None:
        """How many drift findings the last check of `role` produced (0 = as configured)."""
        self._config_drift.labels(group=group, role=role).set(findings)

    def observe_cycle(self, duration_seconds: float) -> None:
        """One main-loop cycle completed in `duration_seconds`."""
        self._cycle_duration.observe(duration_seconds)

    def count_internal_error(self) -> None:
        """The main loop caught an unexpected exception and carried on."""
        self._internal_errors.inc()


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


class MetricsServer:
    """prometheus_client's HTTP server (a daemon thread) serving one registry."""

    def __init__(self, server: WSGIServer, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread

    @property
    def port(self) -> int:
        """The bound port (the real one when asked for port 0)."""
        port: int = self._server.server_address[1]
        return port

    @property
    def host(self) -> str:
        """The bound address."""
        return str(self._server.server_address[0])

    def close(self) -> None:
        """Stop serving and release the port; waits for the serving thread (under half a second)."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


async def serve_metrics(registry: CollectorRegistry, listen: str) -> MetricsServer:
    """Serve `registry` on `listen` (HOST:PORT) over HTTP; StartupError names the address if not.

    The server answers scrapes from its own thread, so a wedged event loop still reports its last
    values (and the cycle counter that stops moving shows the wedge).
    """
    try:
        address = ListenAddress.parse(listen)
    except ValueError as exc:
        raise StartupError(f"cannot serve metrics: {exc}") from None
    try:
        # Binding resolves the host name and may block: keep it off the event loop.
        server, thread = await asyncio.to_thread(
            start_http_server, address.port, address.host, registry
        )
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise StartupError(f"cannot serve metrics on {listen}: {reason}") from None
    return MetricsServer(server, thread)
