"""systemd units for a simulated PD stack (pdsim workers + the real router) and its config.

The command lines are pdsim.stack's, so a unit runs exactly what the loopback tests run, the
router included (sglang-router or smg: `router`, by default from PDSIM_ROUTER).
The three units log to the sandbox's journal, where incident evidence reads them (journalctl).
Faults are injected per role through `--fault-file <share>/faults/<role>.json` (read at every
start: write it, then restart) or through `environment` (PDSIM_FAULTS=kind:key=value).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdsim.stack import (
    HOST,
    REPO_ROOT,
    ROUTER_FAST_ARGS,
    StackPorts,
    default_router,
    free_ports,
    router_command,
    worker_command,
)
from sandbox.namespace import UnitSpec
from watchdog.configfile import Overrides, config_text

ROLES = ("prefill", "decode", "router")


@dataclass(frozen=True)
class PdStackUnits:
    """Unit names, ports, URLs and unit specs of one simulated stack named `name`."""

    name: str
    ports: StackPorts
    fault_dir: Path
    python: str = sys.executable
    env: Mapping[str, Mapping[str, str]] = field(default_factory=dict)  # role -> Environment=
    worker_args: Sequence[str] = ()
    router_args: Sequence[str] = ROUTER_FAST_ARGS
    service_type: str = "simple"
    router: str = field(default_factory=default_router)  # one of pdsim.stack.ROUTERS

    @classmethod
    def allocate(cls, name: str, fault_dir: Path, **kwargs: Any) -> PdStackUnits:
        """A stack on five free loopback ports."""
        prefill, decode, bootstrap, router, metrics = free_ports(5)
        ports = StackPorts(prefill, decode, bootstrap, router, metrics)
        return cls(name=name, ports=ports, fault_dir=fault_dir, **kwargs)

    def unit(self, role: str) -> str:
        """The unit name of a role."""
        return f"sglang-{self.name}-{role}.service"

    def url(self, role: str) -> str:
        """The base URL of a role."""
        port = {"prefill": self.ports.prefill, "decode": self.ports.decode}.get(role)
        return f"http://{HOST}:{port if port is not None else self.ports.router}"

    @property
    def router_metrics_url(self) -> str:
        """The router's separate Prometheus listener."""
        return f"http://{HOST}:{self.ports.router_metrics}/metrics"

    def fault_file(self, role: str) -> Path:
        """Faults this worker reads when it starts."""
        return self.fault_dir / f"{role}.json"

    def set_start_faults(self, role: str, faults: Sequence[Mapping[str, Any]]) -> None:
        """Faults for the next start of `role` (an empty list clears them)."""
        path = self.fault_file(role)
        if faults:
            path.write_text(json.dumps(list(faults)))
        else:
            path.unlink(missing_ok=True)

    def specs(self) -> list[UnitSpec]:
        """The three units (workers run from the repository root, like pdsim.stack)."""
        self.fault_dir.mkdir(parents=True, exist_ok=True)
        base_env = {"PYTHONUNBUFFERED": "1"}
        specs = []
        for role in ("prefill", "decode"):
            argv = worker_command(
                role,
                port=self.ports.prefill if role == "prefill" else self.ports.decode,
                bootstrap_port=self.ports.bootstrap,
                python=self.python,
                fault_file=self.fault_file(role),
                extra=self.worker_args,
            )
            specs.append(
                UnitSpec(
                    name=self.unit(role),
                    description=f"simulated SGLang {role} ({self.name})",
                    exec_start=argv,
                    service_type=self.service_type,
                    environment={**base_env, **self.env.get(role, {})},
                    working_directory=str(REPO_ROOT),
                    output="journal",
                )
            )
        router = router_command(
            prefill_url=self.url("prefill"),
            bootstrap_port=self.ports.bootstrap,
            decode_url=self.url("decode"),
            port=self.ports.router,
            metrics_port=self.ports.router_metrics,
            python=self.python,
            extra=self.router_args,
            router=self.router,
        )
        specs.append(
            UnitSpec(
                name=self.unit("router"),
                description=f"{self.router} in PD mode ({self.name})",
                exec_start=router,
                service_type=self.service_type,
                environment={**base_env, **self.env.get("router", {})},
                working_directory=str(REPO_ROOT),
                output="journal",
            )
        )
        return specs

    def group_overrides(self) -> dict[str, Any]:
        """This stack as one [[group]] of a watchdog config (named like the stack)."""
        group: dict[str, Any] = {"name": self.name}
        for role in ROLES:
            group[role] = {"unit": self.unit(role), "url": self.url(role)}
        group["router"]["metrics_url"] = self.router_metrics_url
        return group

    def config_toml(
        self, state_dir: Path, *layers: Overrides, ready_timeout_seconds: float = 30.0
    ) -> str:
        """A watchdog config for this stack (short probe timeouts; `layers` go on top)."""
        own = {
            "watchdog": {"state_dir": str(state_dir)},
            "group": [
                {
                    **self.group_overrides(),
                    "probe": {"model": "pdsim", "timeout_seconds": 3, "stream_idle_seconds": 2},
                    "restart": {
                        "ready_timeout_seconds": ready_timeout_seconds,
                        "verify_timeout_seconds": max(ready_timeout_seconds, 10),
                    },
                }
            ],
        }
        return config_text(own, *layers)
