"""Helpers for tests that check PromQL (dashboard, alerts) against the metrics the watchdog exposes."""

from __future__ import annotations

import re

from prometheus_client import CollectorRegistry

from watchdog.run.metrics import WatchdogMetrics

_SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum"),
}
_METRIC_NAME = re.compile(r"\bsglang_watchdog_[a-z0-9_]+")


def exposed_sample_names() -> frozenset[str]:
    """Every sample name a WatchdogMetrics registry can expose (without the `_created` extras)."""
    registry = CollectorRegistry()
    WatchdogMetrics(registry)
    return frozenset(
        family.name + suffix for family in registry.collect() for suffix in _SUFFIXES[family.type]
    )


def referenced_metric_names(expr: str) -> set[str]:
    """The sglang_watchdog_* names a PromQL expression uses."""
    return set(_METRIC_NAME.findall(expr))
