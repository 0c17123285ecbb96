"""Extraction of the 0.5.23 progress and abort signals: TTFT count, aborts, decode moments."""

from __future__ import annotations

from dataclasses import replace

from tests.unit.builders import T0, probe
from watchdog.model import ProbeFailure, ProbeKind, Role, RoleCount
from watchdog.observe.observer import own_aborts
from watchdog.observe.scrape import parse_loads
from watchdog.observe.sglang_metrics import decode_moment_tokens, extract_snapshot

TTFT_0523 = """\
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_count{engine_type="decode",is_streaming="true",model_name="m",tp_rank="0"} 7.0
sglang:time_to_first_token_seconds_count{engine_type="decode",is_streaming="true",model_name="m",tp_rank="1"} 7.0
sglang:time_to_first_token_seconds_count{engine_type="decode",is_streaming="false",model_name="m",tp_rank="0"} 3.0
sglang:num_aborted_requests_total{engine_type="decode",model_name="m"} 4.0
"""
TTFT_055 = """\
sglang:time_to_first_token_seconds_count{model_name="m"} 9.0
"""


def test_ttft_count_is_read_where_aborts_are_not_in_it() -> None:
    """0.5.23's TTFT count, which leaves aborts out, and its abort counter are read."""
    snap = extract_snapshot(TTFT_0523, Role.DECODE, T0)
    assert snap.ttft_count == 10.0  # max over TP ranks, summed over is_streaming
    assert snap.aborted_requests_total == 4.0


def test_ttft_count_of_older_versions_counts_aborts_and_is_not_read() -> None:
    """Older versions' TTFT count includes aborts, so neither it nor an abort count is read."""
    snap = extract_snapshot(TTFT_055, Role.DECODE, T0)
    assert snap.ok
    assert snap.ttft_count is None
    assert snap.aborted_requests_total is None


def test_decode_moment_tokens_sum_dp_ranks() -> None:
    """Decode moment tokens sum over DP ranks, skipping rows without or with bad moments."""
    rows: list[dict[str, object]] = [
        {"decode_moments": [10.0, 40.0, 1e5, 160.0, 4e5, 40.0]},
        {"decode_moments": None},  # no decode step yet
        {"decode_moments": [1, 2, 3, 4, 5, 6]},
        {"decode_moments": [1, 2, 3]},  # malformed: skipped
        {},
    ]
    assert decode_moment_tokens(rows) == 46.0
    assert decode_moment_tokens([{}]) is None


def test_parse_loads_carries_decode_tokens() -> None:
    """/v1/loads parsing carries decode tokens when the moments are there, none otherwise."""
    payload = {"loads": [{"timestamp": T0, "decode_moments": [1, 1, 1, 1, 1, 12]}]}
    assert parse_loads(payload, Role.DECODE, T0).decode_tokens_total == 12.0
    assert parse_loads({"loads": [{}]}, Role.DECODE, T0).decode_tokens_total is None


def test_own_aborts_count_each_aborted_probe_on_both_workers() -> None:
    """Each probe we aborted counts once on prefill and once on decode; other failures not."""
    aborted = probe(False, at=T0, reason=ProbeFailure.TIMEOUT_BEFORE_HEADERS)
    probes = (
        replace(aborted, abort_sent=True),
        probe(False, at=T0, reason=ProbeFailure.HTTP_ERROR),
        probe(True, at=T0),
    )
    assert own_aborts(probes) == (RoleCount(Role.PREFILL, 1), RoleCount(Role.DECODE, 1))
    assert own_aborts(probes[1:]) == ()


def test_a_failed_direct_probe_is_a_failure_of_our_own_making() -> None:
    """A direct PD probe that failed (e.g. a wrong bootstrap_port) may be counted as a bootstrap
    failure by its pair: it is set against the failure counters like an abort of ours, once."""
    direct = replace(probe(False, at=T0, reason=ProbeFailure.HTTP_ERROR), kind=ProbeKind.DIRECT)
    aborted_direct = replace(direct, abort_sent=True)
    ok_direct = replace(probe(True, at=T0), kind=ProbeKind.DIRECT)
    raised = replace(direct, reason=ProbeFailure.INTERNAL_ERROR)
    assert own_aborts((direct, aborted_direct, ok_direct, raised)) == (
        RoleCount(Role.PREFILL, 2),
        RoleCount(Role.DECODE, 2),
    )
