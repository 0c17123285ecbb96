"""pdsim's DP-attention ranks: the pinning field by version, round-robin, one rank's fault."""

from __future__ import annotations

import pytest

from pdsim.api import RequestError
from pdsim.dp import DpRouter, rank_fields
from pdsim.faults import FaultError, parse_fault


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
    assert rank_fields(version) == fields


def test_unpinned_requests_go_round_robin_and_pinned_ones_to_their_rank() -> None:
    dp = DpRouter(4, "0.5.23")
    assert [dp.route({}) for _ in range(5)] == [0, 1, 2, 3, 0]
    assert dp.route({"routed_dp_rank": 2}) == 2
    assert dp.route({"data_parallel_rank": 3}) == 3  # the deprecated alias, still honoured
    assert dp.route({"routed_dp_rank": 1, "data_parallel_rank": 3}) == 1


def test_a_field_the_version_lacks_is_ignored() -> None:
    assert DpRouter(4, "0.5.16").route({"data_parallel_rank": 3}) == 0
    assert DpRouter(4, "0.5.9").route({"routed_dp_rank": 3}) == 0
    assert DpRouter(4, "0.5.9").route({"data_parallel_rank": 3}) == 3


def test_without_dp_there_is_no_rank() -> None:
    assert DpRouter(1, "0.5.23").route({"routed_dp_rank": 2}) is None


@pytest.mark.parametrize("rank", [4, -1, "2", True])
def test_an_inactive_or_malformed_rank_is_refused(rank: object) -> None:
    with pytest.raises(RequestError):
        DpRouter(4, "0.5.23").route({"routed_dp_rank": rank})


def test_a_decode_stall_can_target_one_rank() -> None:
    fault = parse_fault({"kind": "decode_stall_midstream", "after_tokens": 0, "dp_rank": 3})
    assert fault.params == {"after_tokens": 0, "dp_rank": 3}
    assert "dp_rank" not in parse_fault({"kind": "decode_stall_midstream"}).params
    with pytest.raises(FaultError):
        parse_fault({"kind": "decode_stall_midstream", "dp_rank": "three"})
