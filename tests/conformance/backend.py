"""What the conformance checks need from a PD pair, and its two implementations.

`Backend` is the surface of tests/conformance/checks.py: base URLs, plain synchronous HTTP, the
transfer fault, aborts and restarts. `PdsimBackend` drives pdsim (pdsim/stack.py, its
`transfer_stall` fault on prefill); `RealBackend` drives the released sglang 0.5.23 on CPU
(realsglang/stack.py, decode's mooncake data port dropped with nftables under the silent
mooncake timeouts). The checks see no other difference.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Protocol

from pdsim.stack import PDStack, http_get
from realsglang.stack import BOOTSTRAP_PORT, MODEL_NAME, RealSandbox, http_post


class Backend(Protocol):
    """A running prefill, decode and router, with the faults the checks need."""

    name: str
    model: str  # the served model name (`model` of /v1/* requests)
    bootstrap_port: int  # prefill's KV bootstrap port (for a direct dual POST)
    boot_seconds: float  # how long the whole stack took to serve, measured at its start

    def url(self, role: str) -> str:
        """The base URL of `prefill`, `decode` or `router`."""
        ...

    def get(self, target: str, timeout_seconds: float = 5.0) -> tuple[int, bytes]:
        """GET: (status, body); (0, b"") when nothing answers in time."""
        ...

    def post(self, target: str, body: Any, timeout_seconds: float = 30.0) -> tuple[int, bytes]:
        """POST JSON: (status, body); (0, b"") when nothing answers in time."""
        ...

    def stall_transfer(self) -> None:
        """From now on, KV transfers from prefill to decode start and never complete."""
        ...

    def release_transfer(self) -> None:
        """Undo stall_transfer() for new transfers."""
        ...

    def restart(self, role: str) -> None:
        """Restart one server's process (returns at once; it is not ready yet)."""
        ...


def abort(backend: Backend, role: str, rid: str) -> tuple[int, bytes]:
    """`POST /abort_request {"rid"}` on one server."""
    return backend.post(backend.url(role) + "/abort_request", {"rid": rid})


def new_room() -> int:
    """A bootstrap room as the router draws it (int in [0, 2^63))."""
    return random.randrange(2**63)


@dataclass
class PdsimBackend:
    """pdsim's prefill and decode behind the real router (one tests/pdsim stack)."""

    stack: PDStack
    boot_seconds: float
    name: str = "pdsim"
    model: str = "pdsim"
    bootstrap_port: int = field(init=False)

    def __post_init__(self) -> None:
        self.bootstrap_port = self.stack.bootstrap_port

    def url(self, role: str) -> str:
        return self.stack.url(role)

    def get(self, target: str, timeout_seconds: float = 5.0) -> tuple[int, bytes]:
        return http_get(target, timeout_s=timeout_seconds)

    def post(self, target: str, body: Any, timeout_seconds: float = 30.0) -> tuple[int, bytes]:
        return http_post(target, body, timeout_seconds)

    def stall_transfer(self) -> None:
        # Prefill's inflight transfers never complete (pdsim/engine.py, PrefillEngine).
        self.stack.set_fault("prefill", "transfer_stall")

    def release_transfer(self) -> None:
        # As when the dropped port is restored on real servers: what is still stuck moves on.
        self.stack.clear_faults("prefill", "transfer_stall")
        self.stack.release_stuck("prefill")

    def restart(self, role: str) -> None:
        self.stack.restart(role, wait_ready=False)


@dataclass
class RealBackend:
    """The real sglang 0.5.23 pair behind sglang-router 0.3.2, in its sandbox."""

    real: RealSandbox
    boot_seconds: float
    router: str = "sglang-router"
    name: str = "real"
    model: str = MODEL_NAME
    bootstrap_port: int = BOOTSTRAP_PORT

    def url(self, role: str) -> str:
        return self.real.stack.url(self.router if role == "router" else role)

    def get(self, target: str, timeout_seconds: float = 5.0) -> tuple[int, bytes]:
        return self.real.get(target, timeout_seconds)

    def post(self, target: str, body: Any, timeout_seconds: float = 30.0) -> tuple[int, bytes]:
        return self.real.post(target, body, timeout_seconds)

    def stall_transfer(self) -> None:
        self.real.drop_transfer()

    def release_transfer(self) -> None:
        self.real.restore_transfer()

    def restart(self, role: str) -> None:
        self.real.sandbox.queue_unit_job("RestartUnit", self.real.stack.unit(role))
