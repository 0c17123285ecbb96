"""One plan module, one restarter assembly: read from the package's source with ast.

The order guard runs where a plan is made (act/plan.py build_plan), so it holds for every plan
only if nothing else in the package makes one; likewise the host check and `--dry-run` hold for
the daemon and `watchdog restart` alike only if act/restarters.py open_restarter is the one place
a restarter is assembled.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "watchdog"


def _calls_of(name: str) -> dict[str, int]:
    """Module path (relative to the package) -> the number of calls of `name` in it."""
    found: dict[str, int] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if called == name:
                key = path.relative_to(PACKAGE).as_posix()
                found[key] = found.get(key, 0) + 1
    return found


def test_the_scan_sees_calls() -> None:
    """The scanner finds a call it knows is there (a scanner that finds nothing proves nothing)."""
    assert "act/plan.py" in _calls_of("guard_plan")


def test_only_the_plan_module_constructs_a_restart_plan() -> None:
    """No module of the package but act/plan.py calls RestartPlan(...): every plan comes out of
    build_plan (guarded) or the step-less replayed_plan."""
    assert set(_calls_of("RestartPlan")) == {"act/plan.py"}


def test_restarters_are_assembled_in_one_place() -> None:
    """SystemdRestarter, DryRunRestarter and HostCheckedRestarter are built only by
    act/restarters.py (open_restarter), which the daemon and `watchdog restart` both call."""
    for name in ("SystemdRestarter", "DryRunRestarter", "HostCheckedRestarter"):
        assert set(_calls_of(name)) == {"act/restarters.py"}, name
    assert {"run/daemon.py", "commands/restart.py"} <= set(_calls_of("open_restarter"))


def test_the_guard_runs_where_plans_are_made_and_in_the_acting_restarter() -> None:
    """guard_plan is called by build_plan and, as defence in depth, by SystemdRestarter.execute;
    no caller re-guards a plan it got from build_plan."""
    assert _calls_of("guard_plan") == {"act/plan.py": 1, "act/restarters.py": 1}
