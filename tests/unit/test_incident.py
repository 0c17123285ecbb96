"""Incident records: directory layout, summary and report, audit log, retention, and the CLI."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from tests.unit import configs
from tests.unit.evidence_helpers import (
    NOW,
    UNITS,
    evidence,
    gpu,
    metrics,
    observation,
    reading,
    unit_evidence,
    unit_state,
)
from watchdog.cli import main
from watchdog.evidence.classify import IncidentKind, classify
from watchdog.evidence.incident import IncidentStore, UnknownIncident, sanitise
from watchdog.evidence.records import Evidence, ItemStatus, JournalExcerpt, MetricsText
from watchdog.evidence.report import render_report
from watchdog.model import (
    Observation,
    ProbeFailure,
    ProbeKind,
    ProbeResult,
    Reason,
    RestartOutcome,
    RestartPlan,
    RestartStep,
    Role,
    Rung,
    StepResult,
)
from watchdog.optional_io import OptionalIO

STALLED_OBSERVATION = observation(
    metrics=(
        metrics(Role.PREFILL, inflight_queue=3.0),
        metrics(Role.DECODE, http_requests_active=2.0),
    ),
    probes=(
        ProbeResult(
            ProbeKind.COMPLETION, "router", False, ProbeFailure.TIMEOUT_BEFORE_HEADERS, NOW - 25, 20
        ),
    ),
)
REASONS = (Reason("probe_failures", "3 consecutive probes failed", (("failures", 3.0),)),)


def _evidence(metrics_bytes: int = 0) -> Evidence:
    decode_journal = JournalExcerpt(
        UNITS[Role.DECODE],
        True,
        "2026-11-29T07:40:00+0000 h python[2]: Decode batch, #running-req: 3, #transfer-req: 2\n",
        1,
    )
    units = (
        unit_evidence(Role.PREFILL, batch_age=300.0),
        unit_evidence(Role.DECODE, batch_age=312.0).__class__(
            role=Role.DECODE,
            unit=UNITS[Role.DECODE],
            state=unit_state(Role.DECODE, pid=222),
            environ=(("SGLANG_API_KEY", "***"), ("SGLANG_FOO", "1")),
            journal=decode_journal,
            last_batch_at=NOW - 312,
            last_batch_age_seconds=312.0,
            last_batch_line=decode_journal.text.strip(),
        ),
        unit_evidence(Role.ROUTER),
    )
    base = evidence(
        units=units,
        gpu_reading=reading(gpu(0, 165)),
        items=(ItemStatus("journal:prefill", False, "no journal files were found"),),
    )
    text = "sglang:num_prefill_inflight_queue_reqs 3\n" + "#" * metrics_bytes
    return Evidence(
        **{
            **{f: getattr(base, f) for f in base.__dataclass_fields__},
            "metrics": (MetricsText(Role.PREFILL, True, text, False, len(text)),),
        }
    )


def _store(tmp_path: Path, keep: int = 50, max_mib: float = 200) -> IncidentStore:
    return IncidentStore(tmp_path / "state", keep=keep, max_mib=max_mib, clock=lambda: NOW)


def _open(store: IncidentStore, at: float = NOW, **kwargs: object):  # type: ignore[no-untyped-def]
    ev = kwargs.pop("evidence", None) or _evidence()
    obs = kwargs.pop("observation", STALLED_OBSERVATION)
    assert isinstance(obs, Observation)
    return store.open_incident(
        group="dsv4",
        evidence=ev,  # type: ignore[arg-type]
        observation=obs,
        decision_reasons=REASONS,
        verdict="silent_stall",
        now=at,
        **kwargs,  # type: ignore[arg-type]
    )


def _outcome(ok: bool = True, dry_run: bool = False) -> RestartOutcome:
    steps = tuple(RestartStep(role, UNITS[role], f"http://x/{role}", 900) for role in Role)
    plan = RestartPlan("dsv4", "silent_stall", steps)
    results = (
        StepResult(Role.PREFILL, UNITS[Role.PREFILL], True, "ready", "", NOW + 1, NOW + 40),
        StepResult(
            Role.DECODE,
            UNITS[Role.DECODE],
            ok,
            "ready" if ok else "active",
            "" if ok else "unit failed",
            NOW + 40,
            NOW + 80,
        ),
    )
    return RestartOutcome(plan, ok, dry_run, results, NOW + 1, NOW + 80)


def test_incident_directory_and_files(tmp_path: Path) -> None:
    """The directory is <UTC time>-<group>-<kind> and holds every evidence file and the report."""
    incident = _open(_store(tmp_path))
    assert incident.id == "20261130T005320Z-dsv4-transfer_stall"
    assert incident.written
    names = sorted(p.name for p in incident.path.iterdir())
    assert names == [
        "drift.json",
        "gpu.json",
        "http.json",
        "items.json",
        "journal-decode.txt",
        "journal-prefill.txt",
        "metrics-prefill.txt",
        "observation.json",
        "processes.json",
        "report.md",
        "summary.json",
        "units.json",
    ]
    processes = json.loads((incident.path / "processes.json").read_text())
    assert processes[1]["environ"] == {"SGLANG_API_KEY": "***", "SGLANG_FOO": "1"}
    units = json.loads((incident.path / "units.json").read_text())
    assert units[1]["state"]["main_pid"] == 222
    assert units[1]["last_batch_age_seconds"] == 312.0


def test_summary_and_report_contents(tmp_path: Path) -> None:
    """summary.json and report.md carry the classification, ruled-out list, symptoms, timeline."""
    incident = _open(_store(tmp_path))
    summary = json.loads((incident.path / "summary.json").read_text())
    assert summary["kind"] == "transfer_stall"
    assert summary["verdict"] == "silent_stall"
    assert summary["decision_reasons"][0]["code"] == "probe_failures"
    assert summary["evidence"]["unavailable"] == [
        {"name": "journal:prefill", "detail": "no journal files were found"}
    ]
    report = (incident.path / "report.md").read_text()
    for expected in (
        "# Incident 20261130T005320Z-dsv4-transfer_stall",
        "| classification | **transfer_stall** |",
        "## Ruled out",
        "not a collective hang: host GPUs: GPU 0: 0 % util, 165 W of 1000 W (idle)",
        "## Symptoms",
        "decode: last batch line 312 s before capture",
        "pending: prefill inflight (KV transfer) queue 3",
        "## Timeline (UTC)",
        "last decode batch line",
        "completion probe via router failed: timeout_before_headers",
        "## What to look at next",
        "journal:prefill: no journal files were found",
        "| action | pending |",
    ):
        assert expected in report, expected


def test_a_given_classification_is_used(tmp_path: Path) -> None:
    """The caller's classification and kind win over classifying again."""
    store = _store(tmp_path)
    ev = _evidence()
    given = classify(ev, STALLED_OBSERVATION, "decode_only_restart")
    incident = _open(store, classification=given, kind="degraded_bootstrap")
    assert incident.kind == "degraded_bootstrap"
    summary = json.loads((incident.path / "summary.json").read_text())
    assert summary["classification"]["kind"] == str(given.kind)


def test_action_and_verification_update_the_report(tmp_path: Path) -> None:
    """record_action and record_verification rewrite summary.json and report.md."""
    store = _store(tmp_path)
    incident = _open(store)
    store.record_action(incident, _outcome(ok=False))
    store.record_verification(incident, False, "0/8 probes succeeded", NOW + 400)
    summary = json.loads((incident.path / "summary.json").read_text())
    assert summary["action"]["result"] == "failed"
    assert summary["verification"] == {
        "passed": False,
        "detail": "0/8 probes succeeded",
        "at": NOW + 400,
    }
    report = (incident.path / "report.md").read_text()
    assert "| decode | sglang-dsv4-decode.service | FAILED | active | unit failed |" in report
    assert "**FAILED** at" in report
    assert "The action did not help" in report
    assert "decode restart finished: FAILED at active: unit failed" in report


def test_dry_run_is_recorded_as_such(tmp_path: Path) -> None:
    """A rehearsal's action is 'dry_run' and the report says nothing was restarted."""
    store = _store(tmp_path)
    incident = _open(store)
    store.record_action(incident, _outcome(dry_run=True))
    assert "dry run: nothing was restarted" in (incident.path / "report.md").read_text()
    assert store.list_incidents()[0].action == "dry_run"


def test_the_rung_and_why_are_recorded_in_summary_and_report(tmp_path: Path) -> None:
    """A router-only restart says so: summary.json's action has the rung and why, report.md
    shows "rung: router — why" and names the restart for what it was."""
    store = _store(tmp_path)
    incident = _open(store)
    step = RestartStep(Role.ROUTER, UNITS[Role.ROUTER], "http://x/router", 900)
    plan = RestartPlan("dsv4", "router_wedge", (step,), rung=Rung.ROUTER, why="direct PD ok")
    result = StepResult(Role.ROUTER, UNITS[Role.ROUTER], True, "ready", "", NOW + 1, NOW + 3)
    store.record_action(incident, RestartOutcome(plan, True, False, (result,), NOW + 1, NOW + 3))
    action = json.loads((incident.path / "summary.json").read_text())["action"]
    assert (action["rung"], action["why"]) == ("router", "direct PD ok")
    report = (incident.path / "report.md").read_text()
    assert "Router-only restart (router_wedge): **done** after 2.0 s" in report
    assert "rung: router — direct PD ok" in report
    assert "router-only restart done" in report  # the timeline
    assert "Co-restart" not in report


def test_a_full_rung_is_shown_and_a_summary_without_one_reads_as_full(tmp_path: Path) -> None:
    """The full co-restart shows its rung too; an action written before rungs existed
    (no "rung" key) was a full co-restart."""
    store = _store(tmp_path)
    incident = _open(store)
    store.record_action(incident, _outcome())
    summary = json.loads((incident.path / "summary.json").read_text())
    assert summary["action"]["rung"] == "full"
    report = (incident.path / "report.md").read_text()
    assert "Co-restart (silent_stall): **done**" in report
    assert "\nrung: full\n" in report  # no why given: no dash
    assert "co-restart done" in report
    del summary["action"]["rung"], summary["action"]["why"]
    assert "\nrung: full\n" in render_report(summary)


def test_audit_log_is_one_json_line_per_event(tmp_path: Path) -> None:
    """Opening, acting, verifying and explicit audit() calls each append one JSON line."""
    store = _store(tmp_path)
    store.audit("decision", group="dsv4", verdict="silent_stall", action="co_restart")
    incident = _open(store)
    store.record_action(incident, _outcome())
    store.record_verification(incident, True, "8/8", NOW + 300)
    _store(tmp_path).audit("restart_refused", group="dsv4", reason="lock_held")
    lines = (tmp_path / "state" / "audit.jsonl").read_text().splitlines()
    events = [json.loads(line)["event"] for line in lines]
    assert events == [
        "decision",
        "incident_opened",
        "action_recorded",
        "verification_recorded",
        "restart_refused",
    ]
    first = json.loads(lines[0])
    assert first["utc"] == "2026-11-30T00:53:20Z"
    assert first["verdict"] == "silent_stall"


def test_same_second_incidents_get_distinct_ids(tmp_path: Path) -> None:
    """Two incidents in one second do not collide."""
    store = _store(tmp_path)
    assert _open(store).id != _open(store).id


def test_retention_by_count(tmp_path: Path) -> None:
    """Only the newest `keep` incidents are kept; the pruning is audited."""
    store = _store(tmp_path, keep=3)
    ids = [_open(store, at=NOW + i * 60).id for i in range(5)]
    assert [row.id for row in store.list_incidents()] == ids[:1:-1]
    audit = (tmp_path / "state" / "audit.jsonl").read_text()
    assert '"incidents_pruned"' in audit


def test_retention_by_size_keeps_the_newest(tmp_path: Path) -> None:
    """Old incidents go once the total exceeds max_mib; the newest stays even if alone too big."""
    store = _store(tmp_path, max_mib=0.5)  # 512 KiB
    big = _evidence(metrics_bytes=200 * 1024)
    ids = [_open(store, at=NOW + i * 60, evidence=big).id for i in range(4)]
    kept = [row.id for row in store.list_incidents()]
    assert kept == [ids[3], ids[2]]  # two 200 KiB incidents fit, three do not
    huge = _evidence(metrics_bytes=1024 * 1024)
    newest = _open(store, at=NOW + 600, evidence=huge).id
    assert [row.id for row in store.list_incidents()] == [newest]


def test_unwritable_state_dir_never_raises(tmp_path: Path) -> None:
    """When the directory cannot be created the incident is returned unwritten, not raised."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    store = IncidentStore(blocker / "state", keep=5, max_mib=10, clock=lambda: NOW)
    incident = _open(store)
    assert not incident.written
    store.record_action(incident, _outcome())  # logs, never raises
    store.record_verification(incident, True, "ok", NOW)


def test_unknown_and_unsafe_ids_are_refused(tmp_path: Path) -> None:
    """read_report refuses ids that do not exist or try to leave the incidents directory."""
    store = _store(tmp_path)
    _open(store)
    for bad in ("20261129T000000Z-dsv4-nope", "../state", "20261130T005320Z-dsv4-x/../../etc"):
        with pytest.raises(UnknownIncident, match="no incident"):
            store.read_report(bad)


def test_listing_survives_a_corrupt_summary(tmp_path: Path) -> None:
    """An incident whose summary.json is unreadable is still listed, with unknown fields."""
    store = _store(tmp_path)
    incident = _open(store)
    (incident.path / "summary.json").write_text("{not json")
    (row,) = store.list_incidents()
    assert (row.id, row.kind, row.action) == (incident.id, "?", "?")


@pytest.mark.parametrize(
    ("name", "expected"),
    [("dsv4", "dsv4"), ("a/b", "a_b"), ("../etc", "_etc"), (".hidden", "hidden"), ("", "unnamed")],
)
def test_sanitise(name: str, expected: str) -> None:
    """Names become one safe path component."""
    assert sanitise(name) == expected


def test_kind_is_sanitised_in_the_path(tmp_path: Path) -> None:
    """A kind with path characters cannot escape the incidents directory."""
    incident = _open(_store(tmp_path), kind="../../evil kind")
    assert incident.path.parent == tmp_path / "state" / "incidents"
    assert incident.id.endswith("-dsv4-_.._evil_kind")  # one component: ".." inside is inert


# ------------------------------------------------------------------ CLI


@pytest.fixture(autouse=True)
def _reset_logging() -> Iterator[None]:
    """main() points structlog at the captured stderr; later tests must not log into it."""
    yield
    structlog.reset_defaults()


def _config(tmp_path: Path) -> Path:
    units = [f"sglang-dsv4-{role}.service" for role in ("prefill", "decode", "router")]
    overrides = {
        "watchdog": {"state_dir": str(tmp_path / "state")},
        "group": [configs.group("dsv4", units=units)],
    }
    return configs.write_config(tmp_path / "watchdog.toml", overrides)


def test_cli_lists_incidents_newest_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`watchdog incidents` prints a table with id, time, group, kind, action and verification."""
    store = _store(tmp_path)
    first = _open(store)
    second = _open(store, at=NOW + 3600)
    store.record_action(second, _outcome())
    store.record_verification(second, True, "8/8", NOW + 3900)
    capsys.readouterr()  # drop the store's log lines
    assert main(["incidents", "--config", str(_config(tmp_path))]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["ID", "TIME", "(UTC)", "GROUP", "KIND", "ACTION", "VERIFICATION"]
    assert lines[1].split() == [
        second.id,
        "2026-11-30T01:53:20Z",
        "dsv4",
        "transfer_stall",
        "done",
        "passed",
    ]
    assert lines[2].split() == [
        first.id,
        "2026-11-30T00:53:20Z",
        "dsv4",
        "transfer_stall",
        "pending",
        "pending",
    ]
    assert main(["incidents", "--config", str(_config(tmp_path)), "--last", "1"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2


def test_cli_with_no_incidents(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An empty state directory is not an error."""
    assert main(["incidents", "--config", str(_config(tmp_path))]) == 0
    assert capsys.readouterr().out.startswith("no incidents in ")


def test_cli_show_prints_the_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`watchdog incidents show ID` prints report.md, with --config before or after the id."""
    incident = _open(_store(tmp_path))
    config = str(_config(tmp_path))
    capsys.readouterr()
    assert main(["incidents", "show", incident.id, "--config", config]) == 0
    out = capsys.readouterr().out
    assert out == (incident.path / "report.md").read_text()
    assert main(["incidents", "--config", config, "show", incident.id]) == 0
    assert capsys.readouterr().out == out


def test_cli_show_unknown_id_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An unknown id is a usage error with a message naming it."""
    code = main(["incidents", "show", "20991231T000000Z-x-y", "--config", str(_config(tmp_path))])
    assert code == 2
    assert "no incident '20991231T000000Z-x-y'" in capsys.readouterr().err


def test_cli_rejects_a_bad_last(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--last must be a positive whole number (argparse exits 2)."""
    with pytest.raises(SystemExit) as exc:
        main(["incidents", "--config", str(_config(tmp_path)), "--last", "0"])
    assert exc.value.code == 2
    assert "must be at least 1" in capsys.readouterr().err


def test_kind_enum_values_are_path_safe() -> None:
    """Every incident kind is already a safe path component."""
    assert all(sanitise(str(kind)) == str(kind) for kind in IncidentKind)


def test_a_failing_audit_log_is_logged_once_per_episode_and_counted(tmp_path: Path) -> None:
    """A full disk fails every audit line: each failure is counted, the first one of an
    episode is logged, and the first line that works again says so."""
    counted: list[str] = []
    store = IncidentStore(
        tmp_path, keep=5, max_mib=10, clock=lambda: NOW, optional_io=OptionalIO(counted.append)
    )
    store.audit_path.mkdir()  # opening it for writing fails (EISDIR), like ENOSPC would
    with structlog.testing.capture_logs() as logs:
        for n in range(3):
            store.audit("decision", group="g1", n=n)
        store.audit_path.rmdir()
        store.audit("decision", group="g1", n=3)
        store.audit_path.unlink()
        store.audit_path.mkdir()
        store.audit("decision", group="g1", n=4)
    events = [(e["event"], e.get("what")) for e in logs]
    assert events == [
        ("audit_write_failed", "audit"),
        ("file_io_recovered", "audit"),
        ("audit_write_failed", "audit"),
    ]
    assert counted == ["audit"] * 4
