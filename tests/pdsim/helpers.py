"""Small client-side helpers for the pdsim tests: scrape and read metrics, post requests, poll."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

PROMPT = "Reply with the word ok."


def completion_body(endpoint: str, *, max_tokens: int = 4, stream: bool = False) -> dict[str, Any]:
    """A request body for one of the three completion endpoints, in that endpoint's own shape."""
    if endpoint == "/generate":
        return {"text": PROMPT, "sampling_params": {"max_new_tokens": max_tokens}, "stream": stream}
    if endpoint == "/v1/completions":
        return {"model": "default", "prompt": PROMPT, "max_tokens": max_tokens, "stream": stream}
    return {
        "model": "default",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


def parse_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """All samples of an exposition, parsed by prometheus_client (the oracle)."""
    return [
        (s.name, dict(s.labels), s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def family_types(text: str) -> dict[str, str]:
    """Each metric family's type in an exposition text, by family name."""
    return {f.name: f.type for f in text_string_to_metric_families(text)}


def values(text: str, name: str, **labels: str) -> list[float]:
    """The values of every sample of a metric whose labels match the ones given."""
    return [
        v
        for n, lab, v in parse_samples(text)
        if n == name and all(lab.get(k) == val for k, val in labels.items())
    ]


def total(text: str, name: str, **labels: str) -> float:
    """The sum of a metric's matching samples, 0.0 when there are none."""
    return sum(values(text, name, **labels))


def by_label(text: str, name: str, label: str) -> dict[str, float]:
    """A metric's sample values keyed by one of their labels."""
    return {lab[label]: v for n, lab, v in parse_samples(text) if n == name and label in lab}


async def scrape(client: httpx.AsyncClient, base_url: str) -> str:
    """A server's /metrics text, raising on any non-2xx answer."""
    resp = await client.get(base_url + "/metrics", timeout=5.0)
    resp.raise_for_status()
    return resp.text


async def loads(client: httpx.AsyncClient, base_url: str) -> dict[str, Any]:
    """A server's /v1/loads?include=disagg document, raising on any non-2xx answer."""
    resp = await client.get(base_url + "/v1/loads?include=disagg", timeout=5.0)
    resp.raise_for_status()
    result: dict[str, Any] = resp.json()
    return result


async def disagg(client: httpx.AsyncClient, base_url: str) -> dict[str, Any]:
    """The disaggregation section of the first /v1/loads row."""
    data = await loads(client, base_url)
    section: dict[str, Any] = data["loads"][0]["disaggregation"]
    return section


async def sim_state(client: httpx.AsyncClient, base_url: str) -> dict[str, Any]:
    """pdsim's internal /_sim/state, which the tests read to see what the simulator holds."""
    resp = await client.get(base_url + "/_sim/state", timeout=5.0)
    resp.raise_for_status()
    result: dict[str, Any] = resp.json()
    return result


async def wait_until(
    predicate: Callable[[], Awaitable[bool]], *, timeout_s: float = 5.0, interval_s: float = 0.05
) -> None:
    """Poll an async predicate until it holds, failing with an AssertionError past the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        if await predicate():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s}s")
        await asyncio.sleep(interval_s)


def sse_payloads(body: str) -> list[Any]:
    """The JSON payloads of an SSE body, without the final [DONE]."""
    out = []
    for line in body.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[len("data: ") :]))
    return out


def text_of(endpoint: str, payload: Mapping[str, Any]) -> str:
    """The generated text of a non-streamed answer, read from where its endpoint puts it."""
    if endpoint == "/generate":
        return str(payload["text"])
    choice = payload["choices"][0]
    if endpoint == "/v1/completions":
        return str(choice["text"])
    return str(choice["message"]["content"])


def stream_text(endpoint: str, payloads: list[Any]) -> str:
    """The text a stream of events carries, joined the way its endpoint spreads it over chunks."""
    if endpoint == "/generate":
        return str(payloads[-1]["text"]) if payloads else ""
    parts = []
    for p in payloads:
        for choice in p.get("choices", []):
            if endpoint == "/v1/completions":
                parts.append(choice.get("text") or "")
            else:
                parts.append((choice.get("delta") or {}).get("content") or "")
    return "".join(parts)


def dual_body(
    bootstrap_port: int, room: int, rid: str, max_tokens: int, *, stream: bool = False
) -> dict[str, Any]:
    """A /generate body for a direct post to both prefill and decode with one bootstrap room."""
    return {
        "text": PROMPT,
        "sampling_params": {"max_new_tokens": max_tokens},
        "rid": rid,
        "stream": stream,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": bootstrap_port,
        "bootstrap_room": room,
    }
