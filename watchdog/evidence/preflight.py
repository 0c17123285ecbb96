"""Preflight of a live deployment: do its flags and environment let the watchdog see and act?

Read from what `watchdog check` already inspects: each unit's MainPID (or, under a wrapper such as
`sh -c`, the first SGLang or router process below it), its /proc cmdline and environ. Each finding
names the process (role, unit, PID), the flag and the fix. Secrets are never read into a finding:
only whether a key flag is present. The SGLang facts behind each rule: docs/sglang.md §2, §4, §7.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from watchdog.config import GroupSection, ProbeSection
from watchdog.evidence.blocking import wait_for_blocking
from watchdog.evidence.procinfo import (
    DEFAULT_PROC_ROOT,
    read_cmdline,
    read_environ,
    read_process_tree,
)
from watchdog.model import Observation, Role, UnitState, Worker
from watchdog.observe.observer import UnitReader

# The router's health-check timeout must let a real /health (1.00-1.05 s, docs/sglang.md §7.1)
# answer with room to spare, or the router marks healthy workers unhealthy and opens breakers.
MIN_ROUTER_HEALTH_TIMEOUT_SECONDS = 2
ROUTER_DEFAULT_HEALTH_TIMEOUT_SECONDS = 5
CHAT_PATH = "/v1/chat/completions"
# sglang-router 0.3.2, the last release under that name, drops `rid` from chat completions
# (docs/sglang.md §7.9); smg forwards it.
CHAT_PATH_WARNING = (
    f"probe.path: sglang-router (0.3.2, the last release under that name) drops `rid` from "
    f"{CHAT_PATH}, so a stuck chat probe cannot be aborted on the workers and piles up there "
    "(docs/sglang.md §7.9); use /v1/completions or /generate unless the router is smg"
)
HEALTH_GENERATION_ENV = "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"
_FALSE = frozenset({"false", "0", "no", "n"})  # SGLang's EnvBool spelling of false
_SGLANG_SERVER = re.compile(r"(?:^|[\s/])(?:sglang\.launch_server|sglang\s+serve)(?:\s|$)")
_SGLANG_ROUTER = re.compile(
    r"(?:^|[\s/])(?:sglang_router(?:\.launch_router)?|sglang-router)(?:\s|$)"
)
_SMG = re.compile(r"(?:^|[\s/])smg(?:\s|$)")


@dataclass(frozen=True, slots=True)
class PreflightFinding:
    """One setting of a live process that keeps the watchdog from seeing or acting correctly."""

    role: Role
    unit: str
    pid: int
    flag: str  # the flag or variable at fault, as the operator would write it
    problem: str
    fix: str

    @property
    def message(self) -> str:
        """One line: which process, which flag, what goes wrong, what to do."""
        where = f"{self.role} {self.unit} (PID {self.pid})"
        return f"{where}: {self.flag}: {self.problem}; fix: {self.fix}"


@dataclass(frozen=True, slots=True)
class PreflightUnit:
    """The preflight of one unit's live process."""

    role: Role
    unit: str
    checked: bool  # False: no MainPID or /proc unreadable (detail says which)
    pid: int | None = None
    findings: tuple[PreflightFinding, ...] = ()
    detail: str = ""


def config_warnings(probe: ProbeSection) -> tuple[str, ...]:
    """What the config alone says will not work everywhere (shown by `validate` and `check`)."""
    return (CHAT_PATH_WARNING,) if probe.path == CHAT_PATH else ()


def effective_argv(cmdline: Sequence[str]) -> tuple[str, ...]:
    """`cmdline` with `--flag=value` split and a shell's `-c "..."` script split into words."""
    words: list[str] = []
    for arg in cmdline:
        if any(c.isspace() for c in arg):
            try:
                words.extend(shlex.split(arg))
            except ValueError:
                words.append(arg)  # unbalanced quotes: keep it whole
        else:
            words.append(arg)
    out: list[str] = []
    for word in words:
        if word.startswith("--") and "=" in word:
            flag, _, value = word.partition("=")
            out.extend((flag, value))
        else:
            out.append(word)
    return tuple(out)


def flag_value(argv: Sequence[str], flag: str) -> str | None:
    """The value after the last `flag` in an effective argv, None when absent or valueless."""
    value: str | None = None
    for index, arg in enumerate(argv):
        if arg == flag and index + 1 < len(argv) and not argv[index + 1].startswith("--"):
            value = argv[index + 1]
    return value


def is_worker_process(cmdline: Sequence[str]) -> bool:
    """Whether `cmdline` runs an SGLang server (`-m sglang.launch_server`, `sglang serve`)."""
    return _SGLANG_SERVER.search(" ".join(effective_argv(cmdline))) is not None


def router_kind(cmdline: Sequence[str]) -> str | None:
    """ "sglang-router", "smg" or None (not a recognisable router) for a process's cmdline."""
    text = " ".join(effective_argv(cmdline))
    if _SGLANG_ROUTER.search(text):
        return "sglang-router"
    if _SMG.search(text):
        return "smg"
    return None


def worker_findings(
    group: GroupSection,
    role: Role,
    pid: int,
    cmdline: Sequence[str],
    environ: Mapping[str, str],
    *,
    unit: str | None = None,
) -> tuple[PreflightFinding, ...]:
    """Findings for an SGLang prefill or decode server with this cmdline and environ (`unit`:
    which worker's, by default the first of `role`)."""
    unit = unit if unit is not None else group.workers(role)[0].unit
    argv = effective_argv(cmdline)
    flags = set(argv)

    def finding(flag: str, problem: str, fix: str) -> PreflightFinding:
        return PreflightFinding(role, unit, pid, flag, problem, fix)

    out: list[PreflightFinding] = []
    if "--enable-metrics" not in flags:
        note = " (unless the --config file sets enable_metrics)" if "--config" in flags else ""
        out.append(
            finding(
                "--enable-metrics",
                f"not on the command line{note}: SGLang serves no /metrics without it "
                "(docs/sglang.md §7.8), so transfer failures, queues and token progress are "
                "invisible and only the probes remain",
                "add --enable-metrics to the server's command line",
            )
        )
    health_generation = environ.get(HEALTH_GENERATION_ENV)
    if health_generation is not None and health_generation.strip().lower() in _FALSE:
        out.append(
            finding(
                f"{HEALTH_GENERATION_ENV}={health_generation}",
                "GET /health is a static 200 that runs no request (docs/sglang.md §7.1), so a "
                "hung scheduler still looks healthy to the watchdog and the router",
                f"unset {HEALTH_GENERATION_ENV} (default true) in the unit's environment",
            )
        )
    if "--admin-api-key" in flags and group.probe.admin_api_key_file is None:
        out.append(
            finding(
                "--admin-api-key",
                "the server requires the admin key on /abort_request, and none is configured "
                "here, so stuck probes cannot be aborted and pile up in its queues",
                "put the admin key in a file readable by the watchdog and set "
                "probe.admin_api_key_file",
            )
        )
    if "--api-key" in flags and group.probe.api_key_file is None:
        out.append(
            finding(
                "--api-key",
                "the server requires the API key on /v1/loads and /abort_request, and none is "
                "configured here",
                "put the API key in a file readable by the watchdog and set probe.api_key_file",
            )
        )
    return tuple(out)


def router_findings(
    group: GroupSection, pid: int, cmdline: Sequence[str]
) -> tuple[PreflightFinding, ...]:
    """Findings for the router process with this cmdline."""
    unit = group.router.unit
    argv = effective_argv(cmdline)
    out: list[PreflightFinding] = []
    raw = flag_value(argv, "--health-check-timeout-secs")
    timeout: float | None = None
    if raw is not None:
        with contextlib.suppress(ValueError):
            timeout = float(raw)
    if timeout is not None and timeout < MIN_ROUTER_HEALTH_TIMEOUT_SECONDS:
        out.append(
            PreflightFinding(
                Role.ROUTER,
                unit,
                pid,
                f"--health-check-timeout-secs {raw}",
                "SGLang's /health takes 1.00-1.05 s when healthy (docs/sglang.md §7.1), so the "
                "router times healthy workers out, marks them unhealthy and opens circuit breakers",
                f"use --health-check-timeout-secs {MIN_ROUTER_HEALTH_TIMEOUT_SECONDS} or more "
                f"(default {ROUTER_DEFAULT_HEALTH_TIMEOUT_SECONDS})",
            )
        )
    if group.probe.path == CHAT_PATH and router_kind(cmdline) == "sglang-router":
        out.append(
            PreflightFinding(
                Role.ROUTER,
                unit,
                pid,
                f"probe.path {CHAT_PATH}",
                "this sglang-router drops `rid` from chat completions (docs/sglang.md §7.9), so "
                "a stuck chat probe cannot be aborted on the workers and piles up there",
                'set probe.path to "/v1/completions" or "/generate", or run smg',
            )
        )
    return tuple(out)


def _serving_process(
    main_pid: int, role: Role, proc_root: Path
) -> tuple[int, tuple[str, ...], dict[str, str]] | None:
    """(pid, raw cmdline, environ) of the serving process: MainPID, or under a wrapper the first
    descendant that runs SGLang (workers) or a router; None when no process of the tree does."""
    cmdline = read_cmdline(main_pid, proc_root)
    if _is_role_process(role, cmdline):
        return main_pid, cmdline, read_environ(main_pid, proc_root)
    for process in read_process_tree(main_pid, proc_root)[1:]:
        if _is_role_process(role, process.cmdline):
            with contextlib.suppress(OSError):
                pid = process.pid
                return pid, read_cmdline(pid, proc_root), read_environ(pid, proc_root)
    return None


def _is_role_process(role: Role, cmdline: Sequence[str]) -> bool:
    return router_kind(cmdline) is not None if role == Role.ROUTER else is_worker_process(cmdline)


async def _main_pid(
    worker: Worker,
    unit: str,
    unit_reader: UnitReader | None,
    observation: Observation | None,
    timeout_seconds: float,
) -> int | None:
    state: UnitState | None = None
    if unit_reader is not None:
        with contextlib.suppress(Exception):
            state = await asyncio.wait_for(
                unit_reader.read_unit(worker.role, unit), timeout_seconds
            )
    if (state is None or not state.ok) and observation is not None:
        state = observation.unit_of(worker.role, worker.index)
    if state is None or not state.ok or state.main_pid <= 0:
        return None
    return state.main_pid


async def preflight_group(
    group: GroupSection,
    unit_reader: UnitReader | None,
    *,
    observation: Observation | None = None,
    proc_root: Path = DEFAULT_PROC_ROOT,
    timeout_seconds: float = 5.0,
    remote_hosts: Mapping[str, str] | None = None,
) -> tuple[PreflightUnit, ...]:
    """The preflight of every worker's live process (prefills, decodes, router); never raises.

    A unit in `remote_hosts` (unit -> host) is not checked: its MainPID is not a PID of this
    host's /proc, and the process tree walk is not run over SSH.
    """
    out = []
    for worker, section in group.members():
        role, unit = worker.role, section.unit
        host = (remote_hosts or {}).get(unit)
        if host is not None:
            out.append(PreflightUnit(role, unit, False, detail=f"unit on {host}: not checked"))
            continue
        main_pid = await _main_pid(worker, unit, unit_reader, observation, timeout_seconds)
        if main_pid is None:
            out.append(PreflightUnit(role, unit, False, detail="no MainPID to check"))
            continue
        try:
            serving = await wait_for_blocking(
                functools.partial(_serving_process, main_pid, role, proc_root), timeout_seconds
            )
        except (OSError, TimeoutError, ValueError, IndexError) as exc:
            reason = (
                "timed out"
                if isinstance(exc, TimeoutError)
                else (exc.strerror if isinstance(exc, OSError) else None) or str(exc)
            )
            out.append(
                PreflightUnit(role, unit, False, main_pid, detail=f"MainPID {main_pid}: {reason}")
            )
            continue
        if serving is None:
            what = "a router" if role == Role.ROUTER else "an SGLang server"
            detail = f"MainPID {main_pid}: no process of its tree runs {what}"
            out.append(PreflightUnit(role, unit, False, main_pid, detail=detail))
            continue
        pid, cmdline, environ = serving
        findings = (
            router_findings(group, pid, cmdline)
            if role == Role.ROUTER
            else worker_findings(group, role, pid, cmdline, environ, unit=unit)
        )
        out.append(PreflightUnit(role, unit, True, pid, findings))
    return tuple(out)
