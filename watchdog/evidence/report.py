"""Render an incident's summary (summary.json) as report.md for a human. Pure."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from watchdog.model import RUNG_ACTIONS, Rung
from watchdog.redact import redact_text


def _utc(at: float | None) -> str:
    if at is None:
        return "?"
    return datetime.fromtimestamp(at, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _time_of_day(at: float) -> str:
    return datetime.fromtimestamp(at, tz=UTC).strftime("%Y-%m-%d %H:%M:%S")


def _cell(text: object) -> str:
    # A table cell must stay on one line and must not close the cell early.
    return str(text).replace("|", "\\|").replace("\n", " ")


def _bullets(items: Sequence[str], empty: str) -> list[str]:
    return [f"- {item}" for item in items] if items else [f"- {empty}"]


def action_result(summary: Mapping[str, Any]) -> str:
    """done, failed, dry_run, interrupted, or pending (no action recorded yet)."""
    action = summary.get("action")
    if not action:
        return "pending"
    return str(action.get("result", "?"))


def verification_result(summary: Mapping[str, Any]) -> str:
    """passed, failed, or pending."""
    verification = summary.get("verification")
    if not verification:
        return "pending"
    return "passed" if verification.get("passed") else "failed"


def _rung_action(rung: str) -> str:
    """What a rung's restart is called; an unknown rung (a newer summary) by its name."""
    try:
        return RUNG_ACTIONS[Rung(rung)]
    except ValueError:
        return f"{rung} restart"


def _action_lines(action: Mapping[str, Any] | None) -> list[str]:
    if not action:
        return ["No action recorded yet (the restart is running, or the watchdog stopped first)."]
    took = float(action.get("finished_at", 0)) - float(action.get("started_at", 0))
    # Older summaries carry no rung: every restart then was the full co-restart.
    rung = str(action.get("rung", "full"))
    why = str(action.get("why", ""))
    lines = [
        f"{_rung_action(rung).capitalize()} "
        f"({action.get('trigger', '?')}): **{action.get('result', '?')}** "
        f"after {took:.1f} s"
        + (" (dry run: nothing was restarted)" if action.get("dry_run") else ""),
        "",
        f"rung: {rung}" + (f" — {why}" if why else ""),
        "",
        "| step | unit | result | phase | detail |",
        "|---|---|---|---|---|",
    ]
    for step in action.get("steps", []):
        lines.append(
            f"| {_cell(step.get('role'))} | {_cell(step.get('unit'))} | "
            f"{'ok' if step.get('ok') else 'FAILED'} | {_cell(step.get('phase'))} | "
            f"{_cell(step.get('detail', ''))} |"
        )
    if not action.get("steps"):
        lines.append("| - | - | - | - | no step ran |")
    return lines


def _host_lines(hosts: Sequence[Mapping[str, Any]]) -> list[str]:
    if not hosts:
        return []
    lines = [
        "## Hosts",
        "",
        "| role | unit | host | journal | main process | GPUs |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {_cell(h.get('role'))} | {_cell(h.get('unit'))} | {_cell(h.get('host'))} | "
        f"{_cell(h.get('journal', ''))} | {_cell(h.get('main_process', ''))} | "
        f"{_cell(h.get('gpus', ''))} |"
        for h in hosts
    ]
    return [*lines, ""]


def suspects(summary: Mapping[str, Any]) -> list[str]:
    """The workers the verdict's reasons name (`prefill#2`), where a role has several: the
    one whose queue holds the stuck work, those whose failure counters rose."""
    found: list[str] = []
    for item in summary.get("decision_reasons", []):
        values = dict(item.get("values", [])) if isinstance(item, Mapping) else {}
        for name in str(values.get("workers", "")).split(","):
            if name.strip() and name.strip() not in found:
                found.append(name.strip())
    return found


def _soak_line(soak: Mapping[str, Any]) -> str:
    """The soak in one sentence: probes, seconds, the group's counters, and a relapse."""
    line = (
        f"Soak: {soak.get('soak_probes_passed', '?')} of {soak.get('soak_probes_required', '?')} "
        f"probes passed over {float(soak.get('soak_seconds', 0)):.0f} s of "
        f"{float(soak.get('soak_seconds_required', 0)):g} s; transfer failures "
        f"+{float(soak.get('soak_transfer_failures_net', 0)):g} net of our aborts (raw "
        f"+{float(soak.get('soak_transfer_failures_raw', 0)):g}); decode tokens "
        f"+{float(soak.get('soak_decode_tokens', 0)):g}."
    )
    if soak.get("relapse"):
        line += f" **{soak['relapse']}**."
    return line


def _silence_rows(silence: Any) -> list[str]:
    if not isinstance(silence, Mapping):
        return []
    state = (
        f"expired {_utc(silence.get('expired_at'))}"
        if silence.get("expired_at")
        else "not expired yet"
    )
    return [
        f"| Alertmanager silence | {_cell(silence.get('id', '?'))} ({state}) at "
        f"{_cell(silence.get('url', '?'))}: {_cell(', '.join(silence.get('matchers', [])))} |"
    ]


def render_report(summary: Mapping[str, Any]) -> str:
    """report.md: classification, symptoms, ruled out, timeline, action, verification, next;
    redacted (watchdog/redact.py) whatever the summary holds."""
    classification = summary.get("classification", {})
    evidence = summary.get("evidence", {})
    verification = summary.get("verification")
    lines = [
        f"# Incident {summary.get('id', '?')}",
        "",
        "| | |",
        "|---|---|",
        f"| group | {_cell(summary.get('group', '?'))} |",
        f"| classification | **{_cell(summary.get('kind', '?'))}** |",
        f"| detector verdict | {_cell(summary.get('verdict') or '-')} |",
        *(
            [f"| suspected worker(s) | {_cell(', '.join(names))} |"]
            if (names := suspects(summary))
            else []
        ),
        f"| opened | {_utc(summary.get('opened_at'))} |",
        f"| action | {action_result(summary)} |",
        f"| verification | {verification_result(summary)} |",
        *_silence_rows(summary.get("silence")),
        "",
        "## Why it was classified so",
        "",
        *_bullets(classification.get("reasoning", []), "no reasoning recorded"),
        "",
        "## Symptoms",
        "",
        *_bullets(summary.get("symptoms", []), "none recorded"),
        "",
        *_host_lines(summary.get("hosts", [])),
        "## Ruled out",
        "",
        *_bullets(classification.get("ruled_out", []), "nothing could be ruled out"),
        "",
        "## Timeline (UTC)",
        "",
        "| time | event |",
        "|---|---|",
    ]
    timeline = sorted(summary.get("timeline", []), key=lambda e: float(e.get("at", 0)))
    lines += [f"| {_time_of_day(float(e['at']))} | {_cell(e.get('event', ''))} |" for e in timeline]
    if not timeline:
        lines.append("| - | no events |")
    lines += ["", "## Action", "", *_action_lines(summary.get("action")), "", "## Verification", ""]
    if verification:
        result = "passed" if verification.get("passed") else "FAILED"
        lines.append(
            f"**{result}** at {_utc(verification.get('at'))}: {verification.get('detail', '')}"
        )
        soak = verification.get("soak")
        if soak:
            lines += ["", _soak_line(soak)]
        if not verification.get("passed"):
            lines.append("")
            lines.append(
                "The action did not help: a restart does not fix every wedge. "
                "Look at the next steps below before acting again."
            )
    else:
        lines.append("Not verified yet.")
    lines += [
        "",
        "## What to look at next",
        "",
        *_bullets(classification.get("next_steps", []), "nothing suggested"),
        "",
        "## Evidence",
        "",
        f"Captured {_utc(evidence.get('started_at'))} in "
        f"{float(evidence.get('duration_seconds', 0)):.1f} s "
        f"(budget {float(evidence.get('timeout_seconds', 0)):g} s). Files in this directory:",
        "",
        *_bullets([f"`{name}`" for name in evidence.get("files", [])], "none"),
        "",
        "Not captured:",
        "",
        *_bullets(
            [f"{u.get('name')}: {u.get('detail', '')}" for u in evidence.get("unavailable", [])],
            "everything was captured",
        ),
        "",
    ]
    return redact_text("\n".join(lines))
