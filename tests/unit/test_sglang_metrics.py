"""The fast SGLang metrics parser, checked against prometheus_client's parser as the oracle."""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdsim.payloads import VERSIONS, router_payload, sglang_payload
from watchdog.model import MetricsSnapshot, Role, ScrapeFailure
from watchdog.observe.sglang_metrics import (
    _GARBAGE_LINE,
    GENERATE_ENDPOINTS,
    WORKER_NAMES,
    _parse_rest,
    counter_deltas,
    extract_snapshot,
    parse_samples,
)

Key = tuple[str, tuple[tuple[str, str], ...], str]


def _key(name: str, labels: dict[str, str], value: float) -> Key:
    # NaN != NaN; compare its spelling instead so a NaN sample still has to be present.
    return (name, tuple(sorted(labels.items())), "nan" if math.isnan(value) else repr(value))


def oracle(text: str, names: tuple[str, ...] | frozenset[str]) -> list[Key]:
    """The samples prometheus_client reads from `text`, restricted to `names`."""
    wanted = set(names)
    return sorted(
        _key(s.name, dict(s.labels), float(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name in wanted
    )


def ours(text: str, names: tuple[str, ...] | frozenset[str]) -> list[Key]:
    """The samples our parser reads from `text`."""
    return sorted(_key(s.name, dict(s.labels), s.value) for s in parse_samples(text, names).samples)


def oracle_values(text: str) -> Callable[[str], list[tuple[dict[str, str], float]]]:
    """A lookup of (labels, value) per wire name, from one prometheus_client parse of `text`."""
    parsed = [
        (s.name, dict(s.labels), float(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]
    return lambda name: [(labels, value) for n, labels, value in parsed if n == name]


ALL_NAMES = (*WORKER_NAMES, "sglang:token_usage", "sglang:time_to_first_token_seconds_bucket")


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_generated_payloads_parse_like_prometheus_client(version: str, role: str) -> None:
    """Every wanted sample of a TP=8 payload of each version matches prometheus_client's reading."""
    text = sglang_payload(version, role, tp=8, transfer_failed_per_rank=[4, 4, 4, 4, 4, 4, 4, 3])
    expected = oracle(text, ALL_NAMES)
    assert len(expected) > 60
    assert ours(text, ALL_NAMES) == expected
    assert parse_samples(text, ALL_NAMES).malformed_lines == 0


@pytest.mark.parametrize("version", VERSIONS)
def test_extracted_snapshot_matches_oracle_arithmetic(version: str) -> None:
    """Failures are the max over TP ranks, completions the sum over label sets, per version alias."""
    per_rank = [21, 21, 21, 21, 21, 21, 20, 21]
    text = sglang_payload(version, "prefill", tp=8, transfer_failed_per_rank=per_rank)
    snap = extract_snapshot(text, Role.PREFILL, scraped_at=12.5)
    values = oracle_values(text)

    assert snap.ok
    assert snap.scraped_at == 12.5
    assert snap.malformed_lines == 0
    assert snap.transfer_failed == 21.0  # never the sum (167) over ranks
    assert snap.bootstrap_failed == 10.0
    inflight = (
        "sglang:num_prefill_infight_queue_reqs"  # the 0.4.10 typo
        if version == "0.4.10"
        else "sglang:num_prefill_inflight_queue_reqs"
    )
    bootstrap = (
        "sglang:num_prefill_bootstrap_queue_reqs"
        if version == "0.5.23"
        else "sglang:num_prefill_prealloc_queue_reqs"
    )
    assert values(inflight)
    assert values(bootstrap)
    assert snap.inflight_queue == max(v for _, v in values(inflight))
    assert snap.bootstrap_queue == max(v for _, v in values(bootstrap))
    assert snap.running_reqs == max(v for _, v in values("sglang:num_running_reqs"))
    for field, name in (
        ("requests_total", "sglang:num_requests_total"),
        ("generation_tokens_total", "sglang:generation_tokens_total"),
        ("prompt_tokens_total", "sglang:prompt_tokens_total"),
    ):
        assert getattr(snap, field) == sum(v for _, v in values(name))
    assert snap.http_requests_active == sum(
        v
        for labels, v in values("sglang:http_requests_active")
        if labels["endpoint"] in GENERATE_ENDPOINTS
    )
    realtime = values("sglang:realtime_tokens_total")
    if version == "0.5.23":
        by_mode: dict[str, float] = {}
        for labels, value in realtime:
            by_mode[labels["mode"]] = max(by_mode.get(labels["mode"], 0.0), value)
        assert snap.realtime_tokens_total == sum(by_mode.values())
    else:
        assert realtime == []
        assert snap.realtime_tokens_total is None


@pytest.mark.parametrize("version", VERSIONS)
def test_counters_absent_before_the_first_request(version: str) -> None:
    """No request finished and no failure yet: completions unknown (None), failures 0."""
    snap = extract_snapshot(sglang_payload(version, with_completions=False), Role.DECODE, 0.0)
    assert snap.ok
    assert snap.requests_total is None
    assert snap.generation_tokens_total is None
    assert snap.transfer_failed == 0.0


NASTY = r"""# A comment that is not HELP or TYPE
# HELP sglang:num_running_reqs Running "requests" with a \\ backslash and \n newline in help.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="a\"quoted\" name",tp_rank="0"} 3
sglang:num_running_reqs{model_name="back\\slash\\",tp_rank="1"} 2.5e0
sglang:num_running_reqs{model_name="new\nline, and a } brace",tp_rank="2"} NaN
sglang:num_running_reqs{model_name="tab\there {x=\"y\"}",tp_rank="3"} +Inf

  sglang:num_running_reqs{model_name="spaces", tp_rank = "4" ,} -Inf
sglang:num_running_reqs_offline_batch{tp_rank="0"} 99
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{tp_rank="0"} 7 1700000000000
sglang:num_queue_reqs{tp_rank="1"}	8
sglang:num_queue_reqs 9
# TYPE sglang:num_requests_total counter
sglang:num_requests_total{is_streaming="true",model_name="m"} 1e3
sglang:num_requests_total{is_streaming="false",model_name="m"} 25
sglang:num_requests_created{is_streaming="true",model_name="m"} 1.7e9
# TYPE sglang:http_requests_active gauge
sglang:http_requests_active{endpoint="/generate",method="POST"} 2
sglang:http_requests_active{endpoint="/health",method="GET"} 1
sglang:http_requests_active{endpoint="/v1/chat/completions",method="POST"} 3
"""

GARBAGE = [
    "<html><body>502 Bad Gateway</body></html>",
    '{"error": "not prometheus"}',
    "12 34",
    '"quoted line"',
]
BROKEN_WANTED = [
    'sglang:num_running_reqs{tp_rank="9"} not_a_number',
    'sglang:num_running_reqs{tp_rank="9" 1',
    'sglang:num_running_reqs{tp_rank="9",tp_rank="9"} 1',
    "sglang:num_running_reqs{tp_rank=9} 1",
    'sglang:num_running_reqs{tp_rank="9"}',
    "sglang:num_running_reqs 1_000",
    'sglang:num_running_reqs{tp_rank="9"} 1 not_a_timestamp',
    'sglang:num_running_reqs{tp_rank="9"a="b"} 1',
]


def test_nasty_payload_agrees_with_prometheus_client() -> None:
    """Escaped quotes, backslashes, newlines, braces in values, NaN, ±Inf, timestamps all agree."""
    names = ("sglang:num_running_reqs", "sglang:num_queue_reqs", *WORKER_NAMES)
    expected = oracle(NASTY, names)
    assert len(expected) == 13
    assert ours(NASTY, names) == expected
    assert parse_samples(NASTY, names).malformed_lines == 0


def test_broken_lines_are_really_invalid_for_prometheus_client() -> None:
    """Each line our parser rejects is also one prometheus_client refuses to parse."""
    for line in BROKEN_WANTED:
        with pytest.raises(ValueError):  # noqa: PT011 - prometheus_client raises a bare ValueError
            list(text_string_to_metric_families(line + "\n"))


def test_garbage_and_broken_lines_are_skipped_and_counted() -> None:
    """Garbage and unparsable wanted lines are skipped, counted, and leave every good sample intact."""
    lines = NASTY.splitlines()
    mixed = "".join(
        f"{line}\n" for line in [*lines[:5], *GARBAGE, *lines[5:12], *BROKEN_WANTED, *lines[12:]]
    )  # interleaved
    names = ("sglang:num_running_reqs", "sglang:num_queue_reqs", *WORKER_NAMES)
    parsed = parse_samples(mixed, names)
    assert parsed.malformed_lines == len(GARBAGE) + len(BROKEN_WANTED)
    assert ours(mixed, names) == oracle(NASTY, names)
    snap = extract_snapshot(mixed, Role.DECODE, 0.0)
    assert snap.ok
    assert snap.malformed_lines == len(GARBAGE) + len(BROKEN_WANTED)


def test_nasty_payload_extraction() -> None:
    """Label sets are summed (+Inf plus -Inf is unknown), other endpoints are excluded."""
    snap = extract_snapshot(NASTY, Role.DECODE, 0.0)
    assert snap.running_reqs is None
    assert snap.queue_reqs == 9.0  # max of 7, 8 (ranks) + the unlabelled 9: two label sets
    assert snap.requests_total == 1025.0
    assert snap.http_requests_active == 5.0


def test_rank_reduction_skips_nan_and_keeps_infinity() -> None:
    """Ranks reduce with max; a NaN rank is ignored, an +Inf rank wins."""
    text = 'sglang:num_queue_reqs{tp_rank="0"} 7\nsglang:num_queue_reqs{tp_rank="1"} NaN\n'
    assert extract_snapshot(text, Role.DECODE, 0.0).queue_reqs == 7.0
    text += 'sglang:num_queue_reqs{tp_rank="2"} +Inf\n'
    assert extract_snapshot(text, Role.DECODE, 0.0).queue_reqs == math.inf
    only_nan = 'sglang:num_queue_reqs{tp_rank="0"} NaN\n'
    assert extract_snapshot(only_nan, Role.DECODE, 0.0).queue_reqs is None


def test_data_parallel_ranks_are_summed() -> None:
    """With DP attention, failures are the max over TP ranks within a DP rank, summed over DP."""
    text = "".join(
        f'sglang:num_transfer_failed_reqs_total{{dp_rank="{dp}",tp_rank="{tp}"}} {dp + 1}\n'
        for dp in range(2)
        for tp in range(4)
    )
    assert extract_snapshot(text, Role.PREFILL, 0.0).transfer_failed == 3.0


def test_every_generate_endpoint_counts_as_active_work() -> None:
    """OpenAI, native and Anthropic (/v1/messages) generation requests count; /health does not."""
    text = "".join(
        f'sglang:http_requests_active{{endpoint="{endpoint}",method="POST"}} 1\n'
        for endpoint in (
            "/generate",
            "/v1/completions",
            "/v1/chat/completions",
            "/v1/responses",
            "/v1/messages",
            "/health",
        )
    )
    assert extract_snapshot(text, Role.DECODE, 0.0).http_requests_active == 5.0


def test_crlf_bodies_parse() -> None:
    """A body with CRLF line ends parses the same and counts no malformed line."""
    text = NASTY.replace("\n", "\r\n")
    names = ("sglang:num_queue_reqs", "sglang:num_requests_total")
    assert ours(text, names) == oracle(NASTY, names)
    assert parse_samples(text, names).malformed_lines == 0


@pytest.mark.parametrize(
    ("body", "detail"),
    [
        ("", "empty body"),
        ("  \n\n", "empty body"),
        ("<!DOCTYPE html><html><body>Not Found</body></html>", "HTML"),
        ('{"detail": "Not Found"}', "no sample line"),
        ("Internal Server Error\n", None),
    ],
)
def test_not_prometheus_bodies(body: str, detail: str | None) -> None:
    """Empty, HTML and JSON bodies give NOT_PROMETHEUS with a reason."""
    snap = extract_snapshot(body, Role.PREFILL, 3.0)
    if detail is None:
        # Two words look like "<name> <value>": counted as a sample line, nothing wanted in it.
        assert snap.ok
        assert snap.running_reqs is None
        return
    assert not snap.ok
    assert snap.error == ScrapeFailure.NOT_PROMETHEUS
    assert detail in snap.detail
    assert snap.scraped_at == 3.0


def test_valid_payload_without_sglang_names_is_ok_and_empty() -> None:
    """A valid exposition with none of our names is a successful scrape with nothing in it."""
    snap = extract_snapshot("# TYPE up gauge\nup 1\n", Role.PREFILL, 0.0)
    assert snap.ok
    assert snap.running_reqs is None
    assert snap.transfer_failed == 0.0


@pytest.mark.parametrize("old_names", [False, True])
def test_router_worker_health_and_circuit_breakers(old_names: bool) -> None:
    """Router payloads (smg_* and older sgl_router_*) give unhealthy workers and open breakers."""
    text = router_payload(old_names=old_names, health=(1, 0, 0), cb_states=(1, 2, 0))
    snap = extract_snapshot(text, Role.ROUTER, 0.0)
    assert snap.ok
    assert snap.workers_unhealthy == 2
    assert snap.circuit_breakers_open == 1  # half-open (2) is not open
    assert snap.running_reqs is None


def test_router_without_worker_series() -> None:
    """A router that exports no worker gauges yet leaves those fields unknown."""
    snap = extract_snapshot("# TYPE smg_router_requests_total counter\n", Role.ROUTER, 0.0)
    assert not snap.ok  # comments only: not a single sample line
    snap = extract_snapshot("smg_router_requests_total 3\n", Role.ROUTER, 0.0)
    assert snap.ok
    assert snap.workers_unhealthy is None
    assert snap.circuit_breakers_open is None


label_text = st.text(alphabet=st.characters(codec="utf-8"), min_size=0, max_size=20)


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(label_text, min_size=1, max_size=6, unique=True),
    numbers=st.lists(
        st.one_of(
            st.floats(allow_nan=True, allow_infinity=True),
            st.integers(min_value=-(10**15), max_value=10**15).map(float),
        ),
        min_size=6,
        max_size=6,
    ),
)
def test_any_label_value_round_trips_like_prometheus_client(
    values: list[str], numbers: list[float]
) -> None:
    """Arbitrary label values written by prometheus_client read back exactly as its parser reads them."""
    registry = CollectorRegistry()
    gauge = Gauge("sglang:num_running_reqs", "doc", ("model_name", "tp_rank"), registry=registry)
    counter = Counter("sglang:num_requests", "doc", ("model_name",), registry=registry)
    for index, value in enumerate(values):
        gauge.labels(value, str(index)).set(numbers[index])
        counter.labels(value).inc(abs(numbers[index]) if math.isfinite(numbers[index]) else 1.0)
    text = generate_latest(registry).decode("utf-8")
    names = ("sglang:num_running_reqs", "sglang:num_requests_total")
    assert ours(text, names) == oracle(text, names)
    assert parse_samples(text, names).malformed_lines == 0


def _snap(role: Role = Role.PREFILL, at: float = 0.0, **values: float | None) -> MetricsSnapshot:
    return MetricsSnapshot(role=role, scraped_at=at, ok=True, **values)  # type: ignore[arg-type]


def test_counter_deltas_between_two_scrapes() -> None:
    """Deltas are the growth of each counter and the interval between the scrapes."""
    before = _snap(at=10.0, transfer_failed=2.0, requests_total=100.0, generation_tokens_total=5.0)
    after = _snap(at=15.0, transfer_failed=5.0, requests_total=130.0, generation_tokens_total=9.0)
    delta = counter_deltas(before, after)
    assert delta is not None
    assert delta.interval_seconds == 5.0
    assert delta.transfer_failed == 3.0
    assert delta.requests_total == 30.0
    assert delta.generation_tokens_total == 4.0
    assert delta.prompt_tokens_total is None
    assert not delta.reset


def test_counter_deltas_after_a_restart_count_like_rate() -> None:
    """A counter that went down restarted from 0: its increase is its new value, as rate() has it."""
    before = _snap(at=10.0, transfer_failed=21.0, requests_total=5000.0, realtime_tokens_total=9e6)
    after = _snap(at=15.0, transfer_failed=0.0, requests_total=3.0, realtime_tokens_total=None)
    delta = counter_deltas(before, after)
    assert delta is not None
    assert delta.reset
    assert delta.requests_total == 3.0
    assert delta.transfer_failed == 0.0
    assert delta.realtime_tokens_total is None  # absent after the restart: unknown, not zero


def test_counter_deltas_of_a_series_missing_from_a_scrape_are_unknown() -> None:
    """A series that vanished and came back is no reset and counts nothing (not +21)."""
    text = 'sglang:num_transfer_failed_reqs_total{tp_rank="0"} 21\nsglang:num_requests_total 7\n'
    first = extract_snapshot(text, Role.PREFILL, 0.0)
    gone = extract_snapshot("sglang:num_requests_total 7\n", Role.PREFILL, 5.0)
    back = extract_snapshot(text, Role.PREFILL, 10.0)
    assert (first.absent_counters, gone.absent_counters) == (
        ("bootstrap_failed",),
        ("transfer_failed", "bootstrap_failed"),
    )
    assert gone.transfer_failed == 0.0  # still reads 0 for consumers that want a number
    for before, after in ((first, gone), (gone, back)):
        delta = counter_deltas(before, after)
        assert delta is not None
        assert (delta.reset, delta.transfer_failed, delta.requests_total) == (False, 0.0, 0.0)


def test_counter_deltas_need_two_good_scrapes_of_one_role() -> None:
    """No delta against a failed scrape or across roles."""
    good = _snap()
    failed = MetricsSnapshot(Role.PREFILL, 1.0, ok=False, error=ScrapeFailure.TIMEOUT)
    assert counter_deltas(good, failed) is None
    assert counter_deltas(failed, good) is None
    assert counter_deltas(good, _snap(role=Role.DECODE)) is None


# A line of each kind the body scan tells apart: wanted samples (valid, malformed, a name that
# only starts like a wanted one), other samples, comments, blanks, CRLF ends and plain garbage.
_LINES = st.sampled_from(
    [
        'sglang:num_running_reqs{tp_rank="0"} 3',
        "sglang:num_running_reqs 4.5",
        '  sglang:num_running_reqs{tp_rank="1",engine_type="decode"} 7 1700000000000',
        "sglang:num_running_reqs{tp_rank=0} 3",
        "sglang:num_running_reqs nope",
        "sglang:num_running_reqs_created 1.7e9",
        "sglang:generation_tokens_total 12\r",
        'sglang:other_bucket{le="0.5"} 9',
        "# HELP sglang:num_running_reqs The number of running requests.",
        "# TYPE sglang:num_running_reqs gauge",
        "",
        "\r",
        "   ",
        "<html><body>502 Bad Gateway</body></html>",
        '{"error": "oops"}',
        "12 34",
        '"quoted"',
        "\x00",
        "\t-1",
    ]
)


def _two_scans(text: str, names: tuple[str, ...]) -> tuple[list[Key], int]:
    """The parse as two whole-body scans made it before they were one (the reference)."""
    body = "\n" + text
    alternation = "|".join(re.escape(n) for n in sorted(set(names), key=len, reverse=True))
    wanted = re.compile(rf"\n[ \t]*({alternation})(?=[ \t{{])([^\n]*)")
    samples, malformed = [], 0
    for name, rest in wanted.findall(body):
        sample = _parse_rest(name, rest)
        if sample is None:
            malformed += 1
        else:
            samples.append(_key(sample.name, dict(sample.labels), sample.value))
    garbage = re.compile(r"\n" + _GARBAGE_LINE)
    malformed += sum(1 for line in garbage.findall(body) if line.strip())
    return samples, malformed


@given(st.lists(_LINES, max_size=30), st.booleans())
def test_one_scan_finds_what_two_scans_did(lines: list[str], trailing_newline: bool) -> None:
    """The single body scan reads the same samples, in order, and counts the same malformed
    lines as a scan for wanted lines and another for garbage did."""
    text = "\n".join(lines) + ("\n" if trailing_newline else "")
    names = ("sglang:num_running_reqs", "sglang:generation_tokens_total")
    parsed = parse_samples(text, names)
    got = [_key(s.name, dict(s.labels), s.value) for s in parsed.samples]
    assert (got, parsed.malformed_lines) == _two_scans(text, names)
