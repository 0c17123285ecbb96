"""pdsim's DP-attention ranks: the pinning field by version, round-robin, one rank's fault."""

from __future__ import annotations

import pytest

from pdsim.api import RequestError
from pdsim.dp import DpRouter, rank_fields
from pdsim.engine import DecodeEngine, EngineConfig, Req
from pdsim.faults import FaultError, FaultSet, parse_fault
from pdsim.loads import load_row
from pdsim.metrics import SimMetrics
from watchdog.model import Role
from watchdog.observe.sglang_metrics import extract_snapshot


@pytest.mark.parametrize(
    ("version", "fields"),
    [
        ("0.5.5", ("data_parallel_rank",)),
        ("0.5.9", ("data_parallel_rank",)),
        ("0.5.16", ("routed_dp_rank",)),
        ("0.5.19", ("routed_dp_rank", "data_parallel_rank")),
        ("0.5.23", ("routed_dp_rank", "data_parallel_rank")),
    ],
)
def test_the_pinning_field_of_each_version(version: str, fields: tuple[str, ...]) -> None:
    """Each SGLang version honours its own request field for pinning a request to a DP rank."""
    assert rank_fields(version) == fields


def test_unpinned_requests_go_round_robin_and_pinned_ones_to_their_rank() -> None:
    """Unpinned requests rotate over the ranks and pinned ones land on their rank."""
    dp = DpRouter(4, "0.5.23")
    assert [dp.route({}) for _ in range(5)] == [0, 1, 2, 3, 0]
    assert dp.route({"routed_dp_rank": 2}) == 2
    assert dp.route({"data_parallel_rank": 3}) == 3  # the deprecated alias, still honoured
    assert dp.route({"routed_dp_rank": 1, "data_parallel_rank": 3}) == 1


def test_a_field_the_version_lacks_is_ignored() -> None:
    """A pinning field the simulated version does not know is ignored, as that version would."""
    assert DpRouter(4, "0.5.16").route({"data_parallel_rank": 3}) == 0
    assert DpRouter(4, "0.5.9").route({"routed_dp_rank": 3}) == 0
    assert DpRouter(4, "0.5.9").route({"data_parallel_rank": 3}) == 3


def test_without_dp_there_is_no_rank() -> None:
    """Without DP attention a request has no rank, whatever field it carries."""
    assert DpRouter(1, "0.5.23").route({"routed_dp_rank": 2}) is None


@pytest.mark.parametrize("rank", [4, -1, "2", True])
def test_an_inactive_or_malformed_rank_is_refused(rank: object) -> None:
    """A pinned rank outside the active ones, or not an integer, is refused as a bad request."""
    with pytest.raises(RequestError):
        DpRouter(4, "0.5.23").route({"routed_dp_rank": rank})


def test_a_decode_stall_can_target_one_rank() -> None:
    """A decode stall fault may name one DP rank, and a rank that is not an integer is refused."""
    fault = parse_fault({"kind": "decode_stall_midstream", "after_tokens": 0, "dp_rank": 3})
    assert fault.params == {"after_tokens": 0, "dp_rank": 3}
    assert "dp_rank" not in parse_fault({"kind": "decode_stall_midstream"}).params
    with pytest.raises(FaultError):
        parse_fault({"kind": "decode_stall_midstream", "dp_rank": "three"})


# --- Each rank reported on its own, as 0.5.23 does with DP (metrics_collector.py:1382-1392,
# load_inquirer.py:229-256, entrypoints/v1_loads.py:141-150 @ 0.5.23) ---


def _decode(dp_size: int, **faults: dict[str, object]) -> DecodeEngine:
    fault_set = FaultSet()
    fault_set.set([parse_fault({"kind": kind, **params}) for kind, params in faults.items()])
    metrics = SimMetrics(
        version="0.5.23", role="decode", tp_size=1, model_name="m", dp_size=dp_size
    )
    return DecodeEngine(EngineConfig(role="decode", dp_size=dp_size), fault_set, metrics)


def _running(engine: DecodeEngine, ranks: list[int]) -> None:
    for i, rank in enumerate(ranks):
        req = Req(rid=f"r{i}", prompt_tokens=4, max_new_tokens=1000, stream=True, dp_rank=rank)
        engine.reqs[req.rid] = req
        engine.running.append(req)


def _rank_page(engine: DecodeEngine) -> str:
    _headers, body = engine.metrics.render("text/plain", None, {})
    return body.decode()


async def test_each_rank_reports_its_own_tokens_gauges_and_loads_row() -> None:
    """Each DP rank reports its own tokens, gauges and /v1/loads row; the server, their sum."""
    engine = _decode(4)
    _running(engine, [0, 0, 1, 3])
    for _ in range(3):
        await engine._decode_step(engine._active())
    engine.report_stats(gen_throughput=0.0)
    snap = extract_snapshot(_rank_page(engine), Role.DECODE, 0.0)
    assert [(r.dp_rank, r.decode_tokens, r.running_reqs) for r in snap.ranks] == [
        (0, 6.0, 2.0),
        (1, 3.0, 1.0),
        (2, None, 0.0),  # no decode token yet: no series (a zero delta creates none)
        (3, 3.0, 1.0),
    ]
    assert snap.realtime_tokens_total == 12.0  # the server's sum, as before
    rows = [load_row(engine.metrics.naming, s, None) for s in engine._load_stats()]
    assert [r["dp_rank"] for r in rows] == [0, 1, 2, 3]
    assert [r["num_running_reqs"] for r in rows] == [2, 1, 0, 1]
    # Two contiguous steps after the first: two tokens per running request of the rank.
    assert [r["decode_moments"] and r["decode_moments"][5] for r in rows] == [4.0, 2.0, None, 2.0]


async def test_without_dp_there_is_no_dp_rank_label_and_one_row() -> None:
    """Without DP attention there is no dp_rank label and one /v1/loads row, as on SGLang."""
    engine = _decode(1)
    _running(engine, [0, 0])
    await engine._decode_step(engine._active())
    assert "dp_rank" not in _rank_page(engine)
    assert len(engine._load_stats()) == 1


async def test_a_decode_stall_and_a_slow_decode_can_each_target_one_rank() -> None:
    """A decode stall and a slow decode each hold back only the requests of the rank they name."""
    stalled = _decode(4, decode_stall_midstream={"after_tokens": 0, "dp_rank": 2})
    _running(stalled, [0, 1, 2, 3])
    assert sorted(r.dp_rank or 0 for r in stalled._active()) == [0, 1, 3]
    slow = _decode(4, slow_decode={"tokens_per_s": 0.01, "dp_rank": 1})
    _running(slow, [0, 1, 2])
    await slow._decode_step(slow._active())  # every rank's first step is due
    assert sorted(r.dp_rank or 0 for r in slow._active()) == [0, 2]  # rank 1: not for 100 s
