"""Incident records in state_dir: evidence files, summary.json, report.md, audit log, retention.

Layout:

    <state_dir>/audit.jsonl                           one JSON line per decision and action
    <state_dir>/incidents/<UTC time>-<group>-<kind>/  one directory per incident:
        summary.json  report.md  units.json  processes.json  gpu.json  http.json  items.json
        observation.json  metrics-<role>.txt  journal-<role>.txt  stacks-<role>.txt

An incident directory is written under a hidden temporary name and renamed into place, so a
reader never sees half of one. Writing evidence never fails the action it precedes: I/O errors are
logged and the returned Incident is marked unwritten.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import stat
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import structlog

from watchdog.clock import Clock
from watchdog.errors import StateFileError, UsageError
from watchdog.evidence.classify import Classification, classify, gather_signals
from watchdog.evidence.gpu_activity import describe_devices
from watchdog.evidence.records import LOCAL_HOST, Evidence, UnitEvidence
from watchdog.evidence.report import action_result, render_report, verification_result
from watchdog.model import RUNG_ACTIONS, Observation, Reason, RestartOutcome
from watchdog.optional_io import OptionalIO
from watchdog.redact import redact_text, redact_url, redact_value
from watchdog.statefiles import utc_iso, write_json_atomic
from watchdog.statefs import (
    adopt,
    check_writer,
    open_nofollow,
    read_bounded,
    write_atomic,
)

log = structlog.get_logger("watchdog.evidence.incident")

_MIB = 1024 * 1024
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")
_ID = re.compile(r"^\d{8}T\d{6}Z-[A-Za-z0-9_.-]+$")
# A temporary directory older than this was left by a crash mid-write.
_MAX_READ_BYTES = 64 * _MIB  # summary.json and report.md are kilobytes; this bounds a planted one
_STALE_TMP_SECONDS = 3600.0


class SilenceRecord(Protocol):
    """What an incident records of an Alertmanager silence (watchdog/act/alertmanager.py's
    Silence; evidence does not import act)."""

    @property
    def id(self) -> str: ...

    @property
    def starts_at(self) -> float: ...

    @property
    def ends_at(self) -> float: ...

    def texts(self) -> list[str]:
        """The matchers as written in the config."""
        ...


class UnknownIncident(UsageError):
    """No incident with that id in the state directory (exit 2)."""


def sanitise(name: str, max_length: int = 64) -> str:
    """`name` made safe as one path component: [A-Za-z0-9_.-], no leading dot, bounded length."""
    cleaned = _UNSAFE.sub("_", name).lstrip(".")[:max_length]
    return cleaned or "unnamed"


def incident_time(at: float) -> str:
    """The UTC time stamp that starts an incident id, e.g. 20261129T074501Z."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(at))


@dataclass(frozen=True, slots=True)
class Incident:
    """A handle on one incident directory."""

    id: str
    path: Path
    group: str
    kind: str
    opened_at: float
    written: bool = True  # False: the directory could not be written (disk full, permissions)


@dataclass(frozen=True, slots=True)
class IncidentListing:
    """One row of `watchdog incidents`."""

    id: str
    opened_at: float | None
    group: str
    kind: str
    action: str
    verification: str


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return value


def _dump(data: Any) -> str:
    # Every JSON file of an incident is written here: redacted (watchdog/redact.py) on the way.
    return json.dumps(redact_value(_jsonable(data)), indent=2, default=str) + "\n"


def _stacks_text(unit: UnitEvidence) -> str:
    parts = []
    for dump in unit.stacks:
        header = f"===== PID {dump.pid}" + ("" if dump.ok else f" (unavailable: {dump.detail})")
        parts.append(header + (" [truncated]" if dump.truncated else "") + "\n" + dump.text)
    return "\n".join(parts)


def evidence_files(evidence: Evidence, observation: Observation | None) -> dict[str, str]:
    """File name -> content of every evidence file of an incident (pure)."""
    units = [
        {
            "role": u.role,
            "worker": u.label,
            "unit": u.unit,
            "state": u.state,
            "drift": u.drift,
            "drift_checked": u.drift_checked,
            "journal": None
            if u.journal is None
            else {
                "ok": u.journal.ok,
                "detail": u.journal.detail,
                "lines": u.journal.lines,
                "truncated": u.journal.truncated,
            },
            "last_batch_at": u.last_batch_at,
            "last_batch_age_seconds": u.last_batch_age_seconds,
            "last_batch_line": u.last_batch_line,
            "journal_failures": dict(u.journal_failures),
            "host": u.host,
        }
        for u in evidence.units
    ]
    processes = [
        {
            "role": u.role,
            "worker": u.label,
            "unit": u.unit,
            "host": u.host,
            "processes": u.processes,
            "environ": dict(u.environ),
        }
        for u in evidence.units
    ]
    files = {
        "units.json": _dump(units),
        "processes.json": _dump(processes),
        "gpu.json": _dump(evidence.gpu),
        **{f"gpu-{sanitise(h.host)}.json": _dump(h.reading) for h in evidence.remote_gpus},
        "http.json": _dump(evidence.http),
        "items.json": _dump(evidence.items),
        "drift.json": _dump(evidence.drift),
    }
    if observation is not None:
        files["observation.json"] = _dump(observation)
    for metrics in evidence.metrics:
        if metrics.ok:
            note = (
                f"# truncated: first bytes of {metrics.total_bytes}\n" if metrics.truncated else ""
            )
            files[f"metrics-{metrics.role}.txt"] = metrics.text + ("\n" + note if note else "")
    for unit in evidence.units:
        if unit.journal is not None and unit.journal.ok and unit.journal.text:
            files[f"journal-{unit.slug}.txt"] = unit.journal.text
        if any(d.ok for d in unit.stacks):
            files[f"stacks-{unit.slug}.txt"] = _stacks_text(unit)
    # Journal tails quote SGLang's server_args (api_key='...'); _dump redacts the JSON files.
    return {
        name: text if name.endswith(".json") else redact_text(text) for name, text in files.items()
    }


def _symptoms(evidence: Evidence, observation: Observation, verdict: str) -> list[str]:
    signals = gather_signals(evidence, observation, verdict)
    out: list[str] = []
    for unit in evidence.units:
        state = unit.state
        if state is not None and state.ok:
            started = (
                f", started {utc_iso(state.exec_main_start_us / 1e6)}"
                if state.exec_main_start_us
                else ""
            )
            out.append(
                f"{unit.label} ({unit.unit}): {state.active_state}/{state.sub_state}, "
                f"MainPID {state.main_pid}{started}, NRestarts {state.n_restarts}"
            )
        if unit.last_batch_age_seconds is not None:
            out.append(
                f"{unit.label}: last batch line {unit.last_batch_age_seconds:.0f} s before "
                "capture: "
                f"`{unit.last_batch_line.strip()[-200:]}`"
            )
    for item in evidence.http:
        took = f" in {item.duration_seconds:.2f} s" if item.ok else ""
        status = f"HTTP {item.status_code}{took}" if item.ok else f"no answer ({item.detail})"
        out.append(f"{item.name.replace('_', ' ')}: {status}")
    out += [f"pending: {p}" for p in signals.pending]
    out += [f"no progress: {p}" for p in signals.no_progress]
    out += [f"progress: {p}" for p in signals.progress]
    out += [f"failures: {f}" for f in signals.failures]
    out += [f"router: {p}" for p in signals.router_problems]
    if evidence.gpu.ok:
        out.append(f"GPUs ({evidence.gpu.source}): {describe_devices(evidence.gpu.devices)}")
    else:
        out.append(f"GPUs: unavailable ({evidence.gpu.detail})")
    for remote in evidence.remote_gpus:
        reading = remote.reading
        out.append(
            f"GPUs on {remote.host} ({reading.source}): {describe_devices(reading.devices)}"
            if reading.ok
            else f"GPUs on {remote.host}: unavailable ({reading.detail})"
        )
    out += [f"config drift: {d.message}" for d in evidence.drift]
    return out


def host_rows(evidence: Evidence) -> list[dict[str, str]]:
    """Per role, the host its unit runs on and what was captured there; [] when all are local."""
    if all(u.host == LOCAL_HOST for u in evidence.units):
        return []
    rows = []
    for unit in evidence.units:
        journal = unit.journal
        if journal is None:
            journal_text = "not captured"
        else:
            journal_text = (
                f"{journal.lines} line(s)" if journal.ok else f"unavailable: {journal.detail}"
            )
        main = unit.processes[0] if unit.processes else None
        if main is None:
            process = "not captured"
        else:
            process = main.error or f"PID {main.pid}: {' '.join(main.cmdline)[:200]}"
        gpu = evidence.gpu_of(unit)
        rows.append(
            {
                "role": unit.label,
                "unit": unit.unit,
                "host": unit.host,
                "journal": journal_text,
                "main_process": process,
                "gpus": f"{gpu.source}: {len(gpu.devices)} GPU(s)" if gpu.ok else gpu.detail,
            }
        )
    return rows


def _timeline(
    evidence: Evidence, observation: Observation, opened_at: float, kind: str
) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []

    def add(at: float | None, event: str) -> None:
        if at:
            events.append({"at": at, "utc": utc_iso(at), "event": event})

    for unit in evidence.units:
        if unit.started_at:
            restarts = unit.state.n_restarts if unit.state is not None else 0
            add(unit.started_at, f"{unit.label} unit started (NRestarts {restarts})")
        if unit.last_batch_at:
            add(unit.last_batch_at, f"last {unit.label} batch line")
    if observation.probes_in_flight:
        add(
            observation.at - observation.oldest_probe_in_flight_seconds,
            f"oldest of {observation.probes_in_flight} probe(s) still in flight started",
        )
    for probe in observation.probes:
        if not probe.ok:
            add(probe.started_at, f"{probe.kind} probe via {probe.target} failed: {probe.reason}")
    add(evidence.started_at, "evidence capture started")
    add(evidence.finished_at, f"evidence captured ({len(evidence.unavailable)} item(s) missing)")
    add(opened_at, f"incident opened: {kind}")
    return events


class IncidentStore:
    """Writes, updates, lists and prunes incidents under `state_dir`; appends the audit log."""

    def __init__(
        self,
        state_dir: Path | str,
        keep: int,
        max_mib: float,
        *,
        clock: Clock = time.time,
        optional_io: OptionalIO | None = None,
    ) -> None:
        self.state_dir = Path(state_dir)
        # Incidents and the audit log never fail what they record: failures are counted and
        # logged once per episode (a full disk fails every write until it is cleared).
        self.optional_io = optional_io if optional_io is not None else OptionalIO()
        self.root = self.state_dir / "incidents"
        self.audit_path = self.state_dir / "audit.jsonl"
        self.keep = keep
        self.max_bytes = int(max_mib * _MIB)
        self.clock = clock

    # ------------------------------------------------------------------ write
    def open_incident(
        self,
        *,
        group: str,
        evidence: Evidence,
        decision_reasons: Sequence[Reason] = (),
        now: float,
        kind: str | None = None,
        classification: Classification | None = None,
        observation: Observation | None = None,
        verdict: str = "",
    ) -> Incident:
        """Write a new incident directory (classifying the evidence if no classification is
        given), append `incident_opened` to the audit log and prune old incidents."""
        obs = observation if observation is not None else Observation(group=group, at=now)
        if classification is None:
            classification = classify(evidence, obs, verdict)
        kind = kind or str(classification.kind)
        incident_id = self._new_id(now, group, kind)
        path = self.root / incident_id
        summary: dict[str, Any] = {
            "schema": 1,
            "id": incident_id,
            "group": group,
            "kind": kind,
            "verdict": verdict,
            "opened_at": now,
            "opened_at_utc": utc_iso(now),
            "decision_reasons": _jsonable(list(decision_reasons)),
            "classification": _jsonable(classification),
            "symptoms": _symptoms(evidence, obs, verdict),
            "timeline": _timeline(evidence, obs, now, kind),
            "evidence": {
                "started_at": evidence.started_at,
                "duration_seconds": round(evidence.finished_at - evidence.started_at, 3),
                "timeout_seconds": evidence.total_timeout_seconds,
                "unavailable": [{"name": i.name, "detail": i.detail} for i in evidence.unavailable],
                "files": [],
            },
            "action": None,
            "verification": None,
        }
        hosts = host_rows(evidence)
        if hosts:  # a group over several hosts: whose evidence came from where
            summary["hosts"] = hosts
        files = evidence_files(evidence, observation)
        summary["evidence"]["files"] = sorted([*files, "summary.json", "report.md"])
        written = self._write_new(path, files, summary)
        incident = Incident(incident_id, path, group, kind, now, written)
        self.audit(
            "incident_opened",
            id=incident_id,
            group=group,
            kind=kind,
            verdict=verdict,
            unavailable=[i.name for i in evidence.unavailable],
            written=written,
        )
        log.info("incident_opened", group=group, id=incident_id, kind=kind, path=str(path))
        if written:
            self.prune(protect=incident_id)
        return incident

    def record_action(self, incident: Incident, outcome: RestartOutcome) -> None:
        """Add the restart outcome to the incident (summary.json, report.md) and the audit log."""
        if outcome.interrupted:
            result = "interrupted"
        elif outcome.dry_run:
            result = "dry_run"
        else:
            result = "done" if outcome.ok else "failed"
        action = {
            "result": result,
            "ok": outcome.ok,
            "dry_run": outcome.dry_run,
            "trigger": outcome.plan.trigger,
            "rung": str(outcome.plan.rung),
            "why": outcome.plan.why,
            "started_at": outcome.started_at,
            "finished_at": outcome.finished_at,
            "steps": _jsonable(list(outcome.steps)),
        }
        events = []
        for step in outcome.steps:
            if step.started_at:
                events.append((step.started_at, f"{step.role} restart started ({step.unit})"))
            if step.clear:
                events.append(
                    (step.started_at, f"{step.role} stopped, before its start: {step.clear}")
                )
            if step.finished_at:
                state = "ok" if step.ok else f"FAILED at {step.phase}: {step.detail}"
                events.append((step.finished_at, f"{step.role} restart finished: {state}"))
        what = RUNG_ACTIONS[outcome.plan.rung]
        events.append((outcome.finished_at, f"{what} {result}"))

        def update(summary: dict[str, Any]) -> None:
            summary["action"] = action
            summary["timeline"].extend(
                {"at": at, "utc": utc_iso(at), "event": text} for at, text in events if at
            )

        self._update(incident, update)
        failed = outcome.failed_step
        self.audit(
            "action_recorded",
            id=incident.id,
            group=incident.group,
            result=result,
            steps=[f"{s.role}:{'ok' if s.ok else s.phase}" for s in outcome.steps],
            failed_step=None if failed is None else f"{failed.role}: {failed.detail}",
        )

    def record_verification(
        self,
        incident: Incident,
        passed: bool,
        detail: str,
        now: float,
        soak: Mapping[str, float | str] | None = None,
    ) -> None:
        """Add the verification result to the incident and the audit log.

        `soak`: how far the soak got (probes passed, seconds, the group's counters) and, on a
        relapse inside it, its cause (docs/decisions.md, "Verification is a soak").
        """

        def update(summary: dict[str, Any]) -> None:
            summary["verification"] = {"passed": passed, "detail": detail, "at": now}
            if soak is not None:
                summary["verification"]["soak"] = dict(soak)
            summary["timeline"].append(
                {
                    "at": now,
                    "utc": utc_iso(now),
                    "event": f"verification {'passed' if passed else 'FAILED'}: {detail}",
                }
            )

        self._update(incident, update)
        self.audit(
            "verification_recorded",
            id=incident.id,
            group=incident.group,
            passed=passed,
            detail=detail,
            **({"soak": dict(soak)} if soak is not None else {}),
        )

    def record_silence(self, incident: Incident, silence: SilenceRecord, url: str) -> None:
        """Add the Alertmanager silence taken for the co-restart, so an operator finds it."""
        record = {
            "id": silence.id,
            "url": redact_url(url),
            "matchers": silence.texts(),
            "ends_at": silence.ends_at,
            "expired_at": None,
        }

        def update(summary: dict[str, Any]) -> None:
            summary["silence"] = record
            summary["timeline"].append(
                {
                    "at": silence.starts_at,
                    "utc": utc_iso(silence.starts_at),
                    "event": f"Alertmanager silence {silence.id} created "
                    f"({', '.join(silence.texts())})",
                }
            )

        self._update(incident, update)
        self.audit("silence_recorded", id=incident.id, group=incident.group, silence=record)

    def record_silence_expired(self, incident: Incident, why: str) -> None:
        """The silence of the incident was expired (the group left restarting/verifying)."""
        now = self.clock()

        def update(summary: dict[str, Any]) -> None:
            if isinstance(summary.get("silence"), dict):
                summary["silence"]["expired_at"] = now
            summary["timeline"].append(
                {"at": now, "utc": utc_iso(now), "event": f"Alertmanager silence expired: {why}"}
            )

        self._update(incident, update)

    def audit(self, event: str, **fields: Any) -> None:
        """Append one JSON line {"ts", "utc", "event", **fields} to audit.jsonl; never raises."""
        now = self.clock()
        record = redact_value({"ts": now, "utc": utc_iso(now), "event": event, **_jsonable(fields)})
        line = (json.dumps(record, default=str, sort_keys=False) + "\n").encode()
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            owner = check_writer(self.state_dir)
            fd = open_nofollow(self.audit_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            try:
                adopt(fd, owner)
                os.write(fd, line)  # one write of an O_APPEND fd: lines never interleave
            finally:
                os.close(fd)
        except (OSError, StateFileError) as exc:  # StateFileError: a symlink, the wrong user
            self.optional_io.failed("audit", "audit_write_failed", exc, path=str(self.audit_path))
        else:
            self.optional_io.succeeded("audit")

    # ------------------------------------------------------------------ read
    def list_incidents(self, last: int | None = None) -> tuple[IncidentListing, ...]:
        """Incidents newest first (at most `last`), from their summary.json where readable."""
        ids = self._ids()
        if last is not None:
            ids = ids[-last:] if last > 0 else []
        rows = []
        for incident_id in reversed(ids):
            summary = self._read_summary(self.root / incident_id)
            if summary is None:
                rows.append(IncidentListing(incident_id, None, "?", "?", "?", "?"))
                continue
            rows.append(
                IncidentListing(
                    incident_id,
                    summary.get("opened_at"),
                    str(summary.get("group", "?")),
                    str(summary.get("kind", "?")),
                    action_result(summary),
                    verification_result(summary),
                )
            )
        return tuple(rows)

    def read_report(self, incident_id: str) -> str:
        """report.md of one incident; UnknownIncident (exit 2) when there is none."""
        path = self._path_of(incident_id)
        try:
            raw = read_bounded(path / "report.md", _MAX_READ_BYTES)
        except (OSError, StateFileError, ValueError):
            raw = None
        if raw is not None:
            return raw.decode("utf-8", errors="replace")
        summary = self._read_summary(path)
        if summary is not None:
            return render_report(summary)
        raise self._unknown(incident_id)

    # ------------------------------------------------------------------ retention
    def prune(self, protect: str | None = None) -> tuple[str, ...]:
        """Delete the oldest incidents beyond `keep` and beyond `max_mib` in total.

        The newest incident (`protect`) is never deleted, even when it alone exceeds the size cap:
        the evidence of the wedge at hand matters more than the cap.
        """
        self._remove_stale_temporaries()
        ids = self._ids()
        removed: list[str] = []
        excess = max(0, len(ids) - self.keep)
        for incident_id in ids[:excess]:
            if incident_id != protect:
                removed.append(incident_id)
        remaining = [i for i in ids if i not in removed]
        sizes = {i: _dir_size(self.root / i) for i in remaining}
        total = sum(sizes.values())
        for incident_id in list(remaining):
            if total <= self.max_bytes:
                break
            if incident_id == protect or len(remaining) <= 1:
                continue
            removed.append(incident_id)
            remaining.remove(incident_id)
            total -= sizes[incident_id]
        for incident_id in removed:
            _remove_entry(self.root / incident_id)
        if removed:
            log.info("incidents_pruned", removed=removed, kept=len(remaining))
            self.audit("incidents_pruned", removed=removed, kept=len(remaining))
        return tuple(removed)

    # ------------------------------------------------------------------ internals
    def _ids(self) -> list[str]:
        """Incident ids, oldest first (ids start with their UTC time); real directories only.

        A symlink under an incident's name is not one of ours: it is never followed (listed,
        read, sized or pruned), only reported.
        """
        if not self._root_is_real():
            return []
        ids = []
        with os.scandir(self.root) as entries:
            for entry in entries:
                if not _ID.match(entry.name):
                    continue
                if entry.is_symlink():
                    log.error(
                        "state_file_refused",
                        path=entry.path,
                        error="a symbolic link where an incident directory belongs; not followed",
                    )
                elif entry.is_dir(follow_symlinks=False):
                    ids.append(entry.name)
        return sorted(ids)

    def _root_is_real(self) -> bool:
        """Whether `incidents/` is a real directory (False when absent; a symlink is logged)."""
        try:
            mode = os.lstat(self.root).st_mode
        except FileNotFoundError:
            return False
        except OSError as exc:
            log.error("state_file_refused", path=str(self.root), error=str(exc))
            return False
        if stat.S_ISDIR(mode):
            return True
        log.error(
            "state_file_refused",
            path=str(self.root),
            error="not a directory (a symbolic link is never followed): remove it",
        )
        return False

    def _path_of(self, incident_id: str) -> Path:
        if not _ID.match(incident_id) or not _is_real_dir(self.root / incident_id):
            raise self._unknown(incident_id)
        return self.root / incident_id

    def _unknown(self, incident_id: str) -> UnknownIncident:
        return UnknownIncident(
            f"no incident {incident_id!r} in {self.root} (`watchdog incidents` lists them)"
        )

    def _new_id(self, now: float, group: str, kind: str) -> str:
        base = f"{incident_time(now)}-{sanitise(group)}-{sanitise(kind, 32)}"
        candidate, n = base, 1
        # lexists: a dangling link planted under the name is taken too (and never written).
        while os.path.lexists(self.root / candidate) or os.path.lexists(
            self.root / f".tmp-{candidate}"
        ):
            n += 1
            candidate = f"{base}-{n}"
        return candidate

    def _write_new(self, path: Path, files: dict[str, str], summary: dict[str, Any]) -> bool:
        tmp = path.with_name(f".tmp-{path.name}")
        created = False
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            if not self._root_is_real():
                raise OSError(f"{self.root} is not a real directory; nothing is written through it")
            tmp.mkdir(mode=0o750)  # fails on anything already there, a planted link included
            created = True
            for name, content in files.items():
                (tmp / name).write_text(content, encoding="utf-8")
            (tmp / "summary.json").write_text(_dump(summary), encoding="utf-8")
            (tmp / "report.md").write_text(render_report(summary), encoding="utf-8")
            os.replace(tmp, path)
        except OSError as exc:
            self.optional_io.failed("incident", "incident_write_failed", exc, path=str(path))
            if created:
                _remove_entry(tmp)
            return False
        self.optional_io.succeeded("incident")
        return True

    def _update(self, incident: Incident, change: Callable[[dict[str, Any]], None]) -> None:
        if not _is_real_dir(incident.path):
            log.error("incident_update_failed", id=incident.id, error="not a real directory")
            return
        summary = self._read_summary(incident.path)
        if summary is None:
            log.error("incident_update_failed", id=incident.id, error="summary.json unreadable")
            return
        change(summary)
        summary = redact_value(summary)  # an action's step details quote error bodies
        try:
            write_json_atomic(incident.path / "summary.json", summary)
            _write_text_atomic(incident.path / "report.md", render_report(summary))
        except (StateFileError, OSError) as exc:
            self.optional_io.failed("incident", "incident_update_failed", exc, id=incident.id)
        else:
            self.optional_io.succeeded("incident")

    @staticmethod
    def _read_summary(path: Path) -> dict[str, Any] | None:
        try:
            raw = read_bounded(path / "summary.json", _MAX_READ_BYTES)
            data = json.loads(raw) if raw is not None else None
        except (OSError, StateFileError, ValueError, RecursionError):
            return None
        return data if isinstance(data, dict) else None

    def _remove_stale_temporaries(self) -> None:
        if not self._root_is_real():
            return
        for entry in self.root.iterdir():
            if entry.name.startswith(".tmp-"):
                with contextlib.suppress(OSError):
                    if self.clock() - os.lstat(entry).st_mtime > _STALE_TMP_SECONDS:
                        _remove_entry(entry)


def _dir_size(path: Path) -> int:
    total = 0
    for root, _, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def _write_text_atomic(path: Path, text: str) -> None:
    write_atomic(path, redact_text(text).encode("utf-8"))


def _is_real_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _remove_entry(path: Path) -> None:
    """Delete an incident (or leftover temporary): rmtree for a real directory, unlink for
    anything else, a symlink included, so retention never deletes what a link points to."""
    try:
        mode = os.lstat(path).st_mode
        if stat.S_ISDIR(mode):
            # rmtree never follows links inside the tree either (fd-based on Linux).
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except OSError as exc:
        log.error("incident_remove_failed", path=str(path), error=str(exc))
