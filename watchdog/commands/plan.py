"""`watchdog plan`: print the exact co-restart sequence, its timeouts and readiness checks."""

from __future__ import annotations

import argparse
import json

from watchdog.act.restart import build_plan, format_plan, plan_as_dict
from watchdog.commands.common import (
    add_config_argument,
    add_group_argument,
    config_from_args,
    selected_groups,
)
from watchdog.errors import EXIT_OK
from watchdog.redact import redact_text, redact_value


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `plan` subcommand."""
    parser = subparsers.add_parser(
        "plan",
        help="print the co-restart sequence (prefill -> decode -> router) with its checks",
    )
    add_config_argument(parser)
    add_group_argument(parser)
    parser.add_argument("--json", action="store_true", help="print the plans as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print one plan per selected group; nothing is contacted."""
    config = config_from_args(args)
    plans = [build_plan(group, "manual") for group in selected_groups(config, args.group)]
    # Readiness URLs come from the config and may carry credentials: never printed.
    if args.json:
        print(json.dumps(redact_value([plan_as_dict(p) for p in plans]), indent=2))
    else:
        print(redact_text("\n\n".join(format_plan(p) for p in plans)))
    return EXIT_OK
