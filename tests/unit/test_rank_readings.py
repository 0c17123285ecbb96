"""Per-DP-rank readings: each rank's decode tokens and work from /metrics and /v1/loads, and the
tokens our pinned probes received on each rank (docs/decisions.md, "DP-attention ranks")."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from tests.unit.test_dp_probes import TWO_DECODES, _config
from tests.unit.test_probe_scheduler import FakeTime, Probes, run_until_parked, stop_scheduler
from watchdog.config import GroupSection
from watchdog.model import (
    OwnTokens,
    ProbeFailure,
    ProbeKind,
    ProbeResult,
    RankLoad,
    RankTokens,
    Role,
    add_rank_tokens,
)
from watchdog.observe.probes.scheduler import ProbeScheduler
from watchdog.observe.probes.tally import stream_count
from watchdog.observe.scrape import parse_loads
from watchdog.observe.sglang_metrics import extract_snapshot
from watchdog.pairs import Pair

# 0.5.23 with --tp 4 --dp 2 --enable-dp-attention: two TP ranks per DP rank, both labelled.
DP_PAGE = "\n".join(
    [
        *(
            f'sglang:realtime_tokens_total{{dp_rank="{dp}",mode="{mode}",tp_rank="{dp * 2 + tp}"}}'
            f" {value}"
            for dp, mode, value in (
                (0, "decode", 500),
                (1, "decode", 70),
                (0, "prefill_compute", 9),
            )
            for tp in range(2)
        ),
        *(
            f'sglang:num_running_reqs{{dp_rank="{dp}",tp_rank="{dp * 2 + tp}"}} {dp + 3}'
            for dp in range(2)
            for tp in range(2)
        ),
        'sglang:num_queue_reqs{dp_rank="1",tp_rank="2"} 2',
        'sglang:num_decode_transfer_queue_reqs{dp_rank="1",tp_rank="2"} 1',
    ]
)


def test_each_rank_reads_its_own_decode_tokens_and_work() -> None:
    """Max over the TP ranks of one DP rank; only mode="decode" tokens; the group sums stay."""
    snap = extract_snapshot(DP_PAGE + "\n", Role.DECODE, 0.0)
    assert snap.ranks == (
        RankLoad(0, decode_tokens=500.0, running_reqs=3.0, waiting_reqs=None),
        RankLoad(1, decode_tokens=70.0, running_reqs=4.0, waiting_reqs=3.0),
    )
    assert snap.ranks[1].work == 7.0
    assert snap.realtime_tokens_total == 579.0  # the group sum over every mode, as before
    assert snap.running_reqs == 7.0


def test_without_dp_rank_labels_there_are_no_ranks() -> None:
    """A page without dp_rank labels yields no ranks, as a decode without DP attention exports."""
    page = 'sglang:realtime_tokens_total{mode="decode",tp_rank="0"} 5\n'
    assert extract_snapshot(page, Role.DECODE, 0.0).ranks == ()


def _row(rank: int, moments: Any = ..., **extra: Any) -> dict[str, Any]:
    row: dict[str, Any] = {"dp_rank": rank, "num_running_reqs": 2, "num_waiting_reqs": 1, **extra}
    if moments is not ...:
        row["decode_moments"] = moments
    return row


def test_loads_rows_are_read_per_rank() -> None:
    """decode_moments[5] per row; null (no decode step yet) is 0; no such field (before 0.5.19)
    is unknown; a rank named twice says nothing."""
    payload = {
        "loads": [
            _row(0, [3, 6, 100, 12, 200, 40]),
            _row(1, None),
            _row(2),
            _row(3, [1, 1, 1, 1, 1, 1]),
            _row(3, [1, 1, 1, 1, 1, 1]),
        ]
    }
    loads = parse_loads(payload, Role.DECODE, 1.0)
    assert loads.ranks == (
        RankLoad(0, 40.0, 2.0, 1.0),
        RankLoad(1, 0.0, 2.0, 1.0),
        RankLoad(2, None, 2.0, 1.0),
    )
    assert loads.decode_tokens_total == 42.0  # the group sum is unchanged (null rows skipped)


def test_rank_tokens_add_and_subtract_per_rank() -> None:
    """Rank tokens add and subtract rank by rank, keeping ranks only one side has."""
    a = (RankTokens(0, 1, 5), RankTokens(1, 0, 2))
    b = (RankTokens(0, 1, 3),)
    assert add_rank_tokens(a, b) == (RankTokens(0, 1, 8), RankTokens(1, 0, 2))
    assert add_rank_tokens(a, b, sign=-1) == (RankTokens(0, 1, 2), RankTokens(1, 0, 2))


class StreamingPinned:
    """A pinned probe function that streams `tokens` on its rank, then waits for `done`."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.done = asyncio.Event()
        self.streamed = 0

    async def __call__(
        self,
        client: httpx.AsyncClient,
        group: GroupSection,
        pair: Pair,
        *,
        api_key: str | None,
        clock: object,
        dp_rank: int | None = None,
    ) -> ProbeResult:
        count = stream_count()
        count.update(self.tokens + (dp_rank or 0))  # rank r receives tokens + r
        self.streamed += 1
        await self.done.wait()
        assert callable(clock)
        return ProbeResult(
            kind=ProbeKind.DIRECT,
            target="decode",
            ok=True,
            reason=ProbeFailure.OK,
            started_at=float(clock()),
            duration_seconds=0.0,
            worker=pair.decode,
            dp_rank=dp_rank,
            tokens=self.tokens + (dp_rank or 0),
        )


async def test_the_scheduler_counts_pinned_tokens_per_rank_in_flight_then_finished_once() -> None:
    """The scheduler counts a pinned probe's tokens for its rank in flight, then finished once."""
    time = FakeTime(limit=1000.0 + 61)  # one pinned round (after 60 s), then parked
    probes = Probes(block=False)
    pinned = StreamingPinned(4)
    async with httpx.AsyncClient(trust_env=False) as client:
        scheduler = ProbeScheduler(
            _config(TWO_DECODES, dp_probe_every_seconds=60),
            client,
            api_key=None,
            clock=time.clock,
            sleep=time.sleep,
            completion_probe=probes.completion,
            multiround_probe=probes.multiround,
            pinned_probe=pinned,
        )
        task = await run_until_parked(scheduler, time)
        try:
            for _ in range(20):
                if pinned.streamed == 3:
                    break
                await asyncio.sleep(0)
            in_flight = scheduler.own_rank_tokens()
            assert in_flight == tuple(RankTokens(1, r, 4 + r) for r in range(3))
            before = scheduler.own_tokens()
            pinned.done.set()
            for _ in range(10):
                await asyncio.sleep(0)
            assert scheduler.pinned_in_flight == 0
            assert scheduler.own_rank_tokens() == in_flight  # finished: the same, not twice
            assert scheduler.own_tokens().received == before.received  # a share of own_tokens
            assert scheduler.own_tokens() - before == OwnTokens(finished=15)
        finally:
            await stop_scheduler(task)
