"""`watchdog replay`: a recording made by the tests replays through decide() with any config."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from tests.unit import configs
from tests.unit.builders import T0, Stack
from watchdog.cli import main
from watchdog.run.recording import Recorder


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """main() points structlog at the captured stderr; later tests must not log into it."""
    yield
    structlog.reset_defaults()


def write_config(path: Path, name: str = "g", no_progress: float = 45, extra: str = "") -> Path:
    """A one-group config with a tunable no_progress_seconds (plus any extra TOML text)."""
    units = [f"{name}-{role}.service" for role in ("prefill", "decode", "router")]
    stall = {"no_progress_seconds": no_progress}
    configs.write_config(path, {"group": [configs.group(name, units=units, stall=stall)]})
    if extra:
        path.write_text(path.read_text(encoding="utf-8") + extra, encoding="utf-8")
    return path


def write_incident(path: Path, group: str = "g", stall_cycles: int = 30) -> Path:
    """A recorded incident: a healthy minute, then a silent stall."""
    stack = Stack(group=group)
    with path.open("w", encoding="utf-8") as handle:
        recorder = Recorder(handle, group, T0)
        for _ in range(12):
            recorder.append(stack.cycle((True,)))
        for _ in range(stall_cycles):
            recorder.append(stack.stalled())
    return path


def test_replay_prints_state_changes_and_actions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The default thresholds co-restart on the recorded stall; each change is printed once."""
    config = write_config(tmp_path / "w.toml")
    recording = write_incident(tmp_path / "rec.jsonl")
    assert main(["replay", "--config", str(config), str(recording)]) == 0
    out = capsys.readouterr().out
    assert "warming -> healthy  verdict=ok" in out
    assert "healthy -> restarting  verdict=silent_stall  action=co_restart" in out
    assert "restarting -> verifying" in out
    assert "no_progress: progress counters flat for 45s as last read" in out
    assert "simulated co-restart: ok" in out
    assert out.strip().splitlines()[-1].startswith("replayed 42 cycles of group 'g'")
    assert "1 co-restart(s)" in out


def test_replay_with_tuned_thresholds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A longer no_progress_seconds on the same recording does not restart."""
    config = write_config(tmp_path / "w.toml", no_progress=600)
    recording = write_incident(tmp_path / "rec.jsonl")
    assert main(["replay", "--config", str(config), str(recording)]) == 0
    out = capsys.readouterr().out
    assert "co_restart" not in out
    assert "0 co-restart(s)" in out


def test_replay_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--json prints one object per change and a final summary."""
    config = write_config(tmp_path / "w.toml")
    recording = write_incident(tmp_path / "rec.jsonl", stall_cycles=80)
    code = main(
        ["replay", "--config", str(config), str(recording), "--json", "--assume-restart", "failed"]
    )
    assert code == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    events, summary = lines[:-1], lines[-1]["summary"]
    first_restart = next(e for e in events if e["action"] == "co_restart")
    assert (first_restart["from"], first_restart["to"], first_restart["verdict"]) == (
        "healthy",
        "restarting",
        "silent_stall",
    )
    codes = [r["code"] for r in first_restart["reasons"]]
    assert codes[:2] == ["probe_failures", "no_progress"]
    assert first_restart["reasons"][0]["values"]["consecutive"] == 9
    failed = next(e for e in events if e["action"] == "after_restart")
    assert failed["to"] == "stalled"
    assert summary["co_restarts"] >= 2
    assert summary["group"] == "g"


def test_replay_applies_another_groups_thresholds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--group picks the config group whose thresholds replay a recording of another group."""
    config = write_config(tmp_path / "w.toml", name="staging")
    recording = write_incident(tmp_path / "rec.jsonl", group="prod")
    assert main(["replay", "--config", str(config), "--group", "staging", str(recording)]) == 0
    assert "with the thresholds of 'staging'" in capsys.readouterr().out


def test_replay_unknown_group_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An unknown --group exits 2 naming the known groups."""
    config = write_config(tmp_path / "w.toml")
    recording = write_incident(tmp_path / "rec.jsonl")
    assert main(["replay", "--config", str(config), "--group", "nope", str(recording)]) == 2
    assert "'nope' is not in the config (known: g)" in capsys.readouterr().err


def test_replay_corrupt_recording_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A corrupt recording exits 2 with the file and line in the message."""
    config = write_config(tmp_path / "w.toml")
    recording = write_incident(tmp_path / "rec.jsonl")
    with recording.open("a", encoding="utf-8") as handle:
        handle.write("garbage\n")
    assert main(["replay", "--config", str(config), str(recording)]) == 2
    assert f"{recording}:44: not JSON" in capsys.readouterr().err


def test_replay_bad_config_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A config error is reported like everywhere else (exit 2, file and key)."""
    config = write_config(tmp_path / "w.toml", extra="bogus = 1\n")
    recording = write_incident(tmp_path / "rec.jsonl")
    assert main(["replay", "--config", str(config), str(recording)]) == 2
    assert "unknown key" in capsys.readouterr().err
