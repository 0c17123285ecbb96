"""Builders and small fakes shared by the evidence, classification and incident tests."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from watchdog.config import GroupSection, parse_config
from watchdog.evidence.blocking import CommandResult
from watchdog.evidence.capture import EvidenceTools
from watchdog.evidence.records import (
    Evidence,
    GpuDevice,
    GpuReading,
    GpuSource,
    HttpEvidence,
    ItemStatus,
    JournalExcerpt,
    UnitEvidence,
)
from watchdog.model import MetricsSnapshot, Observation, Role, UnitState

NOW = 1_796_000_000.0  # a fixed "now" (late 2026) for pure tests
UNITS = {
    Role.PREFILL: "sglang-dsv4-prefill.service",
    Role.DECODE: "sglang-dsv4-decode.service",
    Role.ROUTER: "sglang-dsv4-router.service",
}


def make_group(**units: dict[str, Any]) -> GroupSection:
    """The demo group, with per-role extra keys (expect_cmdline_contains, expect_env)."""
    group: dict[str, Any] = {
        "name": "dsv4",
        "prefill": {"unit": UNITS[Role.PREFILL], "url": "http://127.0.0.1:30000"},
        "decode": {"unit": UNITS[Role.DECODE], "url": "http://127.0.0.1:30002"},
        "router": {
            "unit": UNITS[Role.ROUTER],
            "url": "http://127.0.0.1:30001",
            "metrics_url": "http://127.0.0.1:29000/metrics",
        },
    }
    for role, extra in units.items():
        group[role].update(extra)
    return parse_config({"group": [group]}, "test.toml").group[0]


def unit_state(
    role: Role,
    *,
    started_at: float = NOW - 3600,
    pid: int = 1000,
    active: str = "active",
    restarts: int = 0,
) -> UnitState:
    """An ok UnitState of `role`."""
    return UnitState(
        role=role,
        unit=UNITS[role],
        ok=True,
        load_state="loaded",
        active_state=active,
        sub_state="running" if active == "active" else "dead",
        main_pid=pid if active == "active" else 0,
        exec_main_start_us=int(started_at * 1e6),
        n_restarts=restarts,
    )


def gpu(util: float, watts: float, limit: float = 1000.0, index: int = 0) -> GpuDevice:
    """One GPU reading."""
    return GpuDevice(
        index, f"GPU-{index:08d}", "NVIDIA B200", util, watts, limit, 170000.0, 183359.0
    )


def reading(*devices: GpuDevice) -> GpuReading:
    """An nvidia-smi reading of these devices."""
    return GpuReading(GpuSource.NVIDIA_SMI, devices)


UNAVAILABLE_GPU = GpuReading(GpuSource.UNAVAILABLE, (), "nvidia-smi not found")


def unit_evidence(
    role: Role,
    *,
    state: UnitState | None = None,
    batch_age: float | None = None,
    batch_line: str | None = None,
    journal_lines: int = 0,
    failures: tuple[tuple[str, int], ...] = (),
    environ: tuple[tuple[str, str], ...] = (),
) -> UnitEvidence:
    """Evidence of one unit; a journal is 'available' when journal_lines or batch_age is given."""
    has_journal = journal_lines > 0 or batch_age is not None
    journal = (
        JournalExcerpt(UNITS[role], True, "line\n" * max(journal_lines, 1), max(journal_lines, 1))
        if has_journal
        else JournalExcerpt(UNITS[role], False, detail="no journal files were found")
    )
    return UnitEvidence(
        role=role,
        unit=UNITS[role],
        state=state if state is not None else unit_state(role),
        environ=environ,
        journal=journal,
        last_batch_at=None if batch_age is None else NOW - batch_age,
        last_batch_age_seconds=batch_age,
        last_batch_line=(
            ""
            if batch_age is None
            else batch_line
            if batch_line is not None
            else f"{role.title()} batch, #running-req: 0"
        ),
        journal_failures=failures,
    )


def http(name: str, status: int = 200, body: str = "") -> HttpEvidence:
    """An HTTP answer."""
    return HttpEvidence(name, f"http://x/{name}", True, status, body)


HEALTHY_HTTP = (
    http("prefill_health"),
    http("decode_health"),
    http("router_readiness"),
    http("router_workers", body='{"workers": [{"url": "a"}, {"url": "b"}]}'),
)


def evidence(
    *,
    units: tuple[UnitEvidence, ...] | None = None,
    gpu_reading: GpuReading | None = None,
    http_answers: tuple[HttpEvidence, ...] = HEALTHY_HTTP,
    items: tuple[ItemStatus, ...] = (),
) -> Evidence:
    """An Evidence bundle with healthy defaults."""
    return Evidence(
        group="dsv4",
        started_at=NOW - 2,
        finished_at=NOW,
        total_timeout_seconds=15.0,
        units=units if units is not None else tuple(unit_evidence(r) for r in Role),
        http=http_answers,
        gpu=gpu_reading if gpu_reading is not None else UNAVAILABLE_GPU,
        items=items,
    )


def metrics(role: Role, **values: Any) -> MetricsSnapshot:
    """A successful scrape of `role` with these fields."""
    return MetricsSnapshot(role=role, scraped_at=NOW, ok=True, **values)


def observation(**kwargs: Any) -> Observation:
    """An Observation of the demo group at NOW."""
    return Observation(group="dsv4", at=NOW, **kwargs)


class FakeUnitReader:
    """UnitReader returning fixed states; `hang` makes read_unit never return."""

    def __init__(self, states: dict[Role, UnitState], hang: bool = False) -> None:
        self.states = states
        self.hang = hang
        self.calls: list[str] = []

    async def read_unit(self, role: Role, unit: str) -> UnitState:
        self.calls.append(unit)
        if self.hang:
            await asyncio.Event().wait()
        return self.states[role]


class FakeJournal:
    """JournalReader returning fixed text per unit, or hanging."""

    def __init__(self, texts: dict[str, str] | None = None, hang: bool = False) -> None:
        self.texts = texts or {}
        self.hang = hang

    async def read_journal(self, unit: str, lines: int, timeout_seconds: float) -> JournalExcerpt:
        if self.hang:
            await asyncio.Event().wait()
        text = self.texts.get(unit)
        if text is None:
            return JournalExcerpt(unit, ok=False, detail="no journal files were found")
        return JournalExcerpt(unit, True, text, len(text.splitlines()))


class FakeGpu:
    """GpuReader returning a fixed reading, or hanging."""

    def __init__(self, value: GpuReading = UNAVAILABLE_GPU, hang: bool = False) -> None:
        self.value = value
        self.hang = hang

    async def read_gpus(self, timeout_seconds: float) -> GpuReading:
        if self.hang:
            await asyncio.Event().wait()
        return self.value


def tools(**kwargs: Any) -> EvidenceTools:
    """EvidenceTools with fakes: no journal, no GPU, no py-spy unless given."""
    defaults: dict[str, Any] = {"journal": FakeJournal(), "gpu": FakeGpu(), "stacks": None}
    defaults.update(kwargs)
    return EvidenceTools(**defaults)


class FakeHost:
    """A remote host (RemoteHost) answering fixed argvs; anything else exits 127 like a shell."""

    def __init__(self, label: str, answers: dict[tuple[str, ...], CommandResult]) -> None:
        self.label = label
        self.answers = answers
        self.calls: list[tuple[str, ...]] = []

    async def run(
        self, argv: Sequence[str], timeout_seconds: float, max_output_bytes: int = 1 << 20
    ) -> CommandResult:
        self.calls.append(tuple(argv))
        answer = self.answers.get(tuple(argv))
        if answer is None:
            return CommandResult(127, b"", f"sh: 1: {argv[0]}: not found\n".encode())
        return answer
