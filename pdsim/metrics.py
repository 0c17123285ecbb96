"""SGLang's Prometheus metrics, per SGLang version, on a per-process prometheus_client registry.

Names, types and label sets follow docs/sglang.md §3 and §7.8. The wire format is the
real library's (`_bake_output`, as `make_asgi_app` does in SGLang, so Accept and gzip negotiation
are the library's too); `_created` samples are off because SGLang runs prometheus_client in
multiprocess mode, which emits none.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import exposition as _exposition
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

SUPPORTED_VERSIONS = ("0.5.23", "0.5.19", "0.5.16", "0.5.9", "0.5.5", "0.4.10")


def version_at_least(version: str, floor: str) -> bool:
    """`version` is `floor` or newer (numeric, component by component)."""
    return tuple(int(x) for x in version.split(".")) >= tuple(int(x) for x in floor.split("."))


@dataclass(frozen=True)
class VersionNaming:
    """What differs between SGLang versions in the metrics, logs and endpoints we simulate."""

    version: str
    prefill_bootstrap_queue: str
    prefill_inflight_queue: str
    unified_engine_type: bool
    scheduler_labels: tuple[str, ...]
    tokenizer_labels: tuple[str, ...]
    realtime_tokens: bool
    kv_transfer_latency: str  # "histogram", "gauge" or "" (absent)
    # /v1/loads (docs/sglang.md §7.6): "" absent (404), "ipc" a round trip through the scheduler
    # (0.5.9), "snapshot" published on batches and when fully idle (0.5.16-0.5.18), "refresh"
    # also every 50 ms while busy without batches (0.5.19+).
    loads: str
    # sglang:http_requests_active (§7.8): "" absent, "headers" a stream leaves it once its headers
    # are sent (0.5.9, BaseHTTPMiddleware), "whole" counted until its last byte (0.5.16+).
    http_active: str

    @property
    def has_v1_loads(self) -> bool:
        return bool(self.loads)

    @property
    def decode_moments(self) -> bool:
        """/v1/loads rows carry decode step-time moment sums from 0.5.19."""
        return version_at_least(self.version, "0.5.19")


_MODERN_SCHEDULER = ("model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank")
_OLD_SCHEDULER = ("model_name", "engine_type", "tp_rank", "pp_rank")

NAMINGS: dict[str, VersionNaming] = {
    # sglang/srt/observability/metrics_collector.py:582-589 @ 0.5.23 (bootstrap queue name);
    # tokenizer labels + is_streaming: metrics_collector.py:1858 @ 0.5.23.
    "0.5.23": VersionNaming(
        version="0.5.23",
        prefill_bootstrap_queue="sglang:num_prefill_bootstrap_queue_reqs",
        prefill_inflight_queue="sglang:num_prefill_inflight_queue_reqs",
        unified_engine_type=False,
        scheduler_labels=_MODERN_SCHEDULER,
        tokenizer_labels=("model_name", "engine_type", "is_streaming"),
        realtime_tokens=True,
        kv_transfer_latency="histogram",
        loads="refresh",
        http_active="whole",
    ),
    # observability/metrics_collector.py:495-502, 525, 1523 (is_streaming), 891
    # (realtime_tokens_total) @ 0.5.19; managers/scheduler.py:374, 4483-4499 (stall refresh).
    "0.5.19": VersionNaming(
        version="0.5.19",
        prefill_bootstrap_queue="sglang:num_prefill_bootstrap_queue_reqs",
        prefill_inflight_queue="sglang:num_prefill_inflight_queue_reqs",
        unified_engine_type=False,
        scheduler_labels=_MODERN_SCHEDULER,
        tokenizer_labels=("model_name", "engine_type", "is_streaming"),
        realtime_tokens=True,
        kv_transfer_latency="histogram",
        loads="refresh",
        http_active="whole",
    ),
    # observability/metrics_collector.py:487-494, 517, 885 @ 0.5.16; tokenizer labels
    # model_name + engine_type, no is_streaming (managers/tokenizer_manager.py:559-569);
    # whole streams in http_requests_active (utils/common.py:2378-2404 +
    # utils/http_middleware_patch.py:38-48: call_next awaits the whole ASGI app).
    "0.5.16": VersionNaming(
        version="0.5.16",
        prefill_bootstrap_queue="sglang:num_prefill_bootstrap_queue_reqs",
        prefill_inflight_queue="sglang:num_prefill_inflight_queue_reqs",
        unified_engine_type=False,
        scheduler_labels=_MODERN_SCHEDULER,
        tokenizer_labels=("model_name", "engine_type"),
        realtime_tokens=True,
        kv_transfer_latency="histogram",
        loads="snapshot",
        http_active="whole",
    ),
    # metrics/collector.py:430-437 (prealloc name), 475 (latency gauge), 778-779
    # (realtime_tokens_total) @ 0.5.9; scheduler labels managers/scheduler_metrics_mixin.py:104-119;
    # tokenizer labels only model_name (managers/tokenizer_manager.py:432-442);
    # http_requests_active in a BaseHTTPMiddleware (utils/common.py:1604-1660).
    "0.5.9": VersionNaming(
        version="0.5.9",
        prefill_bootstrap_queue="sglang:num_prefill_prealloc_queue_reqs",
        prefill_inflight_queue="sglang:num_prefill_inflight_queue_reqs",
        unified_engine_type=False,
        scheduler_labels=_MODERN_SCHEDULER,
        tokenizer_labels=("model_name",),
        realtime_tokens=True,
        kv_transfer_latency="gauge",
        loads="ipc",
        http_active="headers",
    ),
    # Tokenizer labels only model_name (managers/tokenizer_manager.py:359-367 @ 0.5.5);
    # scheduler engine_type "unified" (scheduler_metrics_mixin.py:61-68 @ 0.5.5).
    "0.5.5": VersionNaming(
        version="0.5.5",
        prefill_bootstrap_queue="sglang:num_prefill_prealloc_queue_reqs",
        prefill_inflight_queue="sglang:num_prefill_inflight_queue_reqs",
        unified_engine_type=True,
        scheduler_labels=_OLD_SCHEDULER,
        tokenizer_labels=("model_name",),
        realtime_tokens=False,
        kv_transfer_latency="gauge",
        loads="",
        http_active="",
    ),
    "0.4.10": VersionNaming(
        version="0.4.10",
        prefill_bootstrap_queue="sglang:num_prefill_prealloc_queue_reqs",
        # The typo is SGLang's own wire name in 0.4.x.
        prefill_inflight_queue="sglang:num_prefill_infight_queue_reqs",
        unified_engine_type=True,
        scheduler_labels=_OLD_SCHEDULER,
        tokenizer_labels=("model_name",),
        realtime_tokens=False,
        kv_transfer_latency="",
        loads="",
        http_active="",
    ),
}

_TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
_E2E_BUCKETS = (*_TTFT_BUCKETS, 600, 1200, 1800, 2400)
_KV_MS_BUCKETS = (1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000)


@dataclass(frozen=True)
class SchedulerStats:
    """One scheduler stats report: the values SGLang writes to its gauges in `log_stats`."""

    num_running_reqs: int = 0
    num_used_tokens: int = 0
    token_usage: float = 0.0
    gen_throughput: float = 0.0
    num_queue_reqs: int = 0
    num_prefill_bootstrap_queue_reqs: int = 0
    num_prefill_inflight_queue_reqs: int = 0
    num_decode_prealloc_queue_reqs: int = 0
    num_decode_transfer_queue_reqs: int = 0
    cache_hit_rate: float = 0.0
    max_total_num_tokens: int = 0
    kv_transfer_latency_ms: float = 0.0


class _NonEmptyFamilies(Collector):
    """Drops families without samples: SGLang's multiprocess collector only sees written series,
    so a labelled counter that was never incremented has no HELP/TYPE lines either."""

    def __init__(self, inner: CollectorRegistry) -> None:
        self._inner = inner

    def collect(self) -> Iterator[Metric]:
        for family in self._inner.collect():
            if family.samples:
                yield family


class SimMetrics:
    """The metric families of one simulated SGLang server (scheduler, tokenizer and HTTP layer)."""

    def __init__(
        self,
        *,
        version: str,
        role: str,
        tp_size: int,
        model_name: str,
        registry: CollectorRegistry | None = None,
        dp_size: int = 1,
    ) -> None:
        # SGLang's multiprocess collector emits no `_created` samples; match its output.
        prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]
        self.naming = NAMINGS[version]
        # Metrics live on a private registry; the exposed one shows only families with samples.
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self._families = CollectorRegistry(auto_describe=True)
        self.registry.register(_NonEmptyFamilies(self._families))
        self.role = role
        self.model_name = model_name
        engine_type = "unified" if self.naming.unified_engine_type else role
        # With DP attention each DP rank's schedulers add `dp_rank` to their labels
        # (observability/metrics_collector.py:1382-1392 @ 0.5.23); `--tp T --dp D` gives each
        # rank T/D TP ranks (at least one here, so `--dp-size 4` alone is four schedulers).
        dp = max(dp_size, 1)
        per_dp = max(tp_size // dp, 1) if dp > 1 else tp_size
        self._dp_labels: dict[int, list[dict[str, str]]] = {}
        for dp_rank in range(dp):
            for local in range(per_dp):
                rank = dp_rank * per_dp + local
                labels = {
                    "model_name": model_name,
                    "engine_type": engine_type,
                    "tp_rank": str(rank),
                    "pp_rank": "0",
                }
                if "moe_ep_rank" in self.naming.scheduler_labels:
                    labels["moe_ep_rank"] = "0"
                if dp > 1:
                    labels["dp_rank"] = str(dp_rank)
                self._dp_labels.setdefault(dp_rank, []).append(labels)
        self._rank_labels = [labels for ranks in self._dp_labels.values() for labels in ranks]
        self._tokenizer_base = {"model_name": model_name, "engine_type": engine_type}
        s_labels = [*self.naming.scheduler_labels, *(["dp_rank"] if dp > 1 else [])]
        t_labels = list(self.naming.tokenizer_labels)
        reg = self._families

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, s_labels, registry=reg)

        self.gauges: dict[str, Gauge] = {
            "num_running_reqs": gauge("sglang:num_running_reqs", "The number of running requests."),
            "num_used_tokens": gauge("sglang:num_used_tokens", "The number of used tokens."),
            "token_usage": gauge("sglang:token_usage", "The token usage."),
            "gen_throughput": gauge(
                "sglang:gen_throughput", "The generation throughput (token/s)."
            ),
            "num_queue_reqs": gauge(
                "sglang:num_queue_reqs", "The number of requests in the waiting queue."
            ),
            "cache_hit_rate": gauge("sglang:cache_hit_rate", "The prefix cache hit rate."),
            "max_total_num_tokens": gauge(
                "sglang:max_total_num_tokens",
                "Maximum total number of tokens in the KV cache pool.",
            ),
            "num_prefill_bootstrap_queue_reqs": gauge(
                self.naming.prefill_bootstrap_queue,
                "The number of requests in the prefill bootstrap queue.",
            ),
            "num_prefill_inflight_queue_reqs": gauge(
                self.naming.prefill_inflight_queue,
                "The number of requests in the prefill inflight queue.",
            ),
            "num_decode_prealloc_queue_reqs": gauge(
                "sglang:num_decode_prealloc_queue_reqs",
                "The number of requests in the decode prealloc queue.",
            ),
            "num_decode_transfer_queue_reqs": gauge(
                "sglang:num_decode_transfer_queue_reqs",
                "The number of requests in the decode transfer queue.",
            ),
        }
        if self.naming.kv_transfer_latency == "gauge":
            self.gauges["kv_transfer_latency_ms"] = gauge(
                "sglang:kv_transfer_latency_ms", "The transfer latency of the KV cache in ms."
            )
        self.kv_transfer_latency_hist: Histogram | None = None
        if self.naming.kv_transfer_latency == "histogram":
            self.kv_transfer_latency_hist = Histogram(
                "sglang:kv_transfer_latency_ms",
                "The transfer latency of the KV cache in ms.",
                s_labels,
                buckets=_KV_MS_BUCKETS,
                registry=reg,
            )
        self.num_bootstrap_failed = Counter(
            "sglang:num_bootstrap_failed_reqs",
            "The number of bootstrap failed requests.",
            s_labels,
            registry=reg,
        )
        self.num_transfer_failed = Counter(
            "sglang:num_transfer_failed_reqs",
            "The number of transfer failed requests.",
            s_labels,
            registry=reg,
        )
        self.realtime_tokens: Counter | None = None
        if self.naming.realtime_tokens:
            self.realtime_tokens = Counter(
                "sglang:realtime_tokens",
                "Total number of tokens processed (updated on each log interval). "
                "mode: prefill_compute, prefill_cache, decode.",
                [*s_labels, "mode"],
                registry=reg,
            )

        self.prompt_tokens = Counter(
            "sglang:prompt_tokens", "Number of prefill tokens processed.", t_labels, registry=reg
        )
        self.generation_tokens = Counter(
            "sglang:generation_tokens",
            "Number of generation tokens processed.",
            t_labels,
            registry=reg,
        )
        self.num_requests = Counter(
            "sglang:num_requests", "Number of requests processed.", t_labels, registry=reg
        )
        # The collector's own labels, never is_streaming: the tokenizer counts an abort with
        # them (observability/metrics_collector.py:1959-1963, 2185-2186 and
        # managers/tokenizer_manager.py:2261-2265 @ 0.5.23; verified on real 0.5.23).
        self.num_aborted_requests = Counter(
            "sglang:num_aborted_requests",
            "Number of requests aborted.",
            [k for k in t_labels if k != "is_streaming"],
            registry=reg,
        )
        self.ttft = Histogram(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            t_labels,
            buckets=_TTFT_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            t_labels,
            buckets=_E2E_BUCKETS,
            registry=reg,
        )

        # The HTTP middleware's families exist from 0.5.9 (utils/common.py:1604-1624 @ 0.5.9);
        # 0.5.5 has none of them (no add_prometheus_track_response_middleware in its
        # utils/common.py). Without them the middleware updates a registry nobody exposes.
        http_reg = reg if self.naming.http_active else CollectorRegistry()
        self.http_requests_total = Counter(
            "sglang:http_requests",
            "Total number of HTTP requests by endpoint and method",
            ["endpoint", "method"],
            registry=http_reg,
        )
        self.http_responses_total = Counter(
            "sglang:http_responses",
            "Total number of HTTP responses by endpoint and status code",
            ["endpoint", "status_code", "method"],
            registry=http_reg,
        )
        self.http_requests_active = Gauge(
            "sglang:http_requests_active",
            "Number of currently active HTTP requests",
            ["endpoint", "method"],
            registry=http_reg,
        )

    # Scheduler side: every TP rank reports, so each rank gets its own series.

    def _labels_of(self, dp_rank: int | None) -> list[dict[str, str]]:
        """The label sets of one DP rank's schedulers (None: every scheduler, or rank 0's
        where the server runs DP)."""
        if dp_rank is None:
            return self._rank_labels if len(self._dp_labels) == 1 else self._dp_labels[0]
        return self._dp_labels[dp_rank]

    def log_stats(self, stats: SchedulerStats, dp_rank: int | None = None) -> None:
        values: Mapping[str, float] = {
            "num_running_reqs": stats.num_running_reqs,
            "num_used_tokens": stats.num_used_tokens,
            "token_usage": stats.token_usage,
            "gen_throughput": stats.gen_throughput,
            "num_queue_reqs": stats.num_queue_reqs,
            "cache_hit_rate": stats.cache_hit_rate,
            "max_total_num_tokens": stats.max_total_num_tokens,
            "num_prefill_bootstrap_queue_reqs": stats.num_prefill_bootstrap_queue_reqs,
            "num_prefill_inflight_queue_reqs": stats.num_prefill_inflight_queue_reqs,
            "num_decode_prealloc_queue_reqs": stats.num_decode_prealloc_queue_reqs,
            "num_decode_transfer_queue_reqs": stats.num_decode_transfer_queue_reqs,
            "kv_transfer_latency_ms": stats.kv_transfer_latency_ms,
        }
        for key, gauge in self.gauges.items():
            for labels in self._labels_of(dp_rank):
                gauge.labels(**labels).set(values[key])

    def inc_transfer_failed(self, dp_rank: int | None = None) -> None:
        # One failed request adds 1 on every TP rank (docs/sglang.md §3; SGLang issue #10560).
        for labels in self._labels_of(dp_rank):
            self.num_transfer_failed.labels(**labels).inc()

    def inc_bootstrap_failed(self, dp_rank: int | None = None) -> None:
        for labels in self._labels_of(dp_rank):
            self.num_bootstrap_failed.labels(**labels).inc()

    def add_realtime_tokens(self, mode: str, tokens: int, dp_rank: int | None = None) -> None:
        # A zero delta creates no series (observability/metrics_collector.py:1565-1571 @ 0.5.23).
        if self.realtime_tokens is None or tokens == 0:
            return
        for labels in self._labels_of(dp_rank):
            self.realtime_tokens.labels(**labels, mode=mode).inc(tokens)

    def observe_kv_transfer_latency(self, ms: float, dp_rank: int | None = None) -> None:
        if self.kv_transfer_latency_hist is not None:
            for labels in self._labels_of(dp_rank):
                self.kv_transfer_latency_hist.labels(**labels).observe(ms)

    # Tokenizer side: one process, no rank label; updated when a request finishes.

    def _tok_labels(self, is_streaming: bool) -> dict[str, str]:
        labels = dict(self._tokenizer_base)
        if "is_streaming" in self.naming.tokenizer_labels:
            labels["is_streaming"] = str(is_streaming).lower()
        return {k: v for k, v in labels.items() if k in self.naming.tokenizer_labels}

    def observe_finished(
        self,
        *,
        prompt_tokens: int,
        generation_tokens: int,
        e2e_seconds: float,
        is_streaming: bool,
    ) -> None:
        labels = self._tok_labels(is_streaming)
        self.prompt_tokens.labels(**labels).inc(prompt_tokens)
        self.generation_tokens.labels(**labels).inc(generation_tokens)
        self.num_requests.labels(**labels).inc()
        self.e2e.labels(**labels).observe(e2e_seconds)

    def observe_ttft(self, seconds: float, *, is_streaming: bool) -> None:
        self.ttft.labels(**self._tok_labels(is_streaming)).observe(seconds)

    def observe_aborted(self, *, is_streaming: bool) -> None:
        labels = self._tok_labels(is_streaming)
        labels.pop("is_streaming", None)
        self.num_aborted_requests.labels(**labels).inc()

    # Exposition.

    def render(
        self, accept: str | None, accept_encoding: str | None, params: Mapping[str, list[str]]
    ) -> tuple[list[tuple[str, str]], bytes]:
        """Headers and body exactly as prometheus_client's own ASGI/WSGI app would send them."""
        bake: Any = getattr(_exposition, "_bake_output", None)
        if bake is not None:
            _status, headers, body = bake(self.registry, accept, accept_encoding, params, False)
            return list(headers), body
        encoder, content_type = _exposition.choose_encoder(accept or "")
        return [("Content-Type", content_type)], encoder(self.registry)
