"""`watchdog replay`: feed a recording through decide() with a config; print changes and actions.

Thresholds can be tuned offline on a real incident's data: the recorded observations are replayed
in order at their recorded times. A co-restart the replayed config asks for is simulated as an
instant restart with the outcome `--assume-restart` names (default: ok, like a dry run), so
verification, backoff and the budget play out as they would; the recorded observations after it
are of course those of the real stack, not of a restarted one. A new recording header for the same
group (the daemon restarted) starts a new warm-up with the simulated budget carried over.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from watchdog.act.plan import replayed_plan
from watchdog.commands.common import add_config_argument, config_from_args
from watchdog.config import Config, GroupSection
from watchdog.decide import Decision, GroupState, after_restart, decide, initial_state
from watchdog.errors import EXIT_OK, UsageError
from watchdog.model import Action, RestartOutcome, Role, StepResult
from watchdog.run.recording import RecordedObservation, RecordingHeader, read_entries


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `replay` subcommand."""
    parser = subparsers.add_parser(
        "replay",
        help="replay a recorded incident (--record) through the detector with a (tuned) config",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_argument(parser)
    parser.add_argument(
        "--group",
        help="the config group whose thresholds to use (default: the recording's group)",
    )
    parser.add_argument("recording", type=Path, metavar="RECORDING.jsonl")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument(
        "--assume-restart",
        choices=("ok", "failed"),
        default="ok",
        help="how a simulated co-restart ends (default: ok)",
    )
    parser.set_defaults(func=run)


def _choose(config: Config, requested: str | None, recorded: list[str]) -> tuple[GroupSection, str]:
    """The config group to apply and the recorded group to replay."""
    known = ", ".join(g.name for g in config.group)
    if requested is not None:
        try:
            section = config.group_named(requested)
        except KeyError:
            raise UsageError(
                f"--group {requested!r} is not in the config (known: {known})"
            ) from None
        if requested in recorded:
            return section, requested
        if len(recorded) == 1:
            return section, recorded[0]
        raise UsageError(
            f"the recording holds groups {', '.join(recorded)} but not {requested!r}; "
            "record that group or pick one of them"
        )
    if len(recorded) != 1:
        raise UsageError(f"the recording holds groups {', '.join(recorded)}; pick one with --group")
    name = recorded[0]
    names = [g.name for g in config.group]
    if name in names:
        return config.group_named(name), name
    if len(names) == 1:
        return config.group[0], name
    raise UsageError(
        f"the recording's group {name!r} is not in the config (known: {known}); "
        "pick the thresholds to use with --group"
    )


def _simulated_outcome(group: str, trigger: str, ok: bool, now: float) -> RestartOutcome:
    steps = tuple(
        StepResult(role=role, unit="", ok=ok, phase="dry_run", started_at=now, finished_at=now)
        for role in (Role.PREFILL, Role.DECODE, Role.ROUTER)
    )
    return RestartOutcome(
        plan=replayed_plan(group, trigger),
        ok=ok,
        dry_run=True,
        steps=steps if ok else steps[:1],
        started_at=now,
        finished_at=now,
    )


def _iso(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _event(
    at: float, started_at: float, previous: GroupState, decision: Decision
) -> dict[str, Any]:
    return {
        "at": at,
        "time": _iso(at),
        "offset_seconds": round(at - started_at, 3),
        "from": str(previous.state),
        "to": str(decision.state.state),
        "verdict": str(decision.verdict),
        "action": str(decision.action),
        "reasons": [
            {"code": r.code, "message": r.message, "values": dict(r.values)}
            for r in decision.reasons
        ],
    }


def _print_event(event: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(event))
        return
    action = "" if event["action"] == "none" else f"  action={event['action']}"
    print(
        f"{event['time']} (+{event['offset_seconds']:.1f}s)  {event['from']} -> {event['to']}  "
        f"verdict={event['verdict']}{action}"
    )
    for reason in event["reasons"]:
        print(f"    {reason['code']}: {reason['message']}")


def run(args: argparse.Namespace) -> int:
    """Replay the recording and print every state change and action; exit 0."""
    config = config_from_args(args)
    entries = list(read_entries(args.recording))
    recorded = list(dict.fromkeys(e.group for e in entries if isinstance(e, RecordingHeader)))
    if not recorded:
        raise UsageError(f"{args.recording}: the recording has no header")
    section, name = _choose(config, args.group, recorded)
    state: GroupState | None = None
    started_at = 0.0
    cycles = 0
    actions: Counter[str] = Counter()
    changes = 0
    for entry in entries:
        if isinstance(entry, RecordingHeader):
            if entry.group != name:
                continue
            started_at = entry.started_at if state is None else started_at
            carried = state
            state = initial_state(
                entry.started_at,
                restart_times=carried.budget.restart_times if carried else (),
                consecutive_failures=carried.budget.consecutive_failures if carried else 0,
            )
            continue
        if not isinstance(entry, RecordedObservation) or entry.observation.group != name:
            continue
        if state is None:  # unreachable after read_entries' checks; keeps mypy honest
            state = initial_state(entry.at)
        cycles += 1
        decision = decide(state, entry.observation, section, entry.at)
        if decision.state.state is not state.state or decision.action is not Action.NONE:
            changes += 1
            _print_event(_event(entry.at, started_at, state, decision), args.json)
        if decision.action is not Action.NONE:
            actions[str(decision.action)] += 1
        state = decision.state
        if decision.action is Action.CO_RESTART:
            outcome = _simulated_outcome(
                name, str(decision.verdict), args.assume_restart == "ok", entry.at
            )
            after = after_restart(state, outcome, entry.at)
            label = f"simulated co-restart: {'ok' if outcome.ok else 'failed'}"
            event = {
                "at": entry.at,
                "time": _iso(entry.at),
                "offset_seconds": round(entry.at - started_at, 3),
                "from": str(state.state),
                "to": str(after.state),
                "verdict": str(decision.verdict),
                "action": "after_restart",
                "reasons": [{"code": "simulated_restart", "message": label, "values": {}}],
            }
            _print_event(event, args.json)
            state = after
    summary = {
        "group": name,
        "config_group": section.name,
        "cycles": cycles,
        "state_changes_or_actions": changes,
        "co_restarts": actions.get(str(Action.CO_RESTART), 0),
        "alerts": actions.get(str(Action.ALERT), 0),
        "final_state": str(state.state) if state is not None else None,
    }
    if args.json:
        print(json.dumps({"summary": summary}))
    else:
        print(
            f"replayed {cycles} cycles of group {name!r} with the thresholds of "
            f"{section.name!r}: {summary['co_restarts']} co-restart(s), {summary['alerts']} "
            f"alert(s), final state {summary['final_state']}"
        )
    return EXIT_OK
