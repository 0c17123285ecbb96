"""Streamed PD failures as real SGLang 0.5.23 sends them: HTTP 200 with an error event; headers
before any token on /generate, held until the first chunk on the OpenAI endpoints; non-streamed
failures are HTTP 500 (docs/sglang.md §7.7)."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import httpx
import pytest

from pdsim.stack import PDStack, StackConfig
from tests.pdsim.fixtures import real_config
from tests.pdsim.helpers import PROMPT, dual_body, sse_payloads


@pytest.fixture(scope="module")
def pdsim_config() -> StackConfig:
    """The stacks of this module run with real SGLang 0.5.23's semantics."""
    return real_config()


def _pd_body(stack: PDStack, endpoint: str, stream: bool) -> dict[str, Any]:
    room = random.randrange(2**62)
    if endpoint == "/generate":
        return dual_body(stack.bootstrap_port, room, f"s-{room}", 4, stream=stream)
    pd = {
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": stack.bootstrap_port,
        "bootstrap_room": room,
        "rid": f"s-{room}",
    }
    return {
        "model": "default",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 4,
        "stream": stream,
        **pd,
    }


async def _dual(
    stack: PDStack, client: httpx.AsyncClient, endpoint: str, stream: bool
) -> httpx.Response:
    body = _pd_body(stack, endpoint, stream)
    _prefill, decode = await asyncio.gather(
        client.post(stack.prefill_url + endpoint, json=body),
        client.post(stack.decode_url + endpoint, json=body),
    )
    return decode


async def test_streamed_failure_is_200_with_an_error_event(
    pd_stack: PDStack, client: httpx.AsyncClient
) -> None:
    """A failed transfer: chat stream 200 + `data: {"error": ...}`, /generate stream 200 + an
    abort finish with status 500, non-streamed 500.

    sglang/srt/entrypoints/openai/serving_chat.py:2564-2580 @ 0.5.23;
    sglang/srt/entrypoints/http_server.py:949-990 @ 0.5.23;
    sglang/srt/managers/tokenizer_manager.py:1916-1921 @ 0.5.23.
    """
    pd_stack.set_fault("prefill", "degraded_bootstrap", fraction=1.0)
    chat = await _dual(pd_stack, client, "/v1/chat/completions", True)
    assert chat.status_code == 200
    assert chat.text.rstrip().endswith("data: [DONE]")
    [event] = sse_payloads(chat.text)
    assert event["error"]["code"] == 500
    assert event["error"]["type"] == "INTERNAL_SERVER_ERROR"

    gen = await _dual(pd_stack, client, "/generate", True)
    assert gen.status_code == 200
    [chunk] = sse_payloads(gen.text)
    reason = chunk["meta_info"]["finish_reason"]
    assert reason["type"] == "abort"
    assert reason["status_code"] == 500

    for endpoint in ("/generate", "/v1/chat/completions"):
        whole = await _dual(pd_stack, client, endpoint, False)
        assert whole.status_code == 500


async def test_headers_before_tokens_on_generate_only(
    pd_stack: PDStack, client: httpx.AsyncClient
) -> None:
    """While the KV never arrives, a /generate stream has its 200 headers and an OpenAI stream
    has none.

    sglang/srt/entrypoints/http_server.py:977-981 @ 0.5.23 (StreamingResponse at once);
    sglang/srt/entrypoints/openai/serving_chat.py:2422-2439 @ 0.5.23 (first chunk pulled first).
    """
    pd_stack.set_fault("prefill", "transfer_stall")
    tasks = []
    try:
        for endpoint, headers_expected in (("/generate", True), ("/v1/chat/completions", False)):
            body = _pd_body(pd_stack, endpoint, True)
            tasks.append(
                asyncio.create_task(client.post(pd_stack.prefill_url + endpoint, json=body))
            )
            req = client.build_request("POST", pd_stack.decode_url + endpoint, json=body)
            send = asyncio.create_task(client.send(req, stream=True))
            done, _ = await asyncio.wait({send}, timeout=1.5)
            assert bool(done) == headers_expected, endpoint
            if done:
                resp = send.result()
                assert resp.status_code == 200
                await resp.aclose()
            else:
                send.cancel()
                await asyncio.gather(send, return_exceptions=True)
    finally:
        pd_stack.clear_faults("prefill")
        pd_stack.release_stuck("prefill")
        await asyncio.gather(*tasks, return_exceptions=True)
