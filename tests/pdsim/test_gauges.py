"""Scheduler gauges change only when a stats report runs, as in SGLang (docs/sglang.md §3)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

import httpx

from pdsim.stack import WorkerProcess
from tests.pdsim.helpers import values


async def test_gauges_are_stale_until_a_report(
    pd_worker_factory: Callable[..., WorkerProcess],
) -> None:
    """After a request finishes, gauges keep the last report's values until the idle refresh."""
    args = ("--decode-log-interval", "10", "--idle-report-s", "0.6")
    prefill = pd_worker_factory("prefill", extra=args)
    decode = pd_worker_factory("decode", extra=args)
    body = {
        "input_ids": [1, 2, 3, 4],
        "sampling_params": {"max_new_tokens": 25},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": prefill.bootstrap_port,
        "bootstrap_room": random.randrange(2**63),
    }
    async with httpx.AsyncClient(timeout=10.0) as client:
        legs = await asyncio.gather(
            client.post(prefill.url + "/generate", json=body),
            client.post(decode.url + "/generate", json=body),
        )
        assert [r.status_code for r in legs] == [200, 200]
        stale = (await client.get(decode.url + "/metrics")).text
        # The last report ran at step 20 with the request still running; it has finished since.
        assert values(stale, "sglang:num_running_reqs") == [1.0]
        assert values(stale, "sglang:gen_throughput")[0] > 0
        await asyncio.sleep(0.9)
        fresh = (await client.get(decode.url + "/metrics")).text
    assert values(fresh, "sglang:num_running_reqs") == [0.0]
    assert values(fresh, "sglang:gen_throughput") == [0.0]
