"""Each run-time fault shows the symptoms that the real SGLang failure shows (see README.md)."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from pdsim.faults import FaultError, parse_fault
from pdsim.stack import PDStack, StackConfig
from tests.pdsim.fixtures import real_config
from tests.pdsim.helpers import (
    by_label,
    completion_body,
    disagg,
    parse_samples,
    scrape,
    sim_state,
    total,
    values,
    wait_until,
)


@pytest.fixture(scope="module")
def pdsim_config() -> StackConfig:
    """TP 2 to see per-rank counters; a long decode log interval so no report unfreezes gauges."""
    return real_config(
        tp_size=2,
        prefill_args=("--seed", "1"),
        decode_args=("--decode-log-interval", "100000"),
    )


async def _has_data(lines: list[str]) -> bool:
    return any(line.startswith("data: ") for line in lines)


def _active(text: str, endpoint: str = "/generate") -> float:
    return sum(values(text, "sglang:http_requests_active", endpoint=endpoint, method="POST"))


async def test_transfer_stall(pd_stack: PDStack, client: httpx.AsyncClient) -> None:
    """All say 200, requests hang, gauges freeze; only /v1/loads and http_requests_active move."""
    pd_stack.set_fault("prefill", "transfer_stall")
    before = await scrape(client, pd_stack.decode_url)
    body = completion_body("/generate", max_tokens=4)
    first = asyncio.create_task(client.post(pd_stack.router_url + "/generate", json=body))

    async def live_is(n: int) -> bool:
        p = await disagg(client, pd_stack.prefill_url)
        d = await disagg(client, pd_stack.decode_url)
        return bool(p["prefill_inflight_queue_reqs"] == n and d["decode_transfer_queue_reqs"] == n)

    await wait_until(lambda: live_is(1))
    active_one = _active(await scrape(client, pd_stack.decode_url))
    second = asyncio.create_task(client.post(pd_stack.router_url + "/generate", json=body))
    await wait_until(lambda: live_is(2))
    await asyncio.sleep(0.3)
    mid = await scrape(client, pd_stack.decode_url)
    assert _active(mid) == active_one + 1 >= 2
    for url, path in (
        (pd_stack.router_url, "/health"),
        (pd_stack.router_url, "/readiness"),
        (pd_stack.prefill_url, "/health"),
        (pd_stack.decode_url, "/health"),
    ):
        assert (await client.get(url + path)).status_code == 200, url + path
    assert not first.done()
    assert not second.done()
    # Scheduler gauges keep the last report (0), or are absent while decode has not reported
    # yet (verified on real 0.5.23), while the live queue holds 2 rooms.
    gauge = by_label(mid, "sglang:num_decode_transfer_queue_reqs", "tp_rank")
    assert gauge in ({}, {"0": 0.0, "1": 0.0}), gauge
    name = "sglang:num_requests_total"
    assert total(mid, name) == total(before, name)
    prefill_text = await scrape(client, pd_stack.prefill_url)
    assert max(values(prefill_text, "sglang:num_prefill_inflight_queue_reqs")) <= 2
    rooms = (await sim_state(client, pd_stack.prefill_url))["rooms"]
    assert sorted(r["stuck"] for r in rooms.values()) == ["transfer_stall", "transfer_stall"]

    pd_stack.clear_faults("prefill")
    assert pd_stack.release_stuck("prefill") == 2
    results = await asyncio.gather(first, second)
    assert [r.status_code for r in results] == [200, 200]


async def test_pinned_request(pd_stack: PDStack, client: httpx.AsyncClient) -> None:
    """One request never leaves the inflight queue, survives an abort, while others flow."""
    pd_stack.set_fault("prefill", "pinned_request", count=1)
    body = completion_body("/v1/completions", max_tokens=3)
    pinned = asyncio.create_task(client.post(pd_stack.router_url + "/v1/completions", json=body))

    async def has_pinned() -> bool:
        rooms = (await sim_state(client, pd_stack.prefill_url))["rooms"]
        return any(r["stuck"] == "pinned_request" for r in rooms.values())

    await wait_until(has_pinned)
    others = await asyncio.gather(
        *(client.post(pd_stack.router_url + "/v1/completions", json=body) for _ in range(3))
    )
    assert [r.status_code for r in others] == [200, 200, 200]

    async def only_pinned_left() -> bool:
        p = await disagg(client, pd_stack.prefill_url)
        d = await disagg(client, pd_stack.decode_url)
        # /v1/loads is a snapshot republished every 50 ms: poll, do not read once.
        return bool(p["prefill_inflight_queue_reqs"] == 1 and d["decode_transfer_queue_reqs"] == 1)

    await wait_until(only_pinned_left)
    [room] = (await sim_state(client, pd_stack.prefill_url))["rooms"].values()
    await client.post(pd_stack.prefill_url + "/abort_request", json={"rid": room["rid"]})
    await asyncio.sleep(0.1)
    assert (await disagg(client, pd_stack.prefill_url))["prefill_inflight_queue_reqs"] == 1
    assert not pinned.done()
    pd_stack.clear_faults("prefill")
    pd_stack.release_stuck("prefill")
    assert (await pinned).status_code == 200


async def test_degraded_bootstrap_counts_on_every_rank_and_both_sides(
    pd_stack: PDStack, client: httpx.AsyncClient
) -> None:
    """Failed transfers add 1 per request on every TP rank, on prefill and decode, and abort."""
    name = "sglang:num_transfer_failed_reqs_total"
    before_p = by_label(await scrape(client, pd_stack.prefill_url), name, "tp_rank")
    before_d = by_label(await scrape(client, pd_stack.decode_url), name, "tp_rank")
    pd_stack.set_fault("prefill", "degraded_bootstrap", fraction=1.0)
    resp = await client.post(
        pd_stack.router_url + "/generate", json=completion_body("/generate", max_tokens=2)
    )
    assert resp.status_code >= 500
    after_p = by_label(await scrape(client, pd_stack.prefill_url), name, "tp_rank")
    after_d = by_label(await scrape(client, pd_stack.decode_url), name, "tp_rank")
    failed = after_p["0"] - before_p.get("0", 0.0)
    assert failed >= 1
    assert after_p["1"] - before_p.get("1", 0.0) == failed
    assert after_d["0"] - before_d.get("0", 0.0) == failed
    assert after_d["1"] - before_d.get("1", 0.0) == failed
    assert "Prefill transfer failed for request rank=1 " in pd_stack.log_text("prefill")
    assert "Decode transfer failed for request rank=0 " in pd_stack.log_text("decode")
    # A failed transfer reaches a direct caller as SGLang's abort with status 500.
    room = random.randrange(2**63)
    legs = [
        client.post(
            url + "/generate",
            json={
                **completion_body("/generate", max_tokens=2),
                "rid": f"direct-{room}",
                "bootstrap_host": "127.0.0.1",
                "bootstrap_port": pd_stack.bootstrap_port,
                "bootstrap_room": room,
            },
        )
        for url in (pd_stack.prefill_url, pd_stack.decode_url)
    ]
    prefill_resp, decode_resp = await asyncio.gather(*legs)
    assert prefill_resp.status_code == decode_resp.status_code == 500
    assert "Failed to send kv chunk" in prefill_resp.json()["detail"]
    assert "Failed to get kvcache from prefill instance" in decode_resp.json()["detail"]
    pd_stack.clear_faults("prefill")
    resp = await client.post(
        pd_stack.router_url + "/generate", json=completion_body("/generate", max_tokens=2)
    )
    assert resp.status_code == 200


async def test_decode_stall_midstream(pd_stack: PDStack, client: httpx.AsyncClient) -> None:
    """HTTP 200, part of the stream, then silence; decode /health stays 200."""
    pd_stack.set_fault("decode", "decode_stall_midstream", after_tokens=2)
    body = completion_body("/v1/chat/completions", max_tokens=8, stream=True)
    async with client.stream("POST", pd_stack.router_url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        got: list[str] = []

        async def read() -> None:
            async for line in r.aiter_lines():
                got.append(line)

        reader = asyncio.create_task(read())
        await wait_until(lambda: _has_data(got))
        await asyncio.sleep(0.5)  # 100 decode steps' worth of silence
        data = [line for line in got if line.startswith("data: ")]
        assert 1 <= len(data) < 8
        assert "data: [DONE]" not in data
        assert (await client.get(pd_stack.decode_url + "/health")).status_code == 200
        assert (await sim_state(client, pd_stack.decode_url))["queues"]["running"] == 1
        pd_stack.clear_faults("decode")
        await asyncio.wait_for(reader, timeout=5.0)
        assert "data: [DONE]" in got


async def test_decode_hang_before_headers(pd_stack: PDStack, client: httpx.AsyncClient) -> None:
    """Decode accepts generation requests and never sends headers; /health stays 200."""
    pd_stack.set_fault("decode", "decode_hang_before_headers")
    body = completion_body("/generate", max_tokens=2)
    with pytest.raises(httpx.ReadTimeout):
        await client.post(pd_stack.router_url + "/generate", json=body, timeout=1.0)
    assert (await client.get(pd_stack.decode_url + "/health")).status_code == 200
    assert (await client.get(pd_stack.router_url + "/readiness")).status_code == 200
    assert _active(await scrape(client, pd_stack.decode_url)) >= 1
    pd_stack.clear_faults("decode")

    async def drained() -> bool:
        return _active(await scrape(client, pd_stack.decode_url)) == 0

    await wait_until(drained)


async def test_health_hang(pd_stack: PDStack, client: httpx.AsyncClient) -> None:
    """/health never answers; the router marks decode unhealthy and /readiness turns 503."""
    pd_stack.set_fault("decode", "health_hang")
    with pytest.raises(httpx.ReadTimeout):
        await client.get(pd_stack.decode_url + "/health", timeout=0.5)

    async def readiness(code: int) -> bool:
        return (await client.get(pd_stack.router_url + "/readiness")).status_code == code

    await wait_until(lambda: readiness(503), timeout_s=8.0)
    pd_stack.clear_faults("decode")
    await wait_until(lambda: readiness(200), timeout_s=8.0)


async def test_metrics_garbage(pd_stack: PDStack, client: httpx.AsyncClient) -> None:
    """/metrics answers 200 with an exposition prometheus_client cannot parse."""
    pd_stack.set_fault("prefill", "metrics_garbage")
    resp = await client.get(pd_stack.prefill_url + "/metrics")
    assert resp.status_code == 200
    with pytest.raises(ValueError, match=r"could not convert|Invalid"):
        parse_samples(resp.text)
    pd_stack.clear_faults("prefill", "metrics_garbage")
    assert parse_samples(await scrape(client, pd_stack.prefill_url))


async def test_fault_api(pd_stack: PDStack, client: httpx.AsyncClient) -> None:
    """The control API validates faults strictly and lists, sets and clears them."""
    url = pd_stack.decode_url + "/_sim/fault"
    bad = await client.post(url, json={"kind": "nope"})
    assert bad.status_code == 400
    assert "unknown fault kind" in bad.json()["error"]
    bad = await client.post(url, json={"kind": "pinned_request", "cuont": 1})
    assert bad.status_code == 400
    ok = await client.post(
        url, json=[{"kind": "pinned_request", "count": 2}, {"kind": "metrics_garbage"}]
    )
    assert ok.status_code == 200
    kinds = {f["kind"] for f in (await client.get(url)).json()["faults"]}
    assert kinds == {"pinned_request", "metrics_garbage"}
    cleared = (await client.delete(url + "/metrics_garbage")).json()
    assert cleared["cleared"] == ["metrics_garbage"]
    assert [f["kind"] for f in cleared["faults"]] == ["pinned_request"]
    assert (await client.delete(url)).json()["faults"] == []


async def test_slow_decode_serves_at_its_rate(pd_stack: PDStack, client: httpx.AsyncClient) -> None:
    """Every running request gets tokens_per_s tokens a second: slow, but serving."""
    pd_stack.set_fault("decode", "slow_decode", tokens_per_s=5.0)
    try:
        started = asyncio.get_running_loop().time()
        resp = await client.post(
            pd_stack.router_url + "/generate", json=completion_body("/generate", max_tokens=6)
        )
        took = asyncio.get_running_loop().time() - started
        assert resp.status_code == 200
        assert resp.json()["meta_info"]["completion_tokens"] == 6
        # Five decode steps of 0.2 s after the first token: a busy machine only makes it longer.
        assert took >= 0.9
        assert (await client.get(pd_stack.decode_url + "/health")).status_code == 200
    finally:
        pd_stack.clear_faults("decode")


async def test_loads_absent_answers_404_until_cleared(
    pd_stack: PDStack, client: httpx.AsyncClient
) -> None:
    """The loads_absent fault makes /v1/loads answer 404 until it is cleared."""
    pd_stack.set_fault("decode", "loads_absent")
    assert (await client.get(pd_stack.decode_url + "/v1/loads")).status_code == 404
    pd_stack.clear_faults("decode", "loads_absent")
    assert (await client.get(pd_stack.decode_url + "/v1/loads")).status_code == 200


@pytest.mark.parametrize("rate", [0.0, -1.0, float("inf")])
def test_slow_decode_needs_a_positive_rate(rate: float) -> None:
    """A slow_decode fault without a positive token rate is refused, since it would never finish."""
    with pytest.raises(FaultError, match="tokens_per_s"):
        parse_fault({"kind": "slow_decode", "tokens_per_s": rate})
