"""Peers' text reaches `watchdog check` and `watchdog incidents` output with its terminal control
characters shown as escapes, never obeyed."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.unit.test_incident import _config, _evidence, _open, _store
from watchdog.act.hosts import HostCheck
from watchdog.cli import main
from watchdog.commands.check import HostRows, format_table
from watchdog.evidence.capture import LiveDrift
from watchdog.evidence.records import DriftFinding, DriftKind
from watchdog.model import Observation, Role
from watchdog.observe.observer import ObservedCycle
from watchdog.text import printable

HOSTILE = "\x1b]0;pwned\x07\x1b[2J"
CONTROLS = ("\x1b", "\x07", "\x9b", "\r", "\x00", "\u202e")


def _assert_inert(out: str) -> None:
    for ch in CONTROLS:
        assert ch not in out, repr(ch)


def test_printable_escapes_controls_and_keeps_newlines_and_tabs() -> None:
    """C0 (but newline and tab), DEL, C1 and bidi overrides become visible escapes."""
    text = "a\tb\n" + HOSTILE + "\r\x00\x7f\x9b\u202e" + "é ✓"
    assert printable(text) == (
        "a\tb\n\\x1b]0;pwned\\x07\\x1b[2J\\x0d\\x00\\x7f\\x9b\\u202e" + "é ✓"
    )
    _assert_inert(printable(text))


def test_incidents_show_prints_a_planted_escape_inert(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A journal line with an OSC title and a clear-screen sequence, quoted in report.md, is
    printed by `watchdog incidents show` with no ESC or BEL."""
    base = _evidence()
    units = list(base.units)
    decode = units[1]
    assert decode.journal is not None
    journal = dataclasses.replace(decode.journal, text=f"decode says {HOSTILE}\n")
    units[1] = dataclasses.replace(decode, journal=journal, last_batch_line=f"batch {HOSTILE}")
    incident = _open(_store(tmp_path), evidence=dataclasses.replace(base, units=tuple(units)))
    report = incident.path / "report.md"
    assert "\x1b]0;pwned" in report.read_text()  # planted: the file keeps the evidence as read
    capsys.readouterr()
    assert main(["incidents", "show", incident.id, "--config", str(_config(tmp_path))]) == 0
    out = capsys.readouterr().out
    _assert_inert(out)
    assert "\\x1b]0;pwned\\x07" in out


def test_check_table_prints_a_planted_drift_finding_inert() -> None:
    """A drift finding quoting a hostile value read from a unit (and a host's error detail)
    reaches the check table with no ESC or BEL."""
    finding = DriftFinding(
        unit=f"sglang-decode{HOSTILE}.service",
        kind=next(iter(DriftKind)),
        expected="x",
        actual=HOSTILE,
        message=f"decode runs with {HOSTILE}",
    )
    drift = LiveDrift(Role.DECODE, "sglang-decode.service", True, (finding,))
    hosts: HostRows = [(HostCheck("w@h:22", False, f"ssh said {HOSTILE}"), ("d",))]
    cycle = ObservedCycle(Observation(group="g", at=0.0))
    table = format_table([cycle], drift={"g": (drift,)}, hosts=hosts)
    _assert_inert(table)
    assert "decode runs with \\x1b]0;pwned\\x07" in table
    assert "ssh said \\x1b]0;pwned\\x07" in table
