"""`watchdog plan/restart/reset/pause/resume` without a bus: output, exit codes, state files."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from tests.unit import configs
from watchdog.cli import main
from watchdog.commands.pause import parse_duration
from watchdog.config import DECODE_ONLY_EXPLANATION
from watchdog.errors import EXIT_OK, EXIT_STARTUP, EXIT_USAGE, UsageError
from watchdog.statefiles import (
    RestartHistory,
    RestartLock,
    read_operator_controls,
    read_refusal_counts,
)

PROBE = {"timeout_seconds": 2, "stream_idle_seconds": 1}
RESTART = {"ready_timeout_seconds": 40, "verify_timeout_seconds": 40}


@pytest.fixture(autouse=True)
def _restore_structlog() -> Iterator[None]:
    """cli.main() points structlog at this test's captured stderr; undo that afterwards."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


@pytest.fixture
def config(tmp_path: Path) -> Path:
    """A one-group config whose state_dir is under tmp_path."""
    overrides = {
        "watchdog": {"state_dir": str(tmp_path / "state")},
        "group": [configs.group("g1", probe=PROBE, restart=RESTART)],
    }
    return configs.write_config(tmp_path / "watchdog.toml", overrides)


def state(config: Path) -> Path:
    """The state_dir of the test config."""
    return config.parent / "state"


def test_plan_prints_sequence(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`watchdog plan` prints the three steps in order with their checks and exits 0."""
    assert main(["plan", "--config", str(config)]) == EXIT_OK
    out = capsys.readouterr().out
    assert out.index("1. prefill  p.service") < out.index("2. decode   d.service")
    assert out.index("2. decode   d.service") < out.index("3. router   r.service")
    assert "each step within 40 s" in out


def test_plan_json(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`watchdog plan --json` is machine-readable."""
    assert main(["plan", "--config", str(config), "--json"]) == EXIT_OK
    plans = json.loads(capsys.readouterr().out)
    assert [s["unit"] for s in plans[0]["steps"]] == ["p.service", "d.service", "r.service"]


@pytest.mark.parametrize("units", [["decode"], ["d.service", "router"]])
def test_restart_decode_without_prefill_is_refused_with_exit_3(
    config: Path, units: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """A partial restart with decode but no prefill exits 3, explains why, and is counted."""
    argv = ["restart", "--config", str(config), "--yes"]
    for unit in units:
        argv += ["--unit", unit]
    assert main(argv) == EXIT_STARTUP
    err = capsys.readouterr().err
    assert DECODE_ONLY_EXPLANATION in err
    assert f"Run the safe co-restart instead: watchdog restart --config {config} --group g1" in err
    assert read_refusal_counts(state(config), "g1", now=0.0) == {"decode_without_prefill": 1}
    assert RestartHistory.load(state(config), "g1", now=0.0).records == []


def test_restart_dry_run_records_a_rehearsal(
    config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`restart --dry-run` prints the plan, restarts nothing and records a dry-run entry."""
    assert main(["restart", "--config", str(config), "--dry-run"]) == EXIT_OK
    out = capsys.readouterr().out
    assert out.rstrip().endswith("dry run: nothing was restarted")
    records = RestartHistory.load(state(config), "g1", now=0.0).records
    assert [(r.trigger, r.dry_run, len(r.steps)) for r in records] == [("manual", True, 3)]


def test_router_alone_is_allowed(config: Path) -> None:
    """`restart --unit router` is a one-step plan (the router holds no bootstrap state)."""
    assert main(["restart", "--config", str(config), "--unit", "router", "--dry-run"]) == EXIT_OK
    records = RestartHistory.load(state(config), "g1", now=0.0).records
    assert [s.unit for s in records[0].steps] == ["r.service"]


def test_restart_without_yes_on_a_pipe_is_a_usage_error(
    config: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a terminal to confirm on, a real restart needs --yes (exit 2, nothing done)."""
    monkeypatch.setattr("sys.stdin.isatty", lambda: False)
    assert main(["restart", "--config", str(config)]) == EXIT_USAGE
    assert "pass --yes" in capsys.readouterr().err


def test_restart_fails_fast_when_locked(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A held lock makes `watchdog restart` exit 3 naming the holder, before any unit is touched."""
    with RestartLock(state(config), "g1", purpose="daemon"):
        assert main(["restart", "--config", str(config), "--dry-run"]) == EXIT_STARTUP
    err = capsys.readouterr().err
    assert "another restart of group 'g1' is in progress" in err
    assert "(daemon) since" in err


def test_pause_resume_reset(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """pause writes a lease, resume clears it, reset writes the re-arm time."""
    assert main(["pause", "--config", str(config), "--for", "30m", "--reason", "maint"]) == 0
    controls = read_operator_controls(state(config), "g1")
    assert controls.paused_until is not None
    assert controls.pause_reason == "maint"
    assert main(["resume", "--config", str(config)]) == 0
    assert read_operator_controls(state(config), "g1").paused_until is None
    assert main(["reset", "--config", str(config), "--group", "g1"]) == 0
    assert read_operator_controls(state(config), "g1").rearmed_at is not None
    out = capsys.readouterr().out
    assert "group g1 paused until " in out
    assert "group g1 resumed" in out
    assert "group g1 re-armed at " in out


def test_unknown_group_is_a_usage_error(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--group naming no group exits 2 listing the known ones."""
    assert main(["reset", "--config", str(config), "--group", "nope"]) == EXIT_USAGE
    assert "no group named 'nope' (known: g1)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90", 90.0), ("90s", 90.0), ("30m", 1800.0), ("1.5h", 5400.0), (" 2h ", 7200.0)],
)
def test_parse_duration(text: str, seconds: float) -> None:
    """--for accepts seconds, minutes and hours."""
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "0m", "-5m", "30 minutes", "1d", "m"])
def test_parse_duration_rejects(text: str) -> None:
    """Anything else is a usage error naming the value."""
    with pytest.raises(UsageError) as info:
        parse_duration(text)
    assert str(info.value) == (
        f"--for {text!r} is not a positive duration (a number with s, m or h, e.g. 30m)"
    )
