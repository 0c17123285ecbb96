"""Faults that end in a process restart: a collective hang killed by SGLang's watchdog, and
the decode-only restart that degrades the bootstrap state until a co-restart (docs/sglang.md §6).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from pdsim.stack import PDStack, StackConfig
from tests.pdsim.fixtures import real_config
from tests.pdsim.helpers import by_label, completion_body, loads, scrape, sim_state, wait_until

FAILED = "sglang:num_transfer_failed_reqs_total"


@pytest.fixture(scope="module")
def pdsim_config() -> StackConfig:
    """Short health and watchdog timeouts on decode; a seeded dice for degraded transfers."""
    return real_config(
        prefill_args=("--seed", "3"),
        decode_args=("--health-timeout-s", "1", "--watchdog-timeout", "2.5"),
    )


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client whose timeout outlasts a worker's restart."""
    async with httpx.AsyncClient(timeout=30.0) as c:
        yield c


async def test_collective_hang_then_watchdog(pd_stack: PDStack, client: httpx.AsyncClient) -> None:
    """Busy decode stops: /health 503, /server_info hangs, /v1/loads frozen, then SIGKILL."""
    decode = pd_stack.controller.procs["decode"].popen
    assert decode is not None
    pd_stack.set_fault("decode", "collective_hang")
    request = asyncio.create_task(
        client.post(
            pd_stack.router_url + "/generate", json=completion_body("/generate", max_tokens=50)
        )
    )

    async def hung() -> bool:
        return bool((await sim_state(client, pd_stack.decode_url))["hung"])

    await wait_until(hung)
    first = (await loads(client, pd_stack.decode_url))["loads"][0]["timestamp"]
    await asyncio.sleep(0.2)
    assert (await loads(client, pd_stack.decode_url))["loads"][0]["timestamp"] == first
    with pytest.raises(httpx.ReadTimeout):
        await client.get(pd_stack.decode_url + "/server_info", timeout=0.3)
    assert (await client.get(pd_stack.decode_url + "/health", timeout=5.0)).status_code == 503
    assert (await client.get(pd_stack.prefill_url + "/health")).status_code == 200
    await asyncio.to_thread(decode.wait, 10.0)
    assert decode.returncode == -9
    log = pd_stack.log_text("decode")
    assert "Scheduler watchdog timeout" in log
    assert "Health check failed." in log
    request.cancel()


async def test_decode_only_restart_degrades_until_co_restart(
    pd_stack: PDStack, client: httpx.AsyncClient
) -> None:
    """Decode restarted under a running prefill: transfers fail on both sides until a co-restart."""
    decode = pd_stack.controller.procs["decode"].popen
    if decode is None or decode.poll() is not None:
        await pd_stack.arestart("decode")  # the watchdog may have killed it
    await asyncio.to_thread(pd_stack.wait_ready, "router")
    body = completion_body("/generate", max_tokens=2)
    assert (await client.post(pd_stack.router_url + "/generate", json=body)).status_code == 200

    await pd_stack.arestart("decode")  # decode alone, prefill keeps running
    await asyncio.to_thread(pd_stack.wait_ready, "router")
    for _ in range(8):
        await client.post(pd_stack.router_url + "/generate", json=body)
    state = await sim_state(client, pd_stack.prefill_url)
    assert state["degraded"]["spontaneous"] is True
    assert len(state["degraded"]["decode_incarnations_after_start"]) >= 2
    prefill_failed = by_label(await scrape(client, pd_stack.prefill_url), FAILED, "tp_rank")
    decode_failed = by_label(await scrape(client, pd_stack.decode_url), FAILED, "tp_rank")
    assert prefill_failed["0"] >= 1
    assert decode_failed["0"] >= 1
    assert "Prefill transfer failed for request rank=0" in pd_stack.log_text("prefill")

    await pd_stack.aco_restart()  # prefill -> decode -> router
    results = [await client.post(pd_stack.router_url + "/generate", json=body) for _ in range(8)]
    assert [r.status_code for r in results] == [200] * 8
    state = await sim_state(client, pd_stack.prefill_url)
    assert state["degraded"]["active"] is False
    assert FAILED not in await scrape(client, pd_stack.prefill_url)
    assert FAILED not in await scrape(client, pd_stack.decode_url)
