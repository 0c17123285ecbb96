"""The simulated SGLang scheduler of one worker: PD queues, KV handoff, timing model and faults.

Prefill: bootstrap queue (waiting for decode to register the room) -> waiting queue -> prefill
batch (time per prompt token) -> inflight queue (KV transfer) -> finished. Decode: prealloc queue
(waiting for a slot) -> transfer queue (registered with prefill, waiting for the KV) -> waiting
queue -> running batch (one token per step per request) -> finished. Requests in PD queues are
neither running nor idle, so gauges are refreshed only after prefill batches, every
`decode_log_interval` decode steps, or every `idle_report_s` when fully idle, as in SGLang; the
live queue sizes are published every 50 ms for `/v1/loads` by the loop itself, so they freeze
when the loop is stuck.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import random
import signal
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from pdsim import sglog
from pdsim.faults import FaultSet
from pdsim.loads import LoadStats
from pdsim.metrics import SchedulerStats, SimMetrics, version_at_least

FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # SGLang's marker for the health check's fake bootstrap
# LOAD_STALL_REFRESH_S (sglang/srt/managers/scheduler.py:411 @ 0.5.23, :374 @ 0.5.19): a
# scheduler busy without batches republishes its load snapshot every 50 ms.
SNAPSHOT_INTERVAL_S = 0.05
# load_snapshot_publish_interval (server_args.py @ 0.5.16, default 15): decode batches publish
# every N iterations; prefill batches and idle passes always publish.
DECODE_PUBLISH_INTERVAL = 15
DECODE_STEP_MAX_US = 2_000_000  # STEP_MAX_US, sglang/srt/managers/scheduler.py:404 @ 0.5.23


@dataclass(frozen=True)
class EngineConfig:
    """Timing model and SGLang server arguments that the scheduler needs."""

    role: str
    version: str = "0.5.23"
    tp_size: int = 1
    dp_size: int = 1  # --dp-size with DP attention (pdsim/dp.py)
    model_name: str = "pdsim"
    url: str = ""
    prefill_ms_per_token: float = 0.05
    decode_tokens_per_s: float = 200.0
    max_running: int = 16
    max_prefill_tokens: int = 16384
    max_total_tokens: int = 131072
    transfer_ms: float = 1.0
    decode_log_interval: int = 40
    idle_report_s: float = 30.0
    bootstrap_timeout_s: float = 300.0
    waiting_timeout_s: float = 300.0
    health_timeout_s: float = 20.0
    # SGLang checks for output once a second, after a first 1 s sleep
    # (sglang/srt/entrypoints/http_server.py:778-781 @ 0.5.23); 0.05 is the --fast-health opt-in.
    health_poll_s: float = 1.0
    transfer_backend: str = "mooncake"
    # pdsim's behaviour before it followed SGLang's abort path (see README "Compatibility").
    legacy_aborts: bool = False
    watchdog_timeout_s: float = 300.0
    degraded_fail_fraction: float = 0.5
    spontaneous_degrade: bool = True
    seed: int | None = None

    @property
    def pd_abortable(self) -> bool:
        """Whether the KV sender/receiver has an abort(): every backend on 0.5.23, and mooncake
        before (sglang/srt/managers/scheduler.py:5741-5780 @ 0.5.23 calls it when present);
        NIXL <= 0.5.5 has none, so an aborted request stays in its PD queue."""
        return self.modern or self.transfer_backend == "mooncake"

    @property
    def decode_waiting_timeout(self) -> bool:
        """Decode's KVPoll.WaitingForInput timeout (sglang/srt/disaggregation/common/conn.py:
        2888-2912 @ 0.5.23); mooncake has it in 0.4.10 and 0.5.5, NIXL 0.5.5 does not."""
        return self.modern or self.transfer_backend == "mooncake"

    @property
    def failure_notifies_prefill(self) -> bool:
        """On 0.5.23 a decode-side failure or abort sends ABORT to prefill, which fails the room
        too (sglang/srt/disaggregation/common/conn.py:2906-2911, 711-715 @ 0.5.23)."""
        return self.modern

    @property
    def refreshes_stale_prefill(self) -> bool:
        """Decode drops its cached prefill bootstrap entry (connection_pool, keyed by the
        bootstrap address) when a send to that prefill fails or its room times out, so the next
        request refetches /route: sglang/srt/disaggregation/common/conn.py:1494-1499, 1611 and
        mooncake/conn.py:2596 @ 0.5.19. Before (common/conn.py:1316-1362 @ 0.5.18) only the
        heartbeat checker drops it, so a prefill restarted at the same address between two
        heartbeats leaves decode sending to its old rank ports until decode restarts."""
        return version_at_least(self.version, "0.5.19")

    @property
    def modern(self) -> bool:
        """0.5.9 and later: modelled with 0.5.23's abort, timeout, stream and TTFT behaviour
        (audited on 0.5.23 only; see README "Known differences")."""
        return version_at_least(self.version, "0.5.9")


ABORT_REQ_MESSAGE = "Aborted by AbortReq."  # sglang/srt/disaggregation/common/conn.py:2960 @ 0.5.23
# The reason a failure propagated from the peer carries (common/conn.py:2446-2456 @ 0.5.23).
FROM_ANOTHER_RANK = "Failed due to an unknown reason from another rank"
# pdsim's bootstrap wire: the prefill incarnation rides on each room's response, and a
# registration naming another incarnation is refused with this status (a send to a dead port).
SESSION_HEADER = "X-Pdsim-Prefill-Session"
STALE_PREFILL_STATUS = 409


@dataclass(eq=False)
class Req:
    """One request as the scheduler sees it; `out` carries ("token", n) and ("finish", reason)."""

    rid: str
    prompt_tokens: int
    max_new_tokens: int
    stream: bool
    room: int | None = None
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    fake: bool = False  # health check with the fake bootstrap
    dp_rank: int | None = None  # the DP rank serving it (pdsim/dp.py); None without DP
    out: asyncio.Queue[tuple[str, Any]] = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.monotonic)
    phase: str = "new"
    phase_since: float = field(default_factory=time.monotonic)
    generated: int = 0
    first_token_at: float | None = None
    finished: bool = False
    # prefill side
    registration: Registration | None = None
    transfer_started: float = 0.0
    transfer_done_at: float | None = None
    stuck: str | None = None  # "transfer_stall" or "pinned_request": never completes
    # decode side
    kv_state: str = "prealloc"  # registering, waiting, transferring, success, failed, aborted
    kv_state_since: float = field(default_factory=time.monotonic)
    kv_error: str = ""
    kv_fail_kind: str = "transfer"
    kv_task: asyncio.Task[None] | None = None
    kv_registered_at: float | None = None  # decode: when send_metadata went out
    notify_prefill: bool = True
    # Held before the scheduler (see Engine.hold): an AbortReq was forwarded while it waited.
    abort_forwarded: bool = False

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        self.phase_since = time.monotonic()


@dataclass(eq=False)
class Registration:
    """Decode's registration of one room with prefill's bootstrap server (its KV destination)."""

    room: int
    rid: str
    session_id: str
    decode_start_time: float
    decode_url: str
    is_closing: Callable[[], bool]
    events: asyncio.Queue[dict[str, Any]] = field(default_factory=asyncio.Queue)
    aborted_by_decode: bool = False
    final_sent: bool = False

    def push(self, state: str, **extra: Any) -> None:
        if self.final_sent:
            return
        self.final_sent = state in ("success", "failed", "aborted")
        self.events.put_nowait({"state": state, **extra})


def finish_length(n: int) -> dict[str, Any]:
    return {"type": "length", "length": n}


def finish_abort(message: str, status_code: int | None = None) -> dict[str, Any]:
    reason: dict[str, Any] = {"type": "abort", "message": message}
    if status_code is not None:
        reason["status_code"] = status_code
    return reason


def failure_message(role: str, kind: str, rid: str, room: int, error: str) -> str:
    """The message of a PD failure's abort finish: the scheduler's log line of rank 0 (the rank
    whose output the tokenizer gets), sent with status 500 (sglang/srt/disaggregation/
    prefill.py:1286-1308 (transfer), :1354-1374 (bootstrap); decode.py:1159-1174 (handshake),
    :2863-2890 (transfer) @ 0.5.23; verified on real 0.5.23 by tests/conformance)."""
    line = sglog.transfer_failed_line if kind == "transfer" else sglog.bootstrap_failed_line
    return line(role, 0, rid, room, error)


class Engine:
    """State and loop shared by both roles; subclasses implement one scheduler iteration."""

    def __init__(self, cfg: EngineConfig, faults: FaultSet, metrics: SimMetrics) -> None:
        self.cfg = cfg
        self.faults = faults
        self.metrics = metrics
        self.start_time = time.time()
        self.start_monotonic = time.monotonic()
        self.session_id = uuid.uuid4().hex
        self.rng = random.Random(cfg.seed)
        self.reqs: dict[str, Req] = {}
        # Requests the tokenizer has registered that have not reached the scheduler (Engine.hold).
        self.held: dict[str, Req] = {}
        self.waiting: collections.deque[Req] = collections.deque()
        self.running: list[Req] = []
        self.aborted_rids: collections.deque[str] = collections.deque(maxlen=1000)
        self.counters: collections.Counter[str] = collections.Counter()
        self.last_output_monotonic = 0.0
        self.forward_ct = 0
        self.hang_since: float | None = None
        self._wakeup = asyncio.Event()
        self._info_waiters: list[asyncio.Future[dict[str, Any]]] = []
        self._loads_waiters: list[asyncio.Future[tuple[LoadStats, ...]]] = []
        self._snapshot: tuple[LoadStats, ...] | None = None
        self._snapshot_monotonic = 0.0
        self._decode_publish_counter = 0
        self.total_prefill_uncached_tokens = 0
        self.total_prefill_busy_us = 0
        # Per DP rank (0 without DP): each rank's scheduler keeps its own decode step sums
        # (scheduler.py:2582 @ 0.5.23), reported in its own /v1/loads row.
        self.decode_moment_totals: dict[int, list[float]] = {
            rank: [0.0] * 6 for rank in range(max(cfg.dp_size, 1))
        }
        self._prev_decode_launch: dict[int, float | None] = {}
        self._rank_stepped_at: dict[int, float] = {}  # a slowed rank's last decode step
        self._last_report_monotonic = time.monotonic()  # the idle report is due 30 s after start
        self._gen_tokens_since_report = 0
        self._last_decode_report_monotonic = time.monotonic()
        self._last_prefill_report_monotonic = time.monotonic()
        self._last_prefill_tokens = 0
        self.last_gen_throughput = 0.0
        self.last_kv_transfer_latency_ms = 0.0

    # ----- entry points used by the HTTP layer -----

    def submit(self, req: Req) -> None:
        self.reqs[req.rid] = req
        self._enqueue(req)
        self.wake()

    def hold(self, req: Req) -> None:
        """The tokenizer has the request, the scheduler does not (yet): a hung decode.

        SGLang's tokenizer registers the rid in `rid_to_state` before it tokenizes the request and
        sends it on (sglang/srt/managers/tokenizer_manager.py:926 @ 0.5.23; at the send itself,
        :919-922 @ 0.5.5), so /abort_request finds a request however long it waits there."""
        self.held[req.rid] = req

    def release_held(self, req: Req) -> None:
        """The held request reaches the scheduler, followed by any AbortReq forwarded meanwhile
        (the scheduler reads its input in order): that abort then finds it in a queue
        (sglang/srt/managers/scheduler.py:5675-5780 @ 0.5.23)."""
        self.held.pop(req.rid, None)
        self.submit(req)
        if req.abort_forwarded and not self.cfg.legacy_aborts:
            self._abort_one(req)
            self.wake()

    def wake(self) -> None:
        self._wakeup.set()

    def abort(self, rid: str | None, abort_all: bool) -> int:
        """SGLang's /abort_request; returns how many requests matched."""
        if self.cfg.legacy_aborts:
            return self._legacy_abort(rid, abort_all)
        # The tokenizer ignores an empty rid and forwards only a rid it knows, matched exactly
        # (sglang/srt/managers/tokenizer_manager.py:2241-2253 @ 0.5.23): an unknown rid is a 200
        # that does nothing.
        if not abort_all and not rid:
            return 0
        matches = [
            r
            for r in [*self.reqs.values(), *self.held.values()]
            if not r.fake and not r.finished and (abort_all or r.rid == rid)
        ]
        if not abort_all and not matches:
            return 0
        # Counted once per forwarded AbortReq (tokenizer_manager.py:2261-2265 @ 0.5.23).
        self.metrics.observe_aborted(is_streaming=any(r.stream for r in matches))
        for req in matches:
            self.aborted_rids.append(req.rid)
            if req.rid in self.held:
                # Forwarded, but the scheduler has not got the request: it acts on release.
                req.abort_forwarded = True
            else:
                self._abort_one(req)
        self.wake()
        return len(matches)

    def _abort_one(self, req: Req) -> None:
        """Abort one live request: in a PD queue it fails through the KV poll (role hooks)."""
        if self._abort_in_pd_queue(req):
            return
        self._remove_from_queues(req)
        # SGLang's abort result comes back from the scheduler: a hung one sends nothing, so
        # the abort must not look like output to a concurrent /health (no heartbeat).
        self.finish(req, finish_abort(ABORT_REQ_MESSAGE), output=self.hang_since is None)

    def _abort_in_pd_queue(self, req: Req) -> bool:
        """True when `req` sits in a PD queue (handled or, without abort(), ignored there)."""
        raise NotImplementedError

    def _legacy_abort(self, rid: str | None, abort_all: bool) -> int:
        # pdsim before it followed SGLang: prefix match, every rid recorded, stuck transfers kept.
        if rid:
            self.aborted_rids.append(rid)
        aborted = 0
        for req in list(self.reqs.values()):
            if req.fake or req.finished:
                continue
            if not (abort_all or (rid and req.rid.startswith(rid))):
                continue
            if req.stuck is not None:
                continue
            self._remove_from_queues(req)
            self.finish(req, finish_abort(ABORT_REQ_MESSAGE), output=self.hang_since is None)
            aborted += 1
        self.wake()
        return aborted

    def client_gone(self, req: Req) -> None:
        """The HTTP client disconnected: SGLang's response background task calls abort_request
        with the request's rid (sglang/srt/entrypoints/http_server.py:977-981 @ 0.5.23)."""
        if req.finished:
            return
        if not self.cfg.legacy_aborts:
            self.abort(req.rid, False)
            return
        if req.stuck is not None:
            return
        self._remove_from_queues(req)
        self.finish(req, finish_abort("The client disconnected."), output=self.hang_since is None)

    async def internal_state(self) -> dict[str, Any]:
        """Round-trips through the scheduler loop, like SGLang's /server_info."""
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._info_waiters.append(fut)
        self.wake()
        return await fut

    async def health_check(self) -> bool:
        """SGLang's /health: a one-token fake-bootstrap request; 200 on *any* output in time.

        The loop sleeps before its first look, so a healthy answer takes one poll period (1 s in
        SGLang: sglang/srt/entrypoints/http_server.py:778-781 @ 0.5.23, also 0.4.10 and 0.5.5),
        and fails after the health timeout with the log line of http_server.py:787-797.
        """
        tic = time.monotonic()
        req = Req(
            rid=f"HEALTH_CHECK_{uuid.uuid4().hex[:8]}",
            prompt_tokens=1,
            max_new_tokens=1,
            stream=False,
            room=0,
            bootstrap_host=FAKE_BOOTSTRAP_HOST,
            fake=True,
        )
        self.submit(req)
        try:
            while time.monotonic() < tic + self.cfg.health_timeout_s:
                await asyncio.sleep(self.cfg.health_poll_s)
                if self.last_output_monotonic > tic:
                    return True
            stamp = time.strftime(
                "%H:%M:%S", time.localtime(time.time() - (time.monotonic() - tic))
            )
            last = self.last_output_monotonic
            last_stamp = time.strftime(
                "%H:%M:%S", time.localtime(time.time() - (time.monotonic() - last))
            )
            sglog.log(
                "Health check failed. Server couldn't get a response from detokenizer for last "
                f"{self.cfg.health_timeout_s:.0f} seconds. tic start time: {stamp}. "
                f"last_heartbeat time: {last_stamp}"
            )
            return False
        finally:
            if not req.finished:
                self._remove_from_queues(req)
                # Dropped by the HTTP layer, not answered by the scheduler: no output, so a
                # concurrent /health of a hung scheduler must not see a heartbeat here.
                self.finish(req, finish_abort("health check done"), count=False, output=False)

    def loads_snapshot(self) -> tuple[LoadStats, ...]:
        """The last published load snapshot (0.5.16+: the tokenizer reads shared memory)."""
        if self._snapshot is None:
            self._publish_snapshot()
        assert self._snapshot is not None
        return self._snapshot

    async def loads_ipc(self) -> tuple[LoadStats, ...]:
        """0.5.9: GetLoadsReqInput round-trips through the scheduler loop
        (managers/tokenizer_communicator_mixin.py:882-907, scheduler.py:1084,
        scheduler_metrics_mixin.py:620-750 @ 0.5.9), so it waits while the loop is blocked."""
        fut: asyncio.Future[tuple[LoadStats, ...]] = asyncio.get_running_loop().create_future()
        self._loads_waiters.append(fut)
        self.wake()
        return await fut

    # ----- the loop -----

    async def run(self) -> None:
        # Real SGLang runs a warm-up request before it is up (entrypoints/http_server.py:2504-2529
        # @ 0.5.23): its prefill batch reports prefill's gauges, so they exist from the start;
        # decode reports only every --decode-log-interval decode steps (the warm-up makes 8), so
        # its gauges are absent until then (verified on real 0.5.23, tests/conformance). pdsim
        # runs no warm-up: prefill reports once instead, decode does not.
        if self.cfg.role == "prefill":
            self.report_stats(gen_throughput=0.0)
        self._publish_snapshot()
        while True:
            self._serve_internal_state()
            if self.faults.active("collective_hang") and self._busy():
                await self._hang()
                continue
            await self.iteration()
            now = time.monotonic()
            self._publish_when_due(now)
            if self._fully_idle() and now - self._last_report_monotonic >= self.cfg.idle_report_s:
                self.report_stats(gen_throughput=0.0)
            if not self.has_immediate_work():
                await self._wait_for_work(self.next_deadline())

    async def watchdog(self) -> None:
        """SGLang's --watchdog-timeout: kills the server when a running batch stops advancing."""
        while True:
            await asyncio.sleep(0.2)
            if self.hang_since is None:
                continue
            if time.monotonic() - self.hang_since > self.cfg.watchdog_timeout_s:
                timeout = self.cfg.watchdog_timeout_s
                sglog.log(sglog.watchdog_timeout_line(self.cfg.version, timeout))
                sglog.log_plain(
                    "Received sigquit from a child process. It usually means the child failed."
                )
                os.kill(os.getpid(), signal.SIGKILL)

    async def _hang(self) -> None:
        # A TP collective that never returns: nothing runs, nothing is logged, no snapshot.
        self.hang_since = time.monotonic()
        # Faults can be set from another process (a fault file): poll, an Event cannot see them.
        while self.faults.active("collective_hang"):  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        self.hang_since = None

    async def _wait_for_work(self, deadline: float | None) -> None:
        timeout = SNAPSHOT_INTERVAL_S
        if deadline is not None:
            timeout = max(0.0, min(timeout, deadline - time.monotonic()))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wakeup.wait(), timeout=timeout)
        self._wakeup.clear()

    def _serve_internal_state(self) -> None:
        if self._loads_waiters:
            stats = self._load_stats()
            for lfut in self._loads_waiters:
                if not lfut.done():
                    lfut.set_result(stats)
            self._loads_waiters.clear()
        if not self._info_waiters:
            return
        state = {
            "last_gen_throughput": self.last_gen_throughput,
            "memory_usage": {"kvcache": 0.0, "weight": 0.0},
            "num_running_reqs": len(self.running),
            "avg_spec_accept_length": None,
            "load": self.queue_sizes(),
        }
        for fut in self._info_waiters:
            if not fut.done():
                fut.set_result(state)
        self._info_waiters.clear()

    # ----- finishing and reporting -----

    def emit_token(self, req: Req) -> None:
        now = time.monotonic()
        if req.first_token_at is None:
            req.first_token_at = now
            # 0.5.23: PD prefill workers never observe TTFT
            # (sglang/srt/managers/tokenizer_manager.py:3236-3246 @ 0.5.23).
            skip = self.cfg.modern and self.cfg.role == "prefill"
            if not req.fake and not skip:
                self.metrics.observe_ttft(now - req.arrival, is_streaming=req.stream)
        self.last_output_monotonic = now
        req.out.put_nowait(("token", req.generated))

    def finish(
        self, req: Req, reason: dict[str, Any], *, count: bool = True, output: bool = True
    ) -> None:
        if req.finished:
            return
        req.finished = True
        req.set_phase("finished")
        self.reqs.pop(req.rid, None)
        if req.kv_task is not None and not req.kv_task.done():
            req.kv_task.cancel()
        if output:
            self.last_output_monotonic = time.monotonic()
        req.out.put_nowait(("finish", reason))
        if req.fake or not count:
            return
        # Tokenizer metrics are updated when a request finishes, never per token.
        if reason["type"] == "abort":
            self.counters["requests_aborted"] += 1
            if self.cfg.legacy_aborts:
                self.metrics.observe_aborted(is_streaming=req.stream)
                return
            # Finished is not succeeded: aborts and PD failures are finished requests too
            # (sglang/srt/managers/tokenizer_manager.py:3261-3297 @ 0.5.23), with the tokens
            # they produced: on prefill the first token once its prefill batch ran (an inflight
            # abort counts 1: verified on real 0.5.23, tests/conformance), on decode none for a
            # request stuck before decode.
            self.metrics.observe_finished(
                prompt_tokens=req.prompt_tokens,
                generation_tokens=req.generated,
                e2e_seconds=time.monotonic() - req.arrival,
                is_streaming=req.stream,
            )
            return
        self.metrics.observe_finished(
            prompt_tokens=req.prompt_tokens,
            generation_tokens=req.generated,
            e2e_seconds=time.monotonic() - req.arrival,
            is_streaming=req.stream,
        )
        self.counters["requests_finished"] += 1
        self.counters["generated_tokens"] += req.generated
        self.counters["prompt_tokens"] += req.prompt_tokens

    def ranks(self) -> tuple[int | None, ...]:
        """The DP ranks reported on their own: (None,) without DP (one scheduler, no label).

        With DP attention each rank's scheduler reports its own gauges and tokens, labelled
        dp_rank (observability/metrics_collector.py:1391-1392 @ 0.5.23), and answers its own
        /v1/loads row (managers/scheduler_components/load_inquirer.py:229-256 @ 0.5.23). pdsim
        runs one loop: a rank's share is its requests (Req.dp_rank; a health check's is 0).
        """
        return tuple(range(self.cfg.dp_size)) if self.cfg.dp_size > 1 else (None,)

    @staticmethod
    def on_rank(reqs: Iterable[Req], rank: int | None) -> list[Req]:
        """The requests of `rank` (every request for None)."""
        return [r for r in reqs if rank is None or (r.dp_rank or 0) == rank]

    def report_stats(self, *, gen_throughput: float) -> None:
        self._last_report_monotonic = time.monotonic()
        self.counters["stats_reports"] += 1
        for rank in self.ranks():
            sizes = self.queue_sizes(rank)
            used = self.used_tokens(rank)
            self.metrics.log_stats(
                SchedulerStats(
                    num_running_reqs=len(self.on_rank(self.running, rank)),
                    num_used_tokens=used,
                    token_usage=used / self.cfg.max_total_tokens,
                    gen_throughput=gen_throughput,
                    num_queue_reqs=len(self.on_rank(self.waiting, rank)),
                    num_prefill_bootstrap_queue_reqs=sizes["prefill_bootstrap_queue_reqs"],
                    num_prefill_inflight_queue_reqs=sizes["prefill_inflight_queue_reqs"],
                    num_decode_prealloc_queue_reqs=sizes["decode_prealloc_queue_reqs"],
                    num_decode_transfer_queue_reqs=sizes["decode_transfer_queue_reqs"],
                    max_total_num_tokens=self.cfg.max_total_tokens,
                    kv_transfer_latency_ms=self.last_kv_transfer_latency_ms,
                ),
                dp_rank=rank,
            )

    def _publish_when_due(self, now: float) -> None:
        """Publish the load snapshot from the loop, as each generation does (docs/sglang.md
        §7.6). Fully idle: every pass (scheduler.py:3680-3681 @ 0.5.16). Busy without a batch
        (a PD stall): 0.5.16-0.5.18 never (on_idle returns early, scheduler.py:3644-3647
        @ 0.5.16), 0.5.19+ every LOAD_STALL_REFRESH_S (scheduler.py:5241-5262 @ 0.5.23,
        4483-4499 @ 0.5.19). 0.5.9 has no snapshot: /v1/loads asks the loop."""
        mode = self.metrics.naming.loads
        if mode not in ("snapshot", "refresh"):
            return
        if self._fully_idle() or (
            mode == "refresh" and now - self._snapshot_monotonic >= SNAPSHOT_INTERVAL_S
        ):
            self._publish_snapshot()

    def _on_batch_result(self, *, extend: bool) -> None:
        """process_batch_result publishes first: always after a prefill (extend) batch, every
        DECODE_PUBLISH_INTERVAL other batches (scheduler.py:3567 @ 0.5.16, :655-666)."""
        if self.metrics.naming.loads not in ("snapshot", "refresh"):
            return
        if not extend:
            self._decode_publish_counter += 1
            if self._decode_publish_counter < DECODE_PUBLISH_INTERVAL:
                return
        self._decode_publish_counter = 0
        self._publish_snapshot()

    def _publish_snapshot(self) -> None:
        self._snapshot = self._load_stats()
        self._snapshot_monotonic = time.monotonic()

    def _load_stats(self) -> tuple[LoadStats, ...]:
        """Each rank's get_loads (scheduler_components/load_inquirer.py:109-256 @ 0.5.23)."""
        return tuple(self._rank_load_stats(rank) for rank in self.ranks())

    def _rank_load_stats(self, rank: int | None) -> LoadStats:
        sizes = self.queue_sizes(rank)
        used = self.used_tokens(rank)
        pending = self._pending_token_reqs(rank)
        total = used + sum(r.prompt_tokens for r in pending)
        awaiting_kv = sum(r.prompt_tokens for r in self._awaiting_kv_reqs(rank))
        moments = self.decode_moment_totals[rank or 0]
        waiting = self.on_rank(self.waiting, rank)
        return LoadStats(
            timestamp=time.time(),
            role=self.cfg.role,
            num_running_reqs=len(self.on_rank(self.running, rank)),
            num_waiting_reqs=len(waiting) + self._pd_waiting_reqs(rank),
            num_waiting_uncached_tokens=sum(r.prompt_tokens for r in waiting),
            num_used_tokens=used,
            num_total_tokens=total,
            num_active_tokens=max(0, total - awaiting_kv),
            max_total_num_tokens=self.cfg.max_total_tokens,
            max_running_requests=self.cfg.max_running,
            gen_throughput=self.last_gen_throughput,
            queues=sizes,
            waiting=len(waiting),
            kv_transfer_latency_ms=self.last_kv_transfer_latency_ms,
            total_prefill_uncached_tokens=self.total_prefill_uncached_tokens,
            total_prefill_busy_us=self.total_prefill_busy_us,
            decode_moments=tuple(moments) if moments[0] > 0 else None,
            dp_rank=rank or 0,
        )

    def _pd_waiting_reqs(self, rank: int | None = None) -> int:
        """Requests of the PD queues that count as waiting (not prefill's inflight queue)."""
        raise NotImplementedError

    def _pending_token_reqs(self, rank: int | None = None) -> list[Req]:
        """Requests whose tokens count towards num_total_tokens beyond the used KV."""
        return self.on_rank(self.waiting, rank)

    def _awaiting_kv_reqs(self, rank: int | None = None) -> list[Req]:
        return []

    def sim_state(self) -> dict[str, Any]:
        now = time.monotonic()
        rooms = {
            str(r.room): {
                "rid": r.rid,
                "phase": r.phase,
                "age_s": round(now - r.arrival, 3),
                "phase_age_s": round(now - r.phase_since, 3),
                "stuck": r.stuck,
                "generated": r.generated,
                "kv_state": r.kv_state,
            }
            for r in self.reqs.values()
            if not r.fake and r.room is not None
        }
        return {
            "role": self.cfg.role,
            "pid": os.getpid(),
            "session_id": self.session_id,
            "start_time": self.start_time,
            "sglang_version": self.cfg.version,
            "tp_size": self.cfg.tp_size,
            "faults": self.faults.to_json(),
            "counters": dict(self.counters),
            "forward_ct": self.forward_ct,
            "queues": {
                **self.queue_sizes(),
                "waiting": len(self.waiting),
                "running": len(self.running),
            },
            "rooms": rooms,
            "aborted_rids": list(self.aborted_rids),
            "hung": self.hang_since is not None,
            "snapshot_age_s": round(now - self._snapshot_monotonic, 3),
            "decode_moments": [
                sum(t[i] for t in self.decode_moment_totals.values()) for i in range(6)
            ],
        }

    # ----- hooks for the roles -----

    def _enqueue(self, req: Req) -> None:
        raise NotImplementedError

    def _remove_from_queues(self, req: Req) -> None:
        raise NotImplementedError

    async def iteration(self) -> None:
        raise NotImplementedError

    def queue_sizes(self, rank: int | None = None) -> dict[str, int]:
        raise NotImplementedError

    def used_tokens(self, rank: int | None = None) -> int:
        raise NotImplementedError

    def has_immediate_work(self) -> bool:
        raise NotImplementedError

    def next_deadline(self) -> float | None:
        return None

    def _busy(self) -> bool:
        raise NotImplementedError

    def release_stuck(self) -> int:
        """Test helper: let stuck transfers complete now; returns how many were released."""
        raise NotImplementedError

    def _fully_idle(self) -> bool:
        return not self.reqs


class PrefillEngine(Engine):
    """Prefill: waits for decode's registration, prefills, transfers the KV, then finishes."""

    def __init__(self, cfg: EngineConfig, faults: FaultSet, metrics: SimMetrics) -> None:
        super().__init__(cfg, faults, metrics)
        self.bootstrap_q: list[Req] = []
        self.inflight: list[Req] = []
        self.rooms: dict[int, Req] = {}
        self.pending_registrations: dict[int, Registration] = {}
        self.decode_sessions: dict[str, tuple[str, float]] = {}  # session -> (decode URL, start)
        self.degraded_since: float | None = None
        self.pins_left = 0
        self._pin_fault_stamp = -1.0

    # The bootstrap server calls these.

    def register_room(self, reg: Registration) -> None:
        self._note_decode_session(reg.session_id, reg.decode_url, reg.decode_start_time)
        req = self.rooms.get(reg.room)
        if req is not None and req.registration is None:
            req.registration = reg
        else:
            self.pending_registrations[reg.room] = reg
        self.wake()

    def unregister_room(self, reg: Registration) -> None:
        if self.pending_registrations.get(reg.room) is reg:
            del self.pending_registrations[reg.room]

    def decode_aborted_room(self, room: int) -> None:
        """Decode sent ABORT for a room (its abort, timeout or failure).

        On 0.5.23 the room turns KVPoll.Failed on prefill too
        (sglang/srt/disaggregation/common/conn.py:711-715 @ 0.5.23) and fails there with a failure
        counted; the reason comes from another rank, so it is logged at debug only
        (sglang/srt/disaggregation/prefill.py:1282-1312 @ 0.5.23). Before, prefill drops it.
        """
        req = self.rooms.get(room)
        if req is not None and req.registration is not None:
            req.registration.aborted_by_decode = True
            if self._fails_on_decode_abort() and req.stuck != "pinned_request":
                if req in self.bootstrap_q:
                    self.bootstrap_q.remove(req)
                    self._fail(req, kind="bootstrap", error=FROM_ANOTHER_RANK, log=False)
                elif req in self.inflight:
                    self.inflight.remove(req)
                    self._fail(req, kind="transfer", error=FROM_ANOTHER_RANK, log=False)
        pending = self.pending_registrations.pop(room, None)
        if pending is not None:
            pending.push("aborted", error="aborted by decode")
        self.wake()

    def _fails_on_decode_abort(self) -> bool:
        return self.cfg.failure_notifies_prefill and not self.cfg.legacy_aborts

    def _abort_in_pd_queue(self, req: Req) -> bool:
        # sglang/srt/managers/scheduler.py:5741-5758 @ 0.5.23: bootstrap and inflight requests
        # get sender.abort(), which records "Aborted by AbortReq." and sets KVPoll.Failed; the
        # next poll takes the failure path: prefill.py:1352-1378 (bootstrap) and 1282-1312
        # (inflight). Without abort() (NIXL <= 0.5.5) the request stays where it is.
        if req in self.bootstrap_q:
            if self.cfg.pd_abortable:
                self.bootstrap_q.remove(req)
                self._fail(req, kind="bootstrap", error=ABORT_REQ_MESSAGE)
            return True
        if req in self.inflight:
            # A pinned request is one the transfer engine never lets go of (PR #33920).
            if self.cfg.pd_abortable and req.stuck != "pinned_request":
                self.inflight.remove(req)
                self._fail(req, kind="transfer", error=ABORT_REQ_MESSAGE)
            return True
        return False

    def finish(
        self, req: Req, reason: dict[str, Any], *, count: bool = True, output: bool = True
    ) -> None:
        super().finish(req, reason, count=count, output=output)
        if req.registration is None or reason["type"] != "abort":
            return
        aborted_here = str(reason.get("message", "")).endswith(ABORT_REQ_MESSAGE)
        if aborted_here and not self.cfg.legacy_aborts:
            # An abort on prefill (AbortReq or a client gone) only fails the room here:
            # sender.abort() records the failure locally and sends nothing to decode
            # (sglang/srt/disaggregation/common/conn.py:2458-2466, prefill.py:1282-1312 and
            # 1352-1378 @ 0.5.23), so decode's copy waits for its own abort or its waiting timeout.
            return
        # Tell decode so it does not wait for a KV that will never come.
        req.registration.push("aborted", error=reason.get("message", ""))

    def _note_decode_session(self, session_id: str, decode_url: str, start_time: float) -> None:
        # A decode incarnation that started after this prefill and then was replaced by another
        # one at the same decode while this prefill kept running leaves the transfer engine's
        # peer state stale: the incident in docs/sglang.md §6. A decode older than this prefill
        # does not count, so a clean co-restart prefill -> decode clears it; several decodes,
        # each started once after this prefill (xPyD), are not replacements.
        if session_id in self.decode_sessions:
            return
        self.decode_sessions[session_id] = (decode_url, start_time)
        newer = [url for url, t in self.decode_sessions.values() if t > self.start_time]
        replaced = any(newer.count(url) >= 2 for url in newer)
        if self.cfg.spontaneous_degrade and replaced and self.degraded_since is None:
            self.degraded_since = time.time()

    def failure_fraction(self) -> float:
        fault = self.faults.get("degraded_bootstrap")
        if fault is not None:
            return float(fault.param("fraction"))
        if self.degraded_since is not None:
            return self.cfg.degraded_fail_fraction
        return 0.0

    # Queues.

    def _enqueue(self, req: Req) -> None:
        if req.fake:
            # FakeKVSender is bootstrapped at once.
            req.set_phase("waiting")
            self.waiting.append(req)
            return
        assert req.room is not None
        self.rooms[req.room] = req
        reg = self.pending_registrations.pop(req.room, None)
        if reg is not None:
            req.registration = reg
        req.set_phase("bootstrap")
        self.bootstrap_q.append(req)

    def _remove_from_queues(self, req: Req) -> None:
        for queue in (self.bootstrap_q, self.inflight, self.running):
            if req in queue:
                queue.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        if req.room is not None and self.rooms.get(req.room) is req:
            del self.rooms[req.room]

    def queue_sizes(self, rank: int | None = None) -> dict[str, int]:
        return {
            "prefill_bootstrap_queue_reqs": len(self.on_rank(self.bootstrap_q, rank)),
            "prefill_inflight_queue_reqs": len(self.on_rank(self.inflight, rank)),
            "decode_prealloc_queue_reqs": 0,
            "decode_transfer_queue_reqs": 0,
        }

    def used_tokens(self, rank: int | None = None) -> int:
        return sum(r.prompt_tokens for r in self.on_rank([*self.inflight, *self.running], rank))

    def has_immediate_work(self) -> bool:
        return bool(self.waiting) and self._free_slots() > 0

    def _pd_waiting_reqs(self, rank: int | None = None) -> int:
        # load_inquirer.py:117-120 @ 0.5.23: the bootstrap queue waits, the inflight one not.
        return len(self.on_rank(self.bootstrap_q, rank))

    def _pending_token_reqs(self, rank: int | None = None) -> list[Req]:
        return self.on_rank([*self.waiting, *self.bootstrap_q], rank)

    def next_deadline(self) -> float | None:
        times = [
            r.transfer_done_at
            for r in self.inflight
            if r.transfer_done_at is not None and r.stuck is None
        ]
        return min(times) if times else None

    def _busy(self) -> bool:
        return bool(self.waiting) or bool(self.running)

    def _free_slots(self) -> int:
        # Requests in the inflight queue keep their KV (and request slot) until the transfer ends,
        # so stuck transfers eventually starve new prefill batches, health checks included.
        return self.cfg.max_running - len(self.inflight) - len(self.running)

    # One iteration.

    async def iteration(self) -> None:
        self._process_bootstrap_queue()
        batch = self._form_batch()
        if batch:
            await self._run_batch(batch)
        self._process_inflight_queue()

    def _process_bootstrap_queue(self) -> None:
        now = time.monotonic()
        for req in list(self.bootstrap_q):
            if req.registration is not None:
                self.bootstrap_q.remove(req)
                req.set_phase("waiting")
                self.waiting.append(req)
            elif now - req.phase_since > self.cfg.bootstrap_timeout_s:
                self.bootstrap_q.remove(req)
                self._fail(
                    req,
                    kind="bootstrap",
                    error=f"Request {req.room} timed out after {now - req.phase_since:.1f}s in "
                    "KVPoll.Bootstrapping, Please check the health of the decode server.",
                )

    def _form_batch(self) -> list[Req]:
        batch: list[Req] = []
        tokens = 0
        slots = self._free_slots()
        while self.waiting and len(batch) < slots:
            req = self.waiting[0]
            if batch and tokens + req.prompt_tokens > self.cfg.max_prefill_tokens:
                break
            self.waiting.popleft()
            batch.append(req)
            tokens += req.prompt_tokens
        return batch

    async def _run_batch(self, batch: list[Req]) -> None:
        new_tokens = sum(r.prompt_tokens for r in batch)
        # SGLang logs and refreshes its gauges when it *forms* the batch, before these requests
        # move to the inflight queue: the inflight gauge lags the live queue by one batch.
        now = time.monotonic()
        gap = max(now - self._last_prefill_report_monotonic, 1e-6)
        input_throughput = self._last_prefill_tokens / gap
        self._last_prefill_report_monotonic = now
        self._last_prefill_tokens = new_tokens
        sglog.log(
            sglog.prefill_batch_line(
                self.cfg.version,
                new_seq=len(batch),
                new_token=new_tokens,
                token_usage=self.used_tokens() / self.cfg.max_total_tokens,
                running_req=0,
                queue_req=len(self.waiting),
                bootstrap_req=len(self.bootstrap_q),
                inflight_req=len(self.inflight),
                input_throughput=input_throughput,
            )
        )
        self.report_stats(gen_throughput=self.last_gen_throughput)
        self.counters["prefill_batches"] += 1
        self.running = batch
        launch = time.monotonic()
        await asyncio.sleep(new_tokens * self.cfg.prefill_ms_per_token / 1000.0)
        self.forward_ct += 1
        self.metrics.add_realtime_tokens("prefill_compute", new_tokens)
        self.metrics.add_realtime_tokens("prefill_cache", 0)
        self.running = []
        if not all(r.fake for r in batch):
            # Health-only batches are skipped (scheduler.py:5120-5128 @ 0.5.23).
            self.total_prefill_uncached_tokens += new_tokens
            self.total_prefill_busy_us += int((time.monotonic() - launch) * 1e6)
        # The snapshot is taken before the batch moves to the inflight queue.
        self._on_batch_result(extend=True)
        now = time.monotonic()
        for req in batch:
            if req.finished:
                continue
            req.generated = 1  # prefill computes the first output token
            req.set_phase("inflight")
            req.transfer_started = now
            self._start_transfer(req, now)
            self.inflight.append(req)

    def _start_transfer(self, req: Req, now: float) -> None:
        if req.fake:
            req.transfer_done_at = now
            return
        pin = self.faults.get("pinned_request")
        if pin is not None:
            if pin.set_at_monotonic != self._pin_fault_stamp:
                self._pin_fault_stamp = pin.set_at_monotonic
                self.pins_left = int(pin.param("count"))
            if self.pins_left > 0:
                self.pins_left -= 1
                req.stuck = "pinned_request"
        if req.registration is not None:
            req.registration.push("transferring")
        req.transfer_done_at = now + self.cfg.transfer_ms / 1000.0

    def _process_inflight_queue(self) -> None:
        now = time.monotonic()
        for req in list(self.inflight):
            if req.stuck is not None or req.transfer_done_at is None or now < req.transfer_done_at:
                continue
            if not req.fake and self.faults.active("transfer_stall"):
                # The transfer started and never completes: state Transferring has no timeout.
                req.stuck = "transfer_stall"
                continue
            self.inflight.remove(req)
            self._complete_transfer(req, now)

    def _complete_transfer(self, req: Req, now: float) -> None:
        if req.fake:
            self.emit_token(req)
            self.finish(req, finish_length(1))
            return
        reg = req.registration
        assert reg is not None, "a transfer only starts once decode has registered"
        assert req.room is not None
        peer = reg.decode_url or "decode"
        if reg.aborted_by_decode:
            if self._fails_on_decode_abort():
                self._fail(req, kind="transfer", error=FROM_ANOTHER_RANK, log=False)
                return
            self.rooms.pop(req.room, None)
            self.finish(req, finish_abort("Aborted by the decode side."))
            return
        error = ""
        if reg.is_closing():
            error = f"Failed to send kv chunk of {req.room} to {peer}: decode peer is gone"
        elif self.rng.random() < self.failure_fraction():
            error = f"Failed to send kv chunk of {req.room} to {peer}"
        if error:
            reg.push("failed", error=error)
            self._fail(req, kind="transfer", error=error)
            return
        latency_ms = (now - req.transfer_started) * 1000.0
        self.last_kv_transfer_latency_ms = latency_ms
        self.metrics.observe_kv_transfer_latency(latency_ms)
        reg.push("success", first_token=1)
        self.rooms.pop(req.room, None)
        self.emit_token(req)
        self.finish(req, finish_length(1))

    def _fail(self, req: Req, *, kind: str, error: str, log: bool = True) -> None:
        assert req.room is not None
        for rank in range(self.cfg.tp_size if log else 0):
            if kind == "transfer":
                sglog.log(
                    sglog.transfer_failed_line("prefill", rank, req.rid, req.room, error), rank=rank
                )
            else:
                sglog.log(
                    sglog.bootstrap_failed_line("prefill", rank, req.rid, req.room, error),
                    rank=rank,
                )
        if kind == "transfer":
            self.metrics.inc_transfer_failed(req.dp_rank)
        else:
            self.metrics.inc_bootstrap_failed(req.dp_rank)
        self.counters[f"{kind}_failed"] += 1
        self.rooms.pop(req.room, None)
        self.finish(
            req, finish_abort(failure_message("prefill", kind, req.rid, req.room, error), 500)
        )

    def release_stuck(self) -> int:
        released = 0
        for req in self.inflight:
            if req.stuck is not None:
                req.stuck = None
                req.transfer_done_at = time.monotonic()
                released += 1
        self.wake()
        return released

    def sim_state(self) -> dict[str, Any]:
        state = super().sim_state()
        newer = sorted(s for s, (_, t) in self.decode_sessions.items() if t > self.start_time)
        state["degraded"] = {
            "active": self.failure_fraction() > 0.0,
            "spontaneous": self.degraded_since is not None,
            "since": self.degraded_since,
            "fail_fraction": self.failure_fraction(),
            "decode_incarnations_seen": len(self.decode_sessions),
            "decode_incarnations_after_start": newer,
        }
        state["pending_registrations"] = len(self.pending_registrations)
        return state


class DecodeEngine(Engine):
    """Decode: registers each room with prefill, waits for the KV, then generates tokens."""

    def __init__(self, cfg: EngineConfig, faults: FaultSet, metrics: SimMetrics) -> None:
        super().__init__(cfg, faults, metrics)
        self.prealloc: collections.deque[Req] = collections.deque()
        self.transfer_q: list[Req] = []
        self.http: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._lost_logged_at = 0.0
        # SGLang's connection_pool: per prefill bootstrap address, the prefill incarnation whose
        # bootstrap metadata (per-rank ports) decode fetched once and reuses.
        self.prefill_pool: dict[str, str] = {}
        self.stale_prefill_failures = 0

    async def start_client(self) -> None:
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self.http is not None:
            await self.http.close()

    def _enqueue(self, req: Req) -> None:
        req.set_phase("prealloc")
        self.prealloc.append(req)

    def finish(
        self, req: Req, reason: dict[str, Any], *, count: bool = True, output: bool = True
    ) -> None:
        registered = (
            req.kv_task is not None
            and not req.kv_task.done()
            and req.kv_state in ("registering", "waiting", "transferring")
        )
        super().finish(req, reason, count=count, output=output)
        if registered and reason["type"] == "abort" and req.notify_prefill:
            self._spawn(self._notify_abort(req))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _notify_abort(self, req: Req) -> None:
        # A deliberate abort is not a dead peer: prefill must not count a transfer failure.
        assert self.http is not None
        url = f"http://{req.bootstrap_host}:{req.bootstrap_port}/pdsim/room/abort"
        try:
            async with self.http.post(
                url, json={"room": req.room}, timeout=aiohttp.ClientTimeout(total=2.0)
            ):
                pass
        except (aiohttp.ClientError, TimeoutError):
            pass

    def _abort_in_pd_queue(self, req: Req) -> bool:
        # sglang/srt/managers/scheduler.py:5760-5780 @ 0.5.23: prealloc and transfer requests get
        # receiver.abort() (KVPoll.Failed, "Aborted by AbortReq.", ABORT sent to prefill); the
        # next poll fails them: decode.py:1158-1177 (handshake) and 2857-2916 (transfer).
        if req in self.prealloc or (req in self.transfer_q and req.kv_state == "registering"):
            if self.cfg.pd_abortable:
                self._remove_from_queues(req)
                self._fail(req, kind="bootstrap", error=ABORT_REQ_MESSAGE)
            return True
        if req in self.transfer_q:
            if self.cfg.pd_abortable and req.stuck != "pinned_request":
                self._remove_from_queues(req)
                notify = req.kv_task is None or req.kv_task.done()
                self._fail(req, kind="transfer", error=ABORT_REQ_MESSAGE)
                if notify and self.cfg.failure_notifies_prefill:
                    # The KV stream already ended (the done signal was lost): send ABORT anyway.
                    self._spawn(self._notify_abort(req))
            return True
        return False

    def _remove_from_queues(self, req: Req) -> None:
        for queue in (self.transfer_q, self.running):
            if req in queue:
                queue.remove(req)
        for dq in (self.prealloc, self.waiting):
            if req in dq:
                dq.remove(req)

    def queue_sizes(self, rank: int | None = None) -> dict[str, int]:
        return {
            "prefill_bootstrap_queue_reqs": 0,
            "prefill_inflight_queue_reqs": 0,
            "decode_prealloc_queue_reqs": len(self.on_rank(self.prealloc, rank)),
            "decode_transfer_queue_reqs": len(self.on_rank(self.transfer_q, rank)),
        }

    def used_tokens(self, rank: int | None = None) -> int:
        held = self.on_rank([*self.transfer_q, *self.waiting, *self.running], rank)
        return sum(r.prompt_tokens + r.generated for r in held)

    def _stalled(self, req: Req) -> bool:
        fault = self.faults.get("decode_stall_midstream")
        if fault is None or req.fake:
            return False
        rank = fault.params.get("dp_rank")  # one rank's scheduler wedged, the others serving
        after: int = fault.param("after_tokens")
        return (rank is None or rank == req.dp_rank) and req.generated >= after

    def _slowed_rank(self) -> tuple[int, float] | None:
        """The rank `slow_decode` slows alone, and its rate (None: none, or every rank)."""
        slow = self.faults.get("slow_decode")
        if slow is None or slow.params.get("dp_rank") is None:
            return None
        return int(slow.param("dp_rank")), float(slow.param("tokens_per_s"))

    def _due(self, req: Req, slowed: tuple[int, float] | None, now: float) -> bool:
        """A request of a rank slowed alone decodes once that rank's next step is due: its own
        scheduler steps at the slow rate while the others keep theirs."""
        if slowed is None or (req.dp_rank or 0) != slowed[0]:
            return True
        return now - self._rank_stepped_at.get(slowed[0], 0.0) >= 1.0 / slowed[1]

    def _active(self) -> list[Req]:
        slowed, now = self._slowed_rank(), time.monotonic()
        return [r for r in self.running if not self._stalled(r) and self._due(r, slowed, now)]

    def has_immediate_work(self) -> bool:
        return bool(self._active())

    def _busy(self) -> bool:
        return bool(self.running) or bool(self.waiting)

    def _pd_waiting_reqs(self, rank: int | None = None) -> int:
        # load_inquirer.py:121-129 @ 0.5.23: prealloc, transfer (and retracted) queues wait.
        return len(self.on_rank([*self.prealloc, *self.transfer_q], rank))

    def _pending_token_reqs(self, rank: int | None = None) -> list[Req]:
        # Transfer-queue requests already hold decode KV (load_inquirer.py:130-133 @ 0.5.23).
        return self.on_rank(self.prealloc, rank)

    def _awaiting_kv_reqs(self, rank: int | None = None) -> list[Req]:
        return self.on_rank([*self.prealloc, *self.transfer_q], rank)

    def _capacity(self) -> int:
        return self.cfg.max_running - len(self.transfer_q) - len(self.waiting) - len(self.running)

    async def iteration(self) -> None:
        self._admit_prealloc()
        self._process_transfer_queue()
        while self.waiting and len(self.running) < self.cfg.max_running:
            req = self.waiting.popleft()
            req.set_phase("running")
            self.running.append(req)
        active = self._active()
        if active:
            await self._decode_step(active)
        else:
            self._prev_decode_launch.clear()  # an idle gap: the next step is not contiguous

    def _admit_prealloc(self) -> None:
        capacity = self._capacity()
        while self.prealloc and capacity > 0:
            req = self.prealloc.popleft()
            capacity -= 1
            req.set_phase("transfer")
            self.transfer_q.append(req)
            if req.fake:
                # FakeKVReceiver: the health request finishes in the prebuilt step, without a
                # decode forward, so it adds no decode tokens and no "Decode batch" line
                # (docs/sglang.md §7.5).
                self.transfer_q.remove(req)
                req.generated = 1
                self._on_batch_result(extend=False)  # the prebuilt batch's result
                self.emit_token(req)
                self.finish(req, finish_length(1))
                continue
            self._set_kv_state(req, "registering")
            task = asyncio.create_task(self._receive_kv(req))
            req.kv_task = task
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _set_kv_state(self, req: Req, state: str, error: str = "", kind: str = "transfer") -> None:
        if state == "waiting" and req.kv_registered_at is None:
            req.kv_registered_at = time.monotonic()  # send_metadata: the waiting timeout starts
        req.kv_state = state
        req.kv_state_since = time.monotonic()
        req.kv_error = error
        req.kv_fail_kind = kind
        self.wake()

    async def _receive_kv(self, req: Req) -> None:
        assert self.http is not None
        host = req.bootstrap_host
        port = req.bootstrap_port
        url = f"http://{host}:{port}/pdsim/room"
        payload = {
            "room": req.room,
            "rid": req.rid,
            "session_id": self.session_id,
            "start_time": self.start_time,
            "decode_url": self.cfg.url,
            "prefill_session": self.prefill_pool.get(f"{host}:{port}"),
        }
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5.0, sock_read=None)
        try:
            async with self.http.post(url, json=payload, timeout=timeout) as resp:
                if resp.status == STALE_PREFILL_STATUS:
                    self._stale_prefill(req, f"{host}:{port}")
                    return
                if resp.status != 200:
                    self._set_kv_state(
                        req, "failed", f"bootstrap server returned HTTP {resp.status}", "bootstrap"
                    )
                    return
                self.prefill_pool.setdefault(f"{host}:{port}", resp.headers.get(SESSION_HEADER, ""))
                async for raw in resp.content:
                    event = json.loads(raw)
                    state = event["state"]
                    if state == "failed":
                        self._set_kv_state(
                            req,
                            "failed",
                            "Failed to get kvcache from prefill instance, it might be dead",
                        )
                        return
                    if state == "aborted":
                        self._set_kv_state(req, "aborted", event.get("error", ""))
                        return
                    self._set_kv_state(req, state)
                    if state == "success":
                        return
            self._lost_prefill(req, f"{host}:{port}")
        except aiohttp.ClientConnectorError:
            self._forget_prefill(f"{host}:{port}")
            self._set_kv_state(
                req,
                "failed",
                f"Could not fetch prefill parallel info from bootstrap_addr: {host}:{port}",
                "bootstrap",
            )
        except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError):
            self._lost_prefill(req, f"{host}:{port}")

    def _forget_prefill(self, addr: str) -> None:
        """A failed send drops the cached entry from 0.5.19 on; before, it stays."""
        if self.cfg.refreshes_stale_prefill:
            self.prefill_pool.pop(addr, None)

    def _stale_prefill(self, req: Req, addr: str) -> None:
        # The metadata went to the rank ports of the prefill process that was replaced: the send
        # fails (mooncake/conn.py:2594-2599 @ 0.5.19 records it and the room turns Failed).
        self.stale_prefill_failures += 1
        self._forget_prefill(addr)
        self._set_kv_state(req, "failed", f"send_metadata to prefill {addr} failed")

    def _lost_prefill(self, req: Req, addr: str) -> None:
        now = time.monotonic()
        if now - self._lost_logged_at > 1.0:
            self._lost_logged_at = now
            affected = sum(1 for r in self.transfer_q if r.kv_state not in ("success", "failed"))
            sglog.log(
                sglog.lost_connection_line(
                    self.cfg.version, self.cfg.transfer_backend, addr, affected
                )
            )
        self._forget_prefill(addr)
        self._set_kv_state(
            req, "failed", "Failed to get kvcache from prefill instance, it might be dead"
        )

    def _process_transfer_queue(self) -> None:
        now = time.monotonic()
        for req in list(self.transfer_q):
            state = req.kv_state
            if self._waiting_timed_out(req, now):
                self._time_out(req, now)
            elif state == "success":
                if not req.fake and self.faults.active("transfer_stall"):
                    # The KV arrived but the done signal is never seen: stuck in the transfer queue.
                    req.stuck = "transfer_stall"
                    continue
                if req.stuck is not None:
                    continue
                self.transfer_q.remove(req)
                req.generated = 0
                req.set_phase("waiting")
                self.waiting.append(req)
            elif state == "failed":
                self.transfer_q.remove(req)
                self._fail(req, kind=req.kv_fail_kind, error=req.kv_error)
            elif state == "aborted":
                self.transfer_q.remove(req)
                self.finish(req, finish_abort(f"Aborted on the prefill side: {req.kv_error}"))

    def _time_out(self, req: Req, now: float) -> None:
        self.transfer_q.remove(req)
        assert req.kv_registered_at is not None
        # sglang/srt/disaggregation/common/conn.py:2888-2912 @ 0.5.23: counted from send_metadata;
        # 0.5.23 sends ABORT to prefill, which fails too; mooncake 0.4.10/0.5.5 time out without
        # telling prefill.
        req.notify_prefill = self.cfg.failure_notifies_prefill or self.cfg.legacy_aborts
        self._forget_prefill(f"{req.bootstrap_host}:{req.bootstrap_port}")
        task_alive = req.kv_task is not None and not req.kv_task.done()
        self._fail(
            req,
            kind="transfer",
            error=f"Request {req.room} timed out after {now - req.kv_registered_at:.1f}s "
            "in KVPoll.WaitingForInput",
        )
        if self.cfg.failure_notifies_prefill and not self.cfg.legacy_aborts and not task_alive:
            self._spawn(self._notify_abort(req))

    def _waiting_timed_out(self, req: Req, now: float) -> bool:
        if req.kv_registered_at is None or req.stuck == "pinned_request":
            return False
        if self.cfg.legacy_aborts:
            # pdsim before: only a room still waiting for prefill timed out.
            return (
                req.kv_state == "waiting" and now - req.kv_state_since > self.cfg.waiting_timeout_s
            )
        if not self.cfg.decode_waiting_timeout:
            return False
        # Decode sees no Transferring state: a room is WaitingForInput until the done signal.
        waiting = req.kv_state in ("waiting", "transferring") or (
            req.kv_state == "success" and req.stuck is not None
        )
        return waiting and now - req.kv_registered_at > self.cfg.waiting_timeout_s

    async def _decode_step(self, active: list[Req]) -> None:
        launch = time.monotonic()
        batches = {rank: len(self.on_rank(active, rank)) for rank in self.ranks()}
        for rank, size in batches.items():
            # A rank without a request this step is idle: its next step is not contiguous.
            self._accumulate_decode_moment(rank or 0, launch if size else None, size)
            if size:
                self._rank_stepped_at[rank or 0] = launch
        slow = self.faults.get("slow_decode")
        rate = self.cfg.decode_tokens_per_s
        if slow is not None and slow.params.get("dp_rank") is None:
            rate = slow.param("tokens_per_s")  # every rank slow: the whole loop steps slowly
        await asyncio.sleep(1.0 / rate)
        self.forward_ct += 1
        self._on_batch_result(extend=False)
        for rank, size in batches.items():
            # Each rank counts its own step's tokens (metrics_reporter.py:901-915 @ 0.5.23).
            self.metrics.add_realtime_tokens("decode", size, dp_rank=rank)
        self._gen_tokens_since_report += len(active)
        for req in active:
            if req.finished:
                continue
            req.generated += 1
            self.emit_token(req)
            if req.generated >= req.max_new_tokens:
                self.running.remove(req)
                self.finish(req, finish_length(req.generated))
        if self.forward_ct % self.cfg.decode_log_interval == 0:
            self._log_decode_stats()

    def _accumulate_decode_moment(self, rank: int, launch: float | None, batch_size: int) -> None:
        """Contiguous decode steps of one rank's scheduler add their launch-to-launch time
        (scheduler.py:5120-5180, _accumulate_decode_moment :424-442 @ 0.5.23); each request gets
        one token per step. `launch` None: the rank has no step now (an idle gap)."""
        prev = self._prev_decode_launch.get(rank)
        self._prev_decode_launch[rank] = launch
        if prev is None or launch is None:
            return
        step_us = int((launch - prev) * 1e6)
        if batch_size <= 0 or step_us <= 0 or step_us >= DECODE_STEP_MAX_US:
            return
        b, t = float(batch_size), float(step_us)
        totals = self.decode_moment_totals[rank]
        totals[0] += 1.0
        totals[1] += b
        totals[2] += t
        totals[3] += b * b
        totals[4] += b * t
        totals[5] += b

    def _log_decode_stats(self) -> None:
        now = time.monotonic()
        gap = max(now - self._last_decode_report_monotonic, 1e-6)
        self._last_decode_report_monotonic = now
        self.last_gen_throughput = self._gen_tokens_since_report / gap
        self._gen_tokens_since_report = 0
        used = self.used_tokens()
        prealloc_tokens = sum(r.prompt_tokens for r in self.transfer_q)
        sglog.log(
            sglog.decode_batch_line(
                self.cfg.version,
                running_req=len(self.running),
                num_token=used,
                token_usage=used / self.cfg.max_total_tokens,
                preallocated_usage=prealloc_tokens / self.cfg.max_total_tokens,
                prealloc_req=len(self.prealloc),
                transfer_req=len(self.transfer_q),
                gen_throughput=self.last_gen_throughput,
                queue_req=len(self.waiting),
            )
        )
        self.report_stats(gen_throughput=self.last_gen_throughput)

    def _fail(self, req: Req, *, kind: str, error: str) -> None:
        room = req.room if req.room is not None else 0
        for rank in range(self.cfg.tp_size):
            if kind == "transfer":
                sglog.log(
                    sglog.transfer_failed_line("decode", rank, req.rid, room, error), rank=rank
                )
            else:
                sglog.log(
                    sglog.bootstrap_failed_line("decode", rank, req.rid, room, error), rank=rank
                )
        if kind == "transfer":
            self.metrics.inc_transfer_failed(req.dp_rank)
        else:
            self.metrics.inc_bootstrap_failed(req.dp_rank)
        self.counters[f"{kind}_failed"] += 1
        self.finish(req, finish_abort(failure_message("decode", kind, req.rid, room, error), 500))

    def sim_state(self) -> dict[str, Any]:
        state = super().sim_state()
        state["prefill_pool"] = dict(self.prefill_pool)
        state["stale_prefill_failures"] = self.stale_prefill_failures
        return state

    def release_stuck(self) -> int:
        released = 0
        for req in self.transfer_q:
            if req.stuck is not None:
                req.stuck = None
                released += 1
        self.wake()
        return released
