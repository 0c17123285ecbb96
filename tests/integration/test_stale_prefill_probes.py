"""The watchdog's direct PD probe against a prefill restarted alone, per SGLang version.

What `stall.on_prefill_only_restart = "judge"` relies on (docs/decisions.md, "Restart rungs"):
from 0.5.19 the pair fails one room and then passes the direct probe by itself; before, the direct
probe keeps failing until decode restarts (docs/sglang.md §7.11; pdsim models both).
"""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from pdsim.stack import REAL_SGLANG, PDStack
from watchdog.config import GroupSection, parse_config
from watchdog.observe.probes.direct import run_direct_probe
from watchdog.pairs import Pair

PAIR = Pair(0, 0)


def direct_group(stack: PDStack) -> GroupSection:
    """A group of the stack's prefill (with its bootstrap port) and decode; short timeouts."""
    data = {
        "group": [
            {
                "name": "sim",
                "prefill": {
                    "unit": "p.service",
                    "url": stack.prefill_url,
                    "bootstrap_port": stack.bootstrap_port,
                },
                "decode": {"unit": "d.service", "url": stack.decode_url},
                # Never contacted: a direct probe asks the workers only.
                "router": {"unit": "r.service", "url": "http://127.0.0.1:9"},
                "probe": {
                    "model": "pdsim",
                    "timeout_seconds": 10.0,
                    "stream_idle_seconds": 5.0,
                    "connect_timeout_seconds": 10.0,
                },
            }
        ]
    }
    return parse_config(data, "<test>").group[0]


async def _passes(client: httpx.AsyncClient, group: GroupSection) -> bool:
    result = await run_direct_probe(client, group, PAIR, api_key=None)
    return result.ok


@pytest.mark.parametrize(("version", "recovers"), [("0.5.23", True), ("0.5.16", False)])
async def test_direct_probe_after_a_prefill_restarted_alone(
    pd_stack_factory: Callable[..., PDStack], version: str, recovers: bool
) -> None:
    """0.5.23: one failed probe, then passes; 0.5.16: fails until decode restarts."""
    stack = pd_stack_factory(
        with_router=False,
        compat=REAL_SGLANG,
        sglang_version=version,
        # Prefill's half of a room decode never reaches waits this long, as SGLang's does.
        prefill_args=("--bootstrap-timeout-s", "2"),
    )
    group = direct_group(stack)
    async with httpx.AsyncClient(trust_env=False) as client:
        assert await _passes(client, group)
        await stack.arestart("prefill")
        assert not await _passes(client, group)
        later = [await _passes(client, group) for _ in range(2)]
        assert later == [recovers] * 2
        if not recovers:
            await stack.arestart("decode")
            assert await _passes(client, group)
