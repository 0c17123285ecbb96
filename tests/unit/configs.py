"""Watchdog config files for CLI and daemon tests, written by the one builder (watchdog/configfile.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from watchdog.config import ROLES
from watchdog.configfile import write_config

__all__ = ["LOCAL_URLS", "group", "write_config"]

# The usual local ports of a PD deployment (prefill 30000, router 30001, decode 30002).
LOCAL_URLS = {
    "prefill": "http://127.0.0.1:30000",
    "decode": "http://127.0.0.1:30002",
    "router": "http://127.0.0.1:30001",
}


def group(
    name: str,
    *,
    url: str | None = None,
    units: Sequence[str] = ("p.service", "d.service", "r.service"),
    **sections: Any,
) -> dict[str, Any]:
    """One [[group]]: every role at `url` (else LOCAL_URLS), with `sections` (probe={...}, ...)."""
    out: dict[str, Any] = {"name": name, **sections}
    for role, unit in zip(ROLES, units, strict=True):
        out[role] = {"unit": unit, "url": url or LOCAL_URLS[role]}
    return out
