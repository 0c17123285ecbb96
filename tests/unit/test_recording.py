"""The recording format: Recorder writes JSON Lines that read_recording turns back into observations."""

from __future__ import annotations

import errno
import io
import json
import os
from pathlib import Path

import pytest

from tests.unit.builders import T0, Stack
from watchdog.model import LoadsSnapshot, OperatorControls, Role
from watchdog.run.recording import (
    FORMAT,
    VERSION,
    AppendFile,
    RecordedObservation,
    Recorder,
    RecordingError,
    RecordingHeader,
    read_entries,
    read_header,
    read_recording,
)


def observations(count: int = 5) -> list:  # type: ignore[type-arg]
    """A few varied observations from the simulated stack."""
    stack = Stack()
    loads = (
        LoadsSnapshot(role=Role.PREFILL, fetched_at=T0, ok=True, timestamp=T0, running_reqs=2),
    )
    result = [stack.cycle((True,), loads=loads)]
    stack.fail_transfers(3)
    result.append(stack.stalled(operator=OperatorControls(paused_until=T0 + 60, pause_reason="x")))
    stack.restart(Role.DECODE)
    result.extend(stack.cycle((True, False), scrape=(Role.DECODE,)) for _ in range(count - 2))
    return result


def write(path: Path, group: str = "g", count: int = 5) -> list:  # type: ignore[type-arg]
    """Record `count` observations to `path` and return them."""
    recorded = observations(count)
    with path.open("w", encoding="utf-8") as handle:
        recorder = Recorder(handle, group, T0)
        for obs in recorded:
            recorder.append(obs)
    return recorded


def test_round_trip(tmp_path: Path) -> None:
    """What the Recorder writes reads back as equal observations, in order."""
    path = tmp_path / "rec.jsonl"
    recorded = write(path)
    assert list(read_recording(path)) == recorded


def test_header_and_line_shape(tmp_path: Path) -> None:
    """The first line is the header; each later line is {"at", "observation"}."""
    path = tmp_path / "rec.jsonl"
    recorded = write(path, count=3)
    lines = path.read_text(encoding="utf-8").splitlines()
    assert json.loads(lines[0]) == {
        "format": FORMAT,
        "version": VERSION,
        "group": "g",
        "started_at": T0,
    }
    body = json.loads(lines[1])
    assert set(body) == {"at", "observation"}
    assert body["at"] == recorded[0].at
    assert body["observation"]["probes"][0]["kind"] == "completion"
    assert read_header(path) == RecordingHeader(group="g", started_at=T0, line=1)


def test_recorder_flushes_every_line() -> None:
    """Each append is flushed, so a crash loses at most the line being written."""

    class CountingStream(io.StringIO):
        flushes = 0

        def flush(self) -> None:
            self.flushes += 1
            super().flush()

    stream = CountingStream()
    recorder = Recorder(stream, "g", T0)
    for obs in observations(3):
        recorder.append(obs)
    assert stream.flushes == 4
    assert stream.getvalue().count("\n") == 4


def test_interleaved_groups_and_restarts(tmp_path: Path) -> None:
    """A shared file with several groups and daemon runs reads back per group."""
    path = tmp_path / "rec.jsonl"
    stack_a, stack_b = Stack(group="a"), Stack(group="b")
    with path.open("a", encoding="utf-8") as handle:
        rec_a, rec_b = Recorder(handle, "a", T0), Recorder(handle, "b", T0)
        rec_a.append(stack_a.cycle())
        rec_b.append(stack_b.cycle())
        Recorder(handle, "a", T0 + 100).append(stack_a.cycle())
    assert len(list(read_recording(path, "a"))) == 2
    assert len(list(read_recording(path, "b"))) == 1
    headers = [e for e in read_entries(path) if isinstance(e, RecordingHeader)]
    assert [(h.group, h.started_at) for h in headers] == [("a", T0), ("b", T0), ("a", T0 + 100)]


def test_torn_last_line_is_skipped(tmp_path: Path) -> None:
    """A final line cut short by a killed daemon (no newline) is ignored."""
    path = tmp_path / "rec.jsonl"
    recorded = write(path, count=3)
    with path.open("a", encoding="utf-8") as handle:
        handle.write('{"at": 1, "observation": {"gro')
    assert list(read_recording(path)) == recorded


CORRUPT = [
    (
        "not-json",
        '{"format": "sglang-watchdog-recording", "version": 1, "group": "g", '
        '"started_at": 1}\n{oops\n{"at": 1}\n',
        ":2: not JSON",
    ),
    ("no-header", '{"at": 1, "observation": {}}\n', ":1: not a sglang-watchdog-recording file"),
    (
        "other-format",
        '{"format": "other", "version": 1}\n',
        ":1: not a sglang-watchdog-recording header",
    ),
    (
        "future-version",
        '{"format": "sglang-watchdog-recording", "version": 2, "group": "g", "started_at": 1}\n',
        ":1: unsupported recording version 2 (this watchdog reads version 1)",
    ),
    (
        "bad-observation",
        '{"format": "sglang-watchdog-recording", "version": 1, "group": "g", "started_at": 1}\n'
        '{"at": 1, "observation": {"group": "g", "at": "soon"}}\n',
        ":2: invalid observation: at: ",
    ),
    (
        "missing-observation",
        '{"format": "sglang-watchdog-recording", "version": 1, "group": "g", "started_at": 1}\n'
        '{"at": 1}\n',
        ":2: expected a header or an observation line",
    ),
    ("array", "[1, 2]\n", ":1: expected a JSON object"),
    ("empty-first-line", "\n", ":1: empty line where the sglang-watchdog-recording header"),
]


@pytest.mark.parametrize(("name", "content", "message"), CORRUPT, ids=[c[0] for c in CORRUPT])
def test_corrupt_input_names_file_and_line(
    tmp_path: Path, name: str, content: str, message: str
) -> None:
    """Corrupt input raises RecordingError naming the file and the line."""
    path = tmp_path / f"{name}.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(RecordingError) as caught:
        list(read_recording(path))
    assert str(caught.value).startswith(str(path))
    assert message in str(caught.value)


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    """An unreadable recording names the file and why."""
    path = tmp_path / "absent.jsonl"
    with pytest.raises(RecordingError, match=r"absent\.jsonl: cannot read: No such file"):
        list(read_recording(path))


def test_empty_file_has_no_header(tmp_path: Path) -> None:
    """An empty file is reported as having no header."""
    path = tmp_path / "empty.jsonl"
    path.write_text("", encoding="utf-8")
    with pytest.raises(RecordingError, match="empty recording"):
        read_header(path)


def test_recording_error_exits_2() -> None:
    """A corrupt recording is a usage problem (exit 2), not a startup failure."""
    assert RecordingError("x").exit_code == 2


def test_a_line_cut_short_by_a_full_disk_is_taken_back_and_written_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AppendFile: a write that stops half-way (ENOSPC after a short write) leaves the file as it
    was; the Recorder writes the header it owes with its next append, and the file reads back."""
    path = tmp_path / "rec.jsonl"
    sink = AppendFile(path)
    real_write = os.write
    calls: list[int] = []

    def half_then_full(fd: int, data: bytes | memoryview) -> int:
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    recorder = Recorder(sink, "g", T0)
    recorded = observations(2)
    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(OSError, match="No space left"):
        recorder.append(recorded[0])
    monkeypatch.undo()
    assert path.read_bytes() == b""  # the half line is gone
    recorder.append(recorded[1])
    sink.close()
    entries = list(read_entries(path))
    assert [type(e) for e in entries] == [RecordingHeader, RecordedObservation]
    assert list(read_recording(path)) == [recorded[1]]
