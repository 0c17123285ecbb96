"""Metric names, labels, log wording and endpoints per imitated SGLang version."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import pytest

from pdsim.stack import WorkerProcess
from tests.pdsim.helpers import by_label, family_types, parse_samples


@dataclass(frozen=True)
class Expected:
    """What one SGLang version looks like from outside."""

    bootstrap: str
    inflight: str
    unified: bool
    realtime: bool
    loads: int
    prefill_line: tuple[str, ...]
    decode_line: tuple[str, ...]


EXPECTED = {
    "0.5.23": Expected(
        bootstrap="sglang:num_prefill_bootstrap_queue_reqs",
        inflight="sglang:num_prefill_inflight_queue_reqs",
        unified=False,
        realtime=True,
        loads=200,
        prefill_line=("Prefill batch, #new-seq: ", "#bootstrap-req: ", "#inflight-req: "),
        decode_line=("Decode batch, #running-req: ", "#transfer-req: "),
    ),
    "0.5.5": Expected(
        bootstrap="sglang:num_prefill_prealloc_queue_reqs",
        inflight="sglang:num_prefill_inflight_queue_reqs",
        unified=True,
        realtime=False,
        loads=404,
        prefill_line=("Prefill batch, #new-seq: ", "#prealloc-req: ", "#inflight-req: "),
        decode_line=("Decode batch, #running-req: ", "#transfer-req: "),
    ),
    "0.4.10": Expected(
        bootstrap="sglang:num_prefill_prealloc_queue_reqs",
        inflight="sglang:num_prefill_infight_queue_reqs",
        unified=True,
        realtime=False,
        loads=404,
        prefill_line=("Prefill batch. #new-seq: ", "#unbootstrapped-req: ", "#transferring-req: "),
        decode_line=("Decode batch. #running-req: ",),
    ),
}


@pytest.mark.parametrize("version", list(EXPECTED))
async def test_version_naming(
    pd_worker_factory: Callable[..., WorkerProcess], version: str
) -> None:
    """A direct PD request, then each version's names, labels, /v1/loads and log wording."""
    expected = EXPECTED[version]
    args = ("--decode-log-interval", "10")
    prefill = pd_worker_factory("prefill", sglang_version=version, tp_size=2, extra=args)
    decode = pd_worker_factory("decode", sglang_version=version, tp_size=2, extra=args)
    room = random.randrange(2**63)
    body = {
        "text": "Reply with the word ok.",
        "sampling_params": {"max_new_tokens": 12},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": prefill.bootstrap_port,
        "bootstrap_room": room,
    }
    async with httpx.AsyncClient(timeout=10.0) as client:
        p, d = await asyncio.gather(
            client.post(prefill.url + "/generate", json=body),
            client.post(decode.url + "/generate", json=body),
        )
        assert p.status_code == d.status_code == 200
        assert "ok" in d.json()["text"]
        prefill_text = (await client.get(prefill.url + "/metrics")).text
        decode_text = (await client.get(decode.url + "/metrics")).text
        loads_status = (await client.get(prefill.url + "/v1/loads?include=disagg")).status_code
    types = family_types(prefill_text)
    assert types[expected.bootstrap] == "gauge"
    assert types[expected.inflight] == "gauge"
    assert by_label(prefill_text, expected.inflight, "tp_rank") == {"0": 0.0, "1": 0.0}
    engine_types = {
        lab["engine_type"]
        for n, lab, _ in parse_samples(decode_text)
        if n == "sglang:num_running_reqs"
    }
    assert engine_types == {"unified" if expected.unified else "decode"}
    assert ("sglang:realtime_tokens_total" in decode_text) is expected.realtime
    assert loads_status == expected.loads
    assert "model_path" not in prefill_text
    for fragment in expected.prefill_line:
        assert fragment in prefill.log_text(), fragment
    for fragment in expected.decode_line:
        assert fragment in decode.log_text(), fragment
