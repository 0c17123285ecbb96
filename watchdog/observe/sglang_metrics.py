"""SGLang and router metric names with their version aliases, and the fast parser that reads them.

Parsing a whole SGLang payload with prometheus_client takes tens of milliseconds (3000 lines, mostly
per-TP-rank histogram buckets; client_python#1182), and the watchdog needs a dozen series. So a
regular expression first picks out the lines of the wanted names (the C regex engine does the
scanning), then only those lines are parsed. Label syntax and escaping follow
prometheus_client.parser exactly (its tests use it as the oracle). Lines that cannot be parsed are
skipped and counted, never raised.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

from watchdog.model import MetricsSnapshot, RankLoad, Role, ScrapeFailure, counter_increase

# --- Wire names, newest first where a version renamed a series (docs/sglang.md §3, §7.8) ---

# Counters per TP rank; one failed request adds 1 on every rank, so the max over ranks is the count.
# A labelled counter appears on its first increment: absent means 0.
TRANSFER_FAILED: tuple[str, ...] = ("sglang:num_transfer_failed_reqs_total",)
BOOTSTRAP_FAILED: tuple[str, ...] = ("sglang:num_bootstrap_failed_reqs_total",)
# Gauges (frozen during a PD stall: scheduler gauges refresh only after batches).
PREFILL_INFLIGHT_QUEUE: tuple[str, ...] = (
    "sglang:num_prefill_inflight_queue_reqs",
    "sglang:num_prefill_infight_queue_reqs",  # 0.4.10 wire name has this typo
)
PREFILL_BOOTSTRAP_QUEUE: tuple[str, ...] = (
    "sglang:num_prefill_bootstrap_queue_reqs",  # 0.5.23
    "sglang:num_prefill_prealloc_queue_reqs",  # <= 0.5.5
)
DECODE_PREALLOC_QUEUE: tuple[str, ...] = ("sglang:num_decode_prealloc_queue_reqs",)
DECODE_TRANSFER_QUEUE: tuple[str, ...] = ("sglang:num_decode_transfer_queue_reqs",)
RUNNING_REQS: tuple[str, ...] = ("sglang:num_running_reqs",)
QUEUE_REQS: tuple[str, ...] = ("sglang:num_queue_reqs",)
# Completion counters: advance when a request *finishes*; summed over label sets (is_streaming).
REQUESTS_TOTAL: tuple[str, ...] = ("sglang:num_requests_total",)
GENERATION_TOKENS_TOTAL: tuple[str, ...] = ("sglang:generation_tokens_total",)
PROMPT_TOKENS_TOTAL: tuple[str, ...] = ("sglang:prompt_tokens_total",)
REALTIME_TOKENS_TOTAL: tuple[str, ...] = ("sglang:realtime_tokens_total",)  # 0.5.23+
# The TTFT histogram's count: requests given a first token. 0.5.23 skips aborts and labels the
# series is_streaming; older versions count aborts too, so without that label it is not read.
TTFT_COUNT: tuple[str, ...] = ("sglang:time_to_first_token_seconds_count",)
TTFT_ABORT_FREE_LABEL = "is_streaming"
ABORTED_REQUESTS_TOTAL: tuple[str, ...] = ("sglang:num_aborted_requests_total",)
HTTP_REQUESTS_ACTIVE: tuple[str, ...] = ("sglang:http_requests_active",)
# Only requests that generate count: /health and /metrics are in flight during every scrape.
GENERATE_ENDPOINTS: frozenset[str] = frozenset(
    {"/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"}
)
# Router (its separate Prometheus listener): smg_* since the gateway rename, sgl_router_* before.
ROUTER_WORKER_HEALTH: tuple[str, ...] = ("smg_worker_health", "sgl_router_worker_health")
ROUTER_CB_STATE: tuple[str, ...] = ("smg_worker_cb_state", "sgl_router_cb_state")
CB_STATE_OPEN = 1.0

# Labels that tell the ranks of one scheduler apart; every rank reports the same request, so these
# are reduced with max. Other labels (dp_rank, is_streaming, mode, ...) split real work: summed.
RANK_LABELS: frozenset[str] = frozenset({"tp_rank", "pp_rank", "moe_ep_rank", "attn_tp_rank"})
# The label of a DP rank: each DP rank's scheduler labels its series with it when the server runs
# DP (observability/metrics_collector.py:1391-1392 @ 0.5.23); read per rank by `rank_loads`.
DP_RANK_LABEL = "dp_rank"
# realtime_tokens_total's mode of the tokens decode steps generate (metrics_collector.py:1558-1572
# @ 0.5.23, counted every decode iteration: metrics_reporter.py:901-915).
DECODE_MODE = "decode"

WORKER_NAMES: tuple[str, ...] = (
    *TRANSFER_FAILED,
    *BOOTSTRAP_FAILED,
    *PREFILL_INFLIGHT_QUEUE,
    *PREFILL_BOOTSTRAP_QUEUE,
    *DECODE_PREALLOC_QUEUE,
    *DECODE_TRANSFER_QUEUE,
    *RUNNING_REQS,
    *QUEUE_REQS,
    *REQUESTS_TOTAL,
    *GENERATION_TOKENS_TOTAL,
    *PROMPT_TOKENS_TOTAL,
    *REALTIME_TOKENS_TOTAL,
    *TTFT_COUNT,
    *ABORTED_REQUESTS_TOTAL,
    *HTTP_REQUESTS_ACTIVE,
)
ROUTER_NAMES: tuple[str, ...] = (*ROUTER_WORKER_HEALTH, *ROUTER_CB_STATE)


def wanted_names(role: Role) -> tuple[str, ...]:
    """The wire names extracted from a scrape of `role`."""
    return ROUTER_NAMES if role == Role.ROUTER else WORKER_NAMES


# --- Parsing ---


@dataclass(frozen=True, slots=True)
class Sample:
    """One parsed sample line (the timestamp, if any, is validated and dropped)."""

    name: str
    labels: Mapping[str, str]
    value: float


@dataclass(frozen=True, slots=True)
class ParsedMetrics:
    """The wanted samples of one payload, plus what the cheap whole-body checks found."""

    samples: tuple[Sample, ...]
    malformed_lines: int  # wanted lines that failed to parse + lines that are no valid line at all
    has_sample_lines: bool  # at least one line shaped like a sample, wanted or not

    def by_name(self, name: str) -> tuple[Sample, ...]:
        """The samples of one wire name, in payload order."""
        return tuple(s for s in self.samples if s.name == name)


_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
# Garbage a regex can spot without parsing every line: a line that is not blank, not a comment and
# does not start like a metric name (HTML, JSON, a number, a stray quote). Lines of wanted names
# get the full check. The body gets a leading "\n" so the first line is seen too; this is what
# follows a line's "\n" (the first group: the line).
_GARBAGE_LINE = r"(?![ \t\r]*+[#\na-zA-Z_:]|\Z)([^\n]*)"
_ANY_SAMPLE_LINE = re.compile(rf"\n[ \t]*{_NAME}[ \t{{]")
_LABEL_PAIR = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\]|\\.)*)"[ \t]*')
# The common case, `{a="x",b="y"} 1.5`: no escapes, no timestamp. One match, one findall.
_SIMPLE_PAIR = r'[a-zA-Z_][a-zA-Z0-9_]*="[^"\\]*"'
_SIMPLE_REST = re.compile(
    rf"[ \t]*\{{((?:{_SIMPLE_PAIR}(?:,{_SIMPLE_PAIR})*,?)?)\}}[ \t]*([^ \t\r]+)[ \t\r]*"
)
_SIMPLE_PAIRS = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="([^"\\]*)"')
_ESCAPE = re.compile(r'\\[\\n"]')
_UNESCAPED = {"\\\\": "\\", "\\n": "\n", '\\"': '"'}


@lru_cache(maxsize=8)
def _line_pattern(names: tuple[str, ...]) -> re.Pattern[str]:
    """One scan of the body for both kinds of line it looks at: a sample line of a wanted name
    (groups 1 and 2: the name and the rest of the line), or a line no valid line could start
    with (group 3: _GARBAGE_LINE). No line can be both (a wanted line starts with a name
    character), so one pass finds what two scans did, at about 60 % of their cost on an 8-GPU
    decode's page (bench/profile.md)."""
    # Longest first, so a name that is a prefix of another cannot shadow it; the lookahead then
    # requires the name to end there ("..._total" must not match "..._total_created").
    alternation = "|".join(re.escape(n) for n in sorted(set(names), key=len, reverse=True))
    return re.compile(rf"\n(?:[ \t]*({alternation})(?=[ \t{{])([^\n]*)|{_GARBAGE_LINE})")


def _unescape(match: re.Match[str]) -> str:
    return _UNESCAPED[match.group(0)]


def _parse_labels(text: str) -> tuple[dict[str, str], str] | None:
    """Labels from text starting with "{"; returns (labels, the rest after "}"), None if invalid."""
    labels: dict[str, str] = {}
    pos = 1
    end = len(text)
    while True:
        while pos < end and text[pos] in " \t":
            pos += 1
        if pos < end and text[pos] == "}":
            return labels, text[pos + 1 :]
        match = _LABEL_PAIR.match(text, pos)
        if match is None:
            return None
        name, value = match.group(1), match.group(2)
        if name in labels:
            return None  # prometheus_client rejects duplicate label names
        labels[name] = _ESCAPE.sub(_unescape, value) if "\\" in value else value
        pos = match.end()
        if pos < end and text[pos] == ",":
            pos += 1
        elif pos < end and text[pos] != "}":
            return None


def _parse_number(token: str) -> float | None:
    # prometheus_client refuses "_" (Python's float() would take "1_000") and surrounding spaces.
    if "_" in token:
        return None
    try:
        return float(token)
    except ValueError:
        return None


def _parse_rest(name: str, rest: str) -> Sample | None:
    """A sample line after its metric name: optional labels, value, optional timestamp."""
    simple = _SIMPLE_REST.fullmatch(rest)
    if simple is not None:
        pairs = _SIMPLE_PAIRS.findall(simple.group(1))
        value = _parse_number(simple.group(2))
        simple_labels = dict(pairs)
        if value is None or len(simple_labels) != len(pairs):
            return None
        return Sample(name, simple_labels, value)
    rest = rest.strip()
    labels: dict[str, str] = {}
    if rest.startswith("{"):
        parsed = _parse_labels(rest)
        if parsed is None:
            return None
        labels, rest = parsed
    tokens = rest.split()
    if not tokens:
        return None
    value = _parse_number(tokens[0])
    if value is None:
        return None
    if len(tokens) > 1 and _parse_number(tokens[-1]) is None:
        return None  # a timestamp that is not a number makes the whole line invalid
    return Sample(name, labels, value)


def parse_samples(text: str, names: Iterable[str]) -> ParsedMetrics:
    """The samples of the given wire names in a Prometheus text payload; never raises."""
    body = "\n" + text
    samples: list[Sample] = []
    malformed = 0
    for name, rest, invalid in _line_pattern(tuple(names)).findall(body):
        if not name:
            # A trailing "\r" (CRLF bodies) or a NUL is not a line of its own; only count
            # visible garbage.
            malformed += bool(invalid.strip())
            continue
        sample = _parse_rest(name, rest)
        if sample is None:
            malformed += 1
        else:
            samples.append(sample)
    has_samples = bool(samples) or _ANY_SAMPLE_LINE.search(body) is not None
    return ParsedMetrics(tuple(samples), malformed, has_samples)


# --- Extraction ---


def reduce_ranks(samples: Iterable[Sample]) -> float | None:
    """Max over the rank labels of one scheduler, summed over every other label set.

    One failed request adds 1 on every TP rank, so a sum would multiply it by the TP size. NaN
    samples carry no information and are skipped. None when no sample is left.
    """
    groups: dict[tuple[tuple[str, str], ...], float] = {}
    for sample in samples:
        if math.isnan(sample.value):
            continue
        key = tuple(sorted((k, v) for k, v in sample.labels.items() if k not in RANK_LABELS))
        previous = groups.get(key)
        groups[key] = sample.value if previous is None else max(previous, sample.value)
    total = sum(groups.values())
    return None if not groups or math.isnan(total) else total


def _first_alias(parsed: ParsedMetrics, aliases: Sequence[str]) -> tuple[Sample, ...]:
    for name in aliases:
        found = parsed.by_name(name)
        if found:
            return found
    return ()


def _value(parsed: ParsedMetrics, aliases: Sequence[str]) -> float | None:
    return reduce_ranks(_first_alias(parsed, aliases))


def _generate_requests_active(parsed: ParsedMetrics) -> float | None:
    samples = _first_alias(parsed, HTTP_REQUESTS_ACTIVE)
    selected = [s for s in samples if s.labels.get("endpoint", "/generate") in GENERATE_ENDPOINTS]
    if samples and not selected:
        return 0.0  # the gauge exists, no generate request is in flight
    return reduce_ranks(selected)


def _ttft_count(parsed: ParsedMetrics) -> float | None:
    samples = _first_alias(parsed, TTFT_COUNT)
    if not samples or not all(TTFT_ABORT_FREE_LABEL in s.labels for s in samples):
        return None  # absent, or a version whose TTFT count includes aborted requests
    return reduce_ranks(samples)


def _dp_rank(sample: Sample) -> int | None:
    value = sample.labels.get(DP_RANK_LABEL, "")
    return int(value) if value.isdigit() else None


def _by_rank(samples: Iterable[Sample]) -> dict[int, list[Sample]]:
    out: dict[int, list[Sample]] = {}
    for sample in samples:
        rank = _dp_rank(sample)
        if rank is not None:
            out.setdefault(rank, []).append(sample)
    return out


def _sum_known(*values: float | None) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def rank_loads(parsed: ParsedMetrics) -> tuple[RankLoad, ...]:
    """Each DP rank's decode tokens and work, from the series labelled `dp_rank` (none: empty).

    Within a rank the TP-rank labels are reduced with max, as everywhere (reduce_ranks). A rank's
    realtime decode series appears at its first decode token (a zero delta creates no series,
    metrics_collector.py:1565-1572 @ 0.5.23): until then its tokens are unknown, never 0.
    """
    realtime = _first_alias(parsed, REALTIME_TOKENS_TOTAL)
    decode = _by_rank(s for s in realtime if s.labels.get("mode") == DECODE_MODE)
    running = _by_rank(_first_alias(parsed, RUNNING_REQS))
    waiting = [
        _by_rank(_first_alias(parsed, names))
        for names in (QUEUE_REQS, DECODE_PREALLOC_QUEUE, DECODE_TRANSFER_QUEUE)
    ]
    ranks = sorted({*decode, *running, *(r for queue in waiting for r in queue)})
    return tuple(
        RankLoad(
            dp_rank=rank,
            decode_tokens=reduce_ranks(decode.get(rank, ())),
            running_reqs=reduce_ranks(running.get(rank, ())),
            waiting_reqs=_sum_known(*(reduce_ranks(queue.get(rank, ())) for queue in waiting)),
        )
        for rank in ranks
    )


def _count_where(samples: Iterable[Sample], value: float, *, equal: bool) -> int:
    return sum(1 for s in samples if (s.value == value) == equal and not math.isnan(s.value))


def _failure(role: Role, scraped_at: float, error: ScrapeFailure, detail: str) -> MetricsSnapshot:
    return MetricsSnapshot(role=role, scraped_at=scraped_at, ok=False, error=error, detail=detail)


def _tail(text: str, limit: int = 80) -> str:
    """The last line of a body, at most `limit` characters of its end (for the failure detail)."""
    return text.rsplit("\n", 1)[-1][-limit:]


def extract_snapshot(text: str, role: Role, scraped_at: float) -> MetricsSnapshot:
    """The MetricsSnapshot of one /metrics body of `role`; NOT_PROMETHEUS when nothing parses.

    Only a complete body is a scrape: every exporter SGLang and the routers use ends each line,
    the last one included, with "\n" (prometheus_client's generate_latest, the Rust
    metrics-exporter-prometheus), so a body that ends mid-line was cut short, and its last value
    may be a prefix of the real one ("12" of "12345"). It is TRUNCATED, a failed scrape, never
    read: a cut value would read as a lower counter (docs/decisions.md, "Failure accounting").
    """
    stripped = text.lstrip()
    if not stripped:
        return _failure(role, scraped_at, ScrapeFailure.NOT_PROMETHEUS, "empty body")
    if stripped.startswith("<"):
        return _failure(
            role, scraped_at, ScrapeFailure.NOT_PROMETHEUS, "HTML or XML body, not Prometheus text"
        )
    parsed = parse_samples(text, wanted_names(role))
    if not parsed.has_sample_lines:
        return _failure(
            role,
            scraped_at,
            ScrapeFailure.NOT_PROMETHEUS,
            f"no sample line in the body ({parsed.malformed_lines} malformed lines)",
        )
    if not text.endswith("\n"):
        return _failure(
            role,
            scraped_at,
            ScrapeFailure.TRUNCATED,
            f"body does not end at a line boundary (last line: {_tail(text)!r})",
        )
    if role == Role.ROUTER:
        health = _first_alias(parsed, ROUTER_WORKER_HEALTH)
        cb_state = _first_alias(parsed, ROUTER_CB_STATE)
        return MetricsSnapshot(
            role=role,
            scraped_at=scraped_at,
            ok=True,
            malformed_lines=parsed.malformed_lines,
            workers_unhealthy=_count_where(health, 1.0, equal=False) if health else None,
            circuit_breakers_open=(
                _count_where(cb_state, CB_STATE_OPEN, equal=True) if cb_state else None
            ),
        )
    transfer_failed = _value(parsed, TRANSFER_FAILED)
    bootstrap_failed = _value(parsed, BOOTSTRAP_FAILED)
    absent = (("transfer_failed",) if transfer_failed is None else ()) + (
        ("bootstrap_failed",) if bootstrap_failed is None else ()
    )
    return MetricsSnapshot(
        role=role,
        scraped_at=scraped_at,
        ok=True,
        malformed_lines=parsed.malformed_lines,
        transfer_failed=transfer_failed or 0.0,
        bootstrap_failed=bootstrap_failed or 0.0,
        absent_counters=absent,
        inflight_queue=_value(parsed, PREFILL_INFLIGHT_QUEUE),
        bootstrap_queue=_value(parsed, PREFILL_BOOTSTRAP_QUEUE),
        decode_prealloc_queue=_value(parsed, DECODE_PREALLOC_QUEUE),
        decode_transfer_queue=_value(parsed, DECODE_TRANSFER_QUEUE),
        running_reqs=_value(parsed, RUNNING_REQS),
        queue_reqs=_value(parsed, QUEUE_REQS),
        requests_total=_value(parsed, REQUESTS_TOTAL),
        generation_tokens_total=_value(parsed, GENERATION_TOKENS_TOTAL),
        prompt_tokens_total=_value(parsed, PROMPT_TOKENS_TOTAL),
        realtime_tokens_total=_value(parsed, REALTIME_TOKENS_TOTAL),
        ttft_count=_ttft_count(parsed),
        aborted_requests_total=_value(parsed, ABORTED_REQUESTS_TOTAL),
        http_requests_active=_generate_requests_active(parsed),
        ranks=rank_loads(parsed),
    )


# --- /v1/loads decode moments (0.5.23) ---

# Each DP rank's `decode_moments` row holds running sums over its decode steps: [steps, batch
# size, step µs, batch², batch × µs, generated tokens]. The last one only grows, and only when a
# decode step generated tokens, so it is a progress counter (a fake health request does no decode
# step); it is null until the first decode step.
DECODE_MOMENTS_TOKENS_INDEX = 5


def decode_moment_tokens(rows: Iterable[Mapping[str, object]]) -> float | None:
    """Decode tokens generated so far, summed over the DP rank rows of /v1/loads; None: absent."""
    total: float | None = None
    for row in rows:
        moments = row.get("decode_moments")
        if not isinstance(moments, list) or len(moments) <= DECODE_MOMENTS_TOKENS_INDEX:
            continue
        value = moments[DECODE_MOMENTS_TOKENS_INDEX]
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            continue
        total = float(value) if total is None else total + float(value)
    return total


def row_decode_tokens(row: Mapping[str, object]) -> float | None:
    """One /v1/loads row's decode tokens so far: its decode_moments tokens, 0 where the row holds
    `decode_moments` null (no decode step yet: load_inquirer.py:226-227 @ 0.5.23), None where
    the row has no such field (before 0.5.19) or an unreadable one."""
    if "decode_moments" not in row:
        return None
    moments = row["decode_moments"]
    if moments is None:
        return 0.0
    if not isinstance(moments, list) or len(moments) <= DECODE_MOMENTS_TOKENS_INDEX:
        return None
    value = moments[DECODE_MOMENTS_TOKENS_INDEX]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


# --- Counter deltas between two scrapes ---

COUNTER_FIELDS: tuple[str, ...] = (
    "transfer_failed",
    "bootstrap_failed",
    "requests_total",
    "generation_tokens_total",
    "prompt_tokens_total",
    "realtime_tokens_total",
)


@dataclass(frozen=True, slots=True)
class CounterDeltas:
    """How much each counter of one role grew between two successful scrapes (for `check`).

    A counter that went down was reset: its increase is its current value, as Prometheus rate()
    counts it, and `reset` says that happened to at least one counter. These deltas know no
    process identity; the detector's own accounting (watchdog/decide/counters.py) counts a drop
    only together with a new process. A series absent from either scrape is unknown: None (0.0
    for the failure counters), never a reset.
    """

    role: Role
    interval_seconds: float
    reset: bool
    transfer_failed: float
    bootstrap_failed: float
    requests_total: float | None
    generation_tokens_total: float | None
    prompt_tokens_total: float | None
    realtime_tokens_total: float | None


def _counter_value(snapshot: MetricsSnapshot, name: str) -> float | None:
    """A counter as read, None where its series was absent (failure counters read 0 then)."""
    if name in snapshot.absent_counters:
        return None
    value: float | None = getattr(snapshot, name)
    return value


def counter_deltas(previous: MetricsSnapshot, current: MetricsSnapshot) -> CounterDeltas | None:
    """Counter increases from `previous` to `current` (same role, both ok); None otherwise."""
    if previous.role != current.role or not (previous.ok and current.ok):
        return None
    reset = False
    values: dict[str, float | None] = {}
    for name in COUNTER_FIELDS:
        before = _counter_value(previous, name)
        after = _counter_value(current, name)
        if before is None or after is None:
            values[name] = None  # missing from a scrape: unknown, not a reset to zero
            continue
        reset = reset or after < before
        values[name] = counter_increase(before, after)
    return CounterDeltas(
        role=current.role,
        interval_seconds=max(0.0, current.scraped_at - previous.scraped_at),
        reset=reset,
        transfer_failed=values["transfer_failed"] or 0.0,
        bootstrap_failed=values["bootstrap_failed"] or 0.0,
        requests_total=values["requests_total"],
        generation_tokens_total=values["generation_tokens_total"],
        prompt_tokens_total=values["prompt_tokens_total"],
        realtime_tokens_total=values["realtime_tokens_total"],
    )


def with_timing(snapshot: MetricsSnapshot, duration_seconds: float) -> MetricsSnapshot:
    """The snapshot with the scrape's duration filled in."""
    return dataclasses.replace(snapshot, duration_seconds=duration_seconds)
