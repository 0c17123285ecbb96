"""A simulated PD stack running as real units of a sandboxed systemd, plus its watchdog config.

Reusable by the restart tests, the daemon end-to-end tests, the demo and the benchmark:

    with PdSandbox.start("sbx") as pd:
        pd.config_path          # a watchdog config for the stack (state_dir inside the share dir)
        pd.sandbox.bus_address  # DBUS_SYSTEM_BUS_ADDRESS for the watchdog
        pd.stack.url("router")

The checkout and the running venv are shared with the sandbox, so a checkout under /tmp works
(see sandbox.namespace); `host_paths` adds more (e.g. an output folder under /tmp).

Extra units (the watchdog itself as a Type=notify unit, a load generator) go in `extra_units` or
are added later with `pd.sandbox.add_unit(spec, start=True)`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from pdsim.stack import REPO_ROOT, http_get
from sandbox.namespace import SandboxError, SystemdSandbox, UnitSpec
from sandbox.pdunits import PdStackUnits
from watchdog.configfile import Overrides


@dataclass
class PdSandbox:
    """A started sandbox with the units of `stack` (three, or more with several workers per
    role: `PdSandbox.start(..., prefills=2, decodes=2)`), ready to serve."""

    sandbox: SystemdSandbox
    stack: PdStackUnits
    config_path: Path
    state_dir: Path

    @classmethod
    def start(
        cls,
        name: str = "sbx",
        *,
        extra_units: Sequence[UnitSpec] = (),
        ready_timeout_seconds: float = 30.0,
        config_layers: Sequence[Overrides] = (),
        host_paths: Sequence[Path] = (),
        **stack_kwargs: Any,
    ) -> PdSandbox:
        """Boot a sandbox with the stack (and `extra_units`) and wait until the router is ready."""
        # The units run the venv's python from the checkout: both must be visible inside.
        sandbox = SystemdSandbox(host_paths=[REPO_ROOT, Path(sys.prefix), *host_paths])
        try:
            share = sandbox.share_dir
            stack = PdStackUnits.allocate(name, share / "faults", **stack_kwargs)
            for spec in [*stack.specs(), *extra_units]:
                sandbox.add_unit(spec)
            state_dir = share / "state"
            state_dir.mkdir(parents=True, exist_ok=True)
            config_path = share / "watchdog.toml"
            config_path.write_text(
                stack.config_toml(
                    state_dir, *config_layers, ready_timeout_seconds=ready_timeout_seconds
                )
            )
            pd = cls(sandbox, stack, config_path, state_dir)
            sandbox.start()
            pd.wait_until_serving(timeout_seconds=60.0)
        except BaseException:
            sandbox.stop()
            raise
        return pd

    def stop(self) -> None:
        """Tear the sandbox down (Manager.Exit, then SIGKILL of its PID 1)."""
        self.sandbox.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def env(self) -> dict[str, str]:
        """Environment for a watchdog process driving this sandbox."""
        return {**os.environ, "DBUS_SYSTEM_BUS_ADDRESS": self.sandbox.bus_address}

    def router_ready(self) -> bool:
        """Router /readiness is 200 and /workers lists every worker as healthy."""
        router = self.stack.url("router")
        status, _ = http_get(router + "/readiness", timeout_s=2.0)
        if status != 200:
            return False
        status, body = http_get(router + "/workers", timeout_s=2.0)
        if status != 200:
            return False
        healthy = {w["url"] for w in json.loads(body)["workers"] if w.get("is_healthy")}
        workers = [*self.stack.workers("prefill"), *self.stack.workers("decode")]
        return {self.stack.url(key) for key in workers} <= healthy

    def wait_until_serving(self, timeout_seconds: float = 30.0) -> None:
        """Wait until the router is ready with every worker; SandboxError with logs otherwise."""
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            if self.router_ready():
                return
            time.sleep(0.1)
        logs = "\n".join(
            f"--- {unit}\n{self.sandbox.unit_log(unit)[-1500:]}"
            for unit in (self.stack.unit(key) for key in self.stack.keys)
        )
        raise SandboxError(f"the simulated stack did not become ready:\n{logs}")

    def wait_for_new_start(
        self, key: str, before: dict[str, int], timeout_seconds: float
    ) -> dict[str, int]:
        """Wait until unit `key` started anew since `before` (start_times_us()); every unit's
        start time at that moment. SandboxError after `timeout_seconds`."""
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            now = self.start_times_us()
            if now[key] != before[key]:
                return now
            time.sleep(0.1)
        raise SandboxError(
            f"{self.stack.unit(key)} did not start anew within {timeout_seconds:g} s"
        )

    def start_times_us(self) -> dict[str, int]:
        """ExecMainStartTimestamp of each unit by worker key (`prefill`, `prefill2`, ...,
        `router`; busctl, for assertions outside the code)."""
        out = {}
        for key in self.stack.keys:
            value = self.sandbox.unit_property(
                self.stack.unit(key), "ExecMainStartTimestamp", "Service"
            )
            out[key] = int(value or 0)
        return out
