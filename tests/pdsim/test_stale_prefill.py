"""A prefill restarted alone at the same address, per SGLang version (docs/sglang.md §7.11).

Decode caches each prefill's bootstrap metadata (its per-rank ports). Before 0.5.19 a send to
the replaced process fails and the entry stays, so every room through the pair fails until decode
restarts; from 0.5.19 the failed room drops the entry and the next room refetches /route.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

import httpx
import pytest

from pdsim.stack import REAL_SGLANG, PDStack
from tests.pdsim.helpers import dual_body, sim_state


def _start(factory: Callable[..., PDStack], version: str) -> PDStack:
    # A short bootstrap timeout: prefill's half of a room whose metadata went to the replaced
    # process waits for it (as SGLang does) and must not hold the test for 300 s.
    return factory(
        with_router=False,
        compat=REAL_SGLANG,
        sglang_version=version,
        prefill_args=("--bootstrap-timeout-s", "2"),
    )


async def _room(client: httpx.AsyncClient, stack: PDStack) -> int:
    """One room posted to both prefill and decode, as the router does; decode's status."""
    room = random.randrange(2**63)
    body = dual_body(stack.bootstrap_port, room, f"stale-{room}", 2)
    _, decode = await asyncio.gather(
        client.post(stack.prefill_url + "/generate", json=body),
        client.post(stack.decode_url + "/generate", json=body),
    )
    return decode.status_code


async def _restart_prefill_alone(client: httpx.AsyncClient, stack: PDStack) -> None:
    assert await _room(client, stack) == 200  # decode caches this prefill's metadata
    await stack.arestart("prefill")  # same address, new process; decode keeps running


@pytest.mark.parametrize("version", ["0.5.16"])
async def test_stale_prefill_fails_until_decode_restarts(
    pd_stack_factory: Callable[..., PDStack], version: str
) -> None:
    """Without the fix every room through the pair fails until decode restarts."""
    stack = _start(pd_stack_factory, version)
    async with httpx.AsyncClient(timeout=30.0) as client:
        await _restart_prefill_alone(client, stack)
        assert [await _room(client, stack) for _ in range(3)] == [500] * 3
        state = await sim_state(client, stack.decode_url)
        assert state["stale_prefill_failures"] == 3
        assert "send_metadata to prefill" in stack.log_text("decode")

        await stack.arestart("decode")
        assert [await _room(client, stack) for _ in range(3)] == [200] * 3


@pytest.mark.parametrize("version", ["0.5.19"])
async def test_stale_prefill_recovers_after_one_failure(
    pd_stack_factory: Callable[..., PDStack], version: str
) -> None:
    """From 0.5.19 the first room fails, drops the cached entry, and the pair recovers alone."""
    stack = _start(pd_stack_factory, version)
    async with httpx.AsyncClient(timeout=30.0) as client:
        await _restart_prefill_alone(client, stack)
        assert await _room(client, stack) == 500
        assert [await _room(client, stack) for _ in range(3)] == [200] * 3
        state = await sim_state(client, stack.decode_url)
        assert state["stale_prefill_failures"] == 1
        prefill = await sim_state(client, stack.prefill_url)
        assert list(state["prefill_pool"].values()) == [prefill["session_id"]]
