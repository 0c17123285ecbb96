"""The watchdog's own metrics: the contract (docs/architecture.md) on a fresh registry, and the listener."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from watchdog import __version__
from watchdog.catalog import METRIC_PREFIX, METRICS, Metric
from watchdog.errors import StartupError
from watchdog.model import (
    MetricsSnapshot,
    ProbeFailure,
    ProbeKind,
    ProbeResult,
    RestartOutcome,
    RestartPlan,
    Role,
    ScrapeFailure,
    State,
)
from watchdog.run.metrics import ListenerLimits, WatchdogMetrics, serve_metrics


def _family(metric: Metric) -> str:
    """The family name prometheus_client's parser reports: counters without `_total`."""
    name = METRIC_PREFIX + metric.name
    return name.removesuffix("_total") if metric.kind == "counter" else name


# The contract (watchdog/catalog.py): family name as the parser reports it, type, labels.
CONTRACT: dict[str, tuple[str, frozenset[str]]] = {
    _family(m): (m.kind, frozenset(m.labels)) for m in METRICS
}


def probe(
    kind: ProbeKind = ProbeKind.COMPLETION,
    reason: ProbeFailure = ProbeFailure.OK,
    duration_seconds: float = 0.4,
    ttft_seconds: float | None = 0.2,
) -> ProbeResult:
    """A finished probe result of the given kind and outcome."""
    return ProbeResult(
        kind=kind,
        target="router",
        ok=reason is ProbeFailure.OK,
        reason=reason,
        started_at=1000.0,
        duration_seconds=duration_seconds,
        ttft_seconds=ttft_seconds,
    )


def outcome(*, ok: bool, dry_run: bool, finished_at: float = 2000.0) -> RestartOutcome:
    """A finished restart outcome, live or rehearsed, of one group."""
    return RestartOutcome(
        plan=RestartPlan(group="dsv4", trigger="test", steps=()),
        ok=ok,
        dry_run=dry_run,
        steps=(),
        started_at=1900.0,
        finished_at=finished_at,
    )


def snapshot(role: Role, *, ok: bool = True, transfer_failed: float = 0.0) -> MetricsSnapshot:
    """A scrape snapshot of one role, passed or timed out."""
    return MetricsSnapshot(
        role=role,
        scraped_at=1000.0,
        ok=ok,
        error=ScrapeFailure.OK if ok else ScrapeFailure.TIMEOUT,
        transfer_failed=transfer_failed,
    )


@pytest.fixture
def registry() -> CollectorRegistry:
    """A fresh registry per test, so no test sees another's series."""
    return CollectorRegistry()


@pytest.fixture
def metrics(registry: CollectorRegistry) -> WatchdogMetrics:
    """The watchdog's metrics for one group on the test's own registry."""
    return WatchdogMetrics(registry, groups=["dsv4"])


def exercise_every_series(metrics: WatchdogMetrics) -> None:
    """Touch every series the watchdog exports, so the contract checks see each one."""
    metrics.set_state("dsv4", State.HEALTHY)
    metrics.observe_probe("dsv4", probe())
    metrics.count_probe_skipped("dsv4")
    metrics.count_stall("dsv4", "no_progress")
    metrics.observe_restart("dsv4", outcome(ok=True, dry_run=False))
    metrics.count_refusal("dsv4", "decode_only")
    metrics.set_budget_remaining("dsv4", 2)
    metrics.count_decode_only_restart("dsv4")
    metrics.count_scrape_error("dsv4", "decode")
    metrics.set_observed_transfer_failed("dsv4", Role.PREFILL, 21)
    metrics.set_config_drift("dsv4", Role.DECODE, 1)
    metrics.observe_cycle(0.03)
    metrics.count_internal_error()
    metrics.count_file_error("recording")


def test_exposition_matches_the_contract(
    registry: CollectorRegistry, metrics: WatchdogMetrics
) -> None:
    """Parsed back with prometheus_client's parser, the families, types and labels are the contract."""
    exercise_every_series(metrics)
    text = generate_latest(registry).decode()
    found: dict[str, tuple[str, frozenset[str]]] = {}
    for family in text_string_to_metric_families(text):
        if family.name.endswith("_created"):
            continue  # prometheus_client's creation timestamps, not part of the contract
        labels = frozenset(key for sample in family.samples for key in sample.labels) - {"le"}
        found[family.name] = (family.type, labels)
    assert found == CONTRACT


def test_counter_wire_names_end_in_total(
    registry: CollectorRegistry, metrics: WatchdogMetrics
) -> None:
    """Counters are exposed with the `_total` names the contract lists (docs/architecture.md)."""
    exercise_every_series(metrics)
    text = generate_latest(registry).decode()
    for name in (
        "probes_total",
        "stalls_detected_total",
        "restarts_total",
        "internal_errors_total",
        "file_errors_total",
    ):
        assert f"\nsglang_watchdog_{name}" in text


def test_set_state_marks_exactly_one_state(
    registry: CollectorRegistry, metrics: WatchdogMetrics
) -> None:
    """The current state is 1 and every other state of the group is 0, also after a change."""
    metrics.set_state("dsv4", State.HEALTHY)
    metrics.set_state("dsv4", State.STALLED)
    values = {
        state: registry.get_sample_value(
            "sglang_watchdog_state", {"group": "dsv4", "state": state.value}
        )
        for state in State
    }
    assert values == {state: (1.0 if state is State.STALLED else 0.0) for state in State}


def test_add_group_creates_counters_at_zero(registry: CollectorRegistry) -> None:
    """A group's restart, decode-only and skip counters exist at 0 before anything happens."""
    WatchdogMetrics(registry, groups=["a"])
    for result in ("done", "failed", "dry_run"):
        assert (
            registry.get_sample_value(
                "sglang_watchdog_restarts_total", {"group": "a", "result": result}
            )
            == 0.0
        )
    assert (
        registry.get_sample_value(
            "sglang_watchdog_decode_only_restarts_detected_total", {"group": "a"}
        )
        == 0.0
    )
    assert registry.get_sample_value("sglang_watchdog_probes_skipped_total", {"group": "a"}) == 0.0
    assert (
        registry.get_sample_value("sglang_watchdog_state", {"group": "a", "state": "held"}) == 0.0
    )


def test_observe_probe_counts_by_reason_and_times_failures_too(
    registry: CollectorRegistry, metrics: WatchdogMetrics
) -> None:
    """A failed probe is counted under its reason and its duration is still observed."""
    metrics.observe_probe("dsv4", probe())
    metrics.observe_probe(
        "dsv4",
        probe(reason=ProbeFailure.STALLED_MIDSTREAM, duration_seconds=10.0, ttft_seconds=None),
    )
    labels = {"group": "dsv4", "kind": "completion"}
    assert (
        registry.get_sample_value("sglang_watchdog_probes_total", {**labels, "result": "ok"}) == 1
    )
    assert (
        registry.get_sample_value(
            "sglang_watchdog_probes_total", {**labels, "result": "stalled_midstream"}
        )
        == 1
    )
    assert registry.get_sample_value("sglang_watchdog_probe_duration_seconds_count", labels) == 2
    assert registry.get_sample_value("sglang_watchdog_probe_duration_seconds_sum", labels) == 10.4
    assert (
        registry.get_sample_value("sglang_watchdog_probe_ttft_seconds_count", {"group": "dsv4"})
        == 1
    )


def test_ttft_is_recorded_for_completion_probes_only(
    registry: CollectorRegistry, metrics: WatchdogMetrics
) -> None:
    """A multi-round probe's TTFT (which grows with its context) stays out of the TTFT histogram."""
    metrics.observe_probe("dsv4", probe(kind=ProbeKind.MULTIROUND, ttft_seconds=3.0))
    assert (
        registry.get_sample_value("sglang_watchdog_probe_ttft_seconds_count", {"group": "dsv4"})
        is None
    )


@pytest.mark.parametrize(
    ("ok", "dry_run", "result", "last_restart"),
    [
        (True, False, "done", 2000.0),
        (False, False, "failed", 2000.0),
        (True, True, "dry_run", None),
    ],
)
def test_observe_restart(
    registry: CollectorRegistry,
    metrics: WatchdogMetrics,
    *,
    ok: bool,
    dry_run: bool,
    result: str,
    last_restart: float | None,
) -> None:
    """A sequence is counted by result; only a real one moves the last-restart timestamp."""
    metrics.observe_restart("dsv4", outcome(ok=ok, dry_run=dry_run))
    assert (
        registry.get_sample_value(
            "sglang_watchdog_restarts_total", {"group": "dsv4", "result": result}
        )
        == 1
    )
    assert (
        registry.get_sample_value(
            "sglang_watchdog_last_restart_timestamp_seconds", {"group": "dsv4"}
        )
        == last_restart
    )


def test_count_restart_with_finish_time_sets_last_restart_unless_dry_run(
    registry: CollectorRegistry, metrics: WatchdogMetrics
) -> None:
    """count_restart(group, result, finished_at) moves the last-restart time for real sequences."""
    metrics.count_restart("dsv4", "failed", 1500.0)
    metrics.count_restart("dsv4", "dry_run", 1600.0)
    assert (
        registry.get_sample_value(
            "sglang_watchdog_last_restart_timestamp_seconds", {"group": "dsv4"}
        )
        == 1500.0
    )


def test_count_restart_rejects_unknown_results(metrics: WatchdogMetrics) -> None:
    """A result outside done/failed/dry_run is a programming error."""
    with pytest.raises(ValueError, match="'skipped'"):
        metrics.count_restart("dsv4", "skipped")


def _transfer_series(
    registry: CollectorRegistry,
    metrics: WatchdogMetrics,
    scrapes: list[tuple[MetricsSnapshot, int]],
    role: Role = Role.DECODE,
) -> list[float | None]:
    """The exported transfer-failure value after each (scrape, unit start time)."""
    labels = {"group": "dsv4", "role": role.value}
    seen = []
    for snap, start_us in scrapes:
        metrics.observe_scrape("dsv4", snap, start_us)
        seen.append(
            registry.get_sample_value("sglang_watchdog_observed_transfer_failed_total", labels)
        )
    return seen


def test_observe_scrape_counts_transfer_failures_and_keeps_them_on_error(
    registry: CollectorRegistry, metrics: WatchdogMetrics
) -> None:
    """The first scrape starts the baseline; growth counts; a failed scrape counts an error only."""
    seen = _transfer_series(
        registry,
        metrics,
        [
            (snapshot(Role.PREFILL, transfer_failed=21), 1),
            (snapshot(Role.PREFILL, ok=False), 1),
            (snapshot(Role.PREFILL, transfer_failed=24), 1),
        ],
        Role.PREFILL,
    )
    assert seen == [0.0, 0.0, 3.0]
    assert (
        registry.get_sample_value(
            "sglang_watchdog_scrape_errors_total", {"group": "dsv4", "target": "prefill"}
        )
        == 1
    )


def test_transfer_count_never_drops_on_a_lower_reading_in_the_same_process(
    registry: CollectorRegistry, metrics: WatchdogMetrics
) -> None:
    """5, 8, 6, 9 in one process counts 3 then 1: the suspect 6 neither lowers nor re-adds."""
    seen = _transfer_series(
        registry,
        metrics,
        [(snapshot(Role.DECODE, transfer_failed=v), 7) for v in (5.0, 8.0, 6.0, 9.0)],
    )
    assert seen == [0.0, 3.0, 3.0, 4.0]


def test_transfer_count_does_not_jump_when_the_series_first_appears_late(
    registry: CollectorRegistry, metrics: WatchdogMetrics
) -> None:
    """A series first seen in a process found running starts the baseline: no lifetime jump."""
    absent = replace(snapshot(Role.DECODE), absent_counters=("transfer_failed",))
    seen = _transfer_series(
        registry,
        metrics,
        [
            (absent, 7),
            (absent, 7),
            (snapshot(Role.DECODE, transfer_failed=500), 7),
            (absent, 7),  # missing again: no reading, the baseline stays 500
            (snapshot(Role.DECODE, transfer_failed=502), 7),
        ],
    )
    assert seen == [0.0, 0.0, 0.0, 0.0, 2.0]


def test_transfer_count_of_a_new_process_counts_from_zero(
    registry: CollectorRegistry, metrics: WatchdogMetrics
) -> None:
    """A restarted worker (new unit start time) counts its new value once, and never drops."""
    absent = replace(snapshot(Role.DECODE), absent_counters=("transfer_failed",))
    seen = _transfer_series(
        registry,
        metrics,
        [
            (snapshot(Role.DECODE, transfer_failed=40), 7),
            (snapshot(Role.DECODE, transfer_failed=42), 7),
            (absent, 8),  # the new process has no series yet
            (snapshot(Role.DECODE, transfer_failed=1), 8),
            (snapshot(Role.DECODE, transfer_failed=3), 0),  # unit unreadable: same process
        ],
    )
    assert seen == [0.0, 2.0, 2.0, 3.0, 5.0]


def test_transfer_count_sums_the_workers_of_a_role(
    registry: CollectorRegistry, metrics: WatchdogMetrics
) -> None:
    """Two decode workers each keep their own baseline; the role's value is the sum of both."""

    def decode(worker: int, value: float) -> tuple[MetricsSnapshot, int]:
        return replace(snapshot(Role.DECODE, transfer_failed=value), worker=worker), 10 + worker

    seen = _transfer_series(
        registry,
        metrics,
        [decode(0, 10), decode(1, 100), decode(0, 12), decode(1, 101), decode(0, 12)],
    )
    assert seen == [0.0, 0.0, 2.0, 3.0, 3.0]


def test_router_scrapes_create_no_transfer_series(
    registry: CollectorRegistry, metrics: WatchdogMetrics
) -> None:
    """The router has no transfer counter, so its scrape adds no transfer-failure series."""
    metrics.observe_scrape("dsv4", snapshot(Role.ROUTER))
    assert (
        registry.get_sample_value(
            "sglang_watchdog_observed_transfer_failed_total", {"group": "dsv4", "role": "router"}
        )
        is None
    )


def test_build_info_carries_the_version(registry: CollectorRegistry) -> None:
    """build_info is 1 with the package version as its label."""
    WatchdogMetrics(registry)
    assert registry.get_sample_value("sglang_watchdog_build_info", {"version": __version__}) == 1


def test_set_build_info_replaces_the_version(registry: CollectorRegistry) -> None:
    """set_build_info leaves exactly one build_info series, with the new version."""
    WatchdogMetrics(registry).set_build_info("9.9.9")
    text = generate_latest(registry).decode()
    assert [
        line for line in text.splitlines() if line.startswith("sglang_watchdog_build_info")
    ] == ['sglang_watchdog_build_info{version="9.9.9"} 1.0']


@pytest.fixture
def occupied_port() -> Iterator[int]:
    """A port something already listens on, held for the test."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


async def test_server_serves_the_registry(
    registry: CollectorRegistry, metrics: WatchdogMetrics
) -> None:
    """An HTTP scrape of the listener returns the registry's exposition."""
    server = await serve_metrics(registry, "127.0.0.1:0")
    try:
        assert server.host == "127.0.0.1"
        async with httpx.AsyncClient() as client:
            response = await client.get(f"http://127.0.0.1:{server.port}/metrics")
    finally:
        server.close()
    assert response.status_code == 200
    assert f'sglang_watchdog_build_info{{version="{__version__}"}} 1.0' in response.text
    assert 'sglang_watchdog_restarts_total{group="dsv4",result="done"} 0.0' in response.text


async def test_server_close_releases_the_port(registry: CollectorRegistry) -> None:
    """After close() nothing accepts connections on the port any more."""
    server = await serve_metrics(registry, "127.0.0.1:0")
    port = server.port
    server.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port)).close()


async def test_bind_failure_names_the_address(
    registry: CollectorRegistry, occupied_port: int
) -> None:
    """A taken port is a StartupError naming the listen address."""
    listen = f"127.0.0.1:{occupied_port}"
    with pytest.raises(
        StartupError, match=f"cannot serve metrics on {listen}: Address already in use"
    ):
        await serve_metrics(registry, listen)


@pytest.mark.parametrize("listen", ["9464", "localhost", ":9464", "127.0.0.1:http"])
async def test_malformed_listen_address_is_a_startup_error(
    registry: CollectorRegistry, listen: str
) -> None:
    """A listen string that is not HOST:PORT is rejected with its value in the message."""
    with pytest.raises(StartupError, match=repr(listen)):
        await serve_metrics(registry, listen)


def test_ipv6_listen_address_is_unbracketed() -> None:
    """`[::1]:9464` binds host ::1."""
    from watchdog.run.metrics import ListenAddress

    assert ListenAddress.parse("[::1]:9464") == ListenAddress("::1", 9464)


# --- the listener holds out against idle, slow and oversized local clients -----------------------


def raw_get(port: int, request: bytes, timeout: float = 5.0) -> bytes:
    """Send one raw request to 127.0.0.1:port and read the answer until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


GET = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


async def test_idle_connections_neither_add_threads_nor_starve_a_scrape(
    registry: CollectorRegistry, metrics: WatchdogMetrics
) -> None:
    """300 idle connections: no thread more, and a real scrape still answers within seconds."""
    server = await serve_metrics(registry, "127.0.0.1:0")
    idle: list[socket.socket] = []
    try:
        threads = threading.active_count()
        for _ in range(300):
            idle.append(socket.create_connection(("127.0.0.1", server.port), timeout=5))
        await asyncio.sleep(0.2)
        assert threading.active_count() == threads
        started = time.monotonic()
        answer = await asyncio.to_thread(raw_get, server.port, GET)
        assert time.monotonic() - started < 10.0  # not starved (a busy machine is slow, not stuck)
        assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
        assert b"sglang_watchdog_build_info" in answer
        assert threading.active_count() == threads
    finally:
        for sock in idle:
            sock.close()
        server.close()


async def test_slow_client_is_cut_at_the_head_deadline(registry: CollectorRegistry) -> None:
    """A client trickling its request head (slowloris) is disconnected at the deadline."""
    server = await serve_metrics(
        registry, "127.0.0.1:0", limits=ListenerLimits(head_timeout_seconds=1.0)
    )

    def trickle() -> float:
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.sendall(b"GET /metrics HTTP/1.1\r\n")
            sock.settimeout(0.1)
            for n in range(300):  # trickles for 30 s unless cut
                try:
                    sock.sendall(f"X-Slow-{n}: a\r\n".encode())
                    if sock.recv(1) == b"":
                        return time.monotonic() - started
                except TimeoutError:
                    continue
                except OSError:
                    return time.monotonic() - started
        return time.monotonic() - started

    try:
        cut_after = await asyncio.to_thread(trickle)
    finally:
        server.close()
    assert 0.8 <= cut_after < 15.0  # cut at about 1 s; the slack is for a busy machine


async def test_oversized_request_head_is_refused(registry: CollectorRegistry) -> None:
    """A request head beyond the cap gets 431 and the connection is closed."""
    server = await serve_metrics(
        registry, "127.0.0.1:0", limits=ListenerLimits(max_head_bytes=1024)
    )
    big = b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * 4096 + b"\r\n\r\n"
    try:
        answer = await asyncio.to_thread(raw_get, server.port, big)
    finally:
        server.close()
    assert answer.startswith(b"HTTP/1.1 431 ")


async def test_listener_answers_like_prometheus_client(
    registry: CollectorRegistry, metrics: WatchdogMetrics
) -> None:
    """Any GET path serves the registry (gzip and name[] honoured); OPTIONS; others 405."""
    server = await serve_metrics(registry, "127.0.0.1:0")
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as client:
            root = await client.get("/")
            gzipped = await client.get(
                "/metrics?name[]=sglang_watchdog_build_info",
                headers={"Accept-Encoding": "gzip"},
            )
            options = await client.options("/metrics")
            post = await client.post("/metrics")
            favicon = await client.get("/favicon.ico")
        garbage = await asyncio.to_thread(raw_get, server.port, b"hello\r\n\r\n")
    finally:
        server.close()
    assert root.status_code == 200
    assert root.headers["content-type"].startswith("text/plain")
    assert "sglang_watchdog_restarts_total" in root.text
    assert gzipped.headers["content-encoding"] == "gzip"
    assert gzipped.text.strip().endswith(
        f'sglang_watchdog_build_info{{version="{__version__}"}} 1.0'
    )
    assert "sglang_watchdog_restarts_total" not in gzipped.text
    assert (options.status_code, options.headers["allow"]) == (200, "OPTIONS,GET")
    assert post.status_code == 405
    assert (favicon.status_code, favicon.content) == (200, b"")
    assert garbage.startswith(b"HTTP/1.1 400 ")
