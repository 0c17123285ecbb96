"""The demo's embedded watchdog config: the stack's URLs and units with compressed timings."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

ROLES = ("prefill", "decode", "router")


@dataclass(frozen=True)
class DemoTimings:
    """Timings compressed so the whole story (stall → detection → co-restart → verification)
    fits in about a minute; production defaults are in configs/example.toml."""

    cycle_seconds: float = 1.0
    period_seconds: float = 1.0
    timeout_seconds: float = 4.0
    connect_timeout_seconds: float = 1.0
    stream_idle_seconds: float = 2.0
    health_timeout_seconds: float = 1.0
    scrape_timeout_seconds: float = 1.0
    probe_failures: int = 3
    no_progress_seconds: float = 8.0
    startup_timeout_seconds: float = 30.0
    ready_timeout_seconds: float = 30.0
    verify_probes: int = 5
    verify_timeout_seconds: float = 30.0
    backoff_seconds: float = 20.0
    evidence_timeout_seconds: float = 5.0
    shutdown_timeout_seconds: float = 10.0

    def as_dict(self) -> dict[str, float]:
        """Every timing by name."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class DemoTarget:
    """The stack the watchdog looks after: one URL and one systemd unit per role."""

    urls: Mapping[str, str]  # role -> base URL
    units: Mapping[str, str]  # role -> unit name
    router_metrics_url: str
    group: str = "demo"
    model: str = "pdsim"


def config_toml(
    target: DemoTarget,
    *,
    state_dir: Path,
    metrics_listen: str,
    timings: DemoTimings = DemoTimings(),
) -> str:
    """A complete watchdog config (the daemon validates it at start, like any other)."""
    t = timings
    lines = [
        "# Written by `python -m demo`: compressed timings, see demo/config.py.",
        "[watchdog]",
        f"state_dir = {json.dumps(str(state_dir))}",
        f'metrics_listen = "{metrics_listen}"',
        f"cycle_seconds = {t.cycle_seconds:g}",
        f"evidence_timeout_seconds = {t.evidence_timeout_seconds:g}",
        f"shutdown_timeout_seconds = {t.shutdown_timeout_seconds:g}",
        "",
        "[[group]]",
        f'name = "{target.group}"',
    ]
    for role in ROLES:
        lines += [
            "",
            f"[group.{role}]",
            f'unit = "{target.units[role]}"',
            f'url = "{target.urls[role]}"',
        ]
        if role == "router":
            lines.append(f'metrics_url = "{target.router_metrics_url}"')
    lines += [
        "",
        "[group.probe]",
        f"model = {json.dumps(target.model)}",
        f"period_seconds = {t.period_seconds:g}",
        f"timeout_seconds = {t.timeout_seconds:g}",
        f"connect_timeout_seconds = {t.connect_timeout_seconds:g}",
        f"stream_idle_seconds = {t.stream_idle_seconds:g}",
        f"health_timeout_seconds = {t.health_timeout_seconds:g}",
        f"scrape_timeout_seconds = {t.scrape_timeout_seconds:g}",
        # The growing-context probe is a second signal for slow wedges; this story needs one.
        "multiround_every_seconds = 0",
        "",
        "[group.stall]",
        f"probe_failures = {t.probe_failures}",
        f"no_progress_seconds = {t.no_progress_seconds:g}",
        f"startup_timeout_seconds = {t.startup_timeout_seconds:g}",
        "",
        "[group.restart]",
        f"ready_timeout_seconds = {t.ready_timeout_seconds:g}",
        f"verify_probes = {t.verify_probes}",
        f"verify_timeout_seconds = {t.verify_timeout_seconds:g}",
        f"backoff_seconds = {t.backoff_seconds:g}",
    ]
    return "\n".join(lines) + "\n"
