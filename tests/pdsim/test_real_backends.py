"""Decode's WaitingForInput timeout and abortability per version and transfer backend, and the
decode connection log lines in each version's words (docs/sglang.md §7.2, §7.4, §7.5)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable

import httpx

from pdsim.stack import REAL_SGLANG, PDStack
from tests.pdsim.helpers import by_label, dual_body, scrape, sim_state, wait_until

TRANSFER = "sglang:num_transfer_failed_reqs_total"


def _start(factory: Callable[..., PDStack], version: str, backend: str) -> PDStack:
    return factory(
        sglang_version=version,
        worker_args=("--transfer-backend", backend),
        decode_args=("--waiting-timeout-s", "1.5"),
        with_router=False,
        compat=REAL_SGLANG,
    )


async def _post_stuck(
    stack: PDStack, client: httpx.AsyncClient, rid: str
) -> tuple[asyncio.Task[httpx.Response], asyncio.Task[httpx.Response]]:
    body = dual_body(stack.bootstrap_port, random.randrange(2**62), rid, 4)
    p = asyncio.create_task(client.post(stack.prefill_url + "/generate", json=body))
    d = asyncio.create_task(client.post(stack.decode_url + "/generate", json=body))

    async def stuck() -> bool:
        rooms = (await sim_state(client, stack.prefill_url))["rooms"]
        return any(r["rid"] == rid and r["stuck"] for r in rooms.values())

    await wait_until(stuck)
    return p, d


def _failed(text: str) -> float:
    return max(by_label(text, TRANSFER, "tp_rank").values(), default=0.0)


async def test_waiting_timeout_fails_both_sides_on_0523(
    pd_stack_factory: Callable[..., PDStack],
) -> None:
    """0.5.23: decode's receiver fails after the waiting timeout (counted from send_metadata)
    and sends ABORT to prefill, which fails the room too: a stall ends in failures.

    sglang/srt/disaggregation/common/conn.py:2888-2912 @ 0.5.23; environ.py:763 @ 0.5.23 (300 s).
    """
    stack = await asyncio.to_thread(_start, pd_stack_factory, "0.5.23", "nixl")
    async with httpx.AsyncClient(timeout=30.0) as client:
        stack.set_fault("prefill", "transfer_stall")
        p, d = await _post_stuck(stack, client, "waits")
        assert (await asyncio.wait_for(d, 10.0)).status_code == 500
        assert (await asyncio.wait_for(p, 10.0)).status_code == 500
        assert "in KVPoll.WaitingForInput" in stack.log_text("decode")
        assert "Decode transfer failed for request rank=0" in stack.log_text("decode")
        assert _failed(await scrape(client, stack.decode_url)) == 1
        assert _failed(await scrape(client, stack.prefill_url)) == 1
        state = await sim_state(client, stack.prefill_url)
        assert state["queues"]["prefill_inflight_queue_reqs"] == 0


async def test_nixl_055_neither_times_out_nor_aborts(
    pd_stack_factory: Callable[..., PDStack],
) -> None:
    """NIXL 0.5.5 has no abort() and no decode waiting timeout: a stuck transfer stays, an
    abort of it (a real match, so recorded) changes nothing.

    sglang/srt/managers/scheduler.py:5741-5758 @ 0.5.23 (`hasattr(sender, "abort")`);
    sglang/srt/disaggregation/nixl/conn.py @ 0.5.5 (no abort(), no WaitingForInput timeout).
    """
    stack = await asyncio.to_thread(_start, pd_stack_factory, "0.5.5", "nixl")
    async with httpx.AsyncClient(timeout=30.0) as client:
        stack.set_fault("prefill", "transfer_stall")
        p, d = await _post_stuck(stack, client, "pinned-by-nixl")
        for url in (stack.prefill_url, stack.decode_url):
            resp = await client.post(url + "/abort_request", json={"rid": "pinned-by-nixl"})
            assert resp.status_code == 200
        await asyncio.sleep(2.5)
        assert not p.done()
        assert not d.done()
        for url in (stack.prefill_url, stack.decode_url):
            assert _failed(await scrape(client, url)) == 0
            assert "pinned-by-nixl" in (await sim_state(client, url))["aborted_rids"]
        stack.clear_faults("prefill")
        stack.release_stuck("prefill")
        assert [r.status_code for r in await asyncio.gather(p, d)] == [200, 200]


async def test_mooncake_055_times_out_without_telling_prefill(
    pd_stack_factory: Callable[..., PDStack],
) -> None:
    """Mooncake 0.5.5: decode times out alone (prefill keeps the room stuck until aborted, which
    mooncake can); losing prefill prints `Losing connection with prefill instance`.

    sglang/srt/disaggregation/mooncake/conn.py:1298-1312, 1169, 1077-1083 @ 0.5.5.
    """
    stack = await asyncio.to_thread(_start, pd_stack_factory, "0.5.5", "mooncake")
    async with httpx.AsyncClient(timeout=30.0) as client:
        stack.set_fault("prefill", "transfer_stall")
        p, d = await _post_stuck(stack, client, "mc-1")
        assert (await asyncio.wait_for(d, 10.0)).status_code == 500
        assert _failed(await scrape(client, stack.decode_url)) == 1
        await asyncio.sleep(0.5)
        assert not p.done()
        assert _failed(await scrape(client, stack.prefill_url)) == 0
        await client.post(stack.prefill_url + "/abort_request", json={"rid": "mc-1"})
        assert (await asyncio.wait_for(p, 10.0)).status_code == 500
        assert _failed(await scrape(client, stack.prefill_url)) == 1
        assert "Aborted by AbortReq." in stack.log_text("prefill")

        p2, d2 = await _post_stuck(stack, client, "mc-2")
        t0 = time.monotonic()
        await asyncio.to_thread(stack.controller.stop, "prefill")
        assert time.monotonic() - t0 < 1.4  # before decode's own 1.5 s timeout
        await asyncio.wait_for(d2, 10.0)
        log = stack.log_text("decode")
        assert "Losing connection with prefill instance (bootstrap_addr: 127.0.0.1:" in log
        assert "requests affected" in log
        await asyncio.gather(p2, return_exceptions=True)
