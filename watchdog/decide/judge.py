"""Whether a prefill restarted alone needs the survivor rung, judged from observed facts.

With `stall.on_prefill_only_restart = "judge"`: from SGLang 0.5.19 a decode drops its cached
bootstrap metadata of a prefill when a room through it fails, and refetches it, so the pair
recovers by itself after one failed room (docs/sglang.md §7.11); before, every room through the
pair fails until the decode restarts. So once the grace is over, every affected pair passing a
direct PD probe started after the fresh prefill served, with each of their decodes at 0.5.19 or
later, is an alert instead of a restart (docs/decisions.md, "Restart rungs").
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from watchdog.config import GroupSection
from watchdog.decide.reasons import reason
from watchdog.decide.state import GroupState, PairResult
from watchdog.model import Reason
from watchdog.pairs import Pair, decodes_paired_with, pair_name

# The first release whose decode refreshes a restarted prefill's stale bootstrap metadata.
FIRST_SELF_REFRESHING = (0, 5, 19)
_RELEASE = re.compile(r"(\d+)\.(\d+)\.(\d+)(\.post\d+)?")


def refreshes_stale_prefill(version: str) -> bool:
    """A release (or its .postN) at or after 0.5.19; a dev or rc build, or garbage, is not known
    to carry the fix."""
    match = _RELEASE.fullmatch(version.strip())
    if match is None:
        return False
    return tuple(int(part) for part in match.groups()[:3]) >= FIRST_SELF_REFRESHING


def affected_pairs(config: GroupSection, fresh: tuple[int, ...]) -> tuple[Pair, ...]:
    """The pairs of each fresh prefill with the decodes that pair with it."""
    return tuple(Pair(p, d) for p in fresh for d in decodes_paired_with(config, (p,)))


@dataclass(frozen=True, slots=True)
class Judgement:
    """Whether the affected pairs recovered by themselves, and the reason that says so or not."""

    recovered: bool
    why: Reason


def judge_prefill_only(
    mem: GroupState,
    config: GroupSection,
    versions: Mapping[int, str],
    ready_at: float,
) -> Judgement:
    """Recovered: every affected pair passed a direct probe started after `ready_at` (when the
    fresh prefill served) and each of their decodes runs a self-refreshing SGLang."""
    pairs = affected_pairs(config, tuple(f.worker for f in mem.units.prefill_only))
    names = ", ".join(pair_name(config, p) for p in pairs)
    latest = {(r.prefill, r.decode): r for r in mem.direct}
    unproven = [
        pair_name(config, p)
        for p in pairs
        if not _passed_after(latest.get((p.prefill, p.decode)), ready_at)
    ]
    decodes = sorted({p.decode for p in pairs})
    found = [versions.get(d, "") for d in decodes]
    version = ", ".join(sorted({v or "unknown" for v in found}))
    if unproven or not pairs:
        return _not_recovered(
            f"no passing direct PD probe since the prefill served for {', '.join(unproven)}",
            names,
            version,
        )
    if not all(refreshes_stale_prefill(v) for v in found):
        return _not_recovered(
            f"the decodes run SGLang {version}, not known to refresh a restarted prefill's stale "
            "bootstrap metadata by itself (from 0.5.19)",
            names,
            version,
        )
    why = reason(
        "prefill_only_recovered",
        f"the direct PD probes of {names} pass after the grace and their decodes run SGLang "
        f"{version}, which refreshes a restarted prefill's stale bootstrap metadata by itself "
        '(from 0.5.19): no restart (stall.on_prefill_only_restart = "judge")',
        pairs=names,
        version=version,
    )
    return Judgement(recovered=True, why=why)


def _not_recovered(what: str, names: str, version: str) -> Judgement:
    why = reason(
        "prefill_only_judged",
        f"judged, not recovered by itself: {what}; taking the survivor rung",
        pairs=names,
        version=version,
    )
    return Judgement(recovered=False, why=why)


def _passed_after(result: PairResult | None, since: float) -> bool:
    return result is not None and result.ok and result.started_at >= since
