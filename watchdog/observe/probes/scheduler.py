"""Starts a group's probes on a fixed period, whether or not earlier ones have finished.

Waiting for each probe's deadline in turn would make a stall take probe_failures × timeout_seconds
to confirm. Starting one every period_seconds (up to max_in_flight pending) means the probes that
follow the first stuck one are already running, so the verdict comes probe_failures periods after
the first stuck probe's deadline. Probes run as tasks of this scheduler's own TaskGroup; results
are collected with drain_finished() by the observer, once per cycle. The tokens they received,
finished or still in flight, are counted as they arrive (own_tokens(), probes/tally.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

import httpx
import structlog

from watchdog.clock import Clock
from watchdog.config import GroupSection
from watchdog.model import (
    OwnTokens,
    ProbeFailure,
    ProbeKind,
    ProbeResult,
    RankTokens,
    add_rank_tokens,
)
from watchdog.observe.pool import PINNED_LANE, PINNED_PROBES_AT_ONCE, POOL_LANE
from watchdog.observe.probes import internal_error_result
from watchdog.observe.probes.completion import run_completion_probe
from watchdog.observe.probes.direct import PinnedPair, pinned_pairs, run_direct_probe
from watchdog.observe.probes.multiround import run_multiround_probe
from watchdog.observe.probes.tally import CURRENT_TALLY, ProbeTally
from watchdog.pairs import Pair, pairs

log = structlog.get_logger()

Sleep = Callable[[float], Awaitable[None]]


class ProbeFunction(Protocol):
    """The probe contract: run against the group, return a result, never raise for the target."""

    def __call__(
        self,
        client: httpx.AsyncClient,
        group: GroupSection,
        *,
        api_key: str | None,
        clock: Clock,
    ) -> Awaitable[ProbeResult]: ...


class DirectProbeFunction(Protocol):
    """A direct PD probe of one prefill/decode pair (same contract as ProbeFunction)."""

    def __call__(
        self,
        client: httpx.AsyncClient,
        group: GroupSection,
        pair: Pair,
        *,
        api_key: str | None,
        clock: Clock,
    ) -> Awaitable[ProbeResult]: ...


class PinnedProbeFunction(Protocol):
    """A direct PD probe of one pair, pinned to one DP rank of its decode."""

    def __call__(
        self,
        client: httpx.AsyncClient,
        group: GroupSection,
        pair: Pair,
        *,
        api_key: str | None,
        clock: Clock,
        dp_rank: int | None,
    ) -> Awaitable[ProbeResult]: ...


_ROUTER_KINDS = frozenset({ProbeKind.COMPLETION, ProbeKind.MULTIROUND})


def next_due(due: float, period_seconds: float, now: float) -> float:
    """The start after `due`; after a long pause (suspend, overload) resume from now, no burst."""
    due += period_seconds
    return due if due > now else now + period_seconds


class ProbeScheduler:
    """One group's probe starts: a completion probe every period, a multi-round one every N s.

    Direct PD probes (one per prefill/decode pair) start as a round, never two rounds at once:
    every `direct_every_seconds`, and, with `direct_on_failure`, once a period while the latest
    router probe failed, so the detector can tell a wedged router from a wedged pair.
    Pinned direct probes (one per DP rank of each decode with dp_size > 1) start as a round of
    their own on the same terms, every `dp_probe_every_seconds` (docs/decisions.md,
    "DP-attention ranks").
    """

    def __init__(
        self,
        group: GroupSection,
        client: httpx.AsyncClient,
        *,
        api_key: str | None,
        clock: Clock = time.time,
        sleep: Sleep = asyncio.sleep,
        completion_probe: ProbeFunction = run_completion_probe,
        multiround_probe: ProbeFunction = run_multiround_probe,
        direct_probe: DirectProbeFunction = run_direct_probe,
        pinned_probe: PinnedProbeFunction = run_direct_probe,
    ) -> None:
        self._group = group
        self._client = client
        self._api_key = api_key
        self._clock = clock
        self._sleep = sleep
        self._completion_probe = completion_probe
        self._multiround_probe = multiround_probe
        self._direct_probe = direct_probe
        self._pinned_probe = pinned_probe
        self._router_failing = False  # the latest router probe to finish failed
        self._ids = itertools.count()
        self._pending: dict[int, tuple[ProbeKind, float]] = {}
        # The pinned direct probes among _pending, with the (decode, dp_rank) each is pinned to.
        self._pinned_pending: dict[int, tuple[int, int]] = {}
        # Pinned probes run at most this many at once, in their own pool lane (observe/pool.py), so
        # a round for a decode with many DP ranks never takes its worker's health check's slots.
        self._pinned_slots = asyncio.Semaphore(PINNED_PROBES_AT_ONCE)
        self._finished: list[ProbeResult] = []
        self._tallies: dict[int, ProbeTally] = {}  # the pending probes' tokens so far
        self._closed = OwnTokens()  # the tokens of the probes that finished
        self._closed_ranks: tuple[RankTokens, ...] = ()  # the same, of the pinned ones per rank
        self.started = 0  # probes started since construction
        self.skipped_starts = 0  # completion starts skipped because max_in_flight were pending
        self.skipped_multiround = 0  # multi-round starts skipped because one was still running
        self.internal_errors = 0  # probes that raised (a bug: probes return failures)

    @property
    def in_flight(self) -> int:
        """Probes started and not finished (completion and multi-round)."""
        return len(self._pending)

    def in_flight_of(self, kind: ProbeKind) -> int:
        """Pending probes of one kind."""
        return sum(1 for k, _ in self._pending.values() if k == kind)

    @property
    def pinned_in_flight(self) -> int:
        """Pending direct probes pinned to a DP rank (counted in in_flight_of(DIRECT) too)."""
        return len(self._pinned_pending)

    def oldest_in_flight_seconds(self, now: float) -> float:
        """How long the oldest pending probe has run (`now` from the scheduler clock); 0 if none."""
        if not self._pending:
            return 0.0
        return max(0.0, now - min(started for _, started in self._pending.values()))

    def own_tokens(self) -> OwnTokens:
        """Every token our probes received since this scheduler started, each counted once:
        finished probes' and in-flight probes' so far (monotonic; the observer takes deltas)."""
        tallies = self._tallies.values()
        return OwnTokens(
            received=self._closed.received + sum(t.received for t in tallies),
            first=self._closed.first + sum(t.first for t in tallies),
            finished=self._closed.finished,
        )

    def own_rank_tokens(self) -> tuple[RankTokens, ...]:
        """The share of own_tokens() our pinned probes received, per (decode, dp_rank) they are
        pinned to: finished and in flight, each token once (monotonic). The only tokens provably
        ours on one rank (docs/decisions.md, "DP-attention ranks")."""
        in_flight = tuple(
            RankTokens(decode, rank, self._tallies[probe_id].received)
            for probe_id, (decode, rank) in self._pinned_pending.items()
            if probe_id in self._tallies
        )
        return add_rank_tokens(self._closed_ranks, in_flight)

    def finished_so_far(self) -> tuple[ProbeResult, ...]:
        """The results the next drain_finished() would return so far, without draining them."""
        return tuple(self._finished)

    def drain_finished(self) -> tuple[ProbeResult, ...]:
        """Results finished since the last drain, oldest start first."""
        finished, self._finished = self._finished, []
        return tuple(sorted(finished, key=lambda r: r.started_at))

    async def run(self) -> None:  # noqa: PLR0912  # four start schedules in one loop, side by side
        """Start probes until cancelled; cancelling also cancels (and awaits) the pending ones."""
        probe = self._group.probe
        now = self._clock()
        next_completion = now
        every = probe.multiround_every_seconds
        # The first multi-round probe waits one period, so it does not start with the first
        # completion probe; then one every multiround_every_seconds.
        next_multiround = now + min(every, probe.period_seconds) if every > 0 else math.inf
        direct_every = probe.direct_every_seconds
        next_direct = now + direct_every if direct_every > 0 else math.inf
        last_direct = -math.inf
        pinned = pinned_pairs(self._group)
        dp_every = probe.dp_probe_every_seconds
        next_pinned = now + dp_every if dp_every > 0 and pinned else math.inf
        last_pinned = -math.inf
        async with asyncio.TaskGroup() as tasks:
            while True:
                now = self._clock()
                if now >= next_completion:
                    if self.in_flight_of(ProbeKind.COMPLETION) < probe.max_in_flight:
                        self._start(tasks, ProbeKind.COMPLETION, self._completion_probe, now)
                    else:
                        self.skipped_starts += 1
                    next_completion = next_due(next_completion, probe.period_seconds, now)
                if now >= next_multiround:
                    if self.in_flight_of(ProbeKind.MULTIROUND) == 0:
                        self._start(tasks, ProbeKind.MULTIROUND, self._multiround_probe, now)
                    else:
                        self.skipped_multiround += 1
                    next_multiround = next_due(next_multiround, every, now)
                on_failure = (
                    probe.direct_on_failure
                    and self._router_failing
                    and now - last_direct >= probe.period_seconds
                )
                if now >= next_direct or on_failure:
                    if self.in_flight_of(ProbeKind.DIRECT) == self.pinned_in_flight:
                        for pair in pairs(self._group):
                            self._start(tasks, ProbeKind.DIRECT, self._direct(pair), now)
                        last_direct = now
                    if now >= next_direct:
                        next_direct = next_due(next_direct, direct_every, now)
                pinned_on_failure = (
                    pinned
                    and probe.direct_on_failure
                    and self._router_failing
                    and now - last_pinned >= probe.period_seconds
                )
                if now >= next_pinned or pinned_on_failure:
                    if not self._pinned_pending:
                        for one in pinned:
                            self._start(tasks, ProbeKind.DIRECT, self._direct(one), now, pin=one)
                        last_pinned = now
                    if now >= next_pinned:
                        next_pinned = next_due(next_pinned, dp_every, now)
                wake = min(next_completion, next_multiround, next_direct, next_pinned)
                await self._sleep(max(0.0, wake - self._clock()))

    def _direct(self, target: Pair | PinnedPair) -> ProbeFunction:
        """The direct probe of `target` (a pair, or a pair pinned to a DP rank) as a plain
        ProbeFunction."""
        direct, pinned = self._direct_probe, self._pinned_probe

        def probe(
            client: httpx.AsyncClient, group: GroupSection, *, api_key: str | None, clock: Clock
        ) -> Awaitable[ProbeResult]:
            if isinstance(target, PinnedPair):
                return pinned(
                    client, group, target.pair, api_key=api_key, clock=clock, dp_rank=target.dp_rank
                )
            return direct(client, group, target, api_key=api_key, clock=clock)

        return probe

    def _start(
        self,
        tasks: asyncio.TaskGroup,
        kind: ProbeKind,
        probe: ProbeFunction,
        now: float,
        *,
        pin: PinnedPair | None = None,
    ) -> None:
        # Registered before the task first runs, so in_flight is right from this moment on.
        probe_id = next(self._ids)
        self._pending[probe_id] = (kind, now)
        if pin is not None:
            self._pinned_pending[probe_id] = (pin.pair.decode, pin.dp_rank)
        self.started += 1
        tasks.create_task(self._run_one(probe_id, kind, probe), name=f"probe:{kind}:{probe_id}")

    async def _run_one(self, probe_id: int, kind: ProbeKind, probe: ProbeFunction) -> None:
        started_mono = time.monotonic()
        tally = self._tallies[probe_id] = ProbeTally()
        CURRENT_TALLY.set(tally)  # this task's context only: its exchanges report to it
        result: ProbeResult | None = None
        try:
            async with self._lane(probe_id, kind):
                result = await probe(
                    self._client, self._group, api_key=self._api_key, clock=self._clock
                )
        except Exception as exc:
            # A probe that raises is a bug; it must not take the other probes down with it, and
            # it is a failed probe all the same (a group whose probes all raise is not "no data").
            self.internal_errors += 1
            log.error(
                "probe_internal_error",
                group=self._group.name,
                kind=str(kind),
                error=repr(exc),
                traceback=traceback.format_exc(),
            )
            result = internal_error_result(
                kind,
                "decode" if kind is ProbeKind.DIRECT else "router",
                exc,
                started_at=self._pending[probe_id][1],
                duration_seconds=time.monotonic() - started_mono,
            )
        finally:
            del self._pending[probe_id]
            pinned_to = self._pinned_pending.pop(probe_id, None)
            self._close_tally(probe_id, result, pinned_to)  # also when cancelled: kept
        assert result is not None  # the probe's, or the internal error's
        if kind in _ROUTER_KINDS and result.reason is not ProbeFailure.INTERNAL_ERROR:
            self._router_failing = not result.ok
        self._finished.append(result)

    @contextlib.asynccontextmanager
    async def _lane(self, probe_id: int, kind: ProbeKind) -> AsyncIterator[None]:
        """A pinned probe waits for one of its slots and runs in the pinned pool lane; any other
        probe runs at once in the shared pools."""
        if probe_id not in self._pinned_pending:
            yield
            return
        POOL_LANE.set(PINNED_LANE)  # this task's context, and the tasks it creates, only
        async with self._pinned_slots:
            self._pending[probe_id] = (kind, self._clock())  # in flight from its slot on
            yield

    def _close_tally(
        self, probe_id: int, result: ProbeResult | None, pinned_to: tuple[int, int] | None
    ) -> None:
        """Move a finished probe's tokens from in flight to finished, none lost or added twice.

        The result's own count can only add (a probe that reports tokens without streaming
        them through stream_exchange, as the tests' stand-ins do): never below what streamed.
        """
        tally = self._tallies.pop(probe_id)
        tokens = max(tally.received, result.tokens if result is not None else 0)
        first = max(tally.first, int(tokens > 0))
        self._closed += OwnTokens(received=tokens, first=first, finished=tokens)
        if pinned_to is not None:
            decode, rank = pinned_to
            self._closed_ranks = add_rank_tokens(
                self._closed_ranks, (RankTokens(decode, rank, tokens),)
            )
