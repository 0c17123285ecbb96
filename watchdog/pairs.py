"""Which prefill/decode pairs a group has: the router may pair any prefill with any decode.

The one definition of a pair, read by the direct PD probes (observe/probes/direct.py), the
survivor rung's plan (act/plan.py) and the detector's naming (decide/): a decode pairs with
every prefill of its group, so in an xPyD group every decode holds KV-transfer bootstrap state
about every prefill (docs/decisions.md, "Restart rungs").
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from watchdog.config import GroupSection
from watchdog.model import Role, worker_name


@dataclass(frozen=True, slots=True)
class Pair:
    """One prefill and one decode of a group, by their index in the config."""

    prefill: int
    decode: int


def pairs(group: GroupSection) -> tuple[Pair, ...]:
    """Every prefill/decode pair of a group, prefill-major (the router may pick any of them)."""
    return tuple(
        Pair(p, d)
        for p in range(len(group.workers(Role.PREFILL)))
        for d in range(len(group.workers(Role.DECODE)))
    )


def pair_name(group: GroupSection, pair: Pair) -> str:
    """`prefill+decode`, or `prefill#2+decode#1` among several workers (1-based)."""
    p = worker_name(Role.PREFILL, pair.prefill, len(group.prefills))
    d = worker_name(Role.DECODE, pair.decode, len(group.decodes))
    return f"{p}+{d}"


def decodes_paired_with(group: GroupSection, prefills: Iterable[int]) -> tuple[int, ...]:
    """The decodes that pair with any of `prefills`, in config order."""
    wanted = set(prefills)
    return tuple(sorted({pair.decode for pair in pairs(group) if pair.prefill in wanted}))


def prefills_kept_running(group: GroupSection, fresh: Iterable[int]) -> tuple[int, ...]:
    """The prefills, not in `fresh` (restarted alone), that pair with a decode pairing with one.

    The survivor rung restarts the decodes that pair with a fresh prefill; a decode restarted
    under a prefill that kept running is a decode-only restart (that prefill keeps stale state
    about the decode it replaced: docs/sglang.md §6), so these prefills are restarted before
    those decodes (docs/decisions.md, "Restart rungs").
    """
    fresh = set(fresh)
    decodes = set(decodes_paired_with(group, fresh))
    return tuple(sorted({p.prefill for p in pairs(group) if p.decode in decodes} - fresh))
