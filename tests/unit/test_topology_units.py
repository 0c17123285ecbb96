"""Several workers per role in pdsim's router command line and the sandbox's units and config."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from pdsim.stack import role_of, router_command, worker_keys
from sandbox.pdunits import PdStackUnits
from watchdog.config import parse_config
from watchdog.model import Role


def test_router_command_lists_every_worker_with_its_bootstrap_port() -> None:
    """The router command lists every prefill with its own bootstrap port and every decode."""
    argv = router_command(
        prefills=[("http://127.0.0.1:1", 11), ("http://127.0.0.1:2", 12)],
        decodes=["http://127.0.0.1:3", "http://127.0.0.1:4"],
        port=5,
        metrics_port=6,
        router="sglang-router",
        extra=(),
    )
    joined = " ".join(argv)
    assert (
        "--prefill http://127.0.0.1:1 11 --prefill http://127.0.0.1:2 12 "
        "--decode http://127.0.0.1:3 --decode http://127.0.0.1:4 --host" in joined
    )


def test_router_command_one_pair_form_is_unchanged() -> None:
    """The one-pair router command is unchanged, and one without a prefill is refused."""
    one = router_command(
        prefill_url="http://p", bootstrap_port=8998, decode_url="http://d", port=1, metrics_port=2
    )
    assert one[3:9] == [
        "--pd-disaggregation",
        "--prefill",
        "http://p",
        "8998",
        "--decode",
        "http://d",
    ]
    with pytest.raises(ValueError, match="at least one prefill"):
        router_command(decodes=["http://d"], port=1, metrics_port=2)


def test_worker_keys_name_the_first_worker_like_its_role() -> None:
    """The first worker of a role keeps the role's name; later ones are numbered from 2."""
    assert worker_keys("prefill", 3) == ["prefill", "prefill2", "prefill3"]
    assert [role_of(k) for k in ("prefill2", "decode", "router")] == ["prefill", "decode", "router"]


def test_2p2d_units_have_distinct_ports_and_a_valid_config(tmp_path: Path) -> None:
    """A 2P2D stack gets distinct ports, a bootstrap port per prefill, and a valid config."""
    stack = PdStackUnits.allocate("t", tmp_path / "faults", prefills=2, decodes=2)
    assert stack.keys == ["prefill", "prefill2", "decode", "decode2", "router"]
    specs = {s.name: s for s in stack.specs()}
    assert list(specs) == [stack.unit(k) for k in stack.keys]
    ports = {stack.url(k) for k in stack.keys}
    assert len(ports) == 5
    assert stack.bootstrap_port("prefill") != stack.bootstrap_port("prefill2")
    router = " ".join(specs[stack.unit("router")].exec_start)
    for key in ("prefill", "prefill2"):
        assert f"--prefill {stack.url(key)} {stack.bootstrap_port(key)}" in router
    prefill2 = specs[stack.unit("prefill2")].exec_start
    assert prefill2[prefill2.index("--bootstrap-port") + 1] == str(stack.bootstrap_port("prefill2"))
    assert str(stack.fault_file("prefill2")) in prefill2
    config = parse_config(tomllib.loads(stack.config_toml(tmp_path / "state")), "t.toml")
    group = config.group[0]
    assert [w.unit for w in group.workers(Role.PREFILL)] == [
        "sglang-t-prefill.service",
        "sglang-t-prefill2.service",
    ]
    assert [w.url for w in group.workers(Role.DECODE)] == [
        stack.url("decode"),
        stack.url("decode2"),
    ]


def test_one_worker_stack_keeps_its_three_units(tmp_path: Path) -> None:
    """A one-worker stack keeps its three units and still writes prefill's bootstrap port."""
    stack = PdStackUnits.allocate("t", tmp_path)
    assert stack.keys == ["prefill", "decode", "router"]
    # The real bootstrap port is written even for one prefill: direct PD probes need it.
    assert stack.group_overrides()["prefill"] == {
        "unit": "sglang-t-prefill.service",
        "url": stack.url("prefill"),
        "bootstrap_port": stack.bootstrap_port("prefill"),
    }
