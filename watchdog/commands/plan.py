"""`watchdog plan`: print the exact co-restart sequence, its timeouts and readiness checks."""

from __future__ import annotations

import argparse
import json
from collections.abc import Collection

from watchdog.act.plan import build_plan, format_plan, plan_as_dict
from watchdog.commands.common import (
    add_config_argument,
    add_group_argument,
    config_from_args,
    selected_groups,
)
from watchdog.config import GroupSection
from watchdog.decide.verdict import Verdict
from watchdog.errors import EXIT_OK, UsageError
from watchdog.model import RestartPlan, Role, Rung
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
    parser.add_argument(
        "--rung",
        choices=[r.value for r in Rung],
        default=Rung.FULL.value,
        help="which rung to show: full (the co-restart, default), router (the router alone, "
        "taken on a router_wedge verdict) or survivor (after a prefill restarted alone: the "
        "decodes that pair with it, then the router)",
    )
    parser.add_argument(
        "--prefill",
        type=int,
        default=1,
        metavar="N",
        help="with --rung survivor: which prefill was restarted alone, 1-based as reports name "
        "them (prefill#2); default 1, the only one of a 1P1D group. Every decode pairs with "
        "every prefill, so the steps are the same for each",
    )
    parser.set_defaults(func=run)


TRIGGERS = {
    Rung.FULL: "manual",
    Rung.ROUTER: str(Verdict.ROUTER_WEDGE),
    Rung.SURVIVOR: str(Verdict.PREFILL_ONLY_RESTART),
}


def _plan(group: GroupSection, rung: Rung, prefill: int) -> RestartPlan:
    """The plan of one group for `rung`; the survivor rung follows prefill #`prefill`."""
    if rung is not Rung.SURVIVOR:
        return build_plan(group, TRIGGERS[rung], rung=rung)
    count = len(group.workers(Role.PREFILL))
    if not 1 <= prefill <= count:
        raise UsageError(
            f"--prefill {prefill}: group {group.name!r} has {count} prefill worker(s), 1 to {count}"
        )
    return build_plan(group, TRIGGERS[rung], rung=rung, fresh_prefills=(prefill - 1,))


def hosts_of(group: GroupSection, roles: Collection[Role] | None = None) -> dict[str, str]:
    """worker (`decode`, or `decode[1]` among several) -> where its unit runs ("local" or
    user@host:port), in the restart order; only `roles`' workers when given."""
    out = {}
    for role in group.restart.order:
        if roles is not None and role not in roles:
            continue
        for index, worker in enumerate(group.workers(role)):
            target = group.host_of(worker)
            out[group.worker_key(role, index)] = "local" if target is None else target.label
    return out


def with_hosts(text: str, hosts: dict[str, str]) -> str:
    """The plan text followed by each role's host, when the group spans hosts."""
    if set(hosts.values()) == {"local"}:
        return text  # the one-host form prints as it always did
    lines = [text, "Hosts, in the sequence:"]
    lines += [f"  {worker:<8} {host}" for worker, host in hosts.items()]
    lines.append("A host that cannot be reached stops the sequence before its first step.")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Print one plan per selected group; nothing is contacted."""
    config = config_from_args(args)
    groups = selected_groups(config, args.group)
    rung = Rung(args.rung)
    plans = [_plan(group, rung, args.prefill) for group in groups]
    # Readiness URLs come from the config and may carry credentials: never printed.
    if args.json:
        out = [
            {**plan_as_dict(p), "hosts": hosts_of(g)} for p, g in zip(plans, groups, strict=True)
        ]
        print(json.dumps(redact_value(out), indent=2))
    else:
        texts = [
            with_hosts(format_plan(p), hosts_of(g)) for p, g in zip(plans, groups, strict=True)
        ]
        print(redact_text("\n\n".join(texts)))
    return EXIT_OK
