"""DP-attention ranks: the run of each rank's pinned probes, and which rank alone is wedged."""

from __future__ import annotations

from collections.abc import Iterable

from watchdog.decide.state import RankRun
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
