"""Bring a simulated PD stack up and down by hand: `python -m pdsim up|down|...`.

`up` starts prefill, decode and the real router detached, and writes a state file (URLs, PIDs,
command lines, log paths) that the other commands read. Exit codes: 0 ok, 1 a process is not
healthy (status) or a control call failed, 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from pdsim.faults import FAULT_PARAMS
from pdsim.stack import (
    LEGACY_COMPAT,
    REAL_SGLANG,
    REPO_ROOT,
    ROUTER_FAST_ARGS,
    StackConfig,
    StackError,
    StackPorts,
    http_get,
    http_json,
    start_stack,
    stop_pid,
    wait_for_status,
)

DEFAULT_STATE_FILE = Path(tempfile.gettempdir()) / "pdsim-stack.json"
INCIDENT_PORTS = "prefill=30000,decode=30002,bootstrap=8998,router=30001,metrics=29000"


def _parse_ports(text: str) -> StackPorts:
    fields = dict(item.split("=", 1) for item in text.split(","))
    try:
        return StackPorts(
            prefill=int(fields["prefill"]),
            decode=int(fields["decode"]),
            bootstrap=int(fields["bootstrap"]),
            router=int(fields["router"]),
            router_metrics=int(fields["metrics"]),
        )
    except (KeyError, ValueError) as exc:
        raise SystemExit(f"--ports: expected {INCIDENT_PORTS!r}-style value ({exc})") from None


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _load_state(path: Path) -> dict[str, Any]:
    try:
        state: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        raise SystemExit(f"no stack state at {path}; run `up` first") from None
    return state


def cmd_up(args: argparse.Namespace) -> int:
    router_args = () if args.router_defaults else ROUTER_FAST_ARGS
    config = StackConfig(
        compat=LEGACY_COMPAT if args.legacy_compat else REAL_SGLANG,
        sglang_version=args.sglang_version,
        tp_size=args.tp_size,
        worker_args=tuple(args.worker_arg),
        prefill_args=tuple(args.prefill_arg),
        decode_args=tuple(args.decode_arg),
        router_args=(*router_args, *args.router_arg),
        prefill_faults=tuple(json.loads(f) for f in args.prefill_fault),
        decode_faults=tuple(json.loads(f) for f in args.decode_fault),
        log_dir=args.log_dir,
        ports=_parse_ports(args.ports) if args.ports else None,
    )
    try:
        stack = start_stack(config)
    except StackError as exc:
        print(f"pdsim up failed: {exc}", file=sys.stderr)
        return 1
    state = stack.state_json()
    state["log_paths"] = {r: str(stack.log_path(r)) for r in stack.pids}
    state["fault_files"] = {r: str(stack.fault_file(r)) for r in ("prefill", "decode")}
    args.state_file.write_text(json.dumps(state, indent=2) + "\n")
    print(json.dumps({k: state[k] for k in ("router_url", "prefill_url", "decode_url", "pids")}))
    print(f"state: {args.state_file}  logs: {state['log_dir']}", file=sys.stderr)
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    state = _load_state(args.state_file)
    for role in ("router", "decode", "prefill"):
        pid = state["pids"].get(role)
        if pid:
            stop_pid(int(pid))
    args.state_file.unlink(missing_ok=True)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    state = _load_state(args.state_file)
    ok = True
    for role, url, path in (
        ("prefill", state["prefill_url"], "/health"),
        ("decode", state["decode_url"], "/health"),
        ("router", state["router_url"], "/readiness"),
    ):
        status, _ = http_get(url + path, timeout_s=args.timeout)
        ok &= status == 200
        print(f"{role:8} pid={state['pids'].get(role)} {url}{path} -> {status or 'no answer'}")
    return 0 if ok else 1


def cmd_fault(args: argparse.Namespace) -> int:
    state = _load_state(args.state_file)
    url = state[f"{args.role}_url"] + "/_sim/fault"
    try:
        if args.action == "set":
            if not args.kind:
                raise SystemExit(f"fault set needs a kind: {', '.join(FAULT_PARAMS)}")
            body: dict[str, Any] = {"kind": args.kind, "persist": args.persist}
            for pair in args.params:
                key, _, value = pair.partition("=")
                body[key] = _parse_value(value)
            result = http_json("POST", url, body)
        elif args.action == "clear":
            result = http_json("DELETE", url + (f"/{args.kind}" if args.kind else ""))
        else:
            result = http_json("GET", url)
    except StackError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0


def cmd_restart(args: argparse.Namespace) -> int:
    """Restart one process with its recorded command line (e.g. a decode-only restart)."""
    state = _load_state(args.state_file)
    pid = state["pids"].get(args.role)
    if pid:
        stop_pid(int(pid))
    env = {**os.environ}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    with open(state["log_paths"][args.role], "ab") as log:
        proc = subprocess.Popen(
            state["commands"][args.role], cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    state["pids"][args.role] = proc.pid
    args.state_file.write_text(json.dumps(state, indent=2) + "\n")
    path = "/readiness" if args.role == "router" else "/health"
    if not wait_for_status(state[f"{args.role}_url"] + path, timeout_s=30.0):
        print(f"{args.role} restarted (pid {proc.pid}) but is not ready", file=sys.stderr)
        return 1
    print(json.dumps({"role": args.role, "pid": proc.pid}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pdsim", description=__doc__)
    p.add_argument("--state-file", type=Path, default=DEFAULT_STATE_FILE)
    sub = p.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start prefill, decode and router (detached)")
    up.add_argument("--sglang-version", default="0.5.23")
    up.add_argument(
        "--real-sglang",
        action="store_true",
        help="workers behave as real SGLang (1 s /health, counted aborts, 200 + error-event "
        "streams) behind a router with a 3 s health timeout; the default, kept for old scripts",
    )
    up.add_argument(
        "--legacy-compat",
        action="store_true",
        help="bring back pdsim's old behaviours (--fast-health, --legacy-aborts, --legacy-streams)",
    )
    up.add_argument("--tp-size", type=int, default=1)
    up.add_argument("--ports", help=f"fixed ports, e.g. {INCIDENT_PORTS} (default: free ports)")
    up.add_argument("--log-dir", type=Path, default=None)
    up.add_argument("--worker-arg", action="append", default=[], help="extra worker flag (both)")
    up.add_argument("--prefill-arg", action="append", default=[])
    up.add_argument("--decode-arg", action="append", default=[])
    up.add_argument("--router-arg", action="append", default=[])
    up.add_argument(
        "--router-defaults",
        action="store_true",
        help="the router's own health-check defaults instead of the fast test flags",
    )
    up.add_argument("--prefill-fault", action="append", default=[], help="fault JSON at start")
    up.add_argument("--decode-fault", action="append", default=[], help="fault JSON at start")
    up.set_defaults(func=cmd_up)

    down = sub.add_parser("down", help="stop the stack by PID")
    down.set_defaults(func=cmd_down)

    status = sub.add_parser("status", help="health of each process")
    status.add_argument("--timeout", type=float, default=3.0)
    status.set_defaults(func=cmd_status)

    fault = sub.add_parser("fault", help="set, clear or list faults on one worker")
    fault.add_argument("role", choices=("prefill", "decode"))
    fault.add_argument("action", choices=("set", "clear", "list"))
    fault.add_argument("kind", nargs="?", choices=tuple(FAULT_PARAMS))
    fault.add_argument("params", nargs="*", help="key=value parameters of the fault")
    fault.add_argument("--persist", action="store_true", help="keep it across restarts")
    fault.set_defaults(func=cmd_fault)

    restart = sub.add_parser("restart", help="restart one process with its recorded command line")
    restart.add_argument("role", choices=("prefill", "decode", "router"))
    restart.set_defaults(func=cmd_restart)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
