"""The multi-round probe: one N-round conversation through the router, its context growing.

Each round appends the previous answer, like the agentic tool loops that wedged the production
deployment on long multi-round contexts.

Each round is a full completion exchange (same deadline, classification and abort as the completion
probe). The probe fails at the first failing round and says which.
"""

from __future__ import annotations

import time

import httpx

from watchdog.clock import Clock
from watchdog.config import GroupSection
from watchdog.model import ProbeFailure, ProbeKind, ProbeResult
from watchdog.observe.probes import new_request_id
from watchdog.observe.probes.completion import Message, request_body, stream_exchange


async def run_multiround_probe(
    client: httpx.AsyncClient,
    group: GroupSection,
    *,
    api_key: str | None,
    clock: Clock = time.time,
    rounds: int | None = None,
) -> ProbeResult:
    """`rounds` (default: multiround_rounds) growing-context rounds; one result for all of them.

    On success, ttft_seconds is the last round's (the longest context), tokens the sum over rounds.
    """
    probe = group.probe
    total_rounds = rounds if rounds is not None else probe.multiround_rounds
    if total_rounds < 1:
        raise ValueError(f"a multi-round probe needs at least one round, not {total_rounds}")
    conversation = new_request_id(group.name, "multiround")
    started_at = clock()
    started_mono = time.monotonic()
    chat = probe.path == "/v1/chat/completions"
    messages: list[Message] = []
    transcript = ""
    tokens = 0
    last: ProbeResult | None = None
    for index in range(1, total_rounds + 1):
        request_id = f"{conversation}-r{index}"
        question = f"{probe.prompt} (round {index} of {total_rounds})"
        if chat:
            messages.append({"role": "user", "content": question})
            body = request_body(probe, request_id, messages=messages)
        else:
            transcript += f"User: {question}\nAssistant:"
            body = request_body(probe, request_id, prompt=transcript)
        exchange = await stream_exchange(
            client,
            group,
            body,
            kind=ProbeKind.MULTIROUND,
            request_id=request_id,
            api_key=api_key,
            clock=clock,
        )
        last = exchange.result
        tokens += last.tokens
        if not last.ok:
            return ProbeResult(
                kind=ProbeKind.MULTIROUND,
                target="router",
                ok=False,
                reason=last.reason,
                started_at=started_at,
                duration_seconds=time.monotonic() - started_mono,
                ttft_seconds=last.ttft_seconds,
                tokens=tokens,
                status_code=last.status_code,
                error_code=last.error_code,
                request_id=request_id,
                detail=f"round {index}/{total_rounds}: {last.detail}",
                abort_sent=last.abort_sent,
            )
        if chat:
            messages.append({"role": "assistant", "content": exchange.text})
        else:
            transcript += f" {exchange.text}\n"
    context_chars = sum(len(m["content"]) for m in messages) if chat else len(transcript)
    return ProbeResult(
        kind=ProbeKind.MULTIROUND,
        target="router",
        ok=True,
        reason=ProbeFailure.OK,
        started_at=started_at,
        duration_seconds=time.monotonic() - started_mono,
        ttft_seconds=last.ttft_seconds if last is not None else None,
        tokens=tokens,
        status_code=last.status_code if last is not None else None,
        request_id=conversation,
        detail=f"{total_rounds} rounds, final context {context_chars} chars",
    )
