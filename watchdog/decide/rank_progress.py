"""Each DP rank's own decode tokens, read against what our pinned probes received on it.

A decode with DP attention runs one scheduler per rank, and SGLang reports each rank's decode
tokens and work on its own: `realtime_tokens_total{mode="decode",dp_rank=...}` and the rank's
/v1/loads row (docs/decisions.md, "DP-attention ranks"). Each rank gets a progress mark read as a
decode worker's is (fold.ours()): its tokens are progress when, since the mark, they grew beyond
the tokens our probes pinned to that rank received, plus one slack. Only those tokens are ours
on a rank: a router probe's or an unpinned direct probe's rank is unknown, so their tokens are
never charged to any rank (charging them could read a busy rank as flat).

Only the per-iteration counter can show a rank flat: its decode_moments skip every decode step
of 2 s or more (STEP_MAX_US, managers/scheduler.py:404 and :5163-5168 @ 0.5.23), so a rank
making a token every few seconds adds nothing there. Their growth is progress all the same.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from watchdog.decide.counters import step
from watchdog.decide.state import Progress, RankBaseline, RankMark
from watchdog.model import (
    LoadsSnapshot,
    MetricsSnapshot,
    Observation,
    RankLoad,
    RankTokens,
    Role,
    add_rank_tokens,
)

Rank = tuple[int, int]  # a decode worker and one of its DP ranks


@dataclass(frozen=True, slots=True)
class RankFold:
    """Per-rank memory after one observation."""

    baselines: tuple[RankBaseline, ...]
    marks: tuple[RankMark, ...]
    own: tuple[RankTokens, ...]  # our pinned tokens per rank, through this observation's end


@dataclass(frozen=True, slots=True)
class _Reading:
    """One rank as this cycle read it: tokens per source, when, and the work it holds."""

    realtime: float | None
    moments: float | None
    at: float | None  # when its tokens were read, either source (None: not read this cycle)
    flat_at: float | None  # when its per-iteration counter was read (None: not this cycle)
    work: float | None  # live /v1/loads first, else the scheduler's gauges


def _readings(snap: MetricsSnapshot | None, loads: LoadsSnapshot | None) -> dict[int, _Reading]:
    scraped: dict[int, RankLoad] = {r.dp_rank: r for r in snap.ranks} if snap is not None else {}
    live: dict[int, RankLoad] = {r.dp_rank: r for r in loads.ranks} if loads is not None else {}
    out = {}
    for rank in sorted({*scraped, *live}):
        gauge, row = scraped.get(rank), live.get(rank)
        realtime = gauge.decode_tokens if gauge is not None else None
        moments = row.decode_tokens if row is not None else None
        times = [
            *([snap.scraped_at] if snap is not None and realtime is not None else []),
            *([loads.fetched_at] if loads is not None and moments is not None else []),
        ]
        work = row.work if row is not None else None
        if work is None and gauge is not None:
            work = gauge.work
        flat_at = snap.scraped_at if snap is not None and realtime is not None else None
        out[rank] = _Reading(realtime, moments, max(times) if times else None, flat_at, work)
    return out


def _own(items: Sequence[RankTokens]) -> dict[Rank, int]:
    return {(t.decode, t.dp_rank): t.received for t in items}


def fold_rank_progress(
    before: Progress,
    obs: Observation,
    read: Sequence[MetricsSnapshot],
    start_us: Mapping[int, int],
    *,
    slack: float,
) -> RankFold:
    """Fold this cycle's per-rank readings of every decode into baselines and marks.

    `read`: the scrapes read this cycle; `start_us`: each decode's unit start as read (0 or
    absent: not readable). A counter steps as every counter does (decide/counters.py): missing
    is unknown, a lower reading counts nothing and keeps the higher baseline, a new process's
    growth counts from zero (and so reads as progress: never a reason to act). A rank read
    holding no work is idle by right: its flat clock starts again.
    """
    own_now = add_rank_tokens(before.own_ranks, obs.own_rank_tokens)
    own = _own(own_now)
    own_at_start = _own(add_rank_tokens(own_now, obs.own_rank_tokens_during, sign=-1))
    baselines = {(b.decode, b.dp_rank): b for b in before.rank_baselines}
    marks = {(m.decode, m.dp_rank): m for m in before.rank_marks}
    scrapes = {s.worker: s for s in read if s.role is Role.DECODE and s.ok}
    live = {x.worker: x for x in obs.loads if x.role is Role.DECODE and x.ok}
    for decode in sorted({*scrapes, *live}):
        for rank, now in _readings(scrapes.get(decode), live.get(decode)).items():
            key = (decode, rank)
            old = baselines.get(key)
            start = start_us.get(decode, 0) or (old.start_us if old is not None else 0)
            new_process = bool(old is not None and old.start_us and start != old.start_us)
            # Progress only argues against acting: a rank's series first seen counts from zero.
            realtime = step(
                old.realtime if old else None, now.realtime, new_process=new_process, from_zero=True
            )
            moments = step(
                old.moments if old else None, now.moments, new_process=new_process, from_zero=True
            )
            baselines[key] = RankBaseline(decode, rank, start, realtime.known, moments.known)
            mark = marks.get(key)
            if now.work is not None and now.work <= 0:
                # Idle: flat by right, its clock starts again from this read.
                at = now.at if now.at is not None else mark.read_at if mark is not None else None
                if at is not None:
                    marks[key] = RankMark(
                        decode, rank, at, at, own=own_at_start.get(key, 0), work=now.work
                    )
                continue
            if mark is None:
                if now.flat_at is not None:
                    at = now.flat_at
                    own_then = own_at_start.get(key, 0)
                    marks[key] = RankMark(decode, rank, at, at, own=own_then, work=now.work)
                continue
            mark = replace(
                mark,
                realtime=mark.realtime + realtime.increase,
                moments=mark.moments + moments.increase,
                work=now.work if now.work is not None else mark.work,
            )
            ours = own.get(key, 0) - mark.own + slack
            if now.at is not None and (mark.realtime > ours or mark.moments > ours):
                mark = RankMark(
                    decode, rank, now.at, now.at, own=own_at_start.get(key, 0), work=mark.work
                )
            elif now.flat_at is not None:
                mark = replace(mark, read_at=max(mark.read_at, now.flat_at))
            marks[key] = mark
    return RankFold(
        baselines=tuple(baselines[k] for k in sorted(baselines)),
        marks=tuple(marks[k] for k in sorted(marks)),
        own=own_now,
    )
