"""Behaviour checks that hold on the released sglang 0.5.23 and must hold on pdsim too.

Each `check_*(backend)` asserts what real SGLang does (measured on real 0.5.23 on CPU, with the
source line that does it, `path:line @ 0.5.23` under `sglang/srt/`) and fails on a backend that
behaves otherwise. tests/pdsim/test_conformance.py runs them against pdsim, tests/real/
test_conformance.py against real SGLang; docs/sglang.md §8 lists what they found.

Order matters where noted: `check_fresh_server` needs servers that have seen no failure yet,
`check_startup` restarts prefill and runs last.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from tests.conformance.backend import Backend, abort, new_room
from tests.pdsim.helpers import parse_samples, sse_payloads
from watchdog.observe.sglang_metrics import decode_moment_tokens

Samples = list[tuple[str, dict[str, str], float]]

# Label keys of the series the watchdog reads (watchdog/observe/sglang_metrics.py), TP 1, no DP,
# no priority scheduling. Scheduler metrics: observability/metrics_collector.py:1382-1388;
# tokenizer metrics: metrics_collector.py:1807-1813 plus `is_streaming` (:2105); realtime
# tokens add `mode` (:1565-1572); http_requests_active is the HTTP middleware's.
SCHEDULER_KEYS = frozenset({"model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank"})
TOKENIZER_KEYS = frozenset({"model_name", "engine_type", "is_streaming"})
QUEUE_GAUGES = (
    "sglang:num_prefill_bootstrap_queue_reqs",
    "sglang:num_prefill_inflight_queue_reqs",
    "sglang:num_decode_prealloc_queue_reqs",
    "sglang:num_decode_transfer_queue_reqs",
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
)
DECODE_QUEUE_GAUGES = (
    "sglang:num_decode_prealloc_queue_reqs",
    "sglang:num_decode_transfer_queue_reqs",
)
TOKENIZER_COUNTERS = (
    "sglang:num_requests_total",
    "sglang:generation_tokens_total",
    "sglang:prompt_tokens_total",
)
FAILURE_COUNTERS = (
    "sglang:num_transfer_failed_reqs_total",
    "sglang:num_bootstrap_failed_reqs_total",
)
EXPECTED_KEYS: dict[str, frozenset[str]] = {
    **dict.fromkeys(QUEUE_GAUGES, SCHEDULER_KEYS),
    **dict.fromkeys(FAILURE_COUNTERS, SCHEDULER_KEYS),
    **dict.fromkeys(TOKENIZER_COUNTERS, TOKENIZER_KEYS),
    "sglang:time_to_first_token_seconds_count": TOKENIZER_KEYS,
    # The tokenizer collector's own labels: no is_streaming (metrics_collector.py:1959-1963,
    # 2185-2186; tokenizer_manager.py:2261-2265).
    "sglang:num_aborted_requests_total": TOKENIZER_KEYS - {"is_streaming"},
    "sglang:realtime_tokens_total": SCHEDULER_KEYS | {"mode"},
    "sglang:http_requests_active": frozenset({"endpoint", "method"}),
}

# /v1/loads?include=disagg (entrypoints/v1_loads.py:96-150, managers/load_snapshot.py:232-258):
# the top level, a row's core keys plus its `disaggregation` section, and that section.
LOADS_TOP_KEYS = frozenset({"timestamp", "version", "accelerator", "num_accelerators", "loads"})
LOADS_ROW_KEYS = frozenset(
    {
        "timestamp", "dp_rank", "num_running_reqs", "num_waiting_reqs",
        "num_waiting_uncached_tokens", "num_used_tokens", "num_total_tokens",
        "num_active_tokens", "num_prealloc_ready_tokens", "max_total_num_tokens",
        "max_running_requests", "token_usage", "gen_throughput", "cache_hit_rate",
        "utilization", "total_prefill_uncached_tokens", "total_prefill_busy_us",
        "decode_moments", "disaggregation",
    }
)  # fmt: skip
LOADS_DISAGG_KEYS = frozenset(
    {
        "mode", "prefill_bootstrap_queue_reqs", "prefill_inflight_queue_reqs",
        "decode_prealloc_queue_reqs", "decode_transfer_queue_reqs",
        "decode_retracted_queue_reqs", "kv_transfer_speed_gb_s", "kv_transfer_latency_ms",
    }
)  # fmt: skip

STALL_WAIT_SECONDS = 60.0  # a real prefill on two busy cores prefills a short prompt in < 1 s


# --- reading ------------------------------------------------------------------------------------


def scrape(backend: Backend, role: str) -> Samples:
    """Every sample of one server's /metrics."""
    status, body = backend.get(backend.url(role) + "/metrics")
    assert status == 200, f"{backend.name} {role} /metrics: {status}"
    return parse_samples(body.decode())


def series(samples: Samples, name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
    """The (labels, value) of one name, filtered by label values."""
    return [
        (lab, v)
        for n, lab, v in samples
        if n == name and all(lab.get(k) == val for k, val in labels.items())
    ]


def rank_max(samples: Samples, name: str, **labels: str) -> float:
    """A per-rank counter read as the watchdog reads it: max over ranks, absent = 0."""
    return max((v for _, v in series(samples, name, **labels)), default=0.0)


def summed(samples: Samples, name: str, **labels: str) -> float:
    """The sum of every series of a metric whose labels match, 0.0 when none exists yet."""
    return sum(v for _, v in series(samples, name, **labels))


def loads(backend: Backend, role: str) -> dict[str, Any]:
    """The backend's /v1/loads?include=disagg document for a role, asserting it answered 200."""
    status, body = backend.get(backend.url(role) + "/v1/loads?include=disagg")
    assert status == 200, f"{backend.name} {role} /v1/loads: {status}"
    result: dict[str, Any] = json.loads(body)
    return result


def timed_health(backend: Backend, role: str) -> tuple[int, float]:
    """/health's status for a role and how long it took to answer, in seconds."""
    start = time.monotonic()
    status, _ = backend.get(backend.url(role) + "/health", timeout_seconds=30.0)
    return status, time.monotonic() - start


def wait_for(what: str, predicate: Callable[[], bool], timeout_seconds: float) -> None:
    """Poll a predicate every 0.25 s until it holds, failing with what it awaited once late."""
    deadline = time.monotonic() + timeout_seconds
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout_seconds:g} s: {what}"
        time.sleep(0.25)


def complete(backend: Backend, prompt: str = "Hello world", max_tokens: int = 8) -> None:
    """One completion through the router, 200."""
    body = {"model": backend.model, "prompt": prompt, "max_tokens": max_tokens}
    status, text = backend.post(backend.url("router") + "/v1/completions", body)
    assert status == 200, f"{backend.name} router completion: {status} {text[:300]!r}"


# --- a stuck request ----------------------------------------------------------------------------


@dataclass
class Stuck:
    """A streamed /v1/completions posted to prefill and decode with one bootstrap room (as the
    router does), its KV transfer stalled; `responses[role]` once that side's stream ended."""

    rid: str
    responses: dict[str, tuple[int, str]] = field(default_factory=dict)
    threads: list[threading.Thread] = field(default_factory=list)

    def wait_response(self, role: str, timeout_seconds: float = 30.0) -> tuple[int, str]:
        wait_for(
            f"{role}'s stream of {self.rid} ended", lambda: role in self.responses, timeout_seconds
        )
        return self.responses[role]


@contextmanager
def stuck_request(backend: Backend, rid: str) -> Iterator[Stuck]:
    """Stall the transfer path, post a request to both sides directly, wait until prefill holds
    it in its inflight queue (/v1/loads, live); afterwards abort it on both sides and release."""
    stuck = Stuck(rid)
    body = {
        "model": backend.model,
        "prompt": f"A request that will not move: {rid}",
        "max_tokens": 8,
        "stream": True,
        "rid": rid,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": backend.bootstrap_port,
        "bootstrap_room": new_room(),
    }

    def post(role: str) -> None:
        status, text = backend.post(
            backend.url(role) + "/v1/completions", body, timeout_seconds=300.0
        )
        stuck.responses[role] = (status, text.decode(errors="replace"))

    backend.stall_transfer()
    try:
        for role in ("prefill", "decode"):
            thread = threading.Thread(target=post, args=(role,), daemon=True)
            thread.start()
            stuck.threads.append(thread)
        wait_for(
            f"{rid} in prefill's inflight queue",
            lambda: (
                loads(backend, "prefill")["loads"][0]["disaggregation"][
                    "prefill_inflight_queue_reqs"
                ]
                > 0
            ),
            STALL_WAIT_SECONDS,
        )
        yield stuck
    finally:
        for role in ("prefill", "decode"):
            abort(backend, role, rid)
        backend.release_transfer()
        for thread in stuck.threads:
            thread.join(timeout=30.0)


# --- the checks ---------------------------------------------------------------------------------


def check_health_latency(backend: Backend) -> None:
    """/health is 200 and never answers in under ~1 s: the handler sleeps 1 s before its first
    look (entrypoints/http_server.py:776-784). Real: 1.00-1.02 s on both servers."""
    for role in ("prefill", "decode"):
        status, elapsed = timed_health(backend, role)
        assert status == 200, f"{backend.name} {role} /health: {status}"
        assert elapsed >= 0.9, f"{backend.name} {role} /health took {elapsed:.3f} s"


def check_fresh_server(backend: Backend) -> None:
    """On servers that have failed nothing yet: no series of the failure counters (a labelled
    counter exists only from its first increment: metrics_collector.py:667-675, :1434-1438), and
    no decode queue gauges (decode publishes its scheduler gauges only from its first stats
    report, every --decode-log-interval (40) decode steps; a short request or the health check
    makes none). Prefill's gauges exist (its first prefill batch reported them).
    Must run before anything fails on the backend."""
    for role in ("prefill", "decode"):
        samples = scrape(backend, role)
        for name in FAILURE_COUNTERS:
            assert series(samples, name) == [], f"{backend.name} {role}: {name} exists unfailed"
    decode = scrape(backend, "decode")
    for name in DECODE_QUEUE_GAUGES:
        assert series(decode, name) == [], f"{backend.name} decode: {name} exists before a report"
    prefill = scrape(backend, "prefill")
    for name in QUEUE_GAUGES:
        assert series(prefill, name), f"{backend.name} prefill: no {name}"


def check_metric_names_and_labels(backend: Backend) -> None:
    """After one completion through the router, the series the watchdog reads exist with the
    label keys of real SGLang, `engine_type` naming the side; the realtime token counter has
    only the modes that moved (a zero delta is skipped: metrics_collector.py:1565-1571)."""
    complete(backend)
    present = {
        "prefill": (*QUEUE_GAUGES, *TOKENIZER_COUNTERS, "sglang:realtime_tokens_total"),
        "decode": (
            *TOKENIZER_COUNTERS,
            "sglang:realtime_tokens_total",
            "sglang:time_to_first_token_seconds_count",
        ),
    }
    for role, names in present.items():
        samples = scrape(backend, role)
        for name in names:
            found = series(samples, name)
            assert found, f"{backend.name} {role}: no {name}"
            for labels, _ in found:
                assert frozenset(labels) == EXPECTED_KEYS[name], (
                    f"{backend.name} {role} {name}: label keys {sorted(labels)}"
                )
                assert labels["engine_type"] == role, (backend.name, role, name, labels)
        active = series(samples, "sglang:http_requests_active")
        assert active, f"{backend.name} {role}: no sglang:http_requests_active"
        for labels, _ in active:
            assert frozenset(labels) == EXPECTED_KEYS["sglang:http_requests_active"], labels
        modes = {lab["mode"] for lab, _ in series(samples, "sglang:realtime_tokens_total")}
        expected = {"prefill_compute"} if role == "prefill" else {"decode"}
        assert modes == expected, f"{backend.name} {role} realtime_tokens modes {sorted(modes)}"


def decode_counted(backend: Backend) -> tuple[float, float | None]:
    """Decode's per-iteration token counters as the watchdog reads them, once they settled:
    realtime_tokens_total{mode="decode"} and /v1/loads decode_moments (None where absent)."""

    def read() -> tuple[float, float | None]:
        realtime = summed(scrape(backend, "decode"), "sglang:realtime_tokens_total", mode="decode")
        return realtime, decode_moment_tokens(loads(backend, "decode")["loads"])

    last = read()
    deadline = time.monotonic() + 30.0
    while True:  # a request's last step is counted a moment after its answer left
        time.sleep(0.5)
        now = read()
        if now == last:
            return now
        assert time.monotonic() < deadline, f"{backend.name} decode counters never settled"
        last = now


def check_health_adds_no_decode_tokens(backend: Backend) -> None:
    """Decode's /health (ours and the router's) generates one token with a fake bootstrap that
    finishes in the prebuilt step, without a decode forward
    (managers/scheduler_components/batch_result_processor.py:117-140), and the per-iteration
    counters move only in the decode step (:952-1108, metrics_reporter.py:901-915; /v1/loads
    decode_moments likewise): checks add no decode tokens, so the watchdog's account of what is
    ours (watchdog/decide/fold.py ours()) has no allowance for them. A completion moves both
    counters (the control: they are live)."""
    complete(backend)  # decode's counters exist
    before = decode_counted(backend)
    for _ in range(3):
        status, _ = timed_health(backend, "decode")
        assert status == 200, f"{backend.name} decode /health: {status}"
    after = decode_counted(backend)
    assert after == before, f"{backend.name}: decode /health moved its tokens {before} -> {after}"
    complete(backend, max_tokens=8)
    moved = decode_counted(backend)
    assert moved[0] > after[0], f"{backend.name}: realtime_tokens_total did not move: {moved}"
    assert after[1] is not None, f"{backend.name}: no /v1/loads decode_moments"
    assert moved[1] is not None, f"{backend.name}: no /v1/loads decode_moments"
    assert moved[1] > after[1], f"{backend.name}: decode_moments did not move: {after} -> {moved}"


def check_transfer_stall(backend: Backend) -> None:
    """A stalled KV transfer: prefill's inflight gauge > 0 once a later prefill batch reported it
    (disaggregation/prefill.py:1142-1146; a health request is one), decode's queue gauges stay absent or 0 (decode runs
    no batch, so it reports nothing), decode's realtime decode tokens stay flat, and /health
    stays 200 on both sides (the health request never touches the transfer path,
    http_server.py:758-762)."""
    with stuck_request(backend, "conformance-stall-1"):
        decode_before = scrape(backend, "decode")
        # A health request is a one-token prefill batch, which reports prefill's gauges (the
        # gauge is refreshed when a batch forms, so the stuck request's own batch saw 0).
        for role in ("prefill", "decode"):
            status, _ = timed_health(backend, role)
            assert status == 200, f"{backend.name} {role} /health during the stall: {status}"
        wait_for(
            "prefill's inflight gauge > 0",
            lambda: (
                summed(scrape(backend, "prefill"), "sglang:num_prefill_inflight_queue_reqs") > 0
            ),
            STALL_WAIT_SECONDS,
        )
        decode = scrape(backend, "decode")
        for name in DECODE_QUEUE_GAUGES:
            assert summed(decode, name) == 0, (
                f"{backend.name} decode: {name} = {summed(decode, name)}"
            )
        flat = summed(decode, "sglang:realtime_tokens_total", mode="decode")
        assert flat == summed(decode_before, "sglang:realtime_tokens_total", mode="decode")
        # The live view has it: decode's transfer queue holds the request, and both snapshots
        # are republished while the loop is busy without batches (LOAD_STALL_REFRESH_S, 50 ms:
        # managers/scheduler.py:408-411, 5254-5263).
        first = {role: loads(backend, role)["loads"][0] for role in ("prefill", "decode")}
        assert first["decode"]["disaggregation"]["decode_transfer_queue_reqs"] == 1, first
        time.sleep(0.5)
        for role in ("prefill", "decode"):
            later = loads(backend, role)["loads"][0]
            assert later["timestamp"] > first[role]["timestamp"], (backend.name, role, later)
            # The request is in flight on both servers' HTTP middleware.
            active = summed(
                scrape(backend, role), "sglang:http_requests_active", endpoint="/v1/completions"
            )
            assert active >= 1, (backend.name, role, active)


def check_abort_accounting(backend: Backend) -> None:
    """`/abort_request {"rid"}` of a request stuck in prefill's inflight queue is a transfer
    failure on prefill at once (+1, `Aborted by AbortReq`; managers/scheduler.py:5741-5781,
    disaggregation/prefill.py:1272-1312) and an aborted request (+1); decode is not told (its
    counters do not move). Aborted on decode too, it is a transfer failure there
    (disaggregation/decode.py:2857-2916, :2827)."""
    with stuck_request(backend, "conformance-abort-1") as stuck:
        before = {role: scrape(backend, role) for role in ("prefill", "decode")}
        # A prefix of the rid matches nothing (tokenizer_manager.py:2241-2253).
        assert abort(backend, "prefill", stuck.rid[:-2])[0] == 200
        time.sleep(1.0)
        assert "prefill" not in stuck.responses, f"{backend.name}: a rid prefix aborted it"
        status, _ = abort(backend, "prefill", stuck.rid)
        assert status == 200
        wait_for(
            "prefill's transfer failure counted",
            lambda: (
                rank_max(scrape(backend, "prefill"), "sglang:num_transfer_failed_reqs_total")
                == rank_max(before["prefill"], "sglang:num_transfer_failed_reqs_total") + 1
            ),
            10.0,
        )
        prefill = scrape(backend, "prefill")
        for labels, _ in series(prefill, "sglang:num_transfer_failed_reqs_total"):
            assert frozenset(labels) == SCHEDULER_KEYS, labels
        aborted = summed(prefill, "sglang:num_aborted_requests_total")
        assert aborted == summed(before["prefill"], "sglang:num_aborted_requests_total") + 1
        for labels, _ in series(prefill, "sglang:num_aborted_requests_total"):
            assert frozenset(labels) == EXPECTED_KEYS["sglang:num_aborted_requests_total"], labels
        assert rank_max(prefill, "sglang:num_bootstrap_failed_reqs_total") == rank_max(
            before["prefill"], "sglang:num_bootstrap_failed_reqs_total"
        )
        # Finished is not succeeded (tokenizer_manager.py:3261-3297): the aborted request is a
        # finished request, with the one token its prefill made.
        for name in ("sglang:num_requests_total", "sglang:generation_tokens_total"):
            assert summed(prefill, name) == summed(before["prefill"], name) + 1, (
                backend.name,
                name,
            )
        stuck.wait_response("prefill")
        time.sleep(2.0)  # decode is not told: nothing moves there
        decode = scrape(backend, "decode")
        for name in (*FAILURE_COUNTERS, "sglang:num_aborted_requests_total"):
            assert summed(decode, name) == summed(before["decode"], name), (backend.name, name)
        assert "decode" not in stuck.responses, (
            f"{backend.name}: decode's stream ended on a prefill abort: {stuck.responses['decode']}"
        )

        status, _ = abort(backend, "decode", stuck.rid)
        assert status == 200
        wait_for(
            "decode's transfer failure counted",
            lambda: (
                rank_max(scrape(backend, "decode"), "sglang:num_transfer_failed_reqs_total")
                == rank_max(before["decode"], "sglang:num_transfer_failed_reqs_total") + 1
            ),
            10.0,
        )
        stuck.wait_response("decode")
        decode = scrape(backend, "decode")
        assert summed(decode, "sglang:num_requests_total") == (
            summed(before["decode"], "sglang:num_requests_total") + 1
        )
        for name in ("sglang:generation_tokens_total", "sglang:time_to_first_token_seconds_count"):
            assert summed(decode, name) == summed(before["decode"], name), (backend.name, name)


def check_unknown_rid_abort(backend: Backend) -> None:
    """An abort of a rid nobody has is 200 and changes nothing (the tokenizer matches the rid
    exactly: managers/tokenizer_manager.py:2241-2253)."""
    before = scrape(backend, "prefill")
    status, _ = abort(backend, "prefill", "conformance-no-such-rid")
    assert status == 200
    after = scrape(backend, "prefill")
    for name in (*FAILURE_COUNTERS, "sglang:num_aborted_requests_total"):
        assert summed(after, name) == summed(before, name), name


def _error_event(backend: Backend, role: str, text: str, prefix: str) -> None:
    events = sse_payloads(text)
    assert len(events) == 1, f"{backend.name} {role}: {text[:400]!r}"
    error = events[0]["error"]
    assert set(error) == {"object", "message", "type", "param", "code"}, error
    assert error["object"] == "error"
    assert error["type"] == "INTERNAL_SERVER_ERROR"
    assert error["code"] == 500
    assert error["param"] is None
    assert error["message"].startswith(prefix), error["message"]
    assert error["message"].endswith("Aborted by AbortReq."), error["message"]
    assert text.rstrip().endswith("data: [DONE]"), text[-200:]


def check_stream_error_shape(backend: Backend) -> None:
    """A streamed /v1/completions whose request fails in PD (here: aborted while stuck) is HTTP
    200 with one `data: {"error": {...}}` event (type INTERNAL_SERVER_ERROR, code 500, the
    scheduler's failure message) and `data: [DONE]` (entrypoints/openai/serving_completions.py:
    356-371, serving_base.py:223-237); on each side its own message."""
    with stuck_request(backend, "conformance-stream-1") as stuck:
        abort(backend, "prefill", stuck.rid)
        status, text = stuck.wait_response("prefill")
        assert status == 200, (backend.name, status, text[:300])
        _error_event(backend, "prefill", text, "Prefill transfer failed for request rank=0")
        abort(backend, "decode", stuck.rid)
        status, text = stuck.wait_response("decode")
        assert status == 200, (backend.name, status, text[:300])
        _error_event(backend, "decode", text, "Decode transfer failed for request rank=0")


def check_loads_fields(backend: Backend) -> None:
    """/v1/loads?include=disagg: the top-level keys, one row per DP rank with the core keys and
    only the `disaggregation` section, whose `mode` names the side; version 0.5.23."""
    for role in ("prefill", "decode"):
        body = loads(backend, role)
        assert set(body) == LOADS_TOP_KEYS, f"{backend.name} {role}: {sorted(body)}"
        assert body["version"] == "0.5.23"
        [row] = body["loads"]
        assert set(row) == LOADS_ROW_KEYS, (
            f"{backend.name} {role}: missing {sorted(LOADS_ROW_KEYS - set(row))}, "
            f"extra {sorted(set(row) - LOADS_ROW_KEYS)}"
        )
        assert set(row["disaggregation"]) == LOADS_DISAGG_KEYS, sorted(row["disaggregation"])
        assert row["disaggregation"]["mode"] == role
        assert row["dp_rank"] == 0


def check_startup(backend: Backend, ready_timeout_seconds: float) -> float:
    """A restarted server answers /health 503 while shutting down (http_server.py:731-733), then
    nothing while it loads (uvicorn binds only after the model is loaded), then 503 while it
    warms up (ServerStatus.Starting, :735-736), then 200: never 200 from a process that is not
    up. Returns the seconds until 200 (real: ~45 s on two cores; pdsim: ~1 s, docs/sglang.md §8)."""
    backend.restart("prefill")
    start = time.monotonic()
    seen: list[int] = []
    while True:
        status, _ = backend.get(backend.url("prefill") + "/health", timeout_seconds=10.0)
        if status == 200:
            break
        seen.append(status)
        assert time.monotonic() - start < ready_timeout_seconds, f"not up: {seen}"
        time.sleep(0.25)
    elapsed = time.monotonic() - start
    assert seen, f"{backend.name}: /health was 200 at once after a restart"
    assert set(seen) <= {0, 503}, f"{backend.name}: {seen}"
    return elapsed
