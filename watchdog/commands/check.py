"""`watchdog check`: observe every group once (one probe, scrapes, health); print a table or JSON.

Units are read over the system bus when one is reachable, and then each unit's live process is
checked for config drift and preflighted (flags and environment that keep the watchdog from seeing
or acting: watchdog/evidence/preflight.py). Exit 0 when every group's completion probe passed, 1
otherwise, 2 on a bad config; drift (logged as `config_drift`), preflight findings and config
warnings are printed but do not change the exit code. With units on other hosts, each host's SSH
connection is tried once and its connectivity printed first (remote units are read over it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import httpx
import structlog
from pydantic import TypeAdapter

from watchdog.act.hosts import HostCheck, UnitBuses, targets_of
from watchdog.act.systemd import SystemdClient
from watchdog.commands.common import (
    add_config_argument,
    add_group_argument,
    config_from_args,
    selected_groups,
)
from watchdog.config import GroupSection
from watchdog.errors import EXIT_OK, EXIT_UNHEALTHY, SystemdError
from watchdog.evidence.capture import LiveDrift, check_live_drift
from watchdog.evidence.preflight import PreflightUnit, config_warnings, preflight_group
from watchdog.evidence.procinfo import DEFAULT_PROC_ROOT
from watchdog.model import (
    LoadsSnapshot,
    MetricsSnapshot,
    Observation,
    ProbeKind,
    ProbeResult,
    Role,
)
from watchdog.observe.observer import GroupObserver, ObservedCycle, UnitReader
from watchdog.observe.probes import load_admin_api_key, load_api_key
from watchdog.redact import redact_text, redact_value
from watchdog.text import printable

# A factory opening a unit reader for the duration of the check (None: units are left out).
UnitReaderFactory = Callable[[], AbstractAsyncContextManager[UnitReader | None]]
SYSTEM_BUS_SOCKET = Path("/run/dbus/system_bus_socket")


def system_bus_available() -> bool:
    """Whether a system bus is there to read units from (DBUS_SYSTEM_BUS_ADDRESS or the socket)."""
    return bool(os.environ.get("DBUS_SYSTEM_BUS_ADDRESS")) or SYSTEM_BUS_SOCKET.exists()


async def _local_client() -> SystemdClient | None:
    """systemd over the system bus when reachable (one attempt), else None."""
    if not system_bus_available():
        return None
    client = SystemdClient()
    try:
        await client.wait_for_connection(patient=False)
    except SystemdError as exc:
        structlog.get_logger().warning("systemd_unavailable", error=str(exc))
        await client.close()
        return None
    return client


@contextlib.asynccontextmanager
async def systemd_unit_reader() -> AsyncIterator[UnitReader | None]:
    """The default: systemd over the system bus when reachable (one attempt), else no units."""
    client = await _local_client()
    if client is None:
        yield None
        return
    try:
        yield client
    finally:
        await client.close()


@contextlib.asynccontextmanager
async def multihost_unit_reader(
    groups: Sequence[GroupSection],
) -> AsyncIterator[UnitReader | None]:
    """With units on other hosts: the local bus (if reachable) and one SSH connection per host."""
    buses = UnitBuses(await _local_client(), targets_of(groups))
    try:
        yield buses
    finally:
        await buses.close()


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `check` subcommand."""
    parser = subparsers.add_parser(
        "check",
        help="observe each group once: one probe through the router, scrapes, health; "
        "exit 0 when every probe passed, 1 otherwise",
    )
    add_config_argument(parser)
    add_group_argument(parser)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=run)


def run(
    args: argparse.Namespace,
    *,
    unit_reader_factory: UnitReaderFactory | None = None,
    proc_root: Path = DEFAULT_PROC_ROOT,
) -> int:
    """Observe the selected groups once; print; the exit code says whether every probe passed."""
    config = config_from_args(args)
    groups = selected_groups(config, args.group)
    api_keys = {g.name: load_api_key(g.probe.api_key_file) for g in groups}
    for group in groups:
        load_admin_api_key(group.probe)  # an unreadable or empty key file fails here, not at abort
    if unit_reader_factory is not None:
        factory = unit_reader_factory
    elif targets_of(groups):
        factory = functools.partial(multihost_unit_reader, groups)
    else:
        factory = systemd_unit_reader
    cycles, drift, preflight, hosts = asyncio.run(
        _observe_all(groups, api_keys, factory, proc_root)
    )
    warnings = {g.name: config_warnings(g.probe) for g in groups}
    print(
        format_json(cycles, drift, preflight, warnings, hosts)
        if args.json
        else format_table(cycles, drift, preflight, warnings, hosts)
    )
    return EXIT_OK if all(probes_passed(c.observation) for c in cycles) else EXIT_UNHEALTHY


Preflights = dict[str, tuple[PreflightUnit, ...]]
HostRows = list[tuple[HostCheck, tuple[str, ...]]]  # each host's check and its units


async def _observe_all(
    groups: Sequence[GroupSection],
    api_keys: dict[str, str | None],
    unit_reader_factory: UnitReaderFactory,
    proc_root: Path,
) -> tuple[list[ObservedCycle], dict[str, tuple[LiveDrift, ...]], Preflights, HostRows]:
    async with (
        httpx.AsyncClient(trust_env=False) as client,
        unit_reader_factory() as unit_reader,
    ):
        hosts: HostRows = []
        remote: dict[str, str] = {}
        if isinstance(unit_reader, UnitBuses) and unit_reader.has_remote:
            # One attempt per host, concurrently, before the reads that need them.
            remote = unit_reader.remote_hosts()
            for host_check in await unit_reader.connect_remote(wait=True):
                units = tuple(sorted(u for u, h in remote.items() if h == host_check.label))
                hosts.append((host_check, units))
        async with asyncio.TaskGroup() as tasks:
            running = [
                tasks.create_task(
                    GroupObserver(
                        group, client, unit_reader=unit_reader, api_key=api_keys[group.name]
                    ).observe()
                )
                for group in groups
            ]
        cycles = [task.result() for task in running]
        drift: dict[str, tuple[LiveDrift, ...]] = {}
        preflight: Preflights = {}
        if unit_reader is not None:
            for group, cycle in zip(groups, cycles, strict=True):
                drift[group.name] = await check_live_drift(
                    group,
                    unit_reader,
                    observation=cycle.observation,
                    proc_root=proc_root,
                    remote_hosts=(
                        unit_reader.remote_units() if isinstance(unit_reader, UnitBuses) else None
                    ),
                )
                preflight[group.name] = await preflight_group(
                    group,
                    unit_reader,
                    observation=cycle.observation,
                    proc_root=proc_root,
                    remote_hosts=remote,
                )
    return cycles, drift, preflight, hosts


def probes_passed(observation: Observation) -> bool:
    """Whether the observation has a completion probe and every probe in it passed."""
    kinds = {p.kind for p in observation.probes}
    return ProbeKind.COMPLETION in kinds and all(p.ok for p in observation.probes)


# --- output ---

_OBSERVATION = TypeAdapter(Observation)


def _drift_messages(drift: Sequence[LiveDrift]) -> list[str]:
    return [finding.message for unit in drift for finding in unit.findings]


def _preflight_json(units: Sequence[PreflightUnit]) -> dict[str, Any]:
    return {
        "findings": [
            {
                "role": str(f.role),
                "unit": f.unit,
                "pid": f.pid,
                "flag": f.flag,
                "problem": f.problem,
                "fix": f.fix,
                "message": f.message,
            }
            for unit in units
            for f in unit.findings
        ],
        "units": [
            {"role": str(u.role), "unit": u.unit, "checked": u.checked, "pid": u.pid}
            | ({"detail": u.detail} if u.detail else {})
            for u in units
        ],
    }


def _hosts_json(hosts: HostRows) -> list[dict[str, Any]]:
    return [
        {
            "host": c.label,
            "reachable": c.ok,
            "uid": c.uid,
            "detail": c.detail,
            "units": list(units),
        }
        for c, units in hosts
    ]


def _host_lines(hosts: HostRows) -> list[str]:
    lines = ["hosts"]
    for c, units in hosts:
        state = f"reachable, remote uid {c.uid}" if c.ok else f"UNREACHABLE: {c.detail}"
        lines.append(f"  {c.label}  {state} (units: {', '.join(units) or '-'})")
    return lines


def format_json(
    cycles: Sequence[ObservedCycle],
    drift: dict[str, tuple[LiveDrift, ...]] | None = None,
    preflight: Preflights | None = None,
    warnings: dict[str, tuple[str, ...]] | None = None,
    hosts: HostRows | None = None,
) -> str:
    """One JSON document: per group, whether its probes passed, the observation and the deltas,
    drift, the preflight of the live processes and the config's warnings; with units on other
    hosts, each host's connectivity ("hosts")."""
    drift = drift or {}
    preflight = preflight or {}
    warnings = warnings or {}
    out: list[dict[str, Any]] = [
        {
            "group": c.observation.group,
            "passed": probes_passed(c.observation),
            "observation": _OBSERVATION.dump_python(c.observation, mode="json"),
            "drift": _drift_messages(drift.get(c.observation.group, ())),
            "preflight": _preflight_json(preflight.get(c.observation.group, ())),
            "warnings": list(warnings.get(c.observation.group, ())),
            "duration_seconds": round(c.duration_seconds, 3),
        }
        for c in cycles
    ]
    document: dict[str, Any] = {"groups": out}
    if hosts:
        document["hosts"] = _hosts_json(hosts)
    # Details quote URLs and error bodies (which may echo our Authorization header).
    return json.dumps(redact_value(document), indent=2)


def _num(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "-"
    if digits == 0 and float(value).is_integer():
        return str(int(value))
    return f"{value:.{digits or 2}f}"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}s"


def _probe_line(probe: ProbeResult) -> str:
    verdict = "ok" if probe.ok else f"FAIL {probe.reason}"
    parts = [
        f"{probe.kind:<10} {verdict}",
        f"ttft {_seconds(probe.ttft_seconds)}",
        f"total {_seconds(probe.duration_seconds)}",
        f"tokens {probe.tokens}",
    ]
    if probe.status_code is not None:
        parts.append(f"status {probe.status_code}")
    if probe.error_code:
        parts.append(f"x-smg-error-code {probe.error_code}")
    line = "  ".join(parts)
    if probe.detail:
        line += f"\n{'':14}{probe.detail}"
    return line


def _health_cell(probe: ProbeResult) -> str:
    status = probe.status_code if probe.status_code is not None else probe.reason
    return f"{probe.target} {'ok' if probe.ok else 'FAIL'} ({status})"


_METRIC_COLUMNS: tuple[tuple[str, str], ...] = (
    ("transfer_failed", "xfer_fail"),
    ("bootstrap_failed", "boot_fail"),
    ("inflight_queue", "inflight"),
    ("bootstrap_queue", "bootstrap"),
    ("decode_prealloc_queue", "prealloc"),
    ("decode_transfer_queue", "transfer"),
    ("running_reqs", "running"),
    ("queue_reqs", "queued"),
    ("http_requests_active", "http_active"),
    ("requests_total", "requests"),
    ("generation_tokens_total", "gen_tokens"),
    ("realtime_tokens_total", "rt_tokens"),
)


def _metrics_rows(metrics: Sequence[MetricsSnapshot]) -> list[str]:
    workers = [m for m in metrics if m.role != Role.ROUTER]
    rows = []
    if workers:
        header = f"{'role':<8}" + "".join(f"{label:>12}" for _, label in _METRIC_COLUMNS)
        rows.append(header)
        for snap in workers:
            if not snap.ok:
                rows.append(f"{snap.role:<8}  scrape failed: {snap.error} ({snap.detail})")
                continue
            cells = "".join(f"{_num(getattr(snap, name)):>12}" for name, _ in _METRIC_COLUMNS)
            rows.append(f"{snap.role!s:<8}{cells}")
    for snap in metrics:
        if snap.role != Role.ROUTER:
            continue
        if not snap.ok:
            rows.append(f"{'router':<8}  scrape failed: {snap.error} ({snap.detail})")
        else:
            rows.append(
                f"{'router':<8}  unhealthy workers {_num(snap.workers_unhealthy)}, "
                f"open circuit breakers {_num(snap.circuit_breakers_open)}"
            )
    return rows


def _loads_cell(loads: LoadsSnapshot) -> str:
    if not loads.ok:
        return f"{loads.role} {loads.error}"
    return (
        f"{loads.role} running {_num(loads.running_reqs)} waiting {_num(loads.waiting_reqs)} "
        f"inflight {_num(loads.prefill_inflight_queue_reqs)} "
        f"transfer {_num(loads.decode_transfer_queue_reqs)} "
        f"scheduler@{_num(loads.timestamp, 3)}"
    )


def _preflight_lines(units: Sequence[PreflightUnit]) -> list[str]:
    if not units:
        return []
    findings = [f.message for unit in units for f in unit.findings]
    if findings:
        return [f"  preflight {m}" for m in findings]
    if any(u.checked for u in units):
        return ["  preflight ok"]
    reasons = "; ".join(f"{u.role} {u.detail}" for u in units)
    return [f"  preflight not checked ({reasons})"]


def format_table(
    cycles: Sequence[ObservedCycle],
    drift: dict[str, tuple[LiveDrift, ...]] | None = None,
    preflight: Preflights | None = None,
    warnings: dict[str, tuple[str, ...]] | None = None,
    hosts: HostRows | None = None,
) -> str:
    """A human-readable report, one block per group (after the hosts' block, if any)."""
    drift = drift or {}
    preflight = preflight or {}
    warnings = warnings or {}
    blocks = ["\n".join(_host_lines(hosts))] if hosts else []
    for cycle in cycles:
        obs = cycle.observation
        lines = [f"group {obs.group}: {'PASS' if probes_passed(obs) else 'FAIL'}"]
        for probe in obs.probes:
            lines.append(f"  probe     {_probe_line(probe)}")
        lines.append("  health    " + " | ".join(_health_cell(h) for h in obs.health))
        lines.append("  metrics")
        lines += [f"    {row}" for row in _metrics_rows(obs.metrics)]
        if obs.loads:
            lines.append("  loads     " + " | ".join(_loads_cell(x) for x in obs.loads))
        if obs.units:
            lines.append(
                "  units     "
                + " | ".join(
                    f"{u.role} {u.active_state or 'unknown'}"
                    + (f"/{u.sub_state}" if u.sub_state else "")
                    + (f" pid {u.main_pid} restarts {u.n_restarts}" if u.ok else f" ({u.error})")
                    for u in obs.units
                )
            )
        else:
            lines.append("  units     not observed")
        group_drift = drift.get(obs.group, ())
        if any(d.checked for d in group_drift):
            messages = _drift_messages(group_drift)
            lines += [f"  drift     {m}" for m in messages] or ["  drift     none"]
        lines += _preflight_lines(preflight.get(obs.group, ()))
        lines += [f"  warning   {w}" for w in warnings.get(obs.group, ())]
        blocks.append("\n".join(lines))
    # Last: peers' text (probe details, unit errors, drift) may carry terminal escapes.
    return printable(redact_text("\n\n".join(blocks)))
