"""The co-restart of a group with several workers per role: stages, concurrency, refusals."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.unit.test_restart_plan import FakeReadiness, FakeUnits, restarter
from watchdog.act.plan import (
    REASON_DECODE_WITHOUT_PREFILL,
    REASON_PARTIAL,
    build_plan,
    format_plan,
    leaves_workers_out,
    plan_as_dict,
    plan_for_request,
    plan_stages,
    refusal_reason,
    resolve_roles,
)
from watchdog.act.restarters import DryRunRestarter
from watchdog.config import GroupSection, parse_config
from watchdog.errors import RestartRefused
from watchdog.model import RestartStep, Role

P, D, R = Role.PREFILL, Role.DECODE, Role.ROUTER


def make_2p2d() -> GroupSection:
    """Two prefills, two decodes, one router."""
    data = {
        "group": [
            {
                "name": "g2",
                "prefill": [
                    {"unit": "p1.service", "url": "http://127.0.0.1:31001", "bootstrap_port": 8998},
                    {"unit": "p2.service", "url": "http://127.0.0.1:31002", "bootstrap_port": 8999},
                ],
                "decode": [
                    {"unit": "d1.service", "url": "http://127.0.0.1:31003"},
                    {"unit": "d2.service", "url": "http://127.0.0.1:31004"},
                ],
                "router": {"unit": "r.service", "url": "http://127.0.0.1:31000"},
                "probe": {"timeout_seconds": 1, "stream_idle_seconds": 1},
                "restart": {"ready_timeout_seconds": 5, "verify_timeout_seconds": 5},
            }
        ]
    }
    return parse_config(data, "test.toml").group[0]


GROUP = make_2p2d()


def test_plan_has_every_worker_by_role_and_the_router_expects_all() -> None:
    """Prefills, then decodes, then the router; the router waits for all four workers."""
    plan = build_plan(GROUP, "silent_stall")
    assert [(s.role, s.unit) for s in plan.steps] == [
        (P, "p1.service"),
        (P, "p2.service"),
        (D, "d1.service"),
        (D, "d2.service"),
        (R, "r.service"),
    ]
    assert [[s.unit for s in stage] for stage in plan_stages(plan)] == [
        ["p1.service", "p2.service"],
        ["d1.service", "d2.service"],
        ["r.service"],
    ]
    assert plan.steps[1].ready_url == "http://127.0.0.1:31002/health"
    assert plan.steps[-1].expect_workers == (
        "http://127.0.0.1:31001",
        "http://127.0.0.1:31002",
        "http://127.0.0.1:31003",
        "http://127.0.0.1:31004",
    )
    steps = plan_as_dict(plan)["steps"]
    assert isinstance(steps, list)
    assert [s["stage"] for s in steps] == [1, 1, 2, 2, 3]
    json.dumps(plan_as_dict(plan))


def test_format_plan_shows_every_unit_in_its_step() -> None:
    """`watchdog plan`: one numbered step per role, every unit listed under its number."""
    lines = format_plan(build_plan(GROUP, "manual")).splitlines()
    assert lines[0].startswith("group g2 (trigger: manual): restart 5 unit(s) in this order")
    assert lines[1] == (
        "  in 3 steps: the units of one step restart concurrently, each gated on its own "
        "readiness; the next step starts when all of them are ready"
    )
    listed = [line for line in lines if line.startswith("  ") and line[2].isdigit()]
    assert listed == [
        "  1. prefill  p1.service",
        "  1. prefill  p2.service",
        "  2. decode   d1.service",
        "  2. decode   d2.service",
        "  3. router   r.service",
    ]


async def test_dry_run_reports_every_unit() -> None:
    """The dry run rehearses all five steps."""
    outcome = await DryRunRestarter().execute(build_plan(GROUP, "manual"))
    assert [s.unit for s in outcome.steps] == [
        "p1.service",
        "p2.service",
        "d1.service",
        "d2.service",
        "r.service",
    ]
    assert all(s.phase == "dry_run" for s in outcome.steps)


async def test_workers_of_a_role_restart_concurrently_and_all_ready_before_the_next() -> None:
    """Both prefill jobs start before either finishes; no decode starts before both are ready."""
    units, ready = FakeUnits(), FakeReadiness({"p2.service": [False, False, True]})
    gate = asyncio.Event()
    units.job_gate = gate
    started: list[str] = []
    original = units.start_unit

    async def start_unit(unit: str, *, timeout_seconds: float) -> str:
        started.append(unit)
        if len(started) == 2 and started == ["p1.service", "p2.service"]:
            gate.set()  # only released once both prefills are in their job wait together
        if unit not in ("p1.service", "p2.service"):
            gate.set()
        return await original(unit, timeout_seconds=timeout_seconds)

    units.start_unit = start_unit  # type: ignore[method-assign]
    outcome = await asyncio.wait_for(
        restarter(units, ready).execute(build_plan(GROUP, "t")), timeout=60
    )  # only a guard against a deadlock: generous, for a busy machine
    assert outcome.ok, outcome
    restarts = [unit for call, unit in units.calls if call == "start"]
    assert restarts[:2] == ["p1.service", "p2.service"]
    assert set(restarts[2:4]) == {"d1.service", "d2.service"}
    assert restarts[4] == "r.service"
    # p2 needed three readiness checks: no decode was touched before its last one.
    last_p2 = max(i for i, unit in enumerate(ready.checked) if unit == "p2.service")
    first_decode = min(i for i, unit in enumerate(ready.checked) if unit.startswith("d"))
    assert last_p2 < first_decode


async def test_a_failed_worker_stops_after_its_stage() -> None:
    """One prefill failing: its sibling finishes, no decode or router is restarted."""
    units, ready = FakeUnits(), FakeReadiness()
    units.job_results["p2.service"] = "failed"
    outcome = await restarter(units, ready).execute(build_plan(GROUP, "t"))
    assert not outcome.ok
    assert [(s.unit, s.phase) for s in outcome.steps] == [
        ("p1.service", "ready"),
        ("p2.service", "start_job"),
        ("d1.service", "not_started"),
        ("d2.service", "not_started"),
        ("r.service", "not_started"),
    ]
    assert outcome.steps[2].detail == "stopped after p2.service failed (start_job)"
    assert not any(unit.startswith("d") for _, unit in units.calls)


def test_unit_names_of_any_worker_resolve_to_their_role() -> None:
    """`--unit d2.service` is decode; a role name covers all its workers."""
    assert resolve_roles(GROUP, ["d2"]) == (D,)
    assert resolve_roles(GROUP, ["router", "p2.service", "decode"]) == (P, D, R)
    assert not leaves_workers_out(GROUP, ["prefill", "decode", "router"])
    assert not leaves_workers_out(GROUP, ["p1", "p2.service", "decode", "router"])
    assert leaves_workers_out(GROUP, ["p1", "decode", "router"])
    assert not leaves_workers_out(GROUP, ["router"])


def test_refusals_generalise_to_workers() -> None:
    """One decode alone is decode-only; some prefills with all decodes and the router is partial."""
    assert refusal_reason((D,)) == REASON_DECODE_WITHOUT_PREFILL
    assert refusal_reason((P, D, R), some_workers_only=True) == REASON_PARTIAL
    assert refusal_reason((P, D, R)) is None
    with pytest.raises(RestartRefused) as caught:
        plan_for_request(GROUP, resolve_roles(GROUP, ["d2"]), "manual", config="w.toml")
    assert caught.value.reason == REASON_DECODE_WITHOUT_PREFILL
    requested = ["p1", "decode", "router"]
    with pytest.raises(RestartRefused) as partial:
        plan_for_request(
            GROUP,
            resolve_roles(GROUP, requested),
            "manual",
            config="w.toml",
            some_workers_only=leaves_workers_out(GROUP, requested),
        )
    assert partial.value.reason == REASON_PARTIAL
    assert "with every worker of each role" in str(partial.value)
    router = plan_for_request(GROUP, (R,), "manual", config="w.toml")
    assert [s.unit for s in router.steps] == ["r.service"]
    assert isinstance(router.steps[0], RestartStep)
