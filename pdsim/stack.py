"""Start, stop and restart a simulated PD stack (prefill, decode, the real router) by PID.

The command lines built here are the ones a systemd unit, the demo or a benchmark would run:
workers are `python -m pdsim.worker ...` with the repository root as working directory; the
router is `python -m sglang_router.launch_router --pd-disaggregation ...` (sglang-router 0.3.2) or
`python -m smg.launch_router ...` (its successor smg), chosen by PDSIM_ROUTER, bound to 127.0.0.1
on both its listeners. Every process is started in its own session, logs to `<log_dir>/<role>.log`
(appended across restarts, like a journal), and is stopped by its PID: SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
WORKER_ROLES = ("prefill", "decode")
ROLES = ("prefill", "decode", "router")

# The two routers a stack can run: sglang-router 0.3.2 (the last release under that name) and its
# successor smg; docs/sglang.md §7.9 lists how they differ. PDSIM_ROUTER picks the default.
ROUTERS = ("sglang-router", "smg")
ROUTER_ENV = "PDSIM_ROUTER"
_ROUTER_MODULES = {"sglang-router": "sglang_router.launch_router", "smg": "smg.launch_router"}
# smg registers workers through a workflow that retries one not yet healthy only every
# --worker-startup-check-interval (default 30 s); sandbox units start together, so poll each second.
# Put before the caller's arguments, which can override it.
_ROUTER_OWN_ARGS: dict[str, tuple[str, ...]] = {
    "sglang-router": (),
    "smg": ("--worker-startup-check-interval", "1"),
}

# docs/sglang.md §4: fast, deterministic health checking for tests. The 3 s health-check timeout
# is one a real SGLang /health, which never answers in under 1 s (docs/sglang.md §7.1), can meet.
# A one-second grace period on shutdown keeps a router holding hung requests from delaying
# teardown by its default 180 s.
ROUTER_FAST_ARGS: tuple[str, ...] = (
    "--health-check-interval-secs", "1",
    "--health-check-timeout-secs", "3",
    "--health-failure-threshold", "1",
    "--health-success-threshold", "1",
    "--disable-circuit-breaker",
    "--shutdown-grace-period-secs", "1",
)  # fmt: skip


# Kept as a name for callers that ask for a router a real /health can satisfy: the fast
# arguments already are that.
ROUTER_REAL_HEALTH_ARGS: tuple[str, ...] = ROUTER_FAST_ARGS

# Worker opt-ins that bring back pdsim's behaviour from before it followed real SGLang
# (docs/sglang.md §7): `fast-health` (/health polls every 50 ms, no initial 1 s sleep),
# `legacy-aborts` (prefix match, every rid recorded, aborts neither KV failures nor finished
# requests, stuck transfers unabortable) and `legacy-streams` (a PD failure before the first
# token is an HTTP error). The library defaults to the real behaviour (REAL_SGLANG, no opt-ins);
# pass `compat=LEGACY_COMPAT` (or a subset) only where a test needs the old behaviour.
COMPAT_OPTIONS = frozenset({"fast-health", "legacy-aborts", "legacy-streams"})
LEGACY_COMPAT: frozenset[str] = COMPAT_OPTIONS
REAL_SGLANG: frozenset[str] = frozenset()


class StackError(RuntimeError):
    """A process of the stack did not start or become ready; the message has its log tail."""


def default_router() -> str:
    """The router named by PDSIM_ROUTER ("sglang-router" when unset); ValueError if unknown."""
    router = os.environ.get(ROUTER_ENV) or "sglang-router"
    if router not in ROUTERS:
        raise ValueError(f"{ROUTER_ENV}={router!r}: expected one of {', '.join(ROUTERS)}")
    return router


@dataclass(frozen=True)
class StackPorts:
    """The five ports of one stack."""

    prefill: int
    decode: int
    bootstrap: int
    router: int
    router_metrics: int


@dataclass(frozen=True)
class StackConfig:
    """How to build a stack. Tuples of extra arguments are appended to the command lines."""

    sglang_version: str = "0.5.23"
    tp_size: int = 1
    model_name: str = "pdsim"
    worker_args: tuple[str, ...] = ()
    prefill_args: tuple[str, ...] = ()
    decode_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ROUTER_FAST_ARGS
    prefill_faults: tuple[Mapping[str, Any], ...] = ()
    decode_faults: tuple[Mapping[str, Any], ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    log_dir: Path | None = None
    ports: StackPorts | None = None
    python: str = sys.executable
    ready_timeout_s: float = 30.0
    with_router: bool = True
    compat: frozenset[str] = REAL_SGLANG
    router: str = field(default_factory=default_router)  # one of ROUTERS
    # Workers per role behind the router (2P2D: 2, 2). The first of each role uses `ports`;
    # the others get free ports of their own (see worker_keys for their names).
    prefills: int = 1
    decodes: int = 1


def worker_keys(role: str, count: int) -> list[str]:
    """How a stack names the workers of `role`: `prefill`, then `prefill2`, `prefill3`, ..."""
    return [role if i == 0 else f"{role}{i + 1}" for i in range(count)]


def role_of(key: str) -> str:
    """The role of a worker key (`prefill2` -> `prefill`; `router` -> `router`)."""
    return key.rstrip("0123456789")


# Chosen below Linux's default ephemeral range (net.ipv4.ip_local_port_range 32768-60999): a port
# picked there and released could be handed out as a client connection's source port before its
# server binds it ("Address already in use", seen in a CI-like run).
FREE_PORT_RANGE = (20000, 32768)
# A narrower range for this process, "LOW-HIGH" (HIGH excluded): the test suites give each
# pytest-xdist worker a block of its own (tests/conftest.py), so two test processes never hand out
# the same port.
PORT_RANGE_ENV = "PDSIM_PORT_RANGE"

# A port is free when chosen and bound by its server only seconds later (a worker starting on a
# busy machine): in that window a second stack of this process could choose it too (CI: "address
# already in use" for a decode of the slow-decode family, six stacks started side by side). So a
# port handed out here is not handed out again while newer ones can be: the oldest are forgotten
# only when half the range has been given.
_given: dict[int, None] = {}
_given_lock = threading.Lock()


def port_range() -> tuple[int, int]:
    """The range free_ports chooses from: PDSIM_PORT_RANGE when set, else FREE_PORT_RANGE."""
    spec = os.environ.get(PORT_RANGE_ENV)
    if not spec:
        return FREE_PORT_RANGE
    low, _, high = spec.partition("-")
    try:
        chosen = int(low), int(high)
    except ValueError:
        raise ValueError(
            f"{PORT_RANGE_ENV}={spec!r}: expected LOW-HIGH, e.g. 20000-23192"
        ) from None
    if not 1024 <= chosen[0] < chosen[1] <= 65536 or chosen[1] - chosen[0] < 64:
        raise ValueError(
            f"{PORT_RANGE_ENV}={spec!r}: expected 1024 <= LOW, LOW + 64 <= HIGH <= 65536"
        )
    return chosen


def port_block(index: int, count: int) -> tuple[int, int]:
    """Block `index` of `count` equal, disjoint blocks of FREE_PORT_RANGE (one per process)."""
    low, high = FREE_PORT_RANGE
    size = (high - low) // count
    return low + index * size, low + (index + 1) * size


def free_ports(count: int) -> list[int]:
    """Distinct free loopback ports, none handed out before by this process (see _given)."""
    low, high = port_range()
    chooser = random.SystemRandom()
    socks: list[socket.socket] = []
    with _given_lock:
        try:
            while len(socks) < count:
                port = chooser.randrange(low, high)
                if port in _given:
                    continue
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                try:
                    s.bind((HOST, port))
                except OSError:  # in use, or lingering in TIME_WAIT: pick another
                    s.close()
                    continue
                socks.append(s)
            ports = [s.getsockname()[1] for s in socks]
        finally:
            for s in socks:
                s.close()
        for port in ports:
            _given[port] = None
        while len(_given) > (high - low) // 2:
            del _given[next(iter(_given))]
        return ports


def worker_command(
    role: str,
    *,
    port: int,
    bootstrap_port: int,
    python: str = sys.executable,
    host: str = HOST,
    sglang_version: str = "0.5.23",
    tp_size: int = 1,
    model_name: str = "pdsim",
    fault_file: Path | None = None,
    extra: Sequence[str] = (),
    compat: frozenset[str] = REAL_SGLANG,
    enable_metrics: bool = True,
) -> list[str]:
    """The command line of one simulated worker (run it with cwd = repository root).

    `compat` names old pdsim behaviours to bring back (see COMPAT_OPTIONS; none by default).
    `--enable-metrics` is passed unless `enable_metrics=False`: SGLang serves no /metrics
    without it (docs/sglang.md §7.8), and every stack here is scraped."""
    unknown = set(compat) - COMPAT_OPTIONS
    if unknown:
        raise ValueError(f"unknown compat options: {sorted(unknown)}")
    argv = [
        python, "-m", "pdsim.worker",
        "--role", role,
        "--host", host,
        "--port", str(port),
        "--sglang-version", sglang_version,
        "--tp-size", str(tp_size),
        "--served-model-name", model_name,
    ]  # fmt: skip
    if role == "prefill":
        argv += ["--bootstrap-port", str(bootstrap_port)]
    if fault_file is not None:
        argv += ["--fault-file", str(fault_file)]
    if enable_metrics:
        argv.append("--enable-metrics")
    argv += [f"--{name}" for name in sorted(compat)]
    return argv + list(extra)


def router_command(
    *,
    prefill_url: str | None = None,
    bootstrap_port: int | None = None,
    decode_url: str | None = None,
    port: int,
    metrics_port: int,
    python: str = sys.executable,
    host: str = HOST,
    extra: Sequence[str] = ROUTER_FAST_ARGS,
    router: str | None = None,
    prefills: Sequence[tuple[str, int]] = (),
    decodes: Sequence[str] = (),
) -> list[str]:
    """The real router in PD mode; both listeners on `host` (their default is 0.0.0.0).

    Workers are `prefill_url` with `bootstrap_port` and `decode_url`, then `prefills` (URL,
    bootstrap port) and `decodes`: `--prefill URL PORT` and `--decode URL` once per worker. The
    router hands each request's prefill host and bootstrap port to the decode it picks, so two
    prefills on one host need distinct bootstrap ports.
    `router` is one of ROUTERS; None means default_router() (PDSIM_ROUTER). Both accept the
    same flags for everything ROUTER_FAST_ARGS sets.
    """
    router = router or default_router()
    if router not in ROUTERS:
        raise ValueError(f"unknown router {router!r}: expected one of {', '.join(ROUTERS)}")
    all_prefills = list(prefills)
    if prefill_url is not None:
        if bootstrap_port is None:
            raise ValueError("prefill_url needs its bootstrap_port")
        all_prefills.insert(0, (prefill_url, bootstrap_port))
    all_decodes = ([decode_url] if decode_url is not None else []) + list(decodes)
    if not all_prefills or not all_decodes:
        raise ValueError("the router needs at least one prefill and one decode")
    workers: list[str] = []
    for url, bootstrap in all_prefills:
        workers += ["--prefill", url, str(bootstrap)]
    for url in all_decodes:
        workers += ["--decode", url]
    return [
        python, "-m", _ROUTER_MODULES[router],
        "--pd-disaggregation",
        *workers,
        "--host", host,
        "--port", str(port),
        "--prometheus-host", host,
        "--prometheus-port", str(metrics_port),
        *_ROUTER_OWN_ARGS[router],
        *extra,
    ]  # fmt: skip


def http_get(url: str, timeout_s: float = 2.0) -> tuple[int, bytes]:
    """GET returning (status, body); (0, b"") when nothing answers in time."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (OSError, TimeoutError):
        return 0, b""


def http_json(method: str, url: str, body: Any = None, timeout_s: float = 5.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        raise StackError(f"{method} {url}: HTTP {exc.code}: {exc.read().decode()}") from None


def wait_for_status(url: str, *, timeout_s: float, expect: int = 200, probe_s: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status, _ = http_get(url, timeout_s=probe_s)
        if status == expect:
            return True
        time.sleep(0.05)
    return False


def _looks_like_ours(pid: int) -> bool:
    # Guard against PID reuse before signalling a PID read from a state file.
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    # The routers rename their process to "sglang::router" and "smg::router".
    tags = (
        b"pdsim.worker",
        b"sglang_router",
        b"sglang::router",
        b"smg.launch_router",
        b"smg::router",
    )
    return any(tag in cmdline for tag in tags)


def stop_pid(pid: int, *, grace_s: float = 3.0) -> None:
    """SIGTERM, wait, SIGKILL; tolerant of a process that is already gone."""
    if not _looks_like_ours(pid):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and _looks_like_ours(pid):
        time.sleep(0.02)
    if _looks_like_ours(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@dataclass
class _Proc:
    role: str
    argv: list[str]
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None


class StackController:
    """Owns the processes of one stack (mutable: PIDs change on restart)."""

    def __init__(self, config: StackConfig, ports: StackPorts, log_dir: Path) -> None:
        self.config = config
        self.ports = ports
        self.log_dir = log_dir
        self.procs: dict[str, _Proc] = {}
        self.env = {**os.environ, **config.env}
        # Make `python -m pdsim.worker` importable whatever the caller's PYTHONPATH is.
        self.env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p
        )
        # Workers beyond the first of a role: a port each, and a bootstrap port for a prefill.
        more = free_ports(2 * (config.prefills - 1) + (config.decodes - 1))
        self.ports_of: dict[str, tuple[int, int]] = {
            "prefill": (ports.prefill, ports.bootstrap),
            "decode": (ports.decode, ports.bootstrap),
        }
        for key in worker_keys("prefill", config.prefills)[1:]:
            self.ports_of[key] = (more.pop(), more.pop())
        for key in worker_keys("decode", config.decodes)[1:]:
            self.ports_of[key] = (more.pop(), ports.bootstrap)
        self.workers = {
            "prefill": worker_keys("prefill", config.prefills),
            "decode": worker_keys("decode", config.decodes),
        }
        for role in WORKER_ROLES:
            self._add_workers(role)
        if config.with_router:
            self.procs["router"] = _Proc(
                "router",
                router_command(
                    prefills=[(self.url(k), self.ports_of[k][1]) for k in self.workers["prefill"]],
                    decodes=[self.url(k) for k in self.workers["decode"]],
                    port=ports.router,
                    metrics_port=ports.router_metrics,
                    python=config.python,
                    extra=config.router_args,
                    router=config.router,
                ),
                log_dir / "router.log",
            )

    def _add_workers(self, role: str) -> None:
        config = self.config
        for key in self.workers[role]:
            faults = config.prefill_faults if role == "prefill" else config.decode_faults
            path = self.fault_file(key)
            if faults and key == role:  # start faults go to the first worker of the role
                path.write_text(json.dumps([dict(f) for f in faults]))
            else:
                path.unlink(missing_ok=True)
            extra = (
                *config.worker_args,
                *(config.prefill_args if role == "prefill" else config.decode_args),
            )
            port, bootstrap = self.ports_of[key]
            self.procs[key] = _Proc(
                key,
                worker_command(
                    role,
                    port=port,
                    bootstrap_port=bootstrap,
                    python=config.python,
                    sglang_version=config.sglang_version,
                    tp_size=config.tp_size,
                    model_name=config.model_name,
                    fault_file=path,
                    extra=extra,
                    compat=config.compat,
                ),
                self.log_dir / f"{key}.log",
            )

    def fault_file(self, role: str) -> Path:
        return self.log_dir / f"{role}.faults.json"

    def url(self, role: str) -> str:
        """The URL of `router` or of one worker by key (`prefill`, `prefill2`, ...)."""
        port = self.ports.router if role == "router" else self.ports_of[role][0]
        return f"http://{HOST}:{port}"

    def pids(self) -> dict[str, int]:
        return {r: p.popen.pid for r, p in self.procs.items() if p.popen is not None}

    def spawn(self, role: str) -> None:
        proc = self.procs[role]
        with proc.log_path.open("ab") as log:
            proc.popen = subprocess.Popen(
                proc.argv,
                cwd=REPO_ROOT,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                # Own session: a terminal's Ctrl-C reaches only the caller, which stops us by PID.
                start_new_session=True,
            )

    def wait_ready(self, role: str, timeout_s: float | None = None) -> None:
        timeout = self.config.ready_timeout_s if timeout_s is None else timeout_s
        path = "/readiness" if role == "router" else "/health"
        deadline = time.monotonic() + timeout
        proc = self.procs[role]
        while time.monotonic() < deadline:
            if proc.popen is not None and proc.popen.poll() is not None:
                raise StackError(
                    f"{role} exited with {proc.popen.returncode}\n{self.log_tail(role)}"
                )
            status, _ = http_get(self.url(role) + path, timeout_s=2.0)
            if status == 200:
                return
            time.sleep(0.05)
        raise StackError(f"{role} not ready after {timeout:.0f}s\n{self.log_tail(role)}")

    def stop(self, role: str) -> None:
        proc = self.procs[role]
        if proc.popen is None:
            return
        if proc.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.popen.send_signal(signal.SIGTERM)
            try:
                proc.popen.wait(timeout=3.0)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait(timeout=3.0)

    def stop_all(self) -> None:
        for key in ("router", *self.workers["decode"], *self.workers["prefill"]):
            if key in self.procs:
                self.stop(key)

    def log_tail(self, role: str, lines: int = 30) -> str:
        try:
            text = self.procs[role].log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


@dataclass(frozen=True)
class PDStack:
    """A running stack: its URLs, plus helpers to inject faults and restart one process.

    `pids` is read live from the controller, so it reflects restarts.
    """

    prefill_url: str
    decode_url: str
    router_url: str
    router_metrics_url: str
    bootstrap_port: int
    log_dir: Path
    controller: StackController = field(repr=False, compare=False)

    @property
    def pids(self) -> dict[str, int]:
        return self.controller.pids()

    def url(self, role: str) -> str:
        return self.controller.url(role)

    def log_path(self, role: str) -> Path:
        return self.controller.procs[role].log_path

    def log_text(self, role: str) -> str:
        return self.log_path(role).read_text(errors="replace")

    def fault_file(self, role: str) -> Path:
        return self.controller.fault_file(role)

    def set_fault(self, role: str, kind: str, *, persist: bool = False, **params: Any) -> Any:
        body = {"kind": kind, **params, "persist": persist}
        return http_json("POST", self.url(role) + "/_sim/fault", body)["faults"]

    def clear_faults(self, role: str, kind: str | None = None) -> Any:
        path = "/_sim/fault" + (f"/{kind}" if kind else "")
        return http_json("DELETE", self.url(role) + path)

    def sim_state(self, role: str) -> Any:
        return http_json("GET", self.url(role) + "/_sim/state")

    def release_stuck(self, role: str) -> int:
        return int(http_json("POST", self.url(role) + "/_sim/release")["released"])

    def restart(self, role: str, *, wait_ready: bool = True) -> None:
        """Stop one process by PID and start it again with the same command line and fault file."""
        self.controller.stop(role)
        self.controller.spawn(role)
        if wait_ready:
            self.controller.wait_ready(role)

    def worker_keys(self, role: str) -> list[str]:
        """The workers of `role` (`prefill`, `prefill2`, ...; `router` for the router)."""
        return list(self.controller.workers.get(role, ["router"]))

    def co_restart(self) -> None:
        """The incident's fix: every prefill, then every decode, then the router, each ready
        before the next."""
        for role in ROLES:
            for key in self.worker_keys(role):
                if key in self.controller.procs:
                    self.restart(key)

    def wait_ready(self, role: str = "router", timeout_s: float | None = None) -> None:
        self.controller.wait_ready(role, timeout_s)

    async def arestart(self, role: str, *, wait_ready: bool = True) -> None:
        await asyncio.to_thread(self.restart, role, wait_ready=wait_ready)

    async def aco_restart(self) -> None:
        await asyncio.to_thread(self.co_restart)

    def stop(self) -> None:
        self.controller.stop_all()

    def state_json(self) -> dict[str, Any]:
        """What `python -m pdsim up` writes to its state file."""
        return {
            "prefill_url": self.prefill_url,
            "decode_url": self.decode_url,
            "router_url": self.router_url,
            "router_metrics_url": self.router_metrics_url,
            "bootstrap_port": self.bootstrap_port,
            "log_dir": str(self.log_dir),
            "pids": self.pids,
            "commands": {r: p.argv for r, p in self.controller.procs.items()},
        }


def start_stack(config: StackConfig = StackConfig()) -> PDStack:
    """Start prefill, decode, then router, each ready before the next; stop all on error."""
    ports = config.ports or StackPorts(*free_ports(5))
    log_dir = config.log_dir or Path(tempfile.mkdtemp(prefix="pdsim-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    ctl = StackController(config, ports, log_dir)
    stack = PDStack(
        prefill_url=ctl.url("prefill"),
        decode_url=ctl.url("decode"),
        router_url=ctl.url("router"),
        router_metrics_url=f"http://{HOST}:{ports.router_metrics}/metrics",
        bootstrap_port=ports.bootstrap,
        log_dir=log_dir,
        controller=ctl,
    )
    try:
        # Prefill first: a decode that starts after the prefill is this prefill's first decode
        # incarnation (see PrefillEngine._note_decode_session).
        for role in ROLES:
            keys = ctl.workers.get(role, [role])
            for key in keys:
                if key in ctl.procs:
                    ctl.spawn(key)
            for key in keys:
                if key in ctl.procs:
                    ctl.wait_ready(key)
    except BaseException:
        ctl.stop_all()
        raise
    return stack


def stop_stack(stack: PDStack) -> None:
    stack.stop()


@contextlib.contextmanager
def pd_stack(config: StackConfig = StackConfig()) -> Iterator[PDStack]:
    stack = start_stack(config)
    try:
        yield stack
    finally:
        stack.stop()


@contextlib.asynccontextmanager
async def async_pd_stack(config: StackConfig = StackConfig()) -> AsyncIterator[PDStack]:
    stack = await asyncio.to_thread(start_stack, config)
    try:
        yield stack
    finally:
        await asyncio.to_thread(stack.stop)


@dataclass
class WorkerProcess:
    """One standalone simulated worker (no router), for tests of a single server."""

    role: str
    url: str
    bootstrap_port: int
    log_path: Path
    popen: subprocess.Popen[bytes]

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=3.0)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=3.0)


def start_worker(
    role: str,
    *,
    log_dir: Path,
    sglang_version: str = "0.5.23",
    tp_size: int = 1,
    extra: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    fault_file: Path | None = None,
    wait_ready: bool = True,
    ready_timeout_s: float = 20.0,
    compat: frozenset[str] = REAL_SGLANG,
    enable_metrics: bool = True,
) -> WorkerProcess:
    port, bootstrap_port = free_ports(2)
    log_path = log_dir / f"{role}-{port}.log"
    argv = worker_command(
        role,
        port=port,
        bootstrap_port=bootstrap_port,
        sglang_version=sglang_version,
        tp_size=tp_size,
        fault_file=fault_file,
        extra=extra,
        compat=compat,
        enable_metrics=enable_metrics,
    )
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p
    )
    with log_path.open("ab") as log:
        popen = subprocess.Popen(
            argv, cwd=REPO_ROOT, env=full_env, stdin=subprocess.DEVNULL, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    worker = WorkerProcess(role, f"http://{HOST}:{port}", bootstrap_port, log_path, popen)
    if wait_ready and not wait_for_status(worker.url + "/health", timeout_s=ready_timeout_s):
        worker.stop()
        raise StackError(f"{role} worker not ready\n{worker.log_text()[-3000:]}")
    return worker


__all__ = [
    "COMPAT_OPTIONS",
    "LEGACY_COMPAT",
    "REAL_SGLANG",
    "ROUTERS",
    "ROUTER_ENV",
    "ROUTER_FAST_ARGS",
    "ROUTER_REAL_HEALTH_ARGS",
    "PDStack",
    "StackConfig",
    "StackError",
    "StackPorts",
    "WorkerProcess",
    "async_pd_stack",
    "default_router",
    "free_ports",
    "pd_stack",
    "role_of",
    "router_command",
    "start_stack",
    "start_worker",
    "stop_pid",
    "stop_stack",
    "worker_command",
    "worker_keys",
]
