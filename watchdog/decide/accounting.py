"""Transfer/bootstrap failures over a window: raw, explained by aborts, net, and their ratio.

On SGLang 0.5.23 every abort of a request waiting in a PD queue is a counted transfer or
bootstrap failure on every TP rank (docs/sglang.md §7.2): our own aborts of timed-out probes,
client disconnects, anyone's /abort_request. Those say nothing about the transfer path, so only
failures beyond what aborts explain count (docs/decisions.md, "Failure accounting").
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from watchdog.decide.state import FailureSample
from watchdog.model import Role


@dataclass(frozen=True, slots=True)
class RoleFailures:
    """One worker's failures over the window, and how many of them aborts explain."""

    role: Role
    raw: float  # growth of transfer + bootstrap failures (max over TP ranks)
    aborted: float  # growth of num_aborted_requests_total
    own_aborts: float  # aborts of timed-out probes we sent to it
    finished: float  # growth of num_requests_total

    @property
    def explained(self) -> float:
        """Failures aborts can account for: at most one per aborted request.

        Our aborts are themselves in num_aborted_requests_total wherever the worker knew the rid,
        so the two are alternatives, never added up; the larger is the bound.
        """
        return max(self.aborted, self.own_aborts)

    @property
    def net(self) -> float:
        """Failures beyond what aborts explain."""
        return max(0.0, self.raw - self.explained)


@dataclass(frozen=True, slots=True)
class WindowFailures:
    """Failures of both workers over one window."""

    roles: tuple[RoleFailures, ...] = ()
    # Raw failure growth per worker that had any: (role, worker index, increase), in Role order.
    workers: tuple[tuple[Role, int, float], ...] = ()

    def _max(self, field: str) -> float:
        return max((float(getattr(r, field)) for r in self.roles), default=0.0)

    @property
    def raw(self) -> float:
        """Raw failures: the max over roles (prefill and decode count the same request)."""
        return self._max("raw")

    @property
    def explained(self) -> float:
        """Failures aborts explain, max over roles."""
        return self._max("explained")

    @property
    def net(self) -> float:
        """Failures that aborts do not explain: the max over roles, never the sum."""
        return self._max("net")

    @property
    def attempts(self) -> float:
        """Transfers attempted: on prefill a request finishes when its transfer concludes."""
        return next((r.finished for r in self.roles if r.role is Role.PREFILL), 0.0)

    @property
    def ratio(self) -> float | None:
        """Net failures per attempted transfer; None when none was attempted."""
        attempts = self.attempts
        return min(1.0, self.net / attempts) if attempts > 0 else None

    def net_by_role(self) -> dict[str, float]:
        """Net failures per role, for reasons."""
        return {r.role.value: r.net for r in self.roles if r.raw > 0}


def window_failures(samples: Iterable[FailureSample], since: float) -> WindowFailures:
    """The failure accounting of the samples taken at or after `since`."""
    totals: dict[Role, list[float]] = {}
    rose: dict[tuple[Role, int], float] = {}
    for sample in samples:
        if sample.at < since:
            continue
        if sample.increase > 0:
            key = (sample.role, sample.worker)
            rose[key] = rose.get(key, 0.0) + sample.increase
        sums = totals.setdefault(sample.role, [0.0, 0.0, 0.0, 0.0])
        sums[0] += sample.increase
        sums[1] += sample.aborted
        sums[2] += sample.own_aborts
        sums[3] += sample.finished
    return WindowFailures(
        tuple(
            RoleFailures(role, raw=t[0], aborted=t[1], own_aborts=t[2], finished=t[3])
            for role in Role
            if (t := totals.get(role)) is not None
        ),
        tuple(
            (role, worker, rose[role, worker])
            for role, worker in sorted(rose, key=lambda k: (list(Role).index(k[0]), k[1]))
        ),
    )
