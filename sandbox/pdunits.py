"""systemd units for a simulated PD stack (pdsim workers + the real router) and its config.

The command lines are pdsim.stack's, so a unit runs exactly what the loopback tests run, the
router included (sglang-router or smg: `router`, by default from PDSIM_ROUTER).
The units log to the sandbox's journal, where incident evidence reads them (journalctl).
A stack has `prefills` prefill and `decodes` decode workers behind the router (one of each by
default); workers are named by key: `prefill`, `prefill2`, ... (pdsim.stack.worker_keys), and
every method taking a role also takes a worker key. Faults are injected per worker through
`--fault-file <share>/faults/<key>.json` (read at every start: write it, then restart) or
through `environment` (PDSIM_FAULTS=kind:key=value).
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
    role_of,
    router_command,
    worker_command,
    worker_keys,
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
    # role or worker key -> Environment= (a role's entry applies to each of its workers)
    env: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    worker_args: Sequence[str] = ()
    router_args: Sequence[str] = ROUTER_FAST_ARGS
    service_type: str = "simple"
    router: str = field(default_factory=default_router)  # one of pdsim.stack.ROUTERS
    # Workers beyond the first of each role: worker key -> (port, bootstrap port).
    more_ports: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    # role or worker key -> Restart= (a role's entry applies to each of its workers; "no" unless
    # given), e.g. {"prefill": "on-failure"} for systemd bringing a killed prefill back alone
    restart: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def allocate(
        cls, name: str, fault_dir: Path, *, prefills: int = 1, decodes: int = 1, **kwargs: Any
    ) -> PdStackUnits:
        """A stack of `prefills` + `decodes` workers on free loopback ports (two prefills on
        127.0.0.1 each get their own bootstrap port)."""
        extra = worker_keys("prefill", prefills)[1:] + worker_keys("decode", decodes)[1:]
        free = free_ports(5 + 2 * len(extra))
        prefill, decode, bootstrap, router, metrics = free[:5]
        ports = StackPorts(prefill, decode, bootstrap, router, metrics)
        more = {key: (free[5 + 2 * i], free[6 + 2 * i]) for i, key in enumerate(extra)}
        return cls(name=name, ports=ports, fault_dir=fault_dir, more_ports=more, **kwargs)

    def workers(self, role: str) -> list[str]:
        """The worker keys of `role` in order (`prefill`, `prefill2`, ...; `router`)."""
        return [role, *(k for k in self.more_ports if role_of(k) == role)]

    @property
    def keys(self) -> list[str]:
        """Every unit's key: prefills, decodes, then the router."""
        return [key for role in ROLES for key in self.workers(role)]

    def unit(self, role: str) -> str:
        """The unit name of a role (its first worker) or of one worker by key."""
        return f"sglang-{self.name}-{role}.service"

    def url(self, role: str) -> str:
        """The base URL of a role (its first worker) or of one worker by key."""
        if role in self.more_ports:
            return f"http://{HOST}:{self.more_ports[role][0]}"
        port = {"prefill": self.ports.prefill, "decode": self.ports.decode}.get(role)
        return f"http://{HOST}:{port if port is not None else self.ports.router}"

    def bootstrap_port(self, key: str) -> int:
        """The KV bootstrap port of one prefill (the router passes it to the decode)."""
        return self.more_ports[key][1] if key in self.more_ports else self.ports.bootstrap

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
        for key in [*self.workers("prefill"), *self.workers("decode")]:
            role = role_of(key)
            argv = worker_command(
                role,
                port=int(self.url(key).rsplit(":", 1)[1]),
                bootstrap_port=self.bootstrap_port(key),
                python=self.python,
                fault_file=self.fault_file(key),
                extra=self.worker_args,
            )
            env = {**base_env, **self.env.get(role, {}), **self.env.get(key, {})}
            specs.append(
                UnitSpec(
                    name=self.unit(key),
                    description=f"simulated SGLang {key} ({self.name})",
                    exec_start=argv,
                    service_type=self.service_type,
                    environment=env,
                    working_directory=str(REPO_ROOT),
                    output="journal",
                    restart=self.restart.get(key, self.restart.get(role, "no")),
                )
            )
        router = router_command(
            prefills=[(self.url(k), self.bootstrap_port(k)) for k in self.workers("prefill")],
            decodes=[self.url(k) for k in self.workers("decode")],
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
                restart=self.restart.get("router", "no"),
            )
        )
        return specs

    def group_overrides(self) -> dict[str, Any]:
        """This stack as one [[group]] of a watchdog config (named like the stack)."""
        group: dict[str, Any] = {"name": self.name}
        for role in ROLES:
            keys = self.workers(role)
            workers: list[dict[str, Any]] = [
                {"unit": self.unit(k), "url": self.url(k)} for k in keys
            ]
            if role == "prefill":  # the real one, so direct PD probes reach its bootstrap
                for worker, key in zip(workers, keys, strict=True):
                    worker["bootstrap_port"] = self.bootstrap_port(key)
            group[role] = workers[0] if len(keys) == 1 else workers
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
                        # Verification as soon as the group is back: no soak in these tests.
                        "soak_probes": 1,
                        "soak_seconds": 0,
                    },
                }
            ],
        }
        return config_text(own, *layers)
