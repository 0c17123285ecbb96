"""The demo's embedded watchdog config: the stack's URLs and units with compressed timings."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from watchdog.configfile import Overrides, config_text

ROLES = ("prefill", "decode", "router")

# Compressed so the whole story (stall → detection → co-restart → verification) fits in about a
# minute: only what differs from watchdog/config.py's defaults (configs/example.toml shows them).
DEMO_TIMINGS: Overrides = {
    "watchdog": {
        "cycle_seconds": 1.0,
        "evidence_timeout_seconds": 5.0,
        "shutdown_timeout_seconds": 10.0,
    },
    "group": {
        "probe": {
            "period_seconds": 1.0,
            "timeout_seconds": 4.0,
            "connect_timeout_seconds": 1.0,
            "stream_idle_seconds": 2.0,
            "health_timeout_seconds": 2.0,
            "scrape_timeout_seconds": 1.0,
            # The growing-context probe is a second signal for slow wedges; this story needs one.
            "multiround_every_seconds": 0.0,
        },
        "stall": {"no_progress_seconds": 8.0, "startup_timeout_seconds": 30.0},
        "restart": {
            "ready_timeout_seconds": 30.0,
            "verify_probes": 5,
            "verify_timeout_seconds": 30.0,
            # A short soak, so the story ends in seconds (the shipped one lasts 10 minutes).
            "soak_probes": 8,
            "soak_seconds": 5.0,
            "backoff_seconds": 20.0,
        },
    },
}


@dataclass(frozen=True)
class DemoTarget:
    """The stack the watchdog looks after: one URL and one systemd unit per role."""

    urls: Mapping[str, str]  # role -> base URL
    units: Mapping[str, str]  # role -> unit name
    router_metrics_url: str
    group: str = "demo"
    model: str = "pdsim"
    bootstrap_port: int | None = None  # prefill's, for direct PD probes


def config_toml(
    target: DemoTarget,
    *,
    state_dir: Path,
    metrics_listen: str,
    timings: Overrides = DEMO_TIMINGS,
) -> str:
    """A complete watchdog config (the daemon validates it at start, like any other)."""
    group: dict[str, Any] = {"name": target.group, "probe": {"model": target.model}}
    for role in ROLES:
        group[role] = {"unit": target.units[role], "url": target.urls[role]}
    group["router"]["metrics_url"] = target.router_metrics_url
    if target.bootstrap_port is not None:
        group["prefill"]["bootstrap_port"] = target.bootstrap_port
    own = {
        "watchdog": {"state_dir": str(state_dir), "metrics_listen": metrics_listen},
        "group": [group],
    }
    header = "# Written by `python -m demo`: compressed timings, see demo/config.py.\n"
    return header + config_text(timings, own)
