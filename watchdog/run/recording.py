"""The observation recording (JSON Lines) that `--record` writes and `watchdog replay` reads.

Format, version 1: UTF-8 text, one JSON object per line.

- A header line starts every recording session (the daemon writes one per group each time it
  starts, just before that group's first observation, so one file may hold several groups and
  several daemon runs, interleaved)::

      {"format": "sglang-watchdog-recording", "version": 1, "group": "dsv4", "started_at": 1.7e9}

- Then one line per cycle and group: ``{"at": <unix seconds>, "observation": {...}}`` where the
  observation is `watchdog.model.Observation` as pydantic's TypeAdapter dumps it (enums as their
  values, tuples as arrays, every field present), through the redaction policy
  (watchdog/redact.py): an error that quotes a URL has its userinfo masked. Unknown keys inside
  an observation are ignored, so a newer watchdog's recording stays readable where the fields it
  knows did not change.

Reading is strict: a line that is not JSON, a header of another format or version, or an
observation that does not validate raises `RecordingError` naming the file and line number (a
UsageError: the CLI prints it and exits 2). One exception, because daemons get killed: a final line
without its newline that does not parse is a torn write and is skipped.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from pydantic import TypeAdapter, ValidationError

from watchdog.errors import UsageError
from watchdog.model import Observation
from watchdog.redact import redact_value

FORMAT = "sglang-watchdog-recording"
VERSION = 1

_OBSERVATION = TypeAdapter(Observation)


class RecordingError(UsageError):
    """A recording file is unreadable or corrupt; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class RecordingHeader:
    """The first line of a recording session."""

    group: str
    started_at: float
    line: int = 0  # where it was read (0 when written)


@dataclass(frozen=True, slots=True)
class RecordedObservation:
    """One cycle's observation of one group, as recorded."""

    at: float
    observation: Observation
    line: int = 0


def _number(value: float) -> float | None:
    # JSON has no NaN or infinity; a recording must stay readable by any JSON parser.
    return value if math.isfinite(value) else None


class LineSink(Protocol):
    """Where a Recorder writes: a text stream (tests) or an AppendFile (the daemon)."""

    def write(self, text: str, /) -> int: ...

    def flush(self) -> None: ...


class AppendFile:
    """A recording file opened for appending, one os.write per line.

    A line that fails (a full disk) is cut off again, so the file never holds half a line
    followed by the next one, which `watchdog replay` would reject; the Recorder writes it
    again at its next append.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)

    def write(self, text: str, /) -> int:
        """Append `text` whole, or raise OSError and leave the file as it was."""
        data = memoryview(text.encode("utf-8"))
        size = os.fstat(self._fd).st_size
        try:
            while data:
                data = data[os.write(self._fd, data) :]
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, size)
            raise
        return len(text)

    def flush(self) -> None:
        """Nothing is buffered."""

    def close(self) -> None:
        """Close the file."""
        os.close(self._fd)


class Recorder:
    """Appends one group's observations to a stream it does not own, flushing every line.

    The session's header goes out with the first observation, so a recording that cannot be
    written at start (a full disk) is retried at every append and still starts with its header.
    """

    def __init__(self, stream: LineSink, group: str, started_at: float) -> None:
        self._stream = stream
        self.group = group
        header = {
            "format": FORMAT,
            "version": VERSION,
            "group": group,
            "started_at": _number(started_at),
        }
        self._header: str | None = json.dumps(header, allow_nan=False)

    def append(self, observation: Observation) -> None:
        """Write one observation line (the cycle's `at` is the observation's own), redacted:
        probe and scrape errors quote the URL they used, userinfo included.

        Raises OSError when the line cannot be written; the next append writes what is pending.
        """
        if self._header is not None:
            self._write(self._header)
            self._header = None
        body = redact_value(json.loads(_OBSERVATION.dump_json(observation)))
        line = {"at": _number(observation.at), "observation": body}
        self._write(json.dumps(line, allow_nan=False))

    def _write(self, line: str) -> None:
        self._stream.write(line + "\n")
        self._stream.flush()


def _error(path: Path, line: int, reason: str) -> RecordingError:
    return RecordingError(f"{path}:{line}: {reason}")


def _header(path: Path, line: int, data: dict[str, Any]) -> RecordingHeader:
    if data.get("format") != FORMAT:
        raise _error(path, line, f"not a {FORMAT} header (format={data.get('format')!r})")
    if data.get("version") != VERSION:
        raise _error(
            path,
            line,
            f"unsupported recording version {data.get('version')!r} "
            f"(this watchdog reads version {VERSION})",
        )
    group = data.get("group")
    started_at = data.get("started_at")
    if not isinstance(group, str) or not group:
        raise _error(path, line, "header has no group name")
    if not isinstance(started_at, int | float) or isinstance(started_at, bool):
        raise _error(path, line, "header has no numeric started_at")
    return RecordingHeader(group=group, started_at=float(started_at), line=line)


def _observation(path: Path, line: int, data: dict[str, Any]) -> RecordedObservation:
    at = data.get("at")
    if "observation" not in data:
        raise _error(path, line, "expected a header or an observation line (no 'observation' key)")
    if not isinstance(at, int | float) or isinstance(at, bool):
        raise _error(path, line, "observation line has no numeric 'at'")
    try:
        observation = _OBSERVATION.validate_python(data["observation"])
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(part) for part in first["loc"]) or "(observation)"
        raise _error(
            path,
            line,
            f"invalid observation: {where}: {first['msg']} ({exc.error_count()} error(s))",
        ) from None
    return RecordedObservation(at=float(at), observation=observation, line=line)


def read_entries(path: Path | str) -> Iterator[RecordingHeader | RecordedObservation]:
    """Every header and observation of a recording, in file order."""
    file = Path(path)
    try:
        handle = file.open(encoding="utf-8")
    except OSError as exc:
        raise RecordingError(f"{file}: cannot read: {exc.strerror}") from None
    with handle:
        seen_header = False
        pending: tuple[int, str] | None = None
        try:
            for number, text in enumerate(handle, start=1):
                if pending is not None:
                    yield from _entry(file, *pending, torn_ok=False, header_seen=seen_header)
                    seen_header = True
                pending = (number, text)
            if pending is not None:
                yield from _entry(file, *pending, torn_ok=True, header_seen=seen_header)
        except UnicodeDecodeError:
            raise RecordingError(f"{file}: not UTF-8 text") from None


def _entry(
    path: Path, line: int, text: str, *, torn_ok: bool, header_seen: bool
) -> Iterator[RecordingHeader | RecordedObservation]:
    if not text.strip():
        if not header_seen:
            raise _error(path, line, f"empty line where the {FORMAT} header is expected")
        return
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        if torn_ok and not text.endswith("\n"):
            return  # the daemon was killed mid-write: a torn last line
        raise _error(path, line, f"not JSON: {exc.msg} (column {exc.colno})") from None
    if not isinstance(data, dict):
        raise _error(path, line, "expected a JSON object")
    if "format" in data:
        yield _header(path, line, data)
        return
    if not header_seen:
        raise _error(path, line, f"not a {FORMAT} file: the first line must be its header")
    yield _observation(path, line, data)


def read_header(path: Path | str) -> RecordingHeader:
    """The first header of a recording (RecordingError if there is none)."""
    for entry in read_entries(path):
        if isinstance(entry, RecordingHeader):
            return entry
        break
    raise RecordingError(f"{path}: empty recording (no {FORMAT} header)")


def read_recording(path: Path | str, group: str | None = None) -> Iterator[Observation]:
    """The recorded observations, in order; only `group`'s when given."""
    for entry in read_entries(path):
        if isinstance(entry, RecordedObservation) and (
            group is None or entry.observation.group == group
        ):
            yield entry.observation
