"""`watchdog incidents`: list incident reports; `watchdog incidents show ID` prints one."""

from __future__ import annotations

import argparse
from pathlib import Path

from watchdog.commands.common import add_config_argument, config_from_args
from watchdog.errors import EXIT_OK
from watchdog.evidence.incident import IncidentListing, IncidentStore
from watchdog.statefiles import utc_iso
from watchdog.text import printable

_COLUMNS = ("ID", "TIME (UTC)", "GROUP", "KIND", "ACTION", "VERIFICATION")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `incidents` subcommand and its `show` action."""
    parser = subparsers.add_parser(
        "incidents",
        help="list incident reports (newest first); `incidents show ID` prints one",
    )
    add_config_argument(parser)
    parser.add_argument("--last", type=_positive, metavar="N", help="only the N newest incidents")
    actions = parser.add_subparsers(dest="incidents_action", metavar="ACTION")
    show = actions.add_parser("show", help="print the report.md of one incident")
    show.add_argument("id", metavar="ID", help="an incident id as listed by `watchdog incidents`")
    # SUPPRESS: without it the sub-parser's default would overwrite a --config given before `show`.
    show.add_argument("--config", type=Path, default=argparse.SUPPRESS, help="config file")
    parser.set_defaults(func=run)


def format_table(rows: tuple[IncidentListing, ...]) -> str:
    """The listing as aligned columns."""
    cells = [_COLUMNS] + [
        (
            r.id,
            utc_iso(r.opened_at) if r.opened_at is not None else "?",
            r.group,
            r.kind,
            r.action,
            r.verification,
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(_COLUMNS))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in cells
    )


def run(args: argparse.Namespace) -> int:
    """List incidents, or print one report; an unknown id is a usage error (exit 2)."""
    config = config_from_args(args)
    store = IncidentStore(
        config.watchdog.state_dir,
        keep=config.watchdog.incidents_keep,
        max_mib=config.watchdog.incidents_max_mib,
    )
    if getattr(args, "incidents_action", None) == "show":
        # A report quotes journal lines, error bodies and unit properties: peers' text.
        print(printable(store.read_report(args.id)), end="")
        return EXIT_OK
    rows = store.list_incidents(args.last)
    if not rows:
        print(f"no incidents in {store.root}")
        return EXIT_OK
    print(printable(format_table(rows)))
    return EXIT_OK
