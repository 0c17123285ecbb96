"""SGLang's `/v1/loads` rows and response body in each version's shape (docs/sglang.md §7.6).

Three generations: 0.5.9 asks the scheduler on every call (rows without `timestamp`, key
`prefill_prealloc_queue_reqs`, `dp_rank_count` and `aggregate` in the body); 0.5.16+ read a
snapshot the scheduler published (rows with its `timestamp`); 0.5.19+ rows add token
accounting and `decode_moments`, the body `accelerator` and `num_accelerators`. When the
snapshot is published is the engine's business; this module only shapes what it recorded.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

from pdsim.metrics import VersionNaming, version_at_least

SECTIONS = ("all", "core", "disagg", "lora", "memory", "queues", "spec")


@dataclass(frozen=True)
class LoadStats:
    """What one scheduler knows about its load at one moment (one DP rank)."""

    timestamp: float
    role: str
    num_running_reqs: int
    num_waiting_reqs: int
    num_waiting_uncached_tokens: int
    num_used_tokens: int
    num_total_tokens: int
    num_active_tokens: int
    max_total_num_tokens: int
    max_running_requests: int
    gen_throughput: float
    queues: dict[str, int]  # the four PD queue sizes, keys as in Engine.queue_sizes
    waiting: int
    kv_transfer_latency_ms: float
    total_prefill_uncached_tokens: int
    total_prefill_busy_us: int
    # Six running sums over contiguous decode steps: count, Σbatch, Σstep_us, Σbatch²,
    # Σbatch·step_us, Σgenerated (sglang/srt/managers/scheduler.py:424-442 @ 0.5.23); None
    # until the first (load_inquirer.py:226-227 @ 0.5.23).
    decode_moments: tuple[float, ...] | None
    # The rank the row is (one row per DP rank: load_inquirer.py:229-232 @ 0.5.23; 0 without DP).
    dp_rank: int = 0


def invalid_sections(include: set[str]) -> set[str]:
    return include - set(SECTIONS)


def _core(naming: VersionNaming, s: LoadStats) -> dict[str, Any]:
    row: dict[str, Any] = {}
    if naming.loads != "ipc":
        # 0.5.9 drops the timestamp (entrypoints/v1_loads.py:56-58 @ 0.5.9, _loads_dict_factory).
        row["timestamp"] = s.timestamp
    row["dp_rank"] = s.dp_rank
    row["num_running_reqs"] = s.num_running_reqs
    row["num_waiting_reqs"] = s.num_waiting_reqs
    if naming.loads != "ipc":
        row["num_waiting_uncached_tokens"] = s.num_waiting_uncached_tokens
    row["num_used_tokens"] = s.num_used_tokens
    if naming.loads != "ipc":
        row["num_total_tokens"] = s.num_total_tokens
    modern = version_at_least(naming.version, "0.5.19")
    if modern:
        row["num_active_tokens"] = s.num_active_tokens
    if version_at_least(naming.version, "0.5.23"):
        # pdsim's prealloc queue never holds a request waiting for input: no ready tokens.
        row["num_prealloc_ready_tokens"] = 0
    row["max_total_num_tokens"] = s.max_total_num_tokens
    row["max_running_requests"] = s.max_running_requests
    row["token_usage"] = round(s.num_used_tokens / max(s.max_total_num_tokens, 1), 4)
    row["gen_throughput"] = round(s.gen_throughput, 2)
    row["cache_hit_rate"] = 0.0
    row["utilization"] = 0.0
    if modern:
        # managers/load_snapshot.py:216-220 @ 0.5.23 (the same fields in 0.5.19).
        row["total_prefill_uncached_tokens"] = s.total_prefill_uncached_tokens
        row["total_prefill_busy_us"] = s.total_prefill_busy_us
        row["decode_moments"] = list(s.decode_moments) if s.decode_moments else None
    return row


def _disaggregation(naming: VersionNaming, s: LoadStats) -> dict[str, Any]:
    # 0.5.9 names the prefill bootstrap queue "prealloc" (managers/io_struct.py:1849 @ 0.5.9);
    # "bootstrap" from 0.5.16 (managers/load_snapshot.py:158 @ 0.5.16).
    bootstrap_key = (
        "prefill_prealloc_queue_reqs" if naming.loads == "ipc" else "prefill_bootstrap_queue_reqs"
    )
    return {
        "mode": s.role,
        bootstrap_key: s.queues["prefill_bootstrap_queue_reqs"],
        "prefill_inflight_queue_reqs": s.queues["prefill_inflight_queue_reqs"],
        "decode_prealloc_queue_reqs": s.queues["decode_prealloc_queue_reqs"],
        "decode_transfer_queue_reqs": s.queues["decode_transfer_queue_reqs"],
        "decode_retracted_queue_reqs": 0,
        "kv_transfer_speed_gb_s": 0.0,
        "kv_transfer_latency_ms": round(s.kv_transfer_latency_ms, 3),
    }


def load_row(naming: VersionNaming, s: LoadStats, include: set[str] | None) -> dict[str, Any]:
    """One entry of `loads` (LoadSnapshot.to_dict, managers/load_snapshot.py:232-258 @ 0.5.23;
    GetLoadsReqOutput via dataclasses.asdict, entrypoints/v1_loads.py:164-166 @ 0.5.9).
    Speculative and LoRA sections are None in a PD deployment without them, so never shown."""
    row = _core(naming, s)
    every = include is None or "all" in include
    if not every and include == {"core"}:
        pass
    else:
        sections = include or set()
        if every or "memory" in sections:
            row["memory"] = {
                "weight_gb": 0.0,
                "kv_cache_gb": 0.0,
                "graph_gb": 0.0,
                "token_capacity": s.max_total_num_tokens,
            }
        if every or "disagg" in sections:
            row["disaggregation"] = _disaggregation(naming, s)
        if every or "queues" in sections:
            queues = {"waiting": s.waiting, "grammar": 0, "paused": 0, "retracted": 0}
            if version_at_least(naming.version, "0.5.19"):
                queues["prealloc_ready"] = 0
            row["queues"] = queues
    if naming.loads == "ipc":
        row["num_total_reqs"] = row["num_running_reqs"] + row["num_waiting_reqs"]
    return row


def _aggregate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """entrypoints/v1_loads.py:61-82 @ 0.5.9 (_compute_aggregate)."""
    n = len(rows)
    return {
        "total_running_reqs": sum(r["num_running_reqs"] for r in rows),
        "total_waiting_reqs": sum(r["num_waiting_reqs"] for r in rows),
        "total_reqs": sum(r["num_running_reqs"] + r["num_waiting_reqs"] for r in rows),
        "avg_token_usage": round(sum(r["token_usage"] for r in rows) / n, 4),
        "avg_throughput": round(sum(r["gen_throughput"] for r in rows) / n, 2),
        "avg_utilization": round(sum(r["utilization"] for r in rows) / n, 4),
    }


def response_body(
    naming: VersionNaming, rows: list[dict[str, Any]], tp_size: int
) -> dict[str, Any]:
    """The JSON body: `version` always (sglang.version.__version__), then per generation
    (entrypoints/v1_loads.py:169-175 @ 0.5.9, :144-150 @ 0.5.23)."""
    body: dict[str, Any] = {
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(),
        "version": naming.version,
    }
    if naming.loads == "ipc":
        body["dp_rank_count"] = len(rows)
        body["loads"] = rows
        body["aggregate"] = _aggregate(rows)
        return body
    if version_at_least(naming.version, "0.5.19"):
        body["accelerator"] = None  # get_device_name(): no accelerator in a simulation
        body["num_accelerators"] = tp_size
    body["loads"] = rows
    return body
