"""Time to verified recovery: the real watchdog (not dry-run) restarting real systemd units.

One systemd sandbox (sandbox/: a private systemd as PID 1 with its own system bus) runs the
simulated prefill, decode and the real router as units. The daemon runs on the host with
DBUS_SYSTEM_BUS_ADDRESS pointing at the sandbox's bus, so its RestartUnit calls are real. Faults are
injected one after the other into the same sandbox; each is measured from injection to the
daemon's `verification_passed` event, then a completion through the router must succeed.
Needs root (PID and mount namespaces); elsewhere the result says why it was not measured.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from bench.harness import (
    COMPRESSED_TIMINGS,
    GroupTarget,
    LoadGenerator,
    WatchdogProcess,
    summarize_events,
    timing_values,
    watchdog_config_toml,
)
from bench.report import latency_stats
from bench.scenarios import BACKGROUND_LOAD, ROUTER_DEFAULT_ARGS, WORKER_ARGS
from pdsim.stack import free_ports, http_json
from sandbox.namespace import skip_reason
from sandbox.pdsandbox import PdSandbox
from watchdog.configfile import Overrides

RECOVERY_FAULTS = ("transfer_stall", "degraded_bootstrap", "decode_crash")

# A sandbox started in a thread whose awaiting task was cancelled would outlive the bench.
ACTIVE_SANDBOXES: dict[int, PdSandbox] = {}


def _start_sandbox(**kwargs: object) -> PdSandbox:
    pd = PdSandbox.start("bench", **kwargs)  # type: ignore[arg-type]
    ACTIVE_SANDBOXES[id(pd)] = pd
    return pd


def _stop_sandbox(pd: PdSandbox) -> None:
    try:
        pd.stop()
    finally:
        ACTIVE_SANDBOXES.pop(id(pd), None)


def stop_leftover_sandboxes() -> None:
    """Tear down every sandbox still running (after an interrupt)."""
    for pd in list(ACTIVE_SANDBOXES.values()):
        _stop_sandbox(pd)


DESCRIPTION = (
    "The real daemon (not dry-run) against a private systemd (PID 1 of its own namespace, its own "
    "system bus; sandbox/) running prefill, decode and the real router as units; restarts "
    "are real `RestartUnit` jobs over that bus, prefill → decode → router, each waited for until "
    "ready, then verification ({verify} consecutive good probes). Faults, one after the other in "
    "the same sandbox: `transfer_stall` (pdsim fault set on prefill at run time), "
    "`degraded_bootstrap` (decode restarted alone through systemd's RestartUnit, so the daemon "
    "also sees it in the unit start timestamps) and `decode_crash` (SIGKILL of decode, whose "
    "unit has Restart=always, RestartSec=100ms: systemd restarts decode alone). "
    "Latency = fault injected → `stall_detected`, and → `verification_passed`; then one "
    "completion through the router must succeed. Same compressed timings as the scenarios."
)


async def _inject(pd: PdSandbox, fault: str) -> None:
    if fault == "transfer_stall":
        await asyncio.to_thread(
            http_json,
            "POST",
            pd.stack.url("prefill") + "/_sim/fault",
            {"kind": "transfer_stall"},
        )
    elif fault == "degraded_bootstrap":
        unit = pd.stack.unit("decode")
        await asyncio.to_thread(pd.sandbox.queue_unit_job, "RestartUnit", unit)
    elif fault == "decode_crash":
        # SIGKILL of decode's main process; its unit has Restart=always (see _restart_decode_alone),
        # so systemd brings decode back alone under the running prefill.
        await asyncio.to_thread(pd.sandbox.kill_unit, pd.stack.unit("decode"), signal.SIGKILL)
    else:
        raise ValueError(f"unknown recovery fault {fault!r}")


def _restart_decode_alone(pd: PdSandbox) -> None:
    # A typical SGLang unit: Restart=always. Applied by a daemon-reload to the running unit.
    spec = next(s for s in pd.stack.specs() if s.name == pd.stack.unit("decode"))
    pd.sandbox.add_unit(replace(spec, restart="always", extra_service=("RestartSec=100ms",)))


async def _serves(router_url: str) -> bool:
    body = {"model": "pdsim", "prompt": "Reply with the word ok.", "max_tokens": 4}
    try:
        async with httpx.AsyncClient(trust_env=False, timeout=10.0) as client:
            response = await client.post(router_url + "/v1/completions", json=body)
    except httpx.HTTPError:
        return False
    return response.status_code == 200


async def measure_recovery(
    work_dir: Path,
    *,
    reps: int,
    timings: Overrides = COMPRESSED_TIMINGS,
    recovery_timeout_seconds: float = 90.0,
    progress: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run `reps` × each of RECOVERY_FAULTS in one sandbox; a JSON-ready result."""
    reason = skip_reason()
    if reason is not None:
        return {"status": "not measured", "reason": reason}
    values = timing_values(timings)
    await asyncio.to_thread(work_dir.mkdir, parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    pd = await asyncio.to_thread(
        _start_sandbox,
        worker_args=WORKER_ARGS,
        router_args=ROUTER_DEFAULT_ARGS,
        ready_timeout_seconds=values["ready_timeout_seconds"],
    )
    watchdog: WatchdogProcess | None = None
    load_task: asyncio.Task[None] | None = None
    try:
        await asyncio.to_thread(_restart_decode_alone, pd)
        (metrics_port,) = free_ports(1)
        group = GroupTarget(
            name="bench",
            prefill_url=pd.stack.url("prefill"),
            decode_url=pd.stack.url("decode"),
            router_url=pd.stack.url("router"),
            router_metrics_url=pd.stack.router_metrics_url,
            units={role: pd.stack.unit(role) for role in ("prefill", "decode", "router")},
            bootstrap_port=pd.stack.bootstrap_port("prefill"),
        )
        config_path = work_dir / "watchdog.toml"
        config_path.write_text(
            watchdog_config_toml(
                [group],
                timings,
                state_dir=work_dir / "state",
                metrics_listen=f"127.0.0.1:{metrics_port}",
            )
        )
        watchdog = WatchdogProcess(
            config_path, dry_run=False, log_path=work_dir / "watchdog.log", env=pd.env
        )
        await watchdog.start()
        load = LoadGenerator(group.router_url, BACKGROUND_LOAD)
        load_task = asyncio.create_task(load.run())
        healthy = await watchdog.wait_for_event(_became_healthy(0.0), 60.0)
        if healthy is None:
            raise RuntimeError(f"the watchdog never called the sandbox healthy:\n{watchdog.tail()}")
        for rep in range(reps):
            for fault in RECOVERY_FAULTS:
                runs.append(
                    await _one(
                        pd=pd,
                        watchdog=watchdog,
                        fault=fault,
                        rep=rep,
                        timeout_seconds=recovery_timeout_seconds,
                        router_url=group.router_url,
                    )
                )
                progress(f"recovery {fault} #{rep}: {_brief(runs[-1])}")
    except Exception as exc:  # reported in results.md rather than ending the bench
        return {"status": "failed", "reason": f"{type(exc).__name__}: {exc}", "runs": runs}
    finally:
        if load_task is not None:
            load_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await load_task
        if watchdog is not None:
            await watchdog.stop()
        await asyncio.to_thread(_stop_sandbox, pd)
    return {
        "status": "measured",
        "description": DESCRIPTION.format(verify=values["verify_probes"]),
        "watchdog_command": None if watchdog is None else watchdog.command,
        "runs": runs,
        "summary": summarize_recovery(runs, values["period_seconds"]),
    }


def _became_healthy(after: float) -> Callable[[Mapping[str, Any]], bool]:
    def match(event: Mapping[str, Any]) -> bool:
        return (
            event.get("event") == "state_changed"
            and event.get("new") == "healthy"
            and float(event.get("_at", 0.0)) >= after
        )

    return match


def _brief(run: dict[str, Any]) -> str:
    if "error" in run:
        return str(run["error"])
    if "verification_failed_s" in run:
        return (
            f"decision {run['detection_s']} s, verification FAILED at "
            f"{run['verification_failed_s']} s ({run['verification_failed_reasons']}), healthy "
            f"again at {run['healthy_again_s']} s"
        )
    return f"decision {run['detection_s']} s, verified {run['recovery_s']} s"


async def _one(
    *,
    pd: PdSandbox,
    watchdog: WatchdogProcess,
    fault: str,
    rep: int,
    timeout_seconds: float,
    router_url: str,
) -> dict[str, Any]:
    await asyncio.sleep(3.0)
    t0 = time.time()
    run: dict[str, Any] = {"fault": fault, "rep": rep, "t0": t0}
    try:
        await _inject(pd, fault)
    except Exception as exc:
        run["error"] = f"injection failed: {exc}"
        return run
    verdict = await watchdog.wait_for_event(
        lambda e: (
            e.get("event") in ("verification_passed", "verification_failed")
            and float(e.get("_at", 0.0)) >= t0
        ),
        timeout_seconds,
    )
    outcome = summarize_events([e for e in watchdog.events if e.get("_at", 0.0) >= t0], t0)
    run["detection_s"] = _rel(outcome.decision_after_s)
    run["verdict"] = outcome.decision_verdict
    passed = verdict is not None and verdict["event"] == "verification_passed"
    run["recovery_s"] = _rel(float(verdict["_at"]) - t0) if passed and verdict else None
    if verdict is None:
        run["error"] = f"no verification verdict within {timeout_seconds:g} s"
    elif not passed:
        reasons = "; ".join(str(r.get("message")) for r in verdict.get("reasons", []))
        run["verification_failed_s"] = _rel(float(verdict["_at"]) - t0)
        run["verification_failed_reasons"] = reasons
    # Next fault only once the daemon is watching a healthy group again.
    healthy = await watchdog.wait_for_event(_became_healthy(t0), 30.0)
    run["healthy_again_s"] = None if healthy is None else _rel(float(healthy["_at"]) - t0)
    run["served_after"] = await _serves(router_url)
    return run


def _rel(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def summarize_recovery(runs: list[dict[str, Any]], period_seconds: float) -> dict[str, Any]:
    """Per fault: detection and recovery latency statistics, verdicts, serving afterwards."""
    out: dict[str, Any] = {}
    for fault in RECOVERY_FAULTS:
        mine = [r for r in runs if r["fault"] == fault]
        verdicts: dict[str, int] = {}
        for r in mine:
            if r.get("verdict"):
                verdicts[r["verdict"]] = verdicts.get(r["verdict"], 0) + 1
        out[fault] = {
            "runs": len(mine),
            "verification_failed": [
                {"after_s": r["verification_failed_s"], "reasons": r["verification_failed_reasons"]}
                for r in mine
                if "verification_failed_s" in r
            ],
            "healthy_again": latency_stats(
                [r.get("healthy_again_s") for r in mine], period_seconds
            ),
            "detection": latency_stats([r.get("detection_s") for r in mine], period_seconds),
            "recovery": latency_stats([r.get("recovery_s") for r in mine], period_seconds),
            "served_after": sum(1 for r in mine if r.get("served_after")),
            "verdicts": verdicts,
        }
    return out
