"""Optional file I/O: every failure counted, one log line per episode and file, recovery logged."""

from __future__ import annotations

import errno

from structlog.testing import capture_logs

from watchdog.optional_io import OptionalIO


def test_episodes_are_per_file_and_end_when_a_write_works() -> None:
    """Two files failing every cycle log once each; each one's recovery ends only its episode."""
    counted: list[str] = []
    io = OptionalIO(counted.append)
    full = OSError(errno.ENOSPC, "No space left on device")
    with capture_logs() as logs:
        for _ in range(3):
            io.failed("recording", "recording_write_failed", full, key="recording:a")
            io.failed("recording", "recording_write_failed", full, key="recording:b")
        io.succeeded("recording", key="recording:a")
        io.failed("recording", "recording_write_failed", full, key="recording:b")
        io.failed("recording", "recording_write_failed", full, key="recording:a")
    assert [(e["event"], e.get("key")) for e in logs] == [
        ("recording_write_failed", None),
        ("recording_write_failed", None),
        ("file_io_recovered", "recording:a"),
        ("recording_write_failed", None),
    ]
    assert counted == ["recording"] * 8
    assert io.failing("recording:a")
    assert io.failing("recording:b")
    assert logs[0]["error"] == str(full)


def test_nothing_is_logged_for_a_file_that_never_failed() -> None:
    """A success without an episode before it is silent."""
    io = OptionalIO()
    with capture_logs() as logs:
        io.succeeded("audit")
    assert logs == []
    assert not io.failing("audit")
