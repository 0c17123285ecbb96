"""Evidence and drift cover every worker of an xPyD group, each named as reports name it."""

from __future__ import annotations

import json
import os
from typing import Any

import httpx

from tests.unit.evidence_helpers import NOW, FakeJournal, observation, tools
from watchdog.config import GroupSection, parse_config
from watchdog.evidence.capture import capture_evidence, check_live_drift
from watchdog.evidence.incident import evidence_files
from watchdog.model import Role, UnitState

UNITS = {
    "prefill#1": "p1.service",
    "prefill#2": "p2.service",
    "decode#1": "d1.service",
    "decode#2": "d2.service",
    "router": "r.service",
}


def group_2p2d(decode_two: dict[str, Any] | None = None) -> GroupSection:
    """Two prefills, two decodes; `decode_two` adds keys to the second decode."""
    raw: dict[str, Any] = {
        "name": "xp",
        "prefill": [
            {"unit": "p1.service", "url": "http://127.0.0.1:30000"},
            {"unit": "p2.service", "url": "http://127.0.0.1:30010"},
        ],
        "decode": [
            {"unit": "d1.service", "url": "http://127.0.0.1:30002"},
            {"unit": "d2.service", "url": "http://127.0.0.1:30012"} | (decode_two or {}),
        ],
        "router": {"unit": "r.service", "url": "http://127.0.0.1:30001"},
    }
    return parse_config({"group": [raw]}, "test.toml").group[0]


class PerUnitReader:
    """A UnitReader whose every unit runs this test process (its /proc is readable)."""

    async def read_unit(self, role: Role, unit: str) -> UnitState:
        """An active unit whose MainPID is the test process."""
        return UnitState(
            role=role,
            unit=unit,
            ok=True,
            load_state="loaded",
            active_state="active",
            sub_state="running",
            main_pid=os.getpid(),
            exec_main_start_us=int((NOW - 60) * 1e6),
        )


async def test_the_bundle_holds_every_worker_unit_journal_and_processes() -> None:
    """2P2D: both prefills' and both decodes' units, journals and process trees are captured."""
    journal = FakeJournal({unit: f"{unit} log line\n" for unit in UNITS.values()})
    async with httpx.AsyncClient(
        transport=httpx.MockTransport(lambda r: httpx.Response(200, text="ok"))
    ) as client:
        evidence = await capture_evidence(
            group_2p2d(),
            observation(),
            raw_metrics={},
            unit_reader=PerUnitReader(),
            client=client,
            total_timeout_seconds=30.0,
            journal_lines=10,
            tools=tools(journal=journal),
            clock=lambda: NOW,
        )
    assert [(u.label, u.unit) for u in evidence.units] == list(UNITS.items())
    for unit in evidence.units:
        assert unit.journal is not None, unit
        assert unit.journal.ok, unit
        assert [p.pid for p in unit.processes][:1] == [os.getpid()], unit
        assert unit.state is not None
        assert unit.state.worker == unit.worker
    items = {i.name: i for i in evidence.items}
    for name in UNITS:
        assert items[f"journal:{name}"].ok, name
        assert items[f"processes:{name}"].ok, name
    assert {h.name for h in evidence.http} >= {"prefill#2_health", "decode#2_health"}
    files = evidence_files(evidence, None)
    assert {"journal-prefill-2.txt", "journal-decode-2.txt"} <= set(files)
    assert files["journal-decode-2.txt"] == "d2.service log line\n"
    workers = [u["worker"] for u in json.loads(files["units.json"])]
    assert workers == list(UNITS)


async def test_live_drift_checks_the_second_decode_too() -> None:
    """An expectation on decode#2 alone is checked against decode#2's process and reported."""
    group = group_2p2d({"expect_cmdline_contains": ["--no-such-flag-anywhere"]})
    drift = await check_live_drift(group, PerUnitReader())
    by_name = {d.name: d for d in drift}
    assert by_name["decode#2"].checked
    (finding,) = by_name["decode#2"].findings
    assert finding.unit == "d2.service"
    assert "--no-such-flag-anywhere" in finding.message
    assert not by_name["decode#1"].checked  # no expectations of its own
