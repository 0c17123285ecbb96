"""A real sglang 0.5.23 PD pair and both real routers as units of a sandboxed systemd, with faults.

Everything runs in the sandbox's private network namespace (its own loopback, its own nftables),
so fixed ports are safe and a dropped transfer path touches nothing of the host:

    prefill  127.0.0.1:30000 (KV bootstrap :8998)      decode 127.0.0.1:30002
    sglang-router 0.3.2  :30001 (metrics :29000)       smg 1.13  :30011 (metrics :29010)

Both routers front the same pair at once; a watchdog is configured for one of them
(`group_overrides(router)`). The watchdog under test runs inside the sandbox as a unit too
(`add_watchdog`), as in production: it reads the units' journal and /proc as they are there.
Code of the test itself reaches the namespace through `RealSandbox.get/post` (sandbox.netns).

Faults, each named after what it does to the real servers:
- `drop_transfer()`: nftables drops TCP to decode's mooncake data port (the port decode logs as
  `TcpTransport: listen on port N`). With `mooncake_timeouts("silent")` in force when the servers
  started (transfer, progress and status timeouts 900 s), it is the silent stall: `/health` 200
  everywhere, requests hang. With mooncake's defaults, requests hang 30 s and then fail, counted on
  both sides (a failure burst through the router's retries).
- `sigstop(role)`: the scheduler process of a server (its `/health` fails after 20 s: not silent).
- a unit killed or restarted alone: `sandbox.kill_unit`, `sandbox.queue_unit_job`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self

from pdsim.stack import REPO_ROOT, http_get, router_command
from sandbox.namespace import SandboxError, SystemdSandbox, UnitSpec
from sandbox.namespace import skip_reason as sandbox_skip_reason
from sandbox.netns import in_netns, nsenter

HOME_ENV = "REAL_SGLANG_HOME"
DEFAULT_HOME = Path.home() / ".cache" / "sglang-watchdog" / "real-sglang"
HOST = "127.0.0.1"
MODEL_NAME = "tiny"  # --served-model-name: smg routes /v1/completions only when `model` equals it

PREFILL_PORT = 30000
DECODE_PORT = 30002
BOOTSTRAP_PORT = 8998
ROUTERS = ("sglang-router", "smg")
ROUTER_PORTS = {"sglang-router": (30001, 29000), "smg": (30011, 29010)}  # (serving, metrics)

# Mooncake's TCP transport gives up on a transfer that makes no progress for 30 s (its defaults);
# raised, a dropped path is a transfer that never completes and never fails: the silent stall.
SILENT_MOONCAKE = {
    "MC_TRANSFER_TIMEOUT": "900",
    "MC_TCP_PROGRESS_TIMEOUT_SEC": "900",
    "MC_TCP_STATUS_TIMEOUT_SEC": "900",
}
MooncakeTimeouts = Literal["silent", "default"]

# Every server: sglang's CPU engine, mooncake over TCP advertising the loopback (the namespace has
# nothing else), one OpenMP thread (two servers share two cores).
SERVER_ENV = {
    "SGLANG_USE_CPU_ENGINE": "1",
    "SGLANG_HOST_IP": HOST,
    "MOONCAKE_PROTOCOL": "tcp",
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
    # The early send of a cached prefix records a torch.cuda.Event under the overlap scheduler
    # (srt/disaggregation/prefill.py:1496 @ 0.5.23): off on a CPU.
    "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX": "0",
}

# The tiny random Llama (realsglang/make_model.py), torch-native attention, a small KV pool.
SERVER_FLAGS: tuple[str, ...] = (
    "--load-format", "dummy",
    "--device", "cpu",
    "--attention-backend", "torch_native",
    "--dtype", "float32",
    "--max-total-tokens", "8192",
    "--served-model-name", MODEL_NAME,
    "--enable-metrics",
    "--host", HOST,
    "--log-level", "info",
    "--disaggregation-transfer-backend", "mooncake_tcp",
)  # fmt: skip

# Decode's retracted requests are backed up to a CUDA tensor unless told otherwise.
DECODE_FLAGS: tuple[str, ...] = ("--disaggregation-decode-retraction-backup", "cpu_tensor")

# The routers' own defaults for health checking (what production runs), less the 180 s shutdown
# grace a router holding hung requests would otherwise spend at every restart.
ROUTER_ARGS: tuple[str, ...] = ("--shutdown-grace-period-secs", "1")

_TRANSFER_PORT = re.compile(r"TcpTransport: listen on port (\d+)")
_NFT_TABLE = "watchdog_fault"


def home() -> Path:
    """Where `make real-setup` installed the environment ($REAL_SGLANG_HOME or the default)."""
    return Path(os.environ.get(HOME_ENV) or DEFAULT_HOME)


def server_python() -> Path:
    """The interpreter of the sglang venv."""
    return home() / "venv" / "bin" / "python"


def skip_reason() -> str | None:
    """Why a real stack cannot run here (for pytest.skip), or None when it can."""
    reason = sandbox_skip_reason()
    if reason is not None:
        return reason
    if not (home() / ".installed").exists() or not server_python().exists():
        return f"real SGLang is not installed in {home()}: run `make real-setup`"
    for tool, package in (("nft", "nftables"), ("nsenter", "util-linux"), ("ip", "iproute2")):
        if shutil.which(tool) is None:
            return f"the real stack needs `{tool}` (Debian package: {package})"
    return None


def server_command(role: Literal["prefill", "decode"], extra: Sequence[str] = ()) -> list[str]:
    """`python -m sglang.launch_server ...` for one role of the pair."""
    argv = [
        str(server_python()), "-m", "sglang.launch_server",
        "--model-path", str(home() / "model"),
        *SERVER_FLAGS,
        "--disaggregation-mode", role,
    ]  # fmt: skip
    if role == "prefill":
        argv += [
            "--port",
            str(PREFILL_PORT),
            "--disaggregation-bootstrap-port",
            str(BOOTSTRAP_PORT),
        ]
    else:
        argv += ["--port", str(DECODE_PORT), *DECODE_FLAGS]
    return argv + list(extra)


def url(port: int) -> str:
    """A base URL inside the namespace."""
    return f"http://{HOST}:{port}"


@dataclass(frozen=True)
class RealStackUnits:
    """Unit names, URLs and unit specs of one real stack named `name`."""

    name: str
    env_file: Path  # EnvironmentFile= of both servers: the mooncake timeouts, read at each start
    prefill_args: Sequence[str] = ()
    decode_args: Sequence[str] = ()
    routers: Sequence[str] = ROUTERS

    def unit(self, key: str) -> str:
        """`prefill`, `decode`, or a router (`sglang-router`, `smg`) -> its unit name."""
        return f"sglang-{self.name}-{key}.service"

    def url(self, key: str) -> str:
        """The base URL of `prefill`, `decode` or a router."""
        ports = {"prefill": PREFILL_PORT, "decode": DECODE_PORT}
        return url(ports[key] if key in ports else ROUTER_PORTS[key][0])

    def router_metrics_url(self, router: str) -> str:
        """A router's separate Prometheus listener."""
        return f"{url(ROUTER_PORTS[router][1])}/metrics"

    def specs(self) -> list[UnitSpec]:
        """Prefill, decode and one unit per router (each router fronts the same pair)."""
        specs = []
        for role, extra in (("prefill", self.prefill_args), ("decode", self.decode_args)):
            specs.append(
                UnitSpec(
                    name=self.unit(role),
                    description=f"sglang 0.5.23 {role} (CPU, {self.name})",
                    exec_start=server_command(role, extra),  # type: ignore[arg-type]
                    environment={**SERVER_ENV, "HOME": str(self.env_file.parent / "home")},
                    extra_service=[f"EnvironmentFile=-{self.env_file}"],
                    # SGLang's TERM handler stops its subprocesses; a hung transfer thread can
                    # delay it, and systemd then kills the rest of the cgroup.
                    timeout_stop_seconds=15,
                    output="journal",
                )
            )
        for router in self.routers:
            serving, metrics = ROUTER_PORTS[router]
            argv = router_command(
                prefills=[(self.url("prefill"), BOOTSTRAP_PORT)],
                decodes=[self.url("decode")],
                port=serving,
                metrics_port=metrics,
                python=sys.executable,
                extra=ROUTER_ARGS,
                router=router,
            )
            specs.append(
                UnitSpec(
                    name=self.unit(router),
                    description=f"{router} in PD mode ({self.name})",
                    exec_start=argv,
                    environment={"PYTHONUNBUFFERED": "1"},
                    working_directory=str(REPO_ROOT),
                    output="journal",
                )
            )
        return specs

    def group_overrides(self, router: str) -> dict[str, Any]:
        """This stack behind `router` as one [[group]] of a watchdog config."""
        return {
            "name": f"{self.name}-{router}",
            "prefill": {
                "unit": self.unit("prefill"),
                "url": self.url("prefill"),
                "bootstrap_port": BOOTSTRAP_PORT,
            },
            "decode": {"unit": self.unit("decode"), "url": self.url("decode")},
            "router": {
                "unit": self.unit(router),
                "url": self.url(router),
                "metrics_url": self.router_metrics_url(router),
            },
            "probe": {"model": MODEL_NAME},
        }


@dataclass
class RealSandbox:
    """A started sandbox serving the real pair behind both routers."""

    sandbox: SystemdSandbox
    stack: RealStackUnits
    _dropped_port: int | None = field(default=None, init=False)
    # What the env file says, and when it was written (servers started after it run with it).
    _mooncake: tuple[MooncakeTimeouts, float] = field(default=("silent", 0.0), init=False)

    @classmethod
    def start(
        cls,
        name: str = "real",
        *,
        mooncake: MooncakeTimeouts = "silent",
        prefill_args: Sequence[str] = (),
        decode_args: Sequence[str] = (),
        routers: Sequence[str] = ROUTERS,
        ready_timeout_seconds: float = 240.0,
        extra_units: Sequence[UnitSpec] = (),
    ) -> RealSandbox:
        """Boot the sandbox with the pair and routers; wait until every router serves."""
        sandbox = SystemdSandbox(
            host_paths=[REPO_ROOT, Path(sys.prefix), home()], private_network=True
        )
        try:
            share = sandbox.share_dir
            (share / "home").mkdir(parents=True, exist_ok=True)
            stack = RealStackUnits(
                name,
                share / "servers.env",
                prefill_args=tuple(prefill_args),
                decode_args=tuple(decode_args),
                routers=tuple(routers),
            )
            real = cls(sandbox, stack)
            real.mooncake_timeouts(mooncake)
            for spec in [*stack.specs(), *extra_units]:
                sandbox.add_unit(spec)
            sandbox.start()
            real.wait_until_serving(timeout_seconds=ready_timeout_seconds)
        except BaseException:
            sandbox.stop()
            raise
        return real

    def stop(self) -> None:
        """Stop everything (the namespace's systemd and every process in it)."""
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

    # --- reaching the namespace -----------------------------------------------------------------

    def get(self, target: str, timeout_seconds: float = 5.0) -> tuple[int, bytes]:
        """GET inside the namespace: (status, body), (0, b"") when nothing answers in time."""
        return in_netns(
            self.sandbox.netns_path, lambda: http_get(target, timeout_s=timeout_seconds)
        )

    def post(self, target: str, body: Any, timeout_seconds: float = 30.0) -> tuple[int, bytes]:
        """POST JSON inside the namespace: (status, body), (0, b"") on no answer in time."""
        return in_netns(self.sandbox.netns_path, lambda: http_post(target, body, timeout_seconds))

    def run(self, argv: Sequence[str], timeout_seconds: float = 30.0) -> str:
        """A command inside the namespace; its stdout (SandboxError if it fails)."""
        cmd = nsenter(self.sandbox.netns_path, argv)
        result = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout_seconds, check=False
        )
        if result.returncode != 0:
            raise SandboxError(f"{' '.join(cmd)} failed: {result.stderr.strip()}")
        return result.stdout

    # --- readiness ------------------------------------------------------------------------------

    def serving(self) -> bool:
        """Both workers' /health 200 and every router ready with both workers healthy."""
        for role in ("prefill", "decode"):
            if self.get(self.stack.url(role) + "/health", timeout_seconds=5.0)[0] != 200:
                return False
        return all(self.router_ready(router) for router in self.stack.routers)

    def router_ready(self, router: str) -> bool:
        """The router's /readiness is 200 and its /workers lists both workers healthy."""
        base = self.stack.url(router)
        if self.get(base + "/readiness")[0] != 200:
            return False
        status, body = self.get(base + "/workers")
        if status != 200:
            return False
        healthy = {w["url"] for w in json.loads(body)["workers"] if w.get("is_healthy")}
        return {self.stack.url("prefill"), self.stack.url("decode")} <= healthy

    def wait_for_completion(self, router: str, timeout_seconds: float = 240.0) -> None:
        """Until a completion through `router` succeeds (a stall's held requests drained)."""
        deadline = time.monotonic() + timeout_seconds
        target = self.stack.url(router) + "/v1/completions"
        while time.monotonic() < deadline:
            if self.post(target, completion_body(), timeout_seconds=15.0)[0] == 200:
                return
            time.sleep(1.0)
        raise SandboxError(
            f"no completion through {router} in {timeout_seconds:g} s:\n{self.logs()}"
        )

    def wait_until_serving(self, timeout_seconds: float = 240.0) -> None:
        """Wait until serving(); SandboxError with every unit's log tail if not in time."""
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            if self.serving():
                return
            time.sleep(1.0)
        raise SandboxError(f"the real stack did not serve in {timeout_seconds:g} s:\n{self.logs()}")

    def logs(self, lines: int = 30) -> str:
        """The last lines of every unit's journal (for failure messages)."""
        units = ["prefill", "decode", *self.stack.routers]
        return "\n".join(
            f"--- {key}\n" + "\n".join(self.journal(key).splitlines()[-lines:]) for key in units
        )

    def journal(self, key: str) -> str:
        """What a unit (`prefill`, `decode`, a router) logged so far."""
        return self.sandbox.journal_text(self.stack.unit(key))

    def start_time_us(self, key: str) -> int:
        """ExecMainStartTimestamp of a unit (µs since the epoch; 0 if never started)."""
        value = self.sandbox.unit_property(
            self.stack.unit(key), "ExecMainStartTimestamp", "Service"
        )
        return int(value or 0)

    # --- faults ---------------------------------------------------------------------------------

    def mooncake_timeouts(self, which: MooncakeTimeouts) -> None:
        """Mooncake's timeouts for the servers' next start (the running ones keep theirs)."""
        values = SILENT_MOONCAKE if which == "silent" else {}
        self.stack.env_file.write_text(env_lines(values))
        self._mooncake = (which, time.time())

    def running_with(self, which: MooncakeTimeouts) -> bool:
        """Both servers started after `which` was written (so they run with those timeouts)."""
        written, at = self._mooncake
        return written == which and all(
            self.start_time_us(role) / 1e6 > at for role in ("prefill", "decode")
        )

    def ensure_mooncake(self, which: MooncakeTimeouts) -> None:
        """Servers running with `which` timeouts: if not, write them and restart every unit
        (servers first, then the routers, which register the new processes)."""
        if self.running_with(which):
            return
        self.mooncake_timeouts(which)
        for key in ("prefill", "decode", *self.stack.routers):
            self.sandbox.queue_unit_job("RestartUnit", self.stack.unit(key))
        self.wait_until_serving(timeout_seconds=300.0)

    def transfer_port(self) -> int:
        """Decode's mooncake data port, as its current process logged it."""
        found = _TRANSFER_PORT.findall(self.journal("decode"))
        if not found:
            raise SandboxError("decode has not logged its mooncake TcpTransport port")
        return int(found[-1])

    def drop_transfer(self) -> int:
        """Drop TCP to decode's mooncake data port (inside the namespace); returns the port."""
        port = self.transfer_port()
        self.run(["nft", "add", "table", "inet", _NFT_TABLE])
        self.run(
            ["nft", "add", "chain", "inet", _NFT_TABLE, "out",
             "{ type filter hook output priority 0; }"]
        )  # fmt: skip
        self.run(
            ["nft", "add", "rule", "inet", _NFT_TABLE, "out", "tcp", "dport", str(port), "drop"]
        )
        self._dropped_port = port
        return port

    def restore_transfer(self) -> None:
        """Undo drop_transfer() (a no-op when nothing is dropped)."""
        if self._dropped_port is None:
            return
        self.run(["nft", "delete", "table", "inet", _NFT_TABLE])
        self._dropped_port = None

    def scheduler_pid(self, role: str) -> int:
        """Host PID of a server's scheduler process (sglang names it `sglang::scheduler`)."""
        main = self.sandbox.host_pid(self.stack.unit(role))
        if main is None:
            raise SandboxError(f"{role} has no main process")
        for pid in _descendants(main):
            try:
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                continue
            if comm.startswith("sglang::schedul"):
                return pid
        raise SandboxError(f"no sglang::scheduler process under {role}'s PID {main}")

    def sigstop(self, role: str) -> int:
        """SIGSTOP a server's scheduler; returns its host PID (SIGCONT it with os.kill)."""
        pid = self.scheduler_pid(role)
        os.kill(pid, signal.SIGSTOP)
        return pid


def _descendants(pid: int) -> list[int]:
    out: list[int] = []
    todo = [pid]
    while todo:
        current = todo.pop()
        try:
            children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            out.append(child)
            todo.append(child)
    return out


def http_post(target: str, body: Any, timeout_seconds: float) -> tuple[int, bytes]:
    """POST JSON from the calling thread's namespace: (status, body), (0, b"") on no answer."""
    req = urllib.request.Request(target, data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout_seconds) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (OSError, TimeoutError):
        return 0, b""


def completion_body(prompt: str = "Hello world", max_tokens: int = 8) -> dict[str, Any]:
    """A /v1/completions request for the served model."""
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}


def env_lines(values: Mapping[str, str]) -> str:
    """An EnvironmentFile= body."""
    return "".join(f"{k}={v}\n" for k, v in values.items())
