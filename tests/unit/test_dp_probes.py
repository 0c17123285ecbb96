"""Direct PD probes pinned to one DP rank of a decode: the field, the pairs and their cadence."""

from __future__ import annotations

import re
import tomllib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from tests.unit.test_direct_probe import group, two_fakes
from tests.unit.test_probe_scheduler import (
    FakeTime,
    Probes,
    run_until_parked,
    stop_scheduler,
)
from watchdog.config import GroupSection, parse_config
from watchdog.errors import ConfigError
from watchdog.model import ProbeFailure, ProbeKind, ProbeResult
from watchdog.observe.probes.direct import PinnedPair, pinned_pairs, run_direct_probe
from watchdog.observe.probes.scheduler import ProbeScheduler
from watchdog.pairs import Pair


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client that ignores proxy settings, since the fakes listen on 127.0.0.1."""
    async with httpx.AsyncClient(trust_env=False) as c:
        yield c


def _config(decodes: list[dict[str, Any]], **probe: object) -> GroupSection:
    data = {
        "group": [
            {
                "name": "g",
                "prefill": [
                    {"unit": "p1.service", "url": "http://127.0.0.1:1"},
                    {"unit": "p2.service", "url": "http://127.0.0.1:2"},
                ],
                "decode": decodes,
                "router": {"unit": "r.service", "url": "http://127.0.0.1:3"},
                "probe": {"period_seconds": 5.0, "multiround_every_seconds": 0, **probe},
            }
        ]
    }
    return parse_config(data, "<test>").group[0]


TWO_DECODES: list[dict[str, Any]] = [
    {"unit": "d1.service", "url": "http://127.0.0.1:4"},
    {"unit": "d2.service", "url": "http://127.0.0.1:5", "dp_size": 3},
]


def test_one_pinned_pair_per_rank_of_each_dp_decode_with_the_first_prefill() -> None:
    """Each DP rank of a decode with dp_size gets one pinned pair, with the first prefill."""
    assert pinned_pairs(_config(TWO_DECODES)) == tuple(
        PinnedPair(Pair(0, 1), rank) for rank in range(3)
    )


def test_no_pinned_pairs_without_dp() -> None:
    """Decodes without DP attention get no pinned pairs: there is no rank to pin."""
    assert pinned_pairs(_config([{"unit": "d.service", "url": "http://127.0.0.1:4"}])) == ()


@pytest.mark.parametrize("bad", [0, -1, 1025, 2.5, "four"])
def test_dp_size_is_strict(bad: object) -> None:
    """dp_size must be a whole number of ranks in range, or the config is refused."""
    decodes = [{"unit": "d.service", "url": "http://127.0.0.1:4", "dp_size": bad}]
    with pytest.raises((ConfigError, ValidationError)):
        _config(decodes)


def test_dp_rank_field_is_one_of_the_two_sglang_spellings() -> None:
    """dp_rank_field accepts only the two spellings SGLang honours, so a typo cannot pin nothing."""
    with pytest.raises((ConfigError, ValidationError)):
        _config(TWO_DECODES, dp_rank_field="dp_rank")
    assert _config(TWO_DECODES, dp_rank_field="data_parallel_rank").probe.dp_rank_field == (
        "data_parallel_rank"
    )


def test_dp_size_one_is_left_out_of_a_dump() -> None:
    """The default dp_size of 1 is left out of a dumped config, which stays as the user wrote it."""
    dumped = _config(TWO_DECODES).model_dump(by_alias=True)
    assert "dp_size" not in dumped["decode"][0]
    assert dumped["decode"][1]["dp_size"] == 3


@pytest.mark.parametrize("field", ["routed_dp_rank", "data_parallel_rank"])
async def test_the_decode_alone_gets_the_pinning_field(
    client: httpx.AsyncClient, field: str
) -> None:
    """Only decode's copy of the body carries the pinning field; prefill's is the plain one."""
    async with two_fakes() as (prefill, decode):
        config = group(prefill.base_url, decode.base_url)
        config = config.model_copy(
            update={"probe": config.probe.model_copy(update={"dp_rank_field": field})}
        )
        result = await run_direct_probe(client, config, Pair(0, 0), api_key=None, dp_rank=2)
        (to_prefill,) = prefill.requests_to("/generate")
        (to_decode,) = decode.requests_to("/generate")
    assert result.ok, result.detail
    assert result.dp_rank == 2
    assert to_decode.body[field] == 2
    assert {"routed_dp_rank", "data_parallel_rank"} - {field} - set(to_decode.body) == {
        "routed_dp_rank",
        "data_parallel_rank",
    } - {field}
    assert to_decode.body == {**to_prefill.body, field: 2}


class PinnedDirect:
    """A direct probe function that records the (pair, dp_rank) it was asked for."""

    def __init__(self) -> None:
        self.calls: list[tuple[Pair, int | None]] = []

    async def __call__(
        self,
        client: httpx.AsyncClient,
        group: GroupSection,
        pair: Pair,
        *,
        api_key: str | None,
        clock: object,
        dp_rank: int | None = None,
    ) -> ProbeResult:
        self.calls.append((pair, dp_rank))
        assert callable(clock)
        return ProbeResult(
            kind=ProbeKind.DIRECT,
            target="decode",
            ok=True,
            reason=ProbeFailure.OK,
            started_at=float(clock()),
            duration_seconds=0.0,
            worker=pair.decode,
            peer=pair.prefill,
            dp_rank=dp_rank,
        )


async def _run(
    client: httpx.AsyncClient, *, ok: bool, limit: float, **probe: object
) -> list[tuple[Pair, int | None]]:
    time = FakeTime(limit=1000.0 + limit)
    probes = Probes(block=False)
    probes.ok = ok
    direct = PinnedDirect()
    scheduler = ProbeScheduler(
        _config(TWO_DECODES, **probe),
        client,
        api_key=None,
        clock=time.clock,
        sleep=time.sleep,
        completion_probe=probes.completion,
        multiround_probe=probes.multiround,
        direct_probe=direct,
        pinned_probe=direct,
    )
    await stop_scheduler(await run_until_parked(scheduler, time))
    return direct.calls


async def test_a_pinned_round_every_dp_probe_every_seconds(client: httpx.AsyncClient) -> None:
    """While all is well pinned rounds run every dp_probe_every_seconds, and no unpinned probe."""
    calls = await _run(client, ok=True, limit=125, dp_probe_every_seconds=60)
    # Two rounds of the three ranks of decode#2; no unpinned direct probe while all is well.
    assert calls == [(Pair(0, 1), rank) for rank in range(3)] * 2


async def test_dp_probes_can_be_turned_off(client: httpx.AsyncClient) -> None:
    """dp_probe_every_seconds = 0 turns the periodic pinned rounds off."""
    assert await _run(client, ok=True, limit=125, dp_probe_every_seconds=0) == []


async def test_pinned_rounds_also_run_while_router_probes_fail(client: httpx.AsyncClient) -> None:
    """While router probes fail, each direct round also pins every rank, on the same terms."""
    calls = await _run(client, ok=False, limit=30, dp_probe_every_seconds=0)
    pinned = [c for c in calls if c[1] is not None]
    unpinned = [c for c in calls if c[1] is None]
    assert 4 * 3 <= len(pinned) <= 7 * 3, calls
    assert len(unpinned) == len(pinned) // 3 * 4  # the four pairs' rounds, on the same terms


def test_the_2p2d_example_with_its_dp_lines_uncommented_is_valid() -> None:
    """The 2P2D example with its DP lines uncommented is valid, with a pinned pair per rank."""
    example = Path(__file__).parents[2] / "configs" / "example-2p2d.toml"
    text = re.sub(
        r"^# (dp_size = 8|\[group\.probe\]|dp_probe_every_seconds = 60|dp_rank_field = \S+)",
        r"\1",
        example.read_text(),
        flags=re.MULTILINE,
    )
    text = text.replace("dp_size = 8  (see decode #2)", "dp_size = 8")
    config = parse_config(tomllib.loads(text), "<example>").group[0]
    assert [d.dp_size for d in config.decodes] == [8, 8]
    assert len(pinned_pairs(config)) == 16
    assert config.probe.dp_rank_field == "routed_dp_rank"
