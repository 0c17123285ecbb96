"""A fleet of 8 groups under one daemon: a single group's stall is acted on as before; a fault that
hits 6 of them together is a storm, and at most the fleet budget is co-restarted.

Eight pdsim stacks (prefill and decode workers with real SGLang 0.5.23 semantics) each behind
its own real router, watched by one `watchdog --dry-run --log-format json` subprocess
(bench/harness.py). Dry run: the arbiter's decisions are asserted from the daemon's log
(`restart_skipped_dry_run` for a co-restart it would run, `fleet_restart_refused`,
`storm_detected`); eight sandboxed stacks with real restarts are too heavy for a 2-core test
machine, and the arbiter rules before the restarter runs, dry or not. The shared fault is a KV
transfer that never completes (`transfer_stall` on each of the 6 prefills): every group on it
stalls within a cycle or two of the others. Waits are on log events with generous deadlines;
nothing asserts on timing. Every process is stopped by its PID.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from bench.harness import COMPRESSED_TIMINGS, GroupTarget, WatchdogProcess
from pdsim.stack import PDStack, StackConfig, StackPorts, free_ports, start_stack
from watchdog.configfile import config_text, merge

pytestmark = [pytest.mark.slow, pytest.mark.router_agnostic]

GROUPS = 8
STORMED = tuple(f"f{i}" for i in range(6))  # the groups the shared fault hits
ALONE = "f7"  # the group that stalls on its own first
# Generous: 8 stacks and the daemon share two loaded cores.
HEALTHY_TIMEOUT_S = 240.0
EVENT_TIMEOUT_S = 180.0

TIMINGS = merge(
    COMPRESSED_TIMINGS,
    {
        "watchdog": {"cycle_seconds": 1.0},
        # A dry run sends Alertmanager nothing: the storm alert is logged as it would be posted.
        "alertmanager": {"url": "http://127.0.0.1:9"},
        "fleet": {
            "max_concurrent_restarts": 1,
            "max_restarts_per_hour": 6,
            "storm_share": 0.5,
            "storm_window_seconds": 120.0,
            "storm_min_groups": 3,
        },
        "group": {
            "stall": {"no_progress_seconds": 8.0},
            # Long: a group refused or failed asks again only after the test is over.
            "restart": {"backoff_seconds": 600.0},
        },
    },
)


async def _start_stacks(tmp_path: Path) -> list[PDStack]:
    """Start the stacks two at a time; on any failure stop every one already started."""
    stacks: list[PDStack] = []

    def one(index: int) -> PDStack:
        config = StackConfig(
            worker_args=("--no-access-log",),
            ports=StackPorts(*free_ports(5)),
            log_dir=tmp_path / f"stack{index}",
            ready_timeout_s=120.0,
        )
        return start_stack(config)

    try:
        for first in range(0, GROUPS, 2):
            started = await asyncio.gather(
                *(asyncio.to_thread(one, i) for i in range(first, min(first + 2, GROUPS))),
                return_exceptions=True,
            )
            stacks += [s for s in started if isinstance(s, PDStack)]
            errors = [s for s in started if isinstance(s, BaseException)]
            if errors:
                raise errors[0]
    except BaseException:
        for stack in stacks:
            await asyncio.to_thread(stack.stop)
        raise
    return stacks


@contextlib.asynccontextmanager
async def fleet(tmp_path: Path) -> AsyncIterator[tuple[list[PDStack], WatchdogProcess]]:
    """Eight stacks and a dry-run daemon watching all of them, every group already healthy."""
    stacks = await _start_stacks(tmp_path)
    (metrics_port,) = free_ports(1)
    own = {
        "watchdog": {
            "state_dir": str(tmp_path / "state"),
            "metrics_listen": f"127.0.0.1:{metrics_port}",
        },
        "group": [GroupTarget.of_stack(f"f{i}", s).overrides() for i, s in enumerate(stacks)],
    }
    config_path = tmp_path / "watchdog.toml"
    config_path.write_text(config_text(TIMINGS, own))
    watchdog = WatchdogProcess(config_path, dry_run=True, log_path=tmp_path / "watchdog.log")
    try:
        await watchdog.start()
        for i in range(GROUPS):
            healthy = await watchdog.wait_for_event(became_healthy(f"f{i}"), HEALTHY_TIMEOUT_S)
            assert healthy is not None, f"f{i} never healthy:\n{watchdog.tail(40)}"
        yield stacks, watchdog
    finally:
        await watchdog.stop()
        for stack in stacks:
            await asyncio.to_thread(stack.stop)


def event_is(event: Mapping[str, Any], name: str, group: str | None = None) -> bool:
    """Whether `event` is the log event `name` (of `group`, if given)."""
    return event.get("event") == name and (group is None or event.get("group") == group)


def became_healthy(group: str) -> Callable[[Mapping[str, Any]], bool]:
    """A predicate: `group` moved into healthy."""
    return lambda e: event_is(e, "state_changed", group) and e.get("new") == "healthy"


def events(watchdog: WatchdogProcess, name: str) -> list[dict[str, Any]]:
    """Every logged event called `name` so far."""
    return [e for e in watchdog.events if e.get("event") == name]


async def wait(
    watchdog: WatchdogProcess, predicate: Callable[[Mapping[str, Any]], bool], what: str
) -> dict[str, Any]:
    """The first event matching `predicate`; fails the test with the log's tail if none comes."""
    found = await watchdog.wait_for_event(predicate, EVENT_TIMEOUT_S)
    assert found is not None, f"no {what}:\n{watchdog.tail(60)}"
    return found


async def test_a_single_stall_acts_and_a_shared_fault_is_a_storm(tmp_path: Path) -> None:
    """One group stalling alone is co-restarted as today (no fleet refusal); then a fault shared
    by 6 of the 8 groups is one storm verdict naming the stalled groups and what they share, at
    most max_concurrent_restarts (1) of them is co-restarted, and the others are held, named in
    the storm or in their own storm refusal."""
    async with fleet(tmp_path) as (stacks, watchdog):
        alone = stacks[int(ALONE[1:])]
        await asyncio.to_thread(alone.set_fault, "prefill", "transfer_stall")
        await wait(watchdog, lambda e: event_is(e, "restart_skipped_dry_run", ALONE), "restart")
        seen = len(watchdog.events)
        # The fault cleared (nothing was restarted in a dry run): f7 serves again, so its stall
        # no longer counts toward a storm and its co-restart no longer occupies the budget.
        await asyncio.to_thread(alone.clear_faults, "prefill")
        await asyncio.to_thread(alone.release_stuck, "prefill")
        healthy = became_healthy(ALONE)
        await wait(watchdog, lambda e: e in watchdog.events[seen:] and healthy(e), "f7 healthy")
        assert events(watchdog, "fleet_restart_refused") == []
        assert events(watchdog, "storm_detected") == []

        for name in STORMED:
            await asyncio.to_thread(stacks[int(name[1:])].set_fault, "prefill", "transfer_stall")
        storm = await wait(watchdog, lambda e: event_is(e, "storm_detected"), "storm verdict")
        assert set(storm["groups"]) <= set(STORMED), storm
        assert len(storm["groups"]) > GROUPS // 2, storm
        assert {"kind": "host", "value": "127.0.0.1"} in [
            {"kind": s["kind"], "value": s["value"]} for s in storm["suspects"]
        ], storm
        assert len(storm["acted"]) <= 1, storm

        def all_named(_: Mapping[str, Any]) -> bool:
            held = set(storm["held"]) | {
                e["group"]
                for e in events(watchdog, "fleet_restart_refused")
                if e["reason"] == "storm"
            }
            return held | set(storm["acted"]) >= set(STORMED)

        await wait(watchdog, all_named, "storm hold of every group on the shared fault")
        restarted = {
            e["group"] for e in events(watchdog, "restart_skipped_dry_run") if e["group"] != ALONE
        }
        assert len(restarted) <= 1, restarted
        assert restarted <= set(STORMED)
        assert len(events(watchdog, "storm_detected")) == 1
        would_post = [
            e
            for e in events(watchdog, "alertmanager_dry_run")
            if e.get("alertname") == "SGLangWatchdogStorm"
        ]
        assert would_post, "the storm alert was not (dry-)posted"
