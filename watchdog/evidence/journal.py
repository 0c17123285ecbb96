"""The last journal lines of a unit (journalctl) and what they say: batch-line age, failures."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Protocol

from watchdog.evidence.batchlines import is_progress_batch_line
from watchdog.evidence.blocking import CommandRunner, run_command
from watchdog.evidence.records import JournalExcerpt
from watchdog.redact import redact_text

# An SGLang scheduler with requests in flight prints a batch line at least every few seconds; while
# stalled it prints only the one-token batch of each /health check, which is not progress
# (watchdog/evidence/batchlines.py).
# Error signatures from SGLang's disaggregation and scheduler paths (docs/sglang.md §5, §7.5).
FAILURE_SIGNATURES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("transfer_failed", re.compile(r"transfer failed for request")),
    ("bootstrap_failed", re.compile(r"bootstrap failed for request")),
    ("kvpoll_timeout", re.compile(r"timed out after [\d.]+ ?s in KVPoll")),
    ("lost_prefill_connection", re.compile(r"Lost connection with prefill instance")),
    ("scheduler_watchdog_timeout", re.compile(r"Scheduler watchdog timeout")),
    ("health_check_failed", re.compile(r"Health check failed")),
)
# journalctl -o short-iso: "2026-11-29T07:45:01+0000" (systemd 252) or "...+00:00" (newer).
_SHORT_ISO = re.compile(r"^(\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:\.\d+)?)(Z|[+-]\d{2}:?\d{2})\s")

DEFAULT_MAX_BYTES = 512 * 1024


@dataclass(frozen=True, slots=True)
class JournalSummary:
    """What an excerpt says about progress and failures."""

    # Journal time of the newest Prefill/Decode batch line, /health's one-token batches left out.
    last_batch_at: float | None = None
    last_batch_line: str = ""
    failures: tuple[tuple[str, int], ...] = ()  # (signature, lines), only signatures seen


class JournalReader(Protocol):
    """Reads the tail of a unit's journal; returns unavailable instead of raising."""

    async def read_journal(self, unit: str, lines: int, timeout_seconds: float) -> JournalExcerpt:
        """The last `lines` lines of `unit`, within `timeout_seconds`."""
        ...


def parse_short_iso(line: str) -> float | None:
    """The unix time of a `journalctl -o short-iso` line, or None if it does not start with one."""
    match = _SHORT_ISO.match(line)
    if match is None:
        return None
    stamp, zone = match.groups()
    if zone == "Z":
        zone = "+00:00"
    elif ":" not in zone:
        zone = f"{zone[:3]}:{zone[3:]}"
    try:
        return datetime.fromisoformat(stamp + zone).timestamp()
    except ValueError:
        return None


def summarise_journal(text: str) -> JournalSummary:
    """The newest batch line that is not a /health check's (with its journal time) and
    failure-signature counts of an excerpt."""
    last_at: float | None = None
    last_line = ""
    counts: dict[str, int] = {}
    for line in text.splitlines():
        if is_progress_batch_line(line):
            stamp = parse_short_iso(line)
            if stamp is not None:
                last_at, last_line = stamp, line
        for name, pattern in FAILURE_SIGNATURES:
            if pattern.search(line):
                counts[name] = counts.get(name, 0) + 1
    failures = tuple((name, counts[name]) for name, _ in FAILURE_SIGNATURES if name in counts)
    return JournalSummary(last_at, last_line, failures)


def cap_tail(text: str, max_bytes: int) -> tuple[str, bool]:
    """The newest whole lines of `text` fitting in `max_bytes` (UTF-8), and whether any were cut."""
    data = text.encode("utf-8")
    if len(data) <= max_bytes:
        return text, False
    tail = data[-max_bytes:]
    newline = tail.find(b"\n")
    if newline != -1:
        tail = tail[newline + 1 :]
    return tail.decode("utf-8", "ignore"), True


class JournalctlReader:
    """JournalReader over `journalctl -u UNIT -n N -o short-iso --no-pager`.

    `directory` reads the journal files there instead of the system journal (`--directory`: the
    systemd test sandbox's journal, seen from outside its namespace). `runner` runs the command:
    on this host by default, on a remote one over its SSH connection (the same parsing either way).
    """

    def __init__(
        self,
        binary: str = "journalctl",
        max_bytes: int = DEFAULT_MAX_BYTES,
        directory: Path | None = None,
        runner: CommandRunner = run_command,
    ) -> None:
        self.binary = binary
        self.runner = runner
        self.max_bytes = max_bytes
        self.directory = directory

    async def read_journal(self, unit: str, lines: int, timeout_seconds: float) -> JournalExcerpt:
        """The tail of `unit`'s journal; unavailable when journalctl or the journal is missing."""
        where = () if self.directory is None else (f"--directory={self.directory}",)
        result = await self.runner(
            (self.binary, *where, "-u", unit, "-n", str(lines), "-o", "short-iso", "--no-pager"),
            timeout_seconds,
            # journalctl itself honours -n; the byte cap only guards against absurd line lengths.
            max_output_bytes=4 * self.max_bytes,
        )
        if result.returncode is None:
            return JournalExcerpt(unit, ok=False, detail=result.error)
        return interpret_journalctl(
            unit,
            result.returncode,
            result.stdout.decode("utf-8", "replace"),
            result.stderr.decode("utf-8", "replace"),
            self.max_bytes,
        )


def interpret_journalctl(
    unit: str, returncode: int, stdout: str, stderr: str, max_bytes: int = DEFAULT_MAX_BYTES
) -> JournalExcerpt:
    """Turn journalctl's exit status and output into an excerpt (pure, for tests), redacted:
    SGLang logs its server_args at start-up, `api_key='...'` included."""
    err = redact_text(stderr.strip())
    # journalctl exits 0 and says this on stderr when journald never ran (containers, the sandbox).
    if "No journal files were found" in err:
        return JournalExcerpt(
            unit, ok=False, detail="no journal files were found (journald absent)"
        )
    if returncode != 0:
        return JournalExcerpt(
            unit, ok=False, detail=f"journalctl exited {returncode}: {err[:300] or 'no message'}"
        )
    kept = [line for line in redact_text(stdout).splitlines() if not line.startswith("-- ")]
    if not kept:
        return JournalExcerpt(unit, ok=True, detail="no entries for this unit")
    text, truncated = cap_tail("\n".join(kept) + "\n", max_bytes)
    # journalctl adds a hint when the caller lacks read access to the system journal.
    detail = err[:300] if err else ""
    return JournalExcerpt(unit, True, text, len(text.splitlines()), truncated, detail)
