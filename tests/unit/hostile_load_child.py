"""The child of test_hostile_load: the daemon's observe-and-capture cycle under RLIMIT_AS.

Run as `python -m tests.unit.hostile_load_child SPEC` where SPEC is a JSON object (base_urls,
ssh target fields, cycles, limit_bytes). Each cycle observes a 4P4D group (every /metrics page just
under the 16 MiB cap, every unit on a hostile SSH host) and captures evidence over that host, as
the daemon does on a stall. It prints one JSON line: cycles done, outcomes and its peak RSS.
"""

from __future__ import annotations

import asyncio
import json
import resource
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from tests.unit.rss_child import vm_hwm
from watchdog.act.hosts import UnitBuses
from watchdog.config import GroupSection, SshTarget, parse_config
from watchdog.evidence.capture import capture_evidence
from watchdog.evidence.records import Evidence
from watchdog.observe.observer import GroupObserver
from watchdog.observe.pool import make_client

WORKERS_PER_ROLE = 4
GENEROUS_SECONDS = (
    900.0  # every scrape's and /health's deadline: never reached, however loaded the machine
)


def group_4p4d(base_urls: list[str]) -> GroupSection:
    """Four prefills, four decodes and a router on local servers. Timeouts far beyond any load
    (no race): on two cores busy with other work one observation took 63 s, and a scrape cut at
    a 60 s deadline failed the test's "every page read" for the machine's speed, not for memory."""

    def workers(role: str, urls: list[str]) -> list[dict[str, str]]:
        return [{"unit": f"{role}{i}.service", "url": url} for i, url in enumerate(urls)]

    data: dict[str, Any] = {
        "group": [
            {
                "name": "g",
                "prefill": workers("p", base_urls[:WORKERS_PER_ROLE]),
                "decode": workers("d", base_urls[WORKERS_PER_ROLE : 2 * WORKERS_PER_ROLE]),
                "router": {"unit": "r.service", "url": base_urls[-1]},
                "probe": {
                    "timeout_seconds": 60.0,  # no probe runs here (no scheduler)
                    "stream_idle_seconds": 30.0,
                    "health_timeout_seconds": GENEROUS_SECONDS,
                    "scrape_timeout_seconds": GENEROUS_SECONDS,
                },
            }
        ]
    }
    return parse_config(data, "<hostile-load>").group[0]


async def run(spec: dict[str, Any]) -> dict[str, Any]:
    """`spec["cycles"]` observe-and-capture cycles; what they saw and the peak RSS."""
    group = group_4p4d(spec["base_urls"])
    target = SshTarget(
        spec["user"], "127.0.0.1", spec["port"], Path(spec["key"]), Path(spec["known_hosts"])
    )
    units = [w.unit for w in (*group.prefills, *group.decodes)]
    buses = UnitBuses(None, dict.fromkeys(units, target), backoff_max_seconds=0.5)
    scrapes: Counter[str] = Counter()
    journals: Counter[str] = Counter()
    cycles = 0
    peaks: list[int] = []
    seconds: list[tuple[float, float]] = []  # observe, whole cycle: reported, never asserted
    async with make_client() as client:
        observer = GroupObserver(group, client, unit_reader=buses)
        try:
            for _ in range(spec["cycles"]):
                started = time.monotonic()
                observed = await observer.observe()
                observed_at = time.monotonic()
                peaks.append(vm_hwm())
                scrapes.update(str(m.error) for m in observed.observation.metrics)
                evidence = await capture_evidence(
                    group,
                    observed.observation,
                    raw_metrics=observed.raw_metrics,
                    unit_reader=buses,
                    client=client,
                    total_timeout_seconds=60.0,
                    journal_lines=200,
                    remote_hosts=buses.remote_units(),
                )
                journals.update(_journal_outcomes(evidence))
                seconds.append(
                    (round(observed_at - started, 1), round(time.monotonic() - started, 1))
                )
                cycles += 1
        finally:
            for host in buses.hosts.values():
                await host.close()
    return {
        "cycles": cycles,
        "scrapes": dict(scrapes),
        "journals": dict(journals),
        "ssh_connections": sum(h.connections for h in buses.hosts.values()),
        "seconds": seconds,
        "peaks": peaks,
        "peak": vm_hwm(),
    }


def _journal_outcomes(evidence: Evidence) -> list[str]:
    """One word per unit's journal: read (cut at its cap or not) or unavailable."""
    words = []
    for unit in evidence.units:
        journal = unit.journal
        if journal is None or not journal.ok:
            words.append("unavailable: " + (journal.detail[:80] if journal else "none"))
        else:
            words.append("truncated" if journal.truncated else "read")
    return words


def main() -> None:
    """Limit the address space, run the cycles, print the report."""
    spec = json.loads(sys.argv[1])
    limit = int(spec["limit_bytes"])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    print(json.dumps(asyncio.run(run(spec))), flush=True)


if __name__ == "__main__":
    main()
