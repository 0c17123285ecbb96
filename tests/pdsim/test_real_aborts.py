"""Aborts as real SGLang does them: exact rid, and in a PD queue a counted KV failure on every TP
rank that is also a finished request (docs/sglang.md §7.2, §7.3)."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from pdsim.stack import PDStack, StackConfig
from tests.pdsim.fixtures import real_config
from tests.pdsim.helpers import by_label, dual_body, scrape, sim_state, total, wait_until

TRANSFER = "sglang:num_transfer_failed_reqs_total"
BOOTSTRAP = "sglang:num_bootstrap_failed_reqs_total"
REQUESTS = "sglang:num_requests_total"
GEN_TOKENS = "sglang:generation_tokens_total"
TTFT_COUNT = "sglang:time_to_first_token_seconds_count"
ABORTED = "sglang:num_aborted_requests_total"


@pytest.fixture(scope="module")
def pdsim_config() -> StackConfig:
    """TP 2 (failures count on every rank); one decode slot, so a second request waits in the
    decode prealloc queue."""
    return real_config(tp_size=2, decode_args=("--max-running-requests", "1"))


def _room() -> int:
    return random.randrange(2**62)


async def _abort(client: httpx.AsyncClient, url: str, rid: str) -> None:
    resp = await client.post(url + "/abort_request", json={"rid": rid})
    assert resp.status_code == 200


async def _rooms(client: httpx.AsyncClient, url: str) -> dict[str, dict[str, object]]:
    rooms: dict[str, dict[str, object]] = (await sim_state(client, url))["rooms"]
    return rooms


async def _stuck_transfer(
    stack: PDStack, client: httpx.AsyncClient, rid: str, *, stream: bool = False
) -> tuple[asyncio.Task[httpx.Response], asyncio.Task[httpx.Response]]:
    """A request stuck in prefill's inflight queue and decode's transfer queue."""
    stack.set_fault("prefill", "transfer_stall")
    body = dual_body(stack.bootstrap_port, _room(), rid, 4, stream=stream)
    p = asyncio.create_task(client.post(stack.prefill_url + "/generate", json=body))
    d = asyncio.create_task(client.post(stack.decode_url + "/generate", json=body))

    async def stuck() -> bool:
        rooms = await _rooms(client, stack.prefill_url)
        return any(r["rid"] == rid and r["stuck"] == "transfer_stall" for r in rooms.values())

    await wait_until(stuck)
    return p, d


async def test_unknown_or_prefix_rid_does_nothing(
    pd_stack: PDStack, client: httpx.AsyncClient
) -> None:
    """The tokenizer matches rid exactly; an unknown rid is a 200 that does nothing and is not
    recorded.

    sglang/srt/managers/tokenizer_manager.py:2241-2253 @ 0.5.23.
    """
    rid = f"exact-{_room()}"
    p, d = await _stuck_transfer(pd_stack, client, rid)
    before = await scrape(client, pd_stack.decode_url)
    for url in (pd_stack.prefill_url, pd_stack.decode_url):
        await _abort(client, url, "exact-")  # a prefix of the live rid
        await _abort(client, url, "no-such-request")
    await asyncio.sleep(0.3)
    after = await scrape(client, pd_stack.decode_url)
    for url in (pd_stack.prefill_url, pd_stack.decode_url):
        assert (await sim_state(client, url))["aborted_rids"] == []
    assert total(after, ABORTED) == total(before, ABORTED)
    assert not p.done()
    assert not d.done()
    pd_stack.clear_faults("prefill")
    pd_stack.release_stuck("prefill")
    assert [r.status_code for r in await asyncio.gather(p, d)] == [200, 200]


async def test_abort_in_prefill_inflight_is_a_transfer_failure(
    pd_stack: PDStack, client: httpx.AsyncClient
) -> None:
    """Abort of a stuck transfer on prefill: `Prefill transfer failed ... Aborted by AbortReq.`,
    the transfer counter +1 on every TP rank, and one more finished request.

    sglang/srt/managers/scheduler.py:5754-5758 @ 0.5.23 (sender.abort());
    sglang/srt/disaggregation/common/conn.py:2458-2466 @ 0.5.23;
    sglang/srt/disaggregation/prefill.py:1282-1312 @ 0.5.23;
    sglang/srt/managers/tokenizer_manager.py:3261-3297 @ 0.5.23 (finished != succeeded).
    """
    rid = f"inflight-{_room()}"
    before = await scrape(client, pd_stack.prefill_url)
    p, d = await _stuck_transfer(pd_stack, client, rid)
    await _abort(client, pd_stack.prefill_url, rid)
    resp = await asyncio.wait_for(p, 10.0)
    assert resp.status_code == 500
    log = pd_stack.log_text("prefill")
    for rank in (0, 1):
        line = f"Prefill transfer failed for request rank={rank} req.rid={rid!r}"
        assert line in log
    assert "with exception KVTransferError(bootstrap_room=" in log
    assert "Aborted by AbortReq.\n" in log
    after = await scrape(client, pd_stack.prefill_url)
    delta = {
        k: v - by_label(before, TRANSFER, "tp_rank").get(k, 0.0)
        for k, v in by_label(after, TRANSFER, "tp_rank").items()
    }
    assert delta == {"0": 1.0, "1": 1.0}
    assert total(after, REQUESTS) == total(before, REQUESTS) + 1
    assert rid in (await sim_state(client, pd_stack.prefill_url))["aborted_rids"]
    # sender.abort() tells decode nothing (common/conn.py:2458-2466 @ 0.5.23): its copy waits
    # for its own abort, which the watchdog sends too.
    await asyncio.sleep(0.3)
    assert not d.done()
    await _abort(client, pd_stack.decode_url, rid)
    assert (await asyncio.wait_for(d, 10.0)).status_code == 500


async def test_abort_in_decode_transfer_queue(pd_stack: PDStack, client: httpx.AsyncClient) -> None:
    """Abort on decode of a request waiting for its KV: `Decode transfer failed ... Aborted by
    AbortReq.`, +1 on every rank, a finished request without generated tokens or a TTFT sample;
    on 0.5.23 prefill is told and fails the room too (counted, logged at debug only).

    sglang/srt/managers/scheduler.py:5770-5780 @ 0.5.23; decode.py:2857-2916 @ 0.5.23;
    common/conn.py:2955-2962 and 711-715 @ 0.5.23; tokenizer_manager.py:3236-3246 @ 0.5.23.
    """
    rid = f"transfer-{_room()}"
    before_d = await scrape(client, pd_stack.decode_url)
    before_p = await scrape(client, pd_stack.prefill_url)
    p, d = await _stuck_transfer(pd_stack, client, rid)
    await _abort(client, pd_stack.decode_url, rid)
    assert (await asyncio.wait_for(d, 10.0)).status_code == 500
    assert (await asyncio.wait_for(p, 10.0)).status_code == 500
    log = pd_stack.log_text("decode")
    for rank in (0, 1):
        assert f"Decode transfer failed for request rank={rank} decode_req.req.rid={rid!r}" in log
    after_d = await scrape(client, pd_stack.decode_url)
    after_p = await scrape(client, pd_stack.prefill_url)
    for before, after in ((before_d, after_d), (before_p, after_p)):
        assert max(by_label(after, TRANSFER, "tp_rank").values()) == 1 + max(
            by_label(before, TRANSFER, "tp_rank").values(), default=0.0
        )
    assert total(after_d, REQUESTS) == total(before_d, REQUESTS) + 1
    assert total(after_d, GEN_TOKENS) == total(before_d, GEN_TOKENS)
    assert total(after_d, TTFT_COUNT) == total(before_d, TTFT_COUNT)
    assert total(after_d, ABORTED) == total(before_d, ABORTED) + 1
    # The prefill side's failure came from another rank: counted, not logged.
    assert f"Prefill transfer failed for request rank=0 req.rid={rid!r}" not in (
        pd_stack.log_text("prefill")
    )


async def test_abort_in_bootstrap_and_prealloc_queues(
    pd_stack: PDStack, client: httpx.AsyncClient
) -> None:
    """Prefill bootstrap queue and decode prealloc queue: `Prefill bootstrap failed` /
    `Decode handshake failed ... Aborted by AbortReq.`, the bootstrap counter +1 on every rank.

    sglang/srt/managers/scheduler.py:5743-5751, 5762-5767 @ 0.5.23;
    sglang/srt/disaggregation/prefill.py:1352-1378 @ 0.5.23; decode.py:1158-1177 @ 0.5.23.
    """
    # Prefill alone: decode never registers the room, so it waits in the bootstrap queue.
    rid = f"boot-{_room()}"
    before = await scrape(client, pd_stack.prefill_url)
    body = dual_body(pd_stack.bootstrap_port, _room(), rid, 4)
    p = asyncio.create_task(client.post(pd_stack.prefill_url + "/generate", json=body))

    async def queued(url: str, phase: str, wanted: str) -> bool:
        return any(
            r["rid"] == wanted and r["phase"] == phase for r in (await _rooms(client, url)).values()
        )

    await wait_until(lambda: queued(pd_stack.prefill_url, "bootstrap", rid))
    await _abort(client, pd_stack.prefill_url, rid)
    assert (await asyncio.wait_for(p, 10.0)).status_code == 500
    after = await scrape(client, pd_stack.prefill_url)
    assert by_label(after, BOOTSTRAP, "tp_rank") == {
        k: v + 1 for k, v in (by_label(before, BOOTSTRAP, "tp_rank") or {"0": 0, "1": 0}).items()
    }
    log = pd_stack.log_text("prefill")
    assert f"Prefill bootstrap failed for request rank=1 req.rid={rid!r}" in log

    # Decode has one slot: a stuck transfer holds it, the next request waits in prealloc.
    holder = f"holder-{_room()}"
    hp, hd = await _stuck_transfer(pd_stack, client, holder)
    waiter = f"prealloc-{_room()}"
    before = await scrape(client, pd_stack.decode_url)
    body = dual_body(pd_stack.bootstrap_port, _room(), waiter, 4)
    d = asyncio.create_task(client.post(pd_stack.decode_url + "/generate", json=body))
    await wait_until(lambda: queued(pd_stack.decode_url, "prealloc", waiter))
    await _abort(client, pd_stack.decode_url, waiter)
    assert (await asyncio.wait_for(d, 10.0)).status_code == 500
    after = await scrape(client, pd_stack.decode_url)
    assert max(by_label(after, BOOTSTRAP, "tp_rank").values()) == 1 + max(
        by_label(before, BOOTSTRAP, "tp_rank").values(), default=0.0
    )
    log = pd_stack.log_text("decode")
    assert f"Decode handshake failed for request rank=0 decode_req.req.rid={waiter!r}" in log
    pd_stack.clear_faults("prefill")
    pd_stack.release_stuck("prefill")
    await asyncio.gather(hp, hd, return_exceptions=True)


async def test_client_disconnect_aborts_like_abort_request(
    pd_stack: PDStack, client: httpx.AsyncClient
) -> None:
    """A client that drops its stream aborts the request the same way (a counted failure).

    sglang/srt/entrypoints/http_server.py:977-981 @ 0.5.23 (the response's background abort task);
    sglang/srt/managers/tokenizer_manager.py:1959-1975 @ 0.5.23 (non-streamed: every 4 s).
    """
    rid = f"gone-{_room()}"
    before = await scrape(client, pd_stack.decode_url)
    pd_stack.set_fault("prefill", "transfer_stall")
    body = dual_body(pd_stack.bootstrap_port, _room(), rid, 4, stream=True)
    p = asyncio.create_task(client.post(pd_stack.prefill_url + "/generate", json=body))
    async with (
        httpx.AsyncClient(timeout=30.0) as other,
        other.stream("POST", pd_stack.decode_url + "/generate", json=body) as resp,
    ):
        assert resp.status_code == 200  # /generate sends its headers before any token

        async def stuck() -> bool:
            rooms = await _rooms(client, pd_stack.prefill_url)
            return any(r["rid"] == rid and r["stuck"] for r in rooms.values())

        await wait_until(stuck)
    # The stream is closed: decode aborts the request.

    async def failed() -> bool:
        text = await scrape(client, pd_stack.decode_url)
        return max(by_label(text, TRANSFER, "tp_rank").values(), default=0.0) > max(
            by_label(before, TRANSFER, "tp_rank").values(), default=0.0
        )

    await wait_until(failed)
    assert "Aborted by AbortReq." in pd_stack.log_text("decode")
    assert rid in (await sim_state(client, pd_stack.decode_url))["aborted_rids"]
    await asyncio.gather(p, return_exceptions=True)
