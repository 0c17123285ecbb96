"""DP-attention ranks: the run of each rank's pinned probes, and which rank alone is wedged."""

from __future__ import annotations

from collections.abc import Iterable

from watchdog.decide.state import RankMark, RankRun
from watchdog.model import ProbeFailure, ProbeKind, ProbeResult


def fold_ranks(previous: Iterable[RankRun], probes: Iterable[ProbeResult]) -> tuple[RankRun, ...]:
    """Each rank's run after this cycle's pinned direct probes, oldest start first.

    A probe that raised inside the watchdog says nothing about the rank, and one that started
    before the rank's latest known result (a slow one finishing late) does not reorder the run.
    """
    runs = {(r.decode, r.dp_rank): r for r in previous}
    pinned = [
        p
        for p in probes
        if p.kind is ProbeKind.DIRECT
        and p.dp_rank is not None
        and p.reason is not ProbeFailure.INTERNAL_ERROR
    ]
    for probe in sorted(pinned, key=lambda p: p.started_at):
        assert probe.dp_rank is not None  # filtered above; narrows the type
        key = (probe.worker, probe.dp_rank)
        known = runs.get(key)
        if known is not None and probe.started_at < known.started_at:
            continue
        failures = 0 if probe.ok else (known.failures if known is not None else 0) + 1
        runs[key] = RankRun(
            probe.worker,
            probe.dp_rank,
            failures,
            probe.started_at,
            "" if probe.ok else probe.detail,
        )
    return tuple(runs[key] for key in sorted(runs))


def wedged_ranks(ranks: Iterable[RankRun], probe_failures: int) -> tuple[RankRun, ...]:
    """Ranks whose pinned probes failed `probe_failures` times in a row while another rank of
    the same decode passed its latest: one scheduler of the server wedged, the others serving
    (docs/decisions.md, "DP-attention ranks"). Every rank failing is the whole decode's trouble,
    judged by the other rules."""
    ranks = tuple(ranks)
    passing = {r.decode for r in ranks if r.failures == 0}
    return tuple(r for r in ranks if r.failures >= probe_failures and r.decode in passing)


def rank_mark(marks: Iterable[RankMark], run: RankRun) -> RankMark | None:
    """The progress mark of a rank (None: its tokens are not read: no dp_rank series or rows)."""
    return next((m for m in marks if (m.decode, m.dp_rank) == (run.decode, run.dp_rank)), None)


def flat_ranks(
    wedged: Iterable[RankRun], marks: Iterable[RankMark], no_progress_seconds: float
) -> tuple[RankRun, ...]:
    """Wedged ranks whose own decode tokens, as last read, have not grown beyond what our pinned
    probes received on them (and one slack) for `no_progress_seconds`, while holding running or
    waiting work: the rank's scheduler is wedged, not busy (docs/decisions.md, "DP-attention
    ranks"). A rank whose tokens are not read is never among them."""
    marks = tuple(marks)
    out = []
    for run in wedged:
        mark = rank_mark(marks, run)
        if (
            mark is not None
            and mark.read_at - mark.at >= no_progress_seconds
            and mark.work is not None
            and mark.work > 0
        ):
            out.append(run)
    return tuple(out)
