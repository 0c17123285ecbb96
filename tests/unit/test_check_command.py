"""`watchdog check`: one observation per group, a table or JSON, exit 0 / 1 / 2."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from pdsim.payloads import sglang_payload
from tests.unit import configs
from tests.unit.fakerouter import FakeStack, fake_in_thread
from tests.unit.rawhttp import refused_url
from watchdog.cli import build_parser, main
from watchdog.commands import check
from watchdog.model import Role, UnitState
from watchdog.observe.observer import UnitReader


@pytest.fixture
def fake() -> Iterator[FakeStack]:
    """A fake stack served from its own thread and loop, since the command runs asyncio.run()."""
    with fake_in_thread(sglang_payload("0.5.5", "prefill", tp=2)) as stack:
        yield stack


def _config(tmp_path: Path, base_url: str, name: str = "g1", **probe: str) -> Path:
    fast = {"timeout_seconds": 3, "stream_idle_seconds": 2, **probe}
    overrides = {"group": [configs.group(name, url=base_url, probe=fast)]}
    return configs.write_config(tmp_path / f"{name}.toml", overrides)


def test_passing_check_prints_a_table(
    fake: FakeStack, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every probe passed: exit 0 and a table with probe, health and per-role metrics."""
    code = main(["check", "--config", str(_config(tmp_path, fake.base_url))])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "group g1: PASS" in out
    assert "completion ok" in out
    assert "prefill ok (200)" in out
    assert "xfer_fail" in out
    assert "units     not observed" in out


def test_json_output(fake: FakeStack, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--json prints one document with the whole observation per group."""
    code = main(["check", "--config", str(_config(tmp_path, fake.base_url)), "--json"])
    document = json.loads(capsys.readouterr().out)
    assert code == 0
    (group,) = document["groups"]
    assert group["passed"] is True
    observation = group["observation"]
    assert observation["probes"][0]["reason"] == "ok"
    assert [m["role"] for m in observation["metrics"]] == ["prefill", "decode"]


def test_failing_probe_exits_1(
    fake: FakeStack, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A probe that fails (here: unexpected output) makes the check exit 1 and say why."""
    config = _config(tmp_path, fake.base_url, expect_regex="^never$")
    code = main(["check", "--config", str(config)])
    out = capsys.readouterr().out
    assert code == 1
    assert "FAIL unexpected_output" in out


def test_unreachable_stack_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Nothing listening: exit 1 with connect_refused everywhere."""
    code = main(["check", "--config", str(_config(tmp_path, refused_url()))])
    out = capsys.readouterr().out
    assert code == 1
    assert "connect_refused" in out


def test_bad_config_and_unknown_group_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A missing config file or an unknown --group is a usage error (exit 2)."""
    assert main(["check", "--config", str(tmp_path / "missing.toml")]) == 2
    config = _config(tmp_path, refused_url())
    assert main(["check", "--config", str(config), "--group", "nope"]) == 2
    assert "nope" in capsys.readouterr().err


class Units:
    """A unit reader for the factory hook."""

    async def read_unit(self, role: Role, unit: str) -> UnitState:
        return UnitState(role=role, unit=unit, ok=True, active_state="active", sub_state="running")


def test_unit_reader_factory_hook(
    fake: FakeStack, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A unit reader from the factory hook puts the units in the report."""

    @contextlib.asynccontextmanager
    async def factory() -> AsyncIterator[UnitReader | None]:
        yield Units()

    args = build_parser().parse_args(["check", "--config", str(_config(tmp_path, fake.base_url))])
    assert check.run(args, unit_reader_factory=factory) == 0
    assert "prefill active/running" in capsys.readouterr().out
