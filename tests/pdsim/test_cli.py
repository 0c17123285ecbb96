"""`python -m pdsim up|status|fault|restart|down` drives a stack by hand."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from pdsim.stack import REPO_ROOT, http_get, stop_pid


def _cli(state: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pdsim", "--state-file", str(state), *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_cli_up_fault_restart_down(tmp_path: Path) -> None:
    """up writes a state file, fault and restart act on one worker, down stops every PID."""
    state = tmp_path / "state.json"
    up = _cli(state, "up", "--log-dir", str(tmp_path / "logs"), "--decode-arg=--seed=1")
    try:
        assert up.returncode == 0, up.stderr
        info = json.loads(up.stdout)
        assert http_get(info["router_url"] + "/readiness")[0] == 200
        assert _cli(state, "status").returncode == 0
        fault = _cli(state, "fault", "decode", "set", "pinned_request", "count=2", "--persist")
        assert json.loads(fault.stdout)["faults"][0]["count"] == 2
        restart = _cli(state, "restart", "decode")
        assert restart.returncode == 0, restart.stderr
        assert json.loads(restart.stdout)["pid"] != info["pids"]["decode"]
        # Persisted, so the restarted decode has it again.
        listed = json.loads(_cli(state, "fault", "decode", "list").stdout)
        assert [f["kind"] for f in listed["faults"]] == ["pinned_request"]
        assert _cli(state, "fault", "decode", "clear").returncode == 0
        assert _cli(state, "down").returncode == 0
        assert not state.exists()
        assert http_get(info["router_url"] + "/readiness", timeout_s=0.5)[0] == 0
    finally:
        if state.exists():
            for pid in json.loads(state.read_text())["pids"].values():
                stop_pid(int(pid))


def test_cli_up_real_sglang(tmp_path: Path) -> None:
    """`up --real-sglang` starts workers without the compat opt-ins (so /health waits 1 s, as
    SGLang's does: docs/sglang.md §7.1) behind a router whose health timeout allows it; that is
    also what `up` alone does now (`--legacy-compat` brings the opt-ins back). Both always pass
    --enable-metrics."""
    state = tmp_path / "state.json"
    up = _cli(state, "up", "--real-sglang", "--log-dir", str(tmp_path / "logs"))
    try:
        assert up.returncode == 0, up.stderr
        info = json.loads(up.stdout)
        commands = json.loads(state.read_text())["commands"]
        for role in ("prefill", "decode"):
            argv = commands[role]
            assert "--enable-metrics" in argv
            assert not {"--fast-health", "--legacy-aborts", "--legacy-streams"} & set(argv)
        router = commands["router"]
        assert router[router.index("--health-check-timeout-secs") + 1] == "3"
        t0 = time.monotonic()
        assert http_get(info["prefill_url"] + "/health", timeout_s=5.0)[0] == 200
        assert time.monotonic() - t0 >= 0.95
        assert _cli(state, "down").returncode == 0
    finally:
        if state.exists():
            for pid in json.loads(state.read_text())["pids"].values():
                stop_pid(int(pid))
