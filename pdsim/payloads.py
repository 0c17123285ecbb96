"""Realistic SGLang /metrics payloads built with prometheus_client (tests and the scrape benchmark).

The names and label sets follow sglang 0.5.23, 0.5.5 and 0.4.10 (docs/sglang.md §3): one
scheduler series per TP rank, tokenizer series per `is_streaming` (0.5.23), the 0.5.5 prealloc name
and the 0.4.10 `infight` typo. `generate_latest` writes the text exactly as SGLang's exporter does.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

VERSIONS: tuple[str, ...] = ("0.5.23", "0.5.5", "0.4.10")
MODEL = "deepseek-ai/DeepSeek-V4-Flash"

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 90.0, 120.0, 180.0, 300.0, 600.0, 1200.0,
)  # fmt: skip
_CREATED = re.compile(
    r"^(?:# (?:HELP|TYPE) )?[a-zA-Z_:][a-zA-Z0-9_:]*_created[ {].*\n", re.MULTILINE
)
_SHORT_BUCKETS = (0.001, 0.004, 0.01, 0.04, 0.1, 0.4, 1.0, 4.0, 10.0, 40.0, 100.0, 400.0)


def _inflight_name(version: str) -> str:
    return (
        "sglang:num_prefill_infight_queue_reqs"
        if version == "0.4.10"
        else "sglang:num_prefill_inflight_queue_reqs"
    )


def _bootstrap_queue_name(version: str) -> str:
    return (
        "sglang:num_prefill_bootstrap_queue_reqs"
        if version == "0.5.23"
        else "sglang:num_prefill_prealloc_queue_reqs"
    )


def _scheduler_labels(version: str) -> tuple[str, ...]:
    if version == "0.5.23":
        return ("model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank")
    return ("model_name", "engine_type", "tp_rank", "pp_rank")


def _scheduler_values(version: str, role: str, rank: int) -> tuple[str, ...]:
    engine = role if version == "0.5.23" else "unified"
    values = (MODEL, engine, str(rank), "0", "0")
    return values[: len(_scheduler_labels(version))]


def _tokenizer_labels(version: str) -> tuple[str, ...]:
    if version == "0.5.23":
        return ("model_name", "engine_type", "is_streaming")
    return ("model_name", "engine_type")


def _tokenizer_values(version: str, role: str, streaming: bool) -> tuple[str, ...]:
    if version == "0.5.23":
        return (MODEL, role, "true" if streaming else "false")
    return (MODEL, "unified")


def sglang_payload(  # noqa: C901, PLR0912  # one branch per SGLang version's metric naming, read as a table
    version: str,
    role: str = "prefill",
    *,
    tp: int = 8,
    seed: int = 0,
    transfer_failed_per_rank: Sequence[int] | None = None,
    with_completions: bool = True,
    extra_histograms: int = 10,
) -> str:
    """A /metrics body of one SGLang server (`role` prefill or decode) with `tp` scheduler ranks.

    `transfer_failed_per_rank` sets the per-rank failure counters (absent when None or all zero:
    SGLang creates a labelled counter on its first increment). `with_completions=False` leaves the
    completion counters out, as on a server that has not finished a request yet.
    """
    if version not in VERSIONS:
        raise ValueError(f"unknown version {version!r}; known: {VERSIONS}")
    rng = random.Random(f"{version}-{role}-{seed}")
    registry = CollectorRegistry(auto_describe=True)
    sched = _scheduler_labels(version)
    gauges = [
        ("sglang:num_running_reqs", "The number of running requests."),
        ("sglang:num_used_tokens", "The number of used tokens."),
        ("sglang:token_usage", "The token usage."),
        ("sglang:gen_throughput", "The generation throughput (token/s)."),
        ("sglang:num_queue_reqs", "The number of requests in the waiting queue."),
        ("sglang:num_grammar_queue_reqs", "The number of requests in the grammar waiting queue."),
        ("sglang:cache_hit_rate", "The prefix cache hit rate."),
        ("sglang:spec_accept_length", "The average acceptance length of speculative decoding."),
        ("sglang:num_retracted_reqs", "The number of retracted requests."),
        (_bootstrap_queue_name(version), "The number of requests in the prefill bootstrap queue."),
        (_inflight_name(version), "The number of requests in the prefill inflight queue."),
        ("sglang:num_decode_prealloc_queue_reqs", "The number of requests in the prealloc queue."),
        ("sglang:num_decode_transfer_queue_reqs", "The number of requests in the transfer queue."),
        ("sglang:kv_transfer_speed_gb_s", "The KV transfer speed in GB/s."),
        ("sglang:utilization", "The utilization."),
        ("sglang:max_total_num_tokens", "Maximum total number of tokens in the KV cache pool."),
        ("sglang:engine_startup_time", "The time taken for the engine to start up."),
        ("sglang:engine_load_weights_time", "The time taken for the engine to load weights."),
    ]
    if version == "0.5.5":
        gauges.append(("sglang:kv_transfer_latency_ms", "The KV transfer latency in ms."))
    if version != "0.4.10":
        gauges.append(("sglang:pending_prealloc_token_usage", "Pending prealloc token usage."))
    queue_value = rng.randint(0, 40)
    for name, doc in gauges:
        gauge = Gauge(name, doc, sched, registry=registry)
        for rank in range(tp):
            # The TP ranks of one scheduler report the same queues; keep them equal like SGLang.
            value = queue_value if "queue_reqs" in name else rng.random() * 100
            gauge.labels(*_scheduler_values(version, role, rank)).set(value)

    # Every version has the per-rank failure counters (absent until the first failure).
    failed = Counter(
        "sglang:num_transfer_failed_reqs",
        "The number of transfer failed requests.",
        sched,
        registry=registry,
    )
    boot_failed = Counter(
        "sglang:num_bootstrap_failed_reqs",
        "The number of bootstrap failed requests.",
        sched,
        registry=registry,
    )
    if transfer_failed_per_rank and any(transfer_failed_per_rank):
        for rank, count in enumerate(transfer_failed_per_rank):
            failed.labels(*_scheduler_values(version, role, rank)).inc(count)
            boot_failed.labels(*_scheduler_values(version, role, rank)).inc(count // 2)
    retries = Counter(
        "sglang:num_prefill_retries" if version == "0.5.23" else "sglang:num_retractions",
        "Retracted requests.",
        sched,
        registry=registry,
    )
    for rank in range(tp):
        retries.labels(*_scheduler_values(version, role, rank)).inc(rng.randint(0, 3))

    if version == "0.5.23":
        realtime = Counter(
            "sglang:realtime_tokens",
            "Tokens processed, updated every iteration.",
            (*sched, "mode"),
            registry=registry,
        )
        for rank in range(tp):
            for mode in ("prefill_compute", "prefill_cache", "decode"):
                realtime.labels(*_scheduler_values(version, role, rank), mode).inc(
                    rng.randint(1000, 10**7)
                )
        latency = Histogram(
            "sglang:kv_transfer_latency_ms",
            "The KV transfer latency in ms.",
            sched,
            buckets=tuple(b * 1000 for b in _SHORT_BUCKETS),
            registry=registry,
        )
        for rank in range(tp):
            for _ in range(5):
                latency.labels(*_scheduler_values(version, role, rank)).observe(rng.random() * 900)

    for index in range(extra_histograms):
        name = (
            "sglang:queue_time_seconds",
            "sglang:per_stage_req_latency_seconds",
            "sglang:prefill_forward_seconds",
            "sglang:decode_forward_seconds",
            "sglang:prefill_bootstrap_seconds",
            "sglang:decode_transfer_seconds",
            "sglang:grammar_compile_seconds",
            "sglang:retract_seconds",
        )[index % 8]
        if index >= 8:
            name = f"{name[:-8]}_{index}_seconds"
        histogram = Histogram(
            name, "Scheduler-side latency.", sched, buckets=_LATENCY_BUCKETS, registry=registry
        )
        for rank in range(tp):
            for _ in range(3):
                histogram.labels(*_scheduler_values(version, role, rank)).observe(rng.random() * 30)

    tok = _tokenizer_labels(version)
    counters = [
        ("sglang:prompt_tokens", "Number of prefill tokens processed."),
        ("sglang:generation_tokens", "Number of generation tokens processed."),
        ("sglang:num_requests", "The number of requests."),
        ("sglang:num_aborted_requests", "The number of aborted requests."),
        ("sglang:cached_tokens", "The number of cached tokens."),
    ]
    streaming_modes = (True, False) if version == "0.5.23" else (True,)
    for name, doc in counters:
        counter = Counter(name, doc, tok, registry=registry)
        if with_completions:
            for streaming in streaming_modes:
                counter.labels(*_tokenizer_values(version, role, streaming)).inc(
                    rng.randint(1, 10**6)
                )
    for name in (
        "sglang:time_to_first_token_seconds",
        "sglang:e2e_request_latency_seconds",
        "sglang:inter_token_latency_seconds",
    ):
        histogram = Histogram(
            name, "Tokenizer-side latency.", tok, buckets=_LATENCY_BUCKETS, registry=registry
        )
        for streaming in streaming_modes:
            for _ in range(4):
                histogram.labels(*_tokenizer_values(version, role, streaming)).observe(
                    rng.random() * 20
                )
    active = Gauge(
        "sglang:http_requests_active",
        "Number of in-flight HTTP requests.",
        ("endpoint", "method"),
        registry=registry,
    )
    for endpoint, method in (
        ("/generate", "POST"),
        ("/v1/completions", "POST"),
        ("/v1/chat/completions", "POST"),
        ("/health", "GET"),
        ("/metrics", "GET"),
    ):
        active.labels(endpoint, method).set(rng.randint(0, 9))
    return _without_created(generate_latest(registry).decode("utf-8"))


def _without_created(text: str) -> str:
    # SGLang exports in multiprocess mode, which writes no `_created` series.
    return _CREATED.sub("", text)


def router_payload(
    *, old_names: bool = False, health: Sequence[int] = (1, 1), cb_states: Sequence[int] = (0, 0)
) -> str:
    """A router /metrics body: per-worker health and circuit-breaker gauges (smg_*/sgl_router_*)."""
    prefix = "sgl_router_" if old_names else "smg_"
    registry = CollectorRegistry(auto_describe=True)
    workers = [f"http://127.0.0.1:{30000 + 2 * i}" for i in range(max(len(health), len(cb_states)))]
    health_name = f"{prefix}worker_health"
    cb_name = "sgl_router_cb_state" if old_names else "smg_worker_cb_state"
    health_gauge = Gauge(health_name, "Worker health (1/0).", ("worker",), registry=registry)
    cb_gauge = Gauge(cb_name, "Circuit breaker state.", ("worker",), registry=registry)
    for worker, value in zip(workers, health, strict=False):
        health_gauge.labels(worker).set(value)
    for worker, value in zip(workers, cb_states, strict=False):
        cb_gauge.labels(worker).set(value)
    requests = Counter(
        f"{prefix}router_requests", "Requests.", ("route", "method"), registry=registry
    )
    requests.labels("/v1/completions", "POST").inc(42)
    return _without_created(generate_latest(registry).decode("utf-8"))
