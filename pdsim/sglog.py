"""SGLang-like log lines on stdout, in each version's wording, for the journal and the evidence.

Formats follow SGLang's scheduler (`log_prefill_stats`, `log_decode_stats`, the disaggregation
failure paths) and uvicorn's access log. Only TP rank 0 prints batch lines; failure lines are
printed by every rank, as each TP rank's scheduler logs its own. Lines are flushed one by one so a
journal or a test reading the log file sees them at once.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

from pdsim.metrics import version_at_least


def log(message: str, *, rank: int = 0) -> None:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    sys.stdout.write(f"[{stamp} TP{rank}] {message}\n")
    sys.stdout.flush()


def log_plain(message: str) -> None:
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


def prefill_batch_line(
    version: str,
    *,
    new_seq: int,
    new_token: int,
    token_usage: float,
    running_req: int,
    queue_req: int,
    bootstrap_req: int,
    inflight_req: int,
    input_throughput: float,
) -> str:
    if version == "0.4.10":
        return (
            f"Prefill batch. #new-seq: {new_seq}, #new-token: {new_token}, #cached-token: 0, "
            f"token usage: {token_usage:.2f}, #unbootstrapped-req: {bootstrap_req}, "
            f"#queue-req: {queue_req}, #transferring-req: {inflight_req}, "
            f"input throughput (token/s): {input_throughput:.2f} "
        )
    # "#prealloc-req" up to 0.5.9 (managers/scheduler_metrics_mixin.py:224 @ 0.5.9),
    # "#bootstrap-req" from 0.5.16 (scheduler_components/metrics_reporter.py:569 @ 0.5.16).
    bootstrap_key = "#bootstrap-req" if version_at_least(version, "0.5.16") else "#prealloc-req"
    return (
        f"Prefill batch, #new-seq: {new_seq}, #new-token: {new_token}, #cached-token: 0, "
        f"token usage: {token_usage:.2f}, #running-req: {running_req}, #queue-req: {queue_req}, "
        f"{bootstrap_key}: {bootstrap_req}, #inflight-req: {inflight_req}, "
        f"input throughput (token/s): {input_throughput:.2f}, cuda graph: False"
    )


def decode_batch_line(
    version: str,
    *,
    running_req: int,
    num_token: int,
    token_usage: float,
    preallocated_usage: float,
    prealloc_req: int,
    transfer_req: int,
    gen_throughput: float,
    queue_req: int,
) -> str:
    if version == "0.4.10":
        return (
            f"Decode batch. #running-req: {running_req}, #token: {num_token}, "
            f"token usage: {token_usage:.2f}, pre-allocated usage: {preallocated_usage:.2f}, "
            f"#retracted-req: 0, cuda graph: True, "
            f"gen throughput (token/s): {gen_throughput:.2f}, #queue-req: {queue_req}"
        )
    return (
        f"Decode batch, #running-req: {running_req}, #token: {num_token}, "
        f"token usage: {token_usage:.2f}, pre-allocated usage: {preallocated_usage:.2f}, "
        f"#prealloc-req: {prealloc_req}, #transfer-req: {transfer_req}, #retracted-req: 0, "
        f"cuda graph: True, gen throughput (token/s): {gen_throughput:.2f}, #queue-req: {queue_req}"
    )


def transfer_failed_line(role: str, rank: int, rid: str, room: int, error: str) -> str:
    # sglang/srt/disaggregation/prefill.py:1286-1295 and decode.py:2863-2870 @ 0.5.23: the
    # fields are printed with f"{x=}", so decode's read decode_req.req.rid=...
    side = "Prefill" if role == "prefill" else "Decode"
    prefix = "req" if role == "prefill" else "decode_req.req"
    return (
        f"{side} transfer failed for request rank={rank} {prefix}.rid={rid!r} "
        f"{prefix}.bootstrap_room={room} with exception "
        f"KVTransferError(bootstrap_room={room}): {error}"
    )


def bootstrap_failed_line(role: str, rank: int, rid: str, room: int, error: str) -> str:
    # sglang/srt/disaggregation/prefill.py:1354-1357 and decode.py:1159 @ 0.5.23
    # (decode.py:395 @ 0.5.5): decode calls its bootstrap failure a handshake failure.
    if role == "prefill":
        head = f"Prefill bootstrap failed for request rank={rank} req.rid={rid!r}"
    else:
        head = f"Decode handshake failed for request rank={rank} decode_req.req.rid={rid!r}"
    room_field = "req.bootstrap_room" if role == "prefill" else "decode_req.req.bootstrap_room"
    return (
        f"{head} {room_field}={room} with exception KVTransferError(bootstrap_room={room}): {error}"
    )


def lost_connection_line(version: str, backend: str, addr: str, affected: int) -> str:
    """Decode losing its prefill peer, in each version's and backend's words."""
    if version_at_least(version, "0.5.9"):
        # sglang/srt/disaggregation/common/conn.py:2103-2106 @ 0.5.23 (assumed from 0.5.9)
        return (
            f"Lost connection with prefill instance (bootstrap_addr: {addr}), "
            f"{affected} requests affected"
        )
    if backend == "nixl":
        # sglang/srt/disaggregation/nixl/conn.py:258-261 @ 0.5.5
        return (
            f"Lost connection with prefill instance (bootstrap_addr: {addr}), "
            f"{affected} transfers affected"
        )
    # sglang/srt/disaggregation/mooncake/conn.py:1081-1083 @ 0.5.5 (also 0.4.10)
    return (
        f"Losing connection with prefill instance (bootstrap_addr: {addr}), "
        f"{affected} requests affected"
    )


def watchdog_timeout_line(version: str, timeout: float) -> str:
    if version_at_least(version, "0.5.9"):
        # sglang/srt/utils/watchdog.py:153-156 @ 0.5.23 (debug_name "Scheduler"; from 0.5.9)
        return f"Scheduler watchdog timeout (self.watchdog_timeout={timeout}, self.soft=False)"
    # sglang/srt/managers/scheduler_runtime_checker_mixin.py:256 @ 0.5.5
    return f"Watchdog timeout (self.watchdog_timeout={timeout})"


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 500: "Internal Server Error"}


class UvicornStyleAccessLogger(AbstractAccessLogger):
    """Access lines as SGLang's uvicorn prints them.

    `INFO:     127.0.0.1:40000 - "POST /generate HTTP/1.1" 200 OK`
    """

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        if request.path.startswith("/_sim"):
            return
        peer: Any = request.transport.get_extra_info("peername") if request.transport else None
        client = f"{peer[0]}:{peer[1]}" if peer else "-"
        version = f"{request.version.major}.{request.version.minor}"
        reason = response.reason or _REASONS.get(response.status, "")
        log_plain(
            f'INFO:     {client} - "{request.method} {request.path_qs} HTTP/{version}" '
            f"{response.status} {reason}"
        )
