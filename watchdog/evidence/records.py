"""The evidence bundle and its parts as plain frozen values; capture.py and gpu.py read them."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from watchdog.evidence.procinfo import ProcessInfo
from watchdog.model import Role, UnitState

LOCAL_HOST = "local"  # the host label of a unit on this host


class DriftKind(StrEnum):
    """What differs between the expectation and the running process."""

    CMDLINE_MISSING = "cmdline_missing"  # an expected argument (sequence) is not in the cmdline
    ENV_MISSING = "env_missing"  # an expected variable is not set
    ENV_MISMATCH = "env_mismatch"  # set, to another value


@dataclass(frozen=True, slots=True)
class DriftFinding:
    """One expectation the running process does not meet; values of secret keys are redacted."""

    unit: str
    kind: DriftKind
    expected: str
    actual: str | None
    message: str


@dataclass(frozen=True, slots=True)
class JournalExcerpt:
    """The tail of one unit's journal, or why it could not be read."""

    unit: str
    ok: bool
    text: str = ""
    lines: int = 0
    truncated: bool = False  # capped at max_bytes (the newest lines are kept)
    detail: str = ""  # unavailable: why; ok: notes such as "no entries"


class GpuSource(StrEnum):
    """Where a GpuReading came from."""

    NVML = "nvml"
    NVIDIA_SMI = "nvidia-smi"
    UNAVAILABLE = "unavailable"


@dataclass(frozen=True, slots=True)
class GpuDevice:
    """One GPU; None where the driver reports the value as not available or not supported."""

    index: int
    uuid: str = ""
    name: str = ""
    utilization_percent: float | None = None
    power_watts: float | None = None
    power_limit_watts: float | None = None
    memory_used_mib: float | None = None
    memory_total_mib: float | None = None


@dataclass(frozen=True, slots=True)
class GpuReading:
    """Every GPU on the host at one moment, or why they could not be read."""

    source: GpuSource
    devices: tuple[GpuDevice, ...] = ()
    detail: str = ""  # unavailable: why (each source tried); otherwise notes such as a fallback

    @property
    def ok(self) -> bool:
        """True when some source answered (possibly with zero devices)."""
        return self.source != GpuSource.UNAVAILABLE


@dataclass(frozen=True, slots=True)
class HostGpuReading:
    """The GPUs of one remote host (user@host:port), read over its SSH connection."""

    host: str
    reading: GpuReading


@dataclass(frozen=True, slots=True)
class StackDump:
    """The Python stacks of one process (py-spy dump), or why there are none."""

    pid: int
    ok: bool
    text: str = ""
    truncated: bool = False
    detail: str = ""


@dataclass(frozen=True, slots=True)
class ItemStatus:
    """Whether one evidence item was captured, and if not, why."""

    name: str  # "unit:decode", "processes:decode", "journal:decode", "gpu", "http:router_workers"
    ok: bool
    detail: str = ""
    duration_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class UnitEvidence:
    """Everything captured about one unit."""

    role: Role
    unit: str
    state: UnitState | None = None  # systemd properties: fresh, else the cycle's observation
    processes: tuple[ProcessInfo, ...] = ()  # MainPID first, then descendants
    environ: tuple[tuple[str, str], ...] = ()  # MainPID's, allowlisted, secrets redacted
    drift: tuple[DriftFinding, ...] = ()
    drift_checked: bool = False  # False: no process to check, or its environ was unreadable
    journal: JournalExcerpt | None = None
    last_batch_at: float | None = None  # journal time of the newest Prefill/Decode batch line
    last_batch_age_seconds: float | None = None
    last_batch_line: str = ""
    journal_failures: tuple[tuple[str, int], ...] = ()  # failure signature -> lines in the tail
    stacks: tuple[StackDump, ...] = ()
    host: str = LOCAL_HOST  # user@host:port of a unit on another host (read over SSH)
    worker: int = 0  # which worker of `role` (its index in the config)
    name: str = ""  # how people read it: `prefill#2`, or the role alone ("" in older bundles)

    @property
    def label(self) -> str:
        """The worker's name for people (`prefill#2`, `decode`)."""
        return self.name or str(self.role)

    @property
    def slug(self) -> str:
        """The name, safe in a file name (`prefill-2`)."""
        return self.label.replace("#", "-")

    def env(self, key: str) -> str | None:
        """One allowlisted variable of the main process, as stored (redacted if secret)."""
        return dict(self.environ).get(key)

    @property
    def started_at(self) -> float | None:
        """ExecMainStartTimestamp in unix seconds, if known."""
        if self.state is None or not self.state.exec_main_start_us:
            return None
        return self.state.exec_main_start_us / 1e6


@dataclass(frozen=True, slots=True)
class MetricsText:
    """The last raw /metrics payload of one role, capped."""

    role: Role
    ok: bool
    text: str = ""
    truncated: bool = False
    total_bytes: int = 0
    detail: str = ""


@dataclass(frozen=True, slots=True)
class HttpEvidence:
    """One HTTP endpoint's answer at capture time (any status counts as an answer)."""

    name: str  # "prefill_health", "decode_health", "router_readiness", "router_workers"
    url: str
    ok: bool  # an HTTP response arrived
    status_code: int | None = None
    body: str = ""
    truncated: bool = False
    detail: str = ""
    duration_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class Evidence:
    """The evidence bundle of one group at one moment (frozen, JSON-serialisable)."""

    group: str
    started_at: float
    finished_at: float
    total_timeout_seconds: float
    units: tuple[UnitEvidence, ...] = ()
    metrics: tuple[MetricsText, ...] = ()
    http: tuple[HttpEvidence, ...] = ()
    gpu: GpuReading = field(default_factory=lambda: GpuReading(GpuSource.UNAVAILABLE))
    items: tuple[ItemStatus, ...] = ()
    remote_gpus: tuple[HostGpuReading, ...] = ()  # one per remote host of the group's units

    def gpu_of(self, unit: UnitEvidence) -> GpuReading:
        """The GPUs of the host `unit` runs on (this host's unless it is remote)."""
        found = next((h.reading for h in self.remote_gpus if h.host == unit.host), None)
        return self.gpu if found is None else found

    def units_of(self, role: Role) -> tuple[UnitEvidence, ...]:
        """The evidence of every worker of `role`, in config order."""
        return tuple(u for u in self.units if u.role == role)

    def http_for(self, name: str) -> HttpEvidence | None:
        """The answer of one endpoint ("router_readiness", ...)."""
        return next((h for h in self.http if h.name == name), None)

    def metrics_for(self, role: Role) -> MetricsText | None:
        """The raw /metrics of `role`."""
        return next((m for m in self.metrics if m.role == role), None)

    @property
    def unavailable(self) -> tuple[ItemStatus, ...]:
        """Items that could not be captured."""
        return tuple(i for i in self.items if not i.ok)

    @property
    def drift(self) -> tuple[DriftFinding, ...]:
        """Every drift finding of every unit."""
        return tuple(f for u in self.units for f in u.drift)
