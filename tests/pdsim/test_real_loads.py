"""/v1/loads in its three generations (docs/sglang.md §7.6): absent before 0.5.9, an IPC round
trip through the scheduler on 0.5.9, a snapshot that a PD stall freezes on 0.5.16-0.5.18, a 50 ms
stall refresh from 0.5.19, and 0.5.19+ rows with `decode_moments`."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from pdsim.stack import WorkerProcess
from tests.pdsim.helpers import dual_body, sim_state, wait_until


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client shared by one test, closed after it."""
    async with httpx.AsyncClient(timeout=10.0) as c:
        yield c


async def _row(client: httpx.AsyncClient, url: str, query: str = "") -> dict[str, Any]:
    resp = await client.get(url + "/v1/loads" + query)
    assert resp.status_code == 200, resp.text
    row: dict[str, Any] = resp.json()["loads"][0]
    return row


async def test_loads_absent_before_059(
    pd_worker_factory: Callable[..., WorkerProcess], client: httpx.AsyncClient
) -> None:
    """0.5.5 has no /v1/loads (PR #16976 first shipped in 0.5.9); 0.5.9 has it."""
    old = pd_worker_factory("prefill", sglang_version="0.5.5")
    new = pd_worker_factory("prefill", sglang_version="0.5.9")
    assert (await client.get(old.url + "/v1/loads")).status_code == 404
    assert (await client.get(new.url + "/v1/loads")).status_code == 200


async def test_loads_059_ipc_shape_and_hang(
    pd_worker_factory: Callable[..., WorkerProcess], client: httpx.AsyncClient
) -> None:
    """0.5.9 builds each answer in the scheduler: no row timestamp, `prefill_prealloc_queue_reqs`,
    `dp_rank_count` and `aggregate`; a blocked loop leaves /v1/loads hanging.

    sglang/srt/managers/tokenizer_communicator_mixin.py:882-907, scheduler.py:1084,
    scheduler_metrics_mixin.py:620-750, entrypoints/v1_loads.py:56-58, 164-175 @ 0.5.9.
    """
    worker = pd_worker_factory("prefill", sglang_version="0.5.9")
    body = (await client.get(worker.url + "/v1/loads")).json()
    assert body["version"] == "0.5.9"
    assert body["dp_rank_count"] == 1
    assert body["aggregate"]["total_reqs"] == 0
    row = body["loads"][0]
    assert "timestamp" not in row
    assert row["num_total_reqs"] == 0
    assert "prefill_prealloc_queue_reqs" in row["disaggregation"]
    assert "prefill_bootstrap_queue_reqs" not in row["disaggregation"]
    bogus = await client.get(worker.url + "/v1/loads?include=bogus")
    assert bogus.status_code == 400  # io_struct.py:1897-1905 inside the try @ 0.5.9
    assert bogus.json()["code"] == 400

    await client.post(worker.url + "/_sim/fault", json={"kind": "collective_hang"})
    health = asyncio.create_task(client.get(worker.url + "/health", timeout=30.0))
    try:
        await wait_until(lambda: _hung(client, worker.url))
        with pytest.raises(httpx.TimeoutException):
            await client.get(worker.url + "/v1/loads", timeout=1.5)
    finally:
        await client.delete(worker.url + "/_sim/fault")
        with contextlib.suppress(httpx.HTTPError):
            await health


async def test_loads_0523_answers_while_loop_blocked(
    pd_worker_factory: Callable[..., WorkerProcess], client: httpx.AsyncClient
) -> None:
    """0.5.16+ read shared memory: a blocked loop still answers, with a frozen timestamp
    (sglang/srt/managers/tokenizer_control_mixin.py:1001-1029 @ 0.5.23)."""
    worker = pd_worker_factory("prefill")
    await client.post(worker.url + "/_sim/fault", json={"kind": "collective_hang"})
    health = asyncio.create_task(client.get(worker.url + "/health", timeout=30.0))
    try:
        await wait_until(lambda: _hung(client, worker.url))
        first = await _row(client, worker.url)
        await asyncio.sleep(0.3)
        second = await _row(client, worker.url)
        assert first["timestamp"] == second["timestamp"]
    finally:
        await client.delete(worker.url + "/_sim/fault")
        with contextlib.suppress(httpx.HTTPError):
            await health


async def _hung(client: httpx.AsyncClient, url: str) -> bool:
    return bool((await sim_state(client, url))["hung"])


@pytest.mark.parametrize("version", ["0.5.16", "0.5.19"])
async def test_pd_stall_freezes_snapshot_until_0519(
    pd_worker_factory: Callable[..., WorkerProcess], client: httpx.AsyncClient, version: str
) -> None:
    """A transfer stall keeps prefill busy without batches. 0.5.16-0.5.18 publish only on batches
    and when fully idle (scheduler.py:3567, 3644-3647, 3680-3681 @ 0.5.16): timestamp and queues
    freeze at the last batch, before it entered the inflight queue. 0.5.19+ republish every
    LOAD_STALL_REFRESH_S = 0.05 s (scheduler.py:374, 4483-4499 @ 0.5.19)."""
    prefill = pd_worker_factory("prefill", sglang_version=version)
    decode = pd_worker_factory("decode", sglang_version=version)
    await client.post(prefill.url + "/_sim/fault", json={"kind": "transfer_stall"})
    body = dual_body(prefill.bootstrap_port, random.randrange(2**63), "stall-1", 4)
    posts = [
        asyncio.create_task(client.post(w.url + "/generate", json=body, timeout=30.0))
        for w in (prefill, decode)
    ]
    try:

        async def stuck() -> bool:
            state = await sim_state(client, prefill.url)
            return bool(state["queues"]["prefill_inflight_queue_reqs"] == 1)

        await wait_until(stuck)
        await asyncio.sleep(0.1)
        first = await _row(client, prefill.url)
        await asyncio.sleep(0.3)
        second = await _row(client, prefill.url)
        inflight = second["disaggregation"]["prefill_inflight_queue_reqs"]
        if version == "0.5.16":
            assert second["timestamp"] == first["timestamp"]
            assert inflight == 0
        else:
            assert second["timestamp"] > first["timestamp"]
            assert inflight == 1
    finally:
        await client.delete(prefill.url + "/_sim/fault")
        await client.post(prefill.url + "/_sim/release")
        for task in posts:
            with contextlib.suppress(httpx.HTTPError):
                await task


async def test_row_fields_and_decode_moments(
    pd_worker_factory: Callable[..., WorkerProcess], client: httpx.AsyncClient
) -> None:
    """0.5.19+ rows carry token accounting and `decode_moments`: six sums over contiguous decode
    steps [count, Σbatch, Σstep_us, Σbatch², Σbatch·step_us, Σgenerated], null until the first
    (sglang/srt/managers/scheduler.py:424-442, 5120-5180, load_inquirer.py:226-227,
    load_snapshot.py:196-220 @ 0.5.23); the body adds accelerator metadata
    (entrypoints/v1_loads.py:144-150 @ 0.5.23). 0.5.16 rows have none of these."""
    prefill = pd_worker_factory("prefill")
    decode = pd_worker_factory("decode")
    before = await _row(client, decode.url)
    assert before["decode_moments"] is None
    assert before["num_prealloc_ready_tokens"] == 0
    assert before["queues"]["prealloc_ready"] == 0
    body = dual_body(prefill.bootstrap_port, random.randrange(2**63), "moments-1", 12)
    p, d = await asyncio.gather(
        client.post(prefill.url + "/generate", json=body),
        client.post(decode.url + "/generate", json=body),
    )
    assert p.status_code == d.status_code == 200
    await asyncio.sleep(0.2)
    resp = await client.get(decode.url + "/v1/loads")
    top = resp.json()
    assert top["version"] == "0.5.23"
    assert top["num_accelerators"] == 1
    row = top["loads"][0]
    moments = row["decode_moments"]
    assert len(moments) == 6
    count, batch, step_us, batch_sq, batch_step, generated = moments
    assert count >= 5  # twelve tokens, the first from prefill, the first decode step uncounted
    assert batch == count  # one request in every step
    assert batch_sq == count
    assert generated == batch
    assert step_us > 0
    assert batch_step == step_us
    assert "total_prefill_busy_us" in row
    assert "num_active_tokens" in row
    prefill_row = await _row(client, prefill.url)
    assert prefill_row["total_prefill_uncached_tokens"] > 0

    old = pd_worker_factory("decode", sglang_version="0.5.16")
    old_top = (await client.get(old.url + "/v1/loads")).json()
    assert old_top["version"] == "0.5.16"
    assert "accelerator" not in old_top
    old_row = old_top["loads"][0]
    assert "decode_moments" not in old_row
    assert "num_active_tokens" not in old_row
    assert "timestamp" in old_row
    assert "prealloc_ready" not in old_row["queues"]
