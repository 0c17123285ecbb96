"""A group not once healthy since its units last started: paged, never restarted.

A deploy or config error (a model path typo, a probe that can never pass) is not a stall: no
co-restart brings up what never came up, and restarting it in a loop only hides the error behind
`held` (docs/decisions.md, "Never healthy").
"""

from __future__ import annotations

from datetime import UTC, datetime

from watchdog.config import GroupSection
from watchdog.decide.reasons import reason
from watchdog.decide.state import GroupState
from watchdog.decide.verdict import Verdict
from watchdog.model import Reason

# The verdicts that say "the group does not serve". Where it has not served once since its units
# last started, they become never_healthy. The decode- and prefill-only rules are not among them:
# they restore the restart order, whatever the group did since.
NOT_SERVING_VERDICTS = frozenset(
    {
        Verdict.FAILED_START,
        Verdict.SILENT_STALL,
        Verdict.DEGRADED_BOOTSTRAP,
        Verdict.ROUTER_WEDGE,
        Verdict.CRASH,
    }
)


def co_restart_limit_seconds(config: GroupSection) -> float:
    """The longest a co-restart of ours can take: three readiness waits and a probe timeout."""
    return 3 * config.restart.ready_timeout_seconds + config.probe.timeout_seconds


def started_by_us(mem: GroupState, config: GroupSection, start: float) -> bool:
    """Whether a unit start falls within our latest co-restart (its time is persisted).

    Those starts are judged by verification and the failed-attempt streak, not by this rule; the
    restart history survives a daemon restart, so neither forgets whose the start was.
    """
    last = max(mem.budget.restart_times, default=None)
    return last is not None and last <= start <= last + co_restart_limit_seconds(config)


def never_healthy(mem: GroupState, config: GroupSection, now: float) -> Reason | None:
    """The never_healthy reason, when the group has not served once since its units started.

    Not served: no probe that started after the earliest unit start since the group last served
    has passed, and decode has delivered no token beyond our own since (fold.py keeps
    `served_at` and `units.unserved_since`). The startup timeout must have passed since that
    start (a model may load that long), and the start must not be ours.
    """
    since = mem.units.unserved_since
    timeout = config.stall.startup_timeout_seconds
    if since is None or now - since < timeout or started_by_us(mem, config, since):
        return None
    started = datetime.fromtimestamp(since, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return reason(
        "never_healthy",
        f"not once healthy since its units started {now - since:.0f}s ago ({started}): no probe "
        f"has passed and decode has delivered no token beyond our own probes' since "
        f"(startup_timeout_seconds {timeout:g}); a deploy or configuration error is likely "
        "(model path, probe model name, ports). Not restarting: a restart does not bring up "
        "what never came up",
        unserved_seconds=now - since,
        started_at=started,
        startup_timeout_seconds=timeout,
    )
