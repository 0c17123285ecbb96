"""Requests flow client -> real sglang-router -> simulated prefill + decode -> client."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from pdsim.stack import PDStack
from tests.pdsim.helpers import (
    completion_body,
    disagg,
    family_types,
    loads,
    parse_samples,
    scrape,
    sim_state,
    sse_payloads,
    stream_text,
    text_of,
    total,
    values,
    wait_until,
)

ENDPOINTS = ("/generate", "/v1/completions", "/v1/chat/completions")


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client with a timeout above the slowest answer the flow tests wait for."""
    async with httpx.AsyncClient(timeout=10.0) as c:
        yield c


def dual_body(
    stack: PDStack, room: int, rid: str, max_tokens: int, stream: bool = False
) -> dict[str, Any]:
    """A /generate body with the bootstrap fields the router adds, to reach a worker directly."""
    return {
        "text": "Reply with the word ok.",
        "sampling_params": {"max_new_tokens": max_tokens},
        "rid": rid,
        "stream": stream,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": stack.bootstrap_port,
        "bootstrap_room": room,
    }


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("endpoint", ENDPOINTS)
async def test_endpoint_through_router(
    pd_stack: PDStack, client: httpx.AsyncClient, endpoint: str, stream: bool
) -> None:
    """Each endpoint answers through the router, streamed and not, with text containing "ok"."""
    resp = await client.post(
        pd_stack.router_url + endpoint, json=completion_body(endpoint, max_tokens=4, stream=stream)
    )
    assert resp.status_code == 200, resp.text
    if stream:
        assert resp.headers["content-type"].startswith("text/event-stream")
        assert resp.text.rstrip().endswith("data: [DONE]")
        payloads = sse_payloads(resp.text)
        assert len(payloads) >= 4
        assert "ok" in stream_text(endpoint, payloads)
    else:
        body = resp.json()
        assert "ok" in text_of(endpoint, body)
        if endpoint == "/generate":
            assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
            assert body["meta_info"]["completion_tokens"] == 4
        else:
            assert body["choices"][0]["finish_reason"] == "length"
            assert body["usage"]["completion_tokens"] == 4


async def test_completion_counters_advance(pd_stack: PDStack, client: httpx.AsyncClient) -> None:
    """num_requests_total and generation_tokens_total advance on both workers at request finish."""
    before_d = await scrape(client, pd_stack.decode_url)
    before_p = await scrape(client, pd_stack.prefill_url)
    for _ in range(3):
        resp = await client.post(
            pd_stack.router_url + "/v1/completions",
            json=completion_body("/v1/completions", max_tokens=5),
        )
        assert resp.status_code == 200
    after_d = await scrape(client, pd_stack.decode_url)
    after_p = await scrape(client, pd_stack.prefill_url)
    name = "sglang:num_requests_total"
    assert total(after_d, name) - total(before_d, name) == 3
    assert total(after_p, name) - total(before_p, name) == 3
    gen = "sglang:generation_tokens_total"
    assert total(after_d, gen) - total(before_d, gen) == 15
    assert total(after_p, gen) - total(before_p, gen) == 3  # prefill computes the first token
    rt = "sglang:realtime_tokens_total"
    assert total(after_d, rt, mode="decode") - total(before_d, rt, mode="decode") >= 15
    # Router metrics on its own listener.
    router_metrics = (await client.get(pd_stack.router_metrics_url)).text
    assert "smg_" in router_metrics


async def test_metric_types_and_labels(pd_stack: PDStack, client: httpx.AsyncClient) -> None:
    """SGLang's names, types and labels; failure counters absent until the first failure."""
    text = await scrape(client, pd_stack.decode_url)
    types = family_types(text)
    # Decode's scheduler gauges exist only from its first stats report (every 40 decode steps);
    # prefill's batches report them (real 0.5.23 lists decode's queue gauges there too).
    prefill_text = await scrape(client, pd_stack.prefill_url)
    prefill_types = family_types(prefill_text)
    assert prefill_types["sglang:num_running_reqs"] == "gauge"
    assert prefill_types["sglang:num_decode_transfer_queue_reqs"] == "gauge"
    assert types["sglang:num_requests"] == "counter"
    assert types["sglang:realtime_tokens"] == "counter"
    assert types["sglang:http_requests_active"] == "gauge"
    assert prefill_types["sglang:kv_transfer_latency_ms"] == "histogram"
    assert "sglang:num_transfer_failed_reqs_total" not in text
    assert "sglang:num_bootstrap_failed_reqs_total" not in text
    assert "_created" not in text
    [labels] = [lab for n, lab, _ in parse_samples(prefill_text) if n == "sglang:num_running_reqs"]
    assert labels == {
        "model_name": "pdsim",
        "engine_type": "prefill",
        "tp_rank": "0",
        "pp_rank": "0",
        "moe_ep_rank": "0",
    }
    assert values(text, "sglang:http_requests_active", endpoint="/metrics", method="GET") == [1.0]


async def test_info_endpoints_hide_model_paths(
    pd_stack: PDStack, client: httpx.AsyncClient
) -> None:
    """/server_info and /model_info never carry model_path or tokenizer_path."""
    for url in (pd_stack.prefill_url, pd_stack.decode_url):
        for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
            resp = await client.get(url + path)
            assert resp.status_code == 200
            body = resp.json()
            assert "model_path" not in body
            assert "tokenizer_path" not in body
    info = (await client.get(pd_stack.prefill_url + "/server_info")).json()
    assert info["disaggregation_mode"] == "prefill"
    assert info["disaggregation_bootstrap_port"] == pd_stack.bootstrap_port
    boot = await client.get(f"http://127.0.0.1:{pd_stack.bootstrap_port}/health")
    assert boot.text == "OK"


async def test_direct_dual_post_and_abort(pd_stack: PDStack, client: httpx.AsyncClient) -> None:
    """A direct prefill+decode probe with one room works; abort_request ends a long generation."""
    room = random.randrange(2**63)
    rid = f"probe-{room}"
    p, d = await asyncio.gather(
        client.post(pd_stack.prefill_url + "/generate", json=dual_body(pd_stack, room, rid, 3)),
        client.post(pd_stack.decode_url + "/generate", json=dual_body(pd_stack, room, rid, 3)),
    )
    assert p.status_code == d.status_code == 200
    assert d.json()["text"] == "ok ok ok"

    room = random.randrange(2**63)
    rid = f"long-{room}"
    before = await scrape(client, pd_stack.decode_url)
    legs = [
        asyncio.create_task(
            client.post(url + "/generate", json=dual_body(pd_stack, room, rid, 100000))
        )
        for url in (pd_stack.prefill_url, pd_stack.decode_url)
    ]

    async def running() -> bool:
        return bool((await sim_state(client, pd_stack.decode_url))["queues"]["running"] >= 1)

    await wait_until(running)
    # While tokens advance, the request stays in flight.
    live = await scrape(client, pd_stack.decode_url)
    assert values(live, "sglang:http_requests_active", endpoint="/generate", method="POST")[0] >= 1
    t1 = total(live, "sglang:realtime_tokens_total", mode="decode")
    await asyncio.sleep(0.2)
    t2 = total(
        await scrape(client, pd_stack.decode_url), "sglang:realtime_tokens_total", mode="decode"
    )
    assert t2 > t1
    for url in (pd_stack.prefill_url, pd_stack.decode_url):
        r = await client.post(url + "/abort_request", json={"rid": rid})
        assert r.status_code == 200
    p, d = await asyncio.gather(*legs)
    assert d.status_code == 200
    assert d.json()["meta_info"]["finish_reason"]["type"] == "abort"
    after = await scrape(client, pd_stack.decode_url)
    name = "sglang:num_aborted_requests_total"
    assert total(after, name) - total(before, name) == 1
    assert rid in (await sim_state(client, pd_stack.decode_url))["aborted_rids"]


async def test_saturation_queues_but_progresses(
    pd_stack: PDStack, client: httpx.AsyncClient
) -> None:
    """Beyond max-running, requests queue in decode prealloc yet all complete."""
    seen_queue = 0

    async def watch() -> None:
        nonlocal seen_queue
        while True:
            section = await disagg(client, pd_stack.decode_url)
            seen_queue = max(seen_queue, section["decode_prealloc_queue_reqs"])
            await asyncio.sleep(0.02)

    watcher = asyncio.create_task(watch())
    started = time.monotonic()
    try:
        results = await asyncio.gather(
            *(
                client.post(
                    pd_stack.router_url + "/generate",
                    json=completion_body("/generate", max_tokens=80),
                )
                for _ in range(32)
            )
        )
    finally:
        watcher.cancel()
    elapsed = time.monotonic() - started
    assert all(r.status_code == 200 for r in results)
    assert seen_queue > 0
    assert elapsed >= 0.75  # two waves of 80 tokens at 200 tokens/s


async def test_batch_log_lines_and_loads(pd_stack: PDStack, client: httpx.AsyncClient) -> None:
    """Workers print SGLang's batch lines; /v1/loads has the live queues and a moving timestamp."""
    resp = await client.post(
        pd_stack.router_url + "/generate", json=completion_body("/generate", max_tokens=45)
    )
    assert resp.status_code == 200
    decode_log = pd_stack.log_text("decode")
    prefill_log = pd_stack.log_text("prefill")
    assert "] Decode batch, #running-req: " in decode_log
    assert "#transfer-req: " in decode_log
    assert "gen throughput (token/s): " in decode_log
    assert "] Prefill batch, #new-seq: " in prefill_log
    assert "#bootstrap-req: " in prefill_log
    assert "#inflight-req: " in prefill_log
    first = await loads(client, pd_stack.prefill_url)
    await asyncio.sleep(0.15)
    second = await loads(client, pd_stack.prefill_url)
    assert second["loads"][0]["timestamp"] > first["loads"][0]["timestamp"]
    assert second["loads"][0]["disaggregation"]["mode"] == "prefill"
    # An unknown section is a ValueError from LoadSnapshot.to_dict after the handler's try:
    # Starlette's plain 500 (sglang/srt/entrypoints/v1_loads.py:140-141 @ 0.5.23).
    assert (await client.get(pd_stack.prefill_url + "/v1/loads?include=bogus")).status_code == 500
