"""Where the demo's stack and watchdog run: a systemd sandbox (the real loop) or plain processes.

SandboxBackend: a private systemd (PID 1 of its own namespace, sandbox/) runs prefill, decode
and the real router as units, and the watchdog as a Type=notify unit next to them, as in production.
Inside the namespace the units' MainPIDs are the watchdog's own PIDs, so its evidence reads the
right /proc entries; its restarts are real RestartUnit jobs over the sandbox's bus.

PlainBackend: the stack as plain processes (pdsim/) and the watchdog as a subprocess with
`--dry-run` and no system bus: it detects, captures evidence and logs its plan, and restarts
nothing; the demo then lifts the fault, so the rehearsal's verification has a recovered stack.

Either way every process is stopped by PID (the sandbox: Manager.Exit, then SIGKILL of its PID 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Protocol

from demo.config import ROLES, DemoTarget
from pdsim.stack import REPO_ROOT, PDStack, StackConfig, http_json, start_stack
from sandbox.namespace import SandboxError, UnitSpec
from sandbox.pdsandbox import PdSandbox

# A bus that cannot exist: the dry-run watchdog must never see (or touch) the host's own units.
NO_BUS = "unix:path=/nonexistent/sglang-watchdog-demo/bus"
WATCHDOG_UNIT = "sglang-watchdog-demo.service"
STOP_GRACE_SECONDS = 15.0
WATCHDOG_START_SECONDS = 30.0


class SandboxUnavailable(RuntimeError):
    """The systemd sandbox could not boot here although its tools exist (the demo falls back)."""


def _gist(message: str) -> str:
    """A multi-line error (a headline, then a log tail) as one line: headline and last line."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else message
    return f"{lines[0].rstrip(':')}: {lines[-1]}"


def watchdog_command() -> list[str]:
    """The venv's `watchdog` console script (or `python -m watchdog` next to this interpreter)."""
    script = Path(sys.executable).with_name("watchdog")
    return [str(script)] if script.exists() else [sys.executable, "-m", "watchdog"]


def watchdog_argv(config: Path, record: Path, *, dry_run: bool) -> list[str]:
    """The daemon's command line: JSON logs (the demo reads them) and a recording (the picture)."""
    argv = [*watchdog_command(), "--log-format", "json", "--config", str(config)]
    argv += ["--record", str(record)]
    return [*argv, "--dry-run"] if dry_run else argv


def inject_transfer_stall(prefill_url: str) -> None:
    """pdsim's `transfer_stall` on prefill: KV transfers start and never finish (no persist, so a
    restart of prefill clears it, as a real co-restart clears a wedged transfer engine)."""
    http_json("POST", prefill_url + "/_sim/fault", {"kind": "transfer_stall"})


def lift_transfer_stall(prefill_url: str, decode_url: str) -> int:
    """Clear the fault and let the stuck transfers finish; returns how many were stuck.

    For the dry run only. Restarting the plain processes instead would fail every stuck transfer
    (decode counts them), after the rehearsal's verification has already begun, and the watchdog
    would rightly call that a failed verification.
    """
    http_json("DELETE", prefill_url + "/_sim/fault/transfer_stall")
    released = 0
    for url in (prefill_url, decode_url):
        released += int(http_json("POST", url + "/_sim/release")["released"])
    return released


class Backend(Protocol):
    """What the demo needs from where the stack runs."""

    mode: str
    acting: bool  # the watchdog restarts units itself (False: --dry-run)

    @property
    def target(self) -> DemoTarget: ...

    async def start_stack(self, out: Path) -> None: ...
    async def start_watchdog(self, config: Path, record: Path) -> None: ...
    def watchdog_lines(self) -> AsyncIterator[str]: ...
    def watchdog_exit_code(self) -> int | None: ...
    async def stop_watchdog(self) -> None: ...
    async def stop(self) -> None: ...
    def stop_now(self) -> None: ...


async def _stop_process(proc: asyncio.subprocess.Process, grace_seconds: float) -> None:
    """SIGTERM by PID, wait, then SIGKILL."""
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGTERM)
    try:
        async with asyncio.timeout(grace_seconds):
            await proc.wait()
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        await proc.wait()


class PlainBackend:
    """The stack as plain processes; the watchdog as a `--dry-run` subprocess."""

    mode = "plain"
    acting = False

    def __init__(self) -> None:
        self.stack: PDStack | None = None
        self.proc: asyncio.subprocess.Process | None = None

    @property
    def target(self) -> DemoTarget:
        stack = self._stack()
        return DemoTarget(
            urls={role: stack.url(role) for role in ROLES},
            units={role: f"sglang-demo-{role}.service" for role in ROLES},
            router_metrics_url=stack.router_metrics_url,
            bootstrap_port=stack.bootstrap_port,
        )

    def _stack(self) -> PDStack:
        if self.stack is None:
            raise RuntimeError("the stack is not started")
        return self.stack

    async def start_stack(self, out: Path) -> None:
        config = StackConfig(log_dir=out / "stack-logs")
        self.stack = await asyncio.to_thread(start_stack, config)

    async def start_watchdog(self, config: Path, record: Path) -> None:
        env = {**os.environ, "DBUS_SYSTEM_BUS_ADDRESS": NO_BUS, "PYTHONUNBUFFERED": "1"}
        for key in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
            env.pop(key, None)
        self.proc = await asyncio.create_subprocess_exec(
            *watchdog_argv(config, record, dry_run=True),
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,  # Ctrl-C in the terminal reaches the demo only; it stops us
        )

    async def watchdog_lines(self) -> AsyncIterator[str]:
        assert self.proc is not None
        assert self.proc.stderr is not None
        async for raw in self.proc.stderr:
            yield raw.decode("utf-8", errors="replace").rstrip("\n")

    def watchdog_exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.returncode

    async def stop_watchdog(self) -> None:
        if self.proc is not None:
            await _stop_process(self.proc, STOP_GRACE_SECONDS)

    async def stop(self) -> None:
        await self.stop_watchdog()
        if self.stack is not None:
            await asyncio.to_thread(self.stack.stop)
            self.stack = None

    def stop_now(self) -> None:
        """Synchronous last resort (the event loop is gone): SIGKILL and stop by PID."""
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
        if self.stack is not None:
            self.stack.stop()
            self.stack = None


class SandboxBackend:
    """Stack and watchdog as units of a private systemd; real RestartUnit over its own bus."""

    mode = "sandbox"
    acting = True

    def __init__(self) -> None:
        self.pd: PdSandbox | None = None
        self._stopped = False
        self._unit_log: Path | None = None

    @property
    def target(self) -> DemoTarget:
        pd = self._pd()
        return DemoTarget(
            urls={role: pd.stack.url(role) for role in ROLES},
            units={role: pd.stack.unit(role) for role in ROLES},
            router_metrics_url=pd.stack.router_metrics_url,
            bootstrap_port=pd.stack.bootstrap_port("prefill"),
        )

    def _pd(self) -> PdSandbox:
        if self.pd is None:
            raise RuntimeError("the sandbox is not started")
        return self.pd

    async def start_stack(self, out: Path) -> None:
        try:
            # The watchdog unit writes its recording into `out` (under /tmp too: shared back).
            self.pd = await asyncio.to_thread(PdSandbox.start, "demo", host_paths=[out])
        except SandboxError as exc:  # e.g. a container that forbids unshare or mounts
            raise SandboxUnavailable(_gist(str(exc))) from None

    async def start_watchdog(self, config: Path, record: Path) -> None:
        pd = self._pd()
        spec = UnitSpec(
            name=WATCHDOG_UNIT,
            description="sglang-watchdog (demo)",
            exec_start=watchdog_argv(config, record, dry_run=False),
            # READY=1 only once its metrics listener and bus connection are up, as in production.
            service_type="notify",
            environment={
                "PYTHONUNBUFFERED": "1",
                "DBUS_SYSTEM_BUS_ADDRESS": "unix:path=/run/dbus/system_bus_socket",
            },
            working_directory=str(REPO_ROOT),
            timeout_stop_seconds=STOP_GRACE_SECONDS,
            extra_service=("NotifyAccess=main",),
            wanted=False,
        )
        self._unit_log = pd.sandbox.logs_dir / f"{WATCHDOG_UNIT}.log"
        await asyncio.to_thread(pd.sandbox.add_unit, spec, start=True)
        # StartUnit only queues a job: the unit reads "inactive" until the job runs, then
        # "activating" until READY=1. Wait for the outcome, so "inactive" later means it ended.
        deadline = time.monotonic() + WATCHDOG_START_SECONDS
        state = ""
        while time.monotonic() < deadline:
            state = await asyncio.to_thread(self._unit_state)
            if state == "active":
                return
            if state == "failed":
                break
            await asyncio.sleep(0.1)
        tail = "\n".join(pd.sandbox.unit_log(WATCHDOG_UNIT).splitlines()[-15:])
        raise RuntimeError(f"{WATCHDOG_UNIT} did not start (ActiveState={state!r}):\n{tail}")

    async def watchdog_lines(self) -> AsyncIterator[str]:
        """Follow the unit's log file until the watchdog has stopped and everything is read."""
        assert self._unit_log is not None
        while not self._unit_log.exists():
            if self._stopped:
                return
            await asyncio.sleep(0.1)
        with self._unit_log.open(encoding="utf-8", errors="replace") as handle:
            buffer = ""
            while True:
                chunk = handle.readline()
                if chunk:
                    buffer += chunk
                    if buffer.endswith("\n"):
                        yield buffer.rstrip("\n")
                        buffer = ""
                    continue
                if self._stopped:
                    if buffer:
                        yield buffer
                    return
                await asyncio.sleep(0.1)

    def _unit_state(self) -> str:
        pd = self.pd
        if pd is None:
            return ""
        try:
            return pd.sandbox.unit_property(WATCHDOG_UNIT, "ActiveState")
        except Exception:  # the bus is gone: the sandbox is stopping
            return ""

    def watchdog_exit_code(self) -> int | None:
        # Only "it ended" matters to the demo: failed or inactive before we asked it to stop.
        if self._stopped or self.pd is None:
            return None
        state = self._unit_state()
        return 1 if state in ("failed", "inactive") else None

    async def stop_watchdog(self) -> None:
        pd = self.pd
        if pd is None or self._stopped:
            return
        await asyncio.to_thread(pd.sandbox.queue_unit_job, "StopUnit", WATCHDOG_UNIT, check=False)
        deadline = time.monotonic() + STOP_GRACE_SECONDS + 5
        while time.monotonic() < deadline:
            if await asyncio.to_thread(self._unit_state) in ("inactive", "failed", ""):
                break
            await asyncio.sleep(0.2)
        self._stopped = True

    async def stop(self) -> None:
        await self.stop_watchdog()
        self._stopped = True
        if self.pd is not None:
            pd, self.pd = self.pd, None
            await asyncio.to_thread(pd.stop)

    def stop_now(self) -> None:
        """Synchronous last resort: tearing the sandbox down ends every process in it."""
        self._stopped = True
        if self.pd is not None:
            pd, self.pd = self.pd, None
            pd.stop()
