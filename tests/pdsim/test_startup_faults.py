"""Faults given at start (env var or fault file) and faults that survive a restart."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from pdsim.stack import WorkerProcess, http_get, http_json, wait_for_status


def test_slow_start_from_env(pd_worker_factory: Callable[..., WorkerProcess]) -> None:
    """slow_start: /health is 503 for N seconds after start, as during model load, then 200."""
    worker = pd_worker_factory(
        "prefill", env={"PDSIM_FAULTS": "slow_start:seconds=1.2"}, wait_ready=False
    )
    assert wait_for_status(worker.url + "/health", expect=503, timeout_s=10.0)
    assert http_get(worker.url + "/model_info")[0] == 200
    assert wait_for_status(worker.url + "/health", expect=200, timeout_s=5.0)


def test_slow_start_not_listening(pd_worker_factory: Callable[..., WorkerProcess]) -> None:
    """slow_start with listen=false: the API port refuses connections until the 'model' loads."""
    faults = json.dumps([{"kind": "slow_start", "seconds": 1.5, "listen": False}])
    worker = pd_worker_factory("decode", env={"PDSIM_FAULTS": faults}, wait_ready=False)
    time.sleep(0.8)
    assert http_get(worker.url + "/health", timeout_s=0.5)[0] == 0
    assert wait_for_status(worker.url + "/health", expect=200, timeout_s=8.0)


def test_crash_after_from_fault_file(
    pd_worker_factory: Callable[..., WorkerProcess], tmp_path: Path
) -> None:
    """crash_after: the process exits non-zero after N seconds, every time it starts."""
    fault_file = tmp_path / "faults.json"
    fault_file.write_text(json.dumps({"kind": "crash_after", "seconds": 0.3, "exit_code": 3}))
    worker = pd_worker_factory("decode", fault_file=fault_file, wait_ready=False)
    assert worker.popen.wait(timeout=10.0) == 3
    assert "Scheduler hit an exception" in worker.log_text()


def test_runtime_fault_persists_across_restart(
    pd_worker_factory: Callable[..., WorkerProcess], tmp_path: Path
) -> None:
    """A fault set with persist=true is written to the fault file and active after a restart."""
    fault_file = tmp_path / "decode.faults.json"
    worker = pd_worker_factory("decode", fault_file=fault_file)
    http_json("POST", worker.url + "/_sim/fault", {"kind": "pinned_request", "persist": True})
    http_json("POST", worker.url + "/_sim/fault", {"kind": "metrics_garbage"})
    assert json.loads(fault_file.read_text()) == [{"kind": "pinned_request", "count": 1}]
    worker.stop()
    again = pd_worker_factory("decode", fault_file=fault_file)
    faults = http_json("GET", again.url + "/_sim/fault")["faults"]
    assert [f["kind"] for f in faults] == ["pinned_request"]
    http_json("DELETE", again.url + "/_sim/fault")
    assert json.loads(fault_file.read_text()) == []


def test_invalid_fault_config_exits_2(pd_worker_factory: Callable[..., WorkerProcess]) -> None:
    """An unknown fault kind at start is a usage error: exit code 2 before binding any port."""
    worker = pd_worker_factory("prefill", env={"PDSIM_FAULTS": "no_such_fault"}, wait_ready=False)
    assert worker.popen.wait(timeout=10.0) == 2
    assert "unknown fault kind" in worker.log_text()
