"""A /metrics body cut short is never read as counters (hypothesis over real-looking pages).

Every exporter SGLang and the routers use ends each line, the last one included, with "\\n"
(prometheus_client's generate_latest, which pdsim's pages come from; the Rust
metrics-exporter-prometheus). So:
- a page cut anywhere but at a line boundary is a failed scrape (TRUNCATED, or NOT_PROMETHEUS
  when not even one sample line is left), never an ok one: a value cut after its first digits
  would read as a smaller number;
- a page cut at a line boundary cannot be told from a whole one, but it only lacks lines: every
  counter it reads is at most the whole page's value, or absent (unknown). The counter
  accounting (decide/counters.py) then counts nothing for it (test_counter_properties.py).
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pdsim.payloads import VERSIONS, router_payload, sglang_payload
from watchdog.model import MetricsSnapshot, Role, ScrapeFailure
from watchdog.observe.sglang_metrics import extract_snapshot

SETTINGS = settings(max_examples=150, deadline=None)
# The counters a snapshot carries (CounterBaseline's scraped fields).
COUNTERS = (
    "requests_total",
    "generation_tokens_total",
    "prompt_tokens_total",
    "realtime_tokens_total",
    "ttft_count",
    "aborted_requests_total",
    "transfer_failed",
    "bootstrap_failed",
)


@st.composite
def pages(draw: st.DrawFn) -> tuple[str, Role]:
    """A worker's page as SGLang writes it (any version, role, TP size, failures or none)."""
    role = draw(st.sampled_from([Role.PREFILL, Role.DECODE]))
    failed = draw(st.one_of(st.none(), st.integers(1, 999_999)))
    tp = draw(st.integers(1, 4))
    text = sglang_payload(
        draw(st.sampled_from(VERSIONS)),
        role.value,
        tp=tp,
        seed=draw(st.integers(0, 5)),
        transfer_failed_per_rank=None if failed is None else [failed] * tp,
        with_completions=draw(st.booleans()),
        extra_histograms=2,
    )
    return text, role


def counter(snap: MetricsSnapshot, name: str) -> float | None:
    """A counter as the detector reads it: None where its series was absent."""
    if name in snap.absent_counters:
        return None
    value: float | None = getattr(snap, name)
    return value


def test_real_pages_end_at_a_line_boundary() -> None:
    """The premise: prometheus_client ends the last line of a page with a newline, too."""
    for version in VERSIONS:
        for role in ("prefill", "decode"):
            page = sglang_payload(version, role, tp=2)
            assert page.endswith("\n")
            assert extract_snapshot(page, Role(role), 0.0).ok
    assert router_payload().endswith("\n")
    assert extract_snapshot(router_payload(), Role.ROUTER, 0.0).ok


@SETTINGS
@given(page=pages(), data=st.data())
def test_page_cut_mid_line_is_a_failed_scrape(page: tuple[str, Role], data: st.DataObject) -> None:
    """Any cut that does not fall at a line boundary fails the scrape: nothing is read from it."""
    text, role = page
    cut = data.draw(
        st.integers(1, len(text) - 1).filter(lambda i: text[i - 1] != "\n"), label="cut"
    )
    snap = extract_snapshot(text[:cut], role, 7.0)
    assert not snap.ok
    assert snap.error in (ScrapeFailure.TRUNCATED, ScrapeFailure.NOT_PROMETHEUS)
    assert snap.scraped_at == 7.0


@SETTINGS
@given(page=pages(), data=st.data())
def test_value_cut_after_its_first_digits_is_never_read(
    page: tuple[str, Role], data: st.DataObject
) -> None:
    """The attack's cut: a page ending inside the failure counter's value is a TRUNCATED scrape."""
    text, role = page
    series = text.rfind("sglang:num_transfer_failed_reqs_total{")
    if series < 0:
        text = text + 'sglang:num_transfer_failed_reqs_total{tp_rank="0"} 123456.0\n'
        series = text.rfind("sglang:num_transfer_failed_reqs_total{")
    value = text.index("} ", series) + 2
    end = text.index("\n", value)
    cut = data.draw(st.integers(value + 1, end), label="cut")
    snap = extract_snapshot(text[:cut], role, 0.0)
    assert (snap.ok, snap.error) == (False, ScrapeFailure.TRUNCATED)


@SETTINGS
@given(page=pages(), data=st.data())
def test_page_cut_at_a_line_boundary_never_reads_higher(
    page: tuple[str, Role], data: st.DataObject
) -> None:
    """A page cut after a whole line reads each counter at most as high as the whole page does."""
    text, role = page
    boundaries = [i + 1 for i, c in enumerate(text) if c == "\n"]
    cut = data.draw(st.sampled_from(boundaries), label="cut")
    whole = extract_snapshot(text, role, 0.0)
    part = extract_snapshot(text[:cut], role, 0.0)
    assert whole.ok
    if not part.ok:
        assert part.error == ScrapeFailure.NOT_PROMETHEUS  # no sample line left yet
        return
    for name in COUNTERS:
        read, true = counter(part, name), counter(whole, name)
        assert read is None or (true is not None and read <= true), (name, read, true)
