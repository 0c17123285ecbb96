"""What a restart needs from its executor and from systemd, as protocols of their own.

Kept apart from act/restarters.py (the restarters and their assembly) so that act/hosts.py,
which wraps a Restarter and implements a UnitController over several hosts, imports neither the
module that assembles it nor anything of D-Bus: no import cycle (tests/unit/test_imports.py).
"""

from __future__ import annotations

from typing import Protocol

from watchdog.model import RestartOutcome, RestartPlan, Role, UnitState


class Restarter(Protocol):
    """Executes a RestartPlan. Implementations: SystemdRestarter, DryRunRestarter,
    HostCheckedRestarter."""

    async def execute(self, plan: RestartPlan) -> RestartOutcome:
        """Run the plan's steps in order, stopping at the first failure."""
        ...


class UnitController(Protocol):
    """The systemd operations a restart needs (SystemdClient and UnitBuses implement it)."""

    async def stop_unit(self, unit: str, *, timeout_seconds: float) -> str:
        """StopUnit and wait for the job result; raises JobFailed and friends."""
        ...

    async def start_unit(self, unit: str, *, timeout_seconds: float) -> str:
        """StartUnit and wait for the job result; raises JobFailed and friends."""
        ...

    async def unit_processes(self, unit: str) -> tuple[int, ...]:
        """The PIDs still in the unit's control group (none for a unit systemd unloaded)."""
        ...

    async def wait_for_active(self, role: Role, unit: str, *, timeout_seconds: float) -> UnitState:
        """Wait until the unit is active; raises SystemdError or TimeoutError."""
        ...

    async def read_unit(self, role: Role, unit: str) -> UnitState:
        """The unit's current state; never raises for a failing unit."""
        ...
