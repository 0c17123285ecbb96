"""`Role` end to end: the config's restart.order parses into Role members and unit_for takes one."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from watchdog.act.plan import build_plan, resolve_roles
from watchdog.config import ROLES, parse_config
from watchdog.errors import ConfigError
from watchdog.model import Role

MINIMAL = (
    Path(__file__).resolve().parents[2] / "tests" / "data" / "valid-minimal.toml"
).read_text()


def with_order(order: str) -> str:
    """The minimal config with `restart.order = <order>` (a TOML value)."""
    return f"{MINIMAL}\n[group.restart]\norder = {order}\n"


def test_order_names_become_roles() -> None:
    """The TOML strings of restart.order arrive as Role members, in the co-restart order."""
    config = parse_config(tomllib.loads(with_order('["prefill", "decode", "router"]')), "f")
    order = config.group[0].restart.order
    assert order == (Role.PREFILL, Role.DECODE, Role.ROUTER)
    assert all(type(role) is Role for role in order)
    assert order == ROLES


def test_default_order_is_roles() -> None:
    """Without restart.order the default is the same Role tuple."""
    config = parse_config(tomllib.loads(MINIMAL), "f")
    assert config.group[0].restart.order == ROLES
    assert all(type(role) is Role for role in config.group[0].restart.order)


def test_unit_for_takes_a_role() -> None:
    """unit_for maps each Role to its own section; plans and --unit resolve through it."""
    group = parse_config(tomllib.loads(MINIMAL), "f").group[0]
    assert group.workers(Role.PREFILL)[0] is group.prefill
    assert group.workers(Role.DECODE)[0] is group.decode
    assert group.workers(Role.ROUTER)[0] is group.router
    plan = build_plan(group, trigger="test")
    assert [(s.role, s.unit) for s in plan.steps] == [
        (role, group.workers(role)[0].unit) for role in ROLES
    ]
    assert resolve_roles(group, ["router", group.decode.unit, "prefill"]) == ROLES


def test_a_non_string_role_is_a_type_error() -> None:
    """A number in restart.order is reported like any other non-string setting."""
    with pytest.raises(ConfigError) as info:
        parse_config(tomllib.loads(with_order('[1, "decode", "router"]')), "f")
    assert [str(issue) for issue in info.value.issues] == [
        "f: group#1.restart.order#1: Input should be a valid string (got 1)"
    ]
