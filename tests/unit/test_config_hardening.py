"""Bounds the daemon needs: durations, listen addresses, expect_regex, config size, pause leases."""

from __future__ import annotations

import time
import tomllib
from pathlib import Path
from typing import Any

import pytest

from watchdog.commands.pause import MAX_PAUSE_SECONDS, parse_duration
from watchdog.config import (
    EXPECT_REGEX_TEXT_CHARS,
    MAX_CONFIG_BYTES,
    MAX_TIMEOUT_SECONDS,
    MAX_WINDOW_SECONDS,
    MIN_SECONDS,
    GroupSection,
    ProbeSection,
    load_config,
    parse_config,
    parse_listen,
    regex_backtracking_risk,
)
from watchdog.configfile import build_config
from watchdog.errors import ConfigError, UsageError

DATA = Path(__file__).resolve().parents[1] / "data"


def _minimal() -> dict[str, Any]:
    return tomllib.loads((DATA / "valid-minimal.toml").read_text())


def _issues(*layers: dict[str, Any]) -> list[str]:
    try:
        build_config(_minimal(), *layers)
    except ConfigError as exc:
        return [f"{issue.key}: {issue.reason}" for issue in exc.issues]
    return []


# --- durations --------------------------------------------------------------------------------

# (section, key, maximum, whether 0 switches it off): every duration key of the config.
DURATIONS = [
    ("watchdog", "cycle_seconds", MAX_TIMEOUT_SECONDS, False),
    ("watchdog", "shutdown_timeout_seconds", MAX_TIMEOUT_SECONDS, False),
    ("watchdog", "evidence_timeout_seconds", MAX_TIMEOUT_SECONDS, False),
    ("probe", "period_seconds", MAX_TIMEOUT_SECONDS, False),
    ("probe", "timeout_seconds", MAX_TIMEOUT_SECONDS, False),
    ("probe", "connect_timeout_seconds", MAX_TIMEOUT_SECONDS, False),
    ("probe", "stream_idle_seconds", MAX_TIMEOUT_SECONDS, False),
    ("probe", "multiround_every_seconds", MAX_TIMEOUT_SECONDS, True),
    ("probe", "direct_every_seconds", MAX_TIMEOUT_SECONDS, True),
    ("probe", "dp_probe_every_seconds", MAX_TIMEOUT_SECONDS, True),
    ("probe", "health_timeout_seconds", MAX_TIMEOUT_SECONDS, False),
    ("probe", "scrape_timeout_seconds", MAX_TIMEOUT_SECONDS, False),
    ("stall", "no_progress_seconds", MAX_WINDOW_SECONDS, False),
    ("stall", "window_seconds", MAX_WINDOW_SECONDS, False),
    ("stall", "pinned_inflight_seconds", MAX_WINDOW_SECONDS, False),
    ("stall", "startup_timeout_seconds", MAX_TIMEOUT_SECONDS, False),
    ("stall", "decode_only_grace_seconds", MAX_WINDOW_SECONDS, True),
    ("restart", "ready_timeout_seconds", MAX_TIMEOUT_SECONDS, False),
    ("restart", "budget_window_seconds", MAX_WINDOW_SECONDS, False),
    ("restart", "backoff_seconds", MAX_WINDOW_SECONDS, True),
    ("restart", "verify_timeout_seconds", MAX_TIMEOUT_SECONDS, False),
    ("restart", "soak_seconds", MAX_WINDOW_SECONDS, True),
    ("restart", "clear_timeout_seconds", MAX_TIMEOUT_SECONDS, False),
]


def _layer(section: str, key: str, value: float) -> dict[str, Any]:
    if section == "watchdog":
        return {"watchdog": {key: value}}
    return {"group": {section: {key: value}}}


def _key(section: str, key: str) -> str:
    return f"watchdog.{key}" if section == "watchdog" else f"group#1.{section}.{key}"


def test_every_duration_key_is_in_the_table() -> None:
    """A new duration key cannot skip the bounds: the table lists every *_seconds setting."""
    config = build_config(_minimal())
    sections = {
        "watchdog": config.watchdog,
        "probe": config.group[0].probe,
        "stall": config.group[0].stall,
        "restart": config.group[0].restart,
    }
    keys = {
        (name, key)
        for name, section in sections.items()
        for key in type(section).model_fields
        if key.endswith("_seconds")
    }
    assert keys == {(section, key) for section, key, _, _ in DURATIONS}


@pytest.mark.parametrize(
    ("section", "key", "high", "zero_is_off"), DURATIONS, ids=[d[1] for d in DURATIONS]
)
@pytest.mark.parametrize("value", [1e-300, MIN_SECONDS / 2, 1e300, float("nan"), float("inf")])
def test_durations_out_of_bounds_are_refused_naming_the_key(
    section: str, key: str, high: float, zero_is_off: bool, value: float
) -> None:
    """Each duration refuses what would spin, overflow a date or never end, naming its key."""
    issues = _issues(_layer(section, key, value))
    assert issues, (key, value)
    assert all(issue.startswith(_key(section, key) + ": ") for issue in issues), issues


@pytest.mark.parametrize(
    ("section", "key", "high", "zero_is_off"), DURATIONS, ids=[d[1] for d in DURATIONS]
)
def test_durations_at_the_bounds_are_accepted(
    section: str, key: str, high: float, zero_is_off: bool
) -> None:
    """The bounds themselves (and 0 where 0 means off) pass the bounds check; the cross-field
    rules (timeouts that must fit in each other) still apply and are not what this tests."""
    values = [*([0.0] if zero_is_off else []), high]
    if key != "health_timeout_seconds":  # its own floor is 2 s (docs/sglang.md §7.1)
        values.append(MIN_SECONDS)
    for value in values:
        issues = _issues(_layer(section, key, value))
        own = [i for i in issues if i.startswith(_key(section, key) + ": ")]
        assert not [i for i in own if "minimum of" in i or "maximum of" in i], (value, own)
        assert not [i for i in own if "Input should" in i], (value, own)


def test_zero_is_refused_where_it_does_not_mean_off() -> None:
    """period_seconds = 0 keeps pydantic's plain message (the existing negative-duration rule)."""
    assert _issues(_layer("probe", "period_seconds", 0)) == [
        "group#1.probe.period_seconds: Input should be greater than 0 (got 0)"
    ]


# --- metrics_listen ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("listen", "expected"),
    [
        ("127.0.0.1:9464", ("127.0.0.1", 9464)),
        ("localhost:9464", ("localhost", 9464)),
        ("[::1]:9000", ("::1", 9000)),
        ("0.0.0.0:65535", ("0.0.0.0", 65535)),
        ("metrics.example.org:1", ("metrics.example.org", 1)),
    ],
)
def test_listen_addresses_that_work(listen: str, expected: tuple[str, int]) -> None:
    """IPv4, host names and bracketed IPv6 parse to what the listener binds."""
    assert parse_listen(listen) == expected
    assert build_config(_minimal(), {"watchdog": {"metrics_listen": listen}})


@pytest.mark.parametrize(
    "listen",
    [
        ":9000",
        "host:99999",
        "host:-1",
        "host:0",
        "exa mple:1",
        "h\u00e9st:9464",
        "host:\u0661\u0662",
        "::1:9000",
        "[nope]:9000",
        "-host:1",
        "host",
        "",
        "a" * 300 + ":1",
    ],
)
def test_listen_addresses_that_cannot_work_are_refused(listen: str) -> None:
    """Every malformed HOST:PORT is a config error on watchdog.metrics_listen."""
    with pytest.raises(ValueError, match=r"HOST:PORT|port|host|IPv6"):
        parse_listen(listen)
    issues = _issues({"watchdog": {"metrics_listen": listen}})
    assert len(issues) == 1
    assert issues[0].startswith("watchdog.metrics_listen: ")
    assert len(issues[0]) < 400  # a long value is quoted, not copied whole


# --- names, paths, urls -----------------------------------------------------------------------


@pytest.mark.parametrize("suffix", ["\n", "\r", "\t", " ", "\x00", "\u2028"])
def test_names_with_control_or_space_characters_are_refused(suffix: str) -> None:
    """A trailing newline (or any whitespace/control character) in a group or unit name."""
    group = {"name": "dsv4" + suffix, "decode": {"unit": "sglang-dsv4-decode.service" + suffix}}
    assert sorted(i.split(":")[0] for i in _issues({"group": [group]})) == [
        "group#1.decode.unit",
        "group#1.name",
    ]


def test_paths_with_a_nul_byte_or_empty_are_refused(tmp_path: Path) -> None:
    """state_dir and the key files: a NUL can be written in TOML ("\\u0000") but not opened."""
    issues = _issues(
        {
            "watchdog": {"state_dir": f"{tmp_path}\x00x"},
            "group": {"probe": {"api_key_file": "k\x00", "admin_api_key_file": ""}},
        }
    )
    assert sorted(i.split(":")[0] for i in issues) == [
        "group#1.probe.admin_api_key_file",
        "group#1.probe.api_key_file",
        "watchdog.state_dir",
    ]


@pytest.mark.parametrize("url", ["http://127.0.0.1:30001\t", "http://127.0.0.1:30001/a b"])
def test_urls_with_whitespace_are_refused(url: str) -> None:
    """urlsplit drops tabs and newlines silently; the HTTP client would refuse the URL later."""
    issues = _issues({"group": {"router": {"url": url}}})
    assert [i.split(":")[0] for i in issues] == ["group#1.router.url"]


# --- expect_regex -----------------------------------------------------------------------------

ACCEPTED_PATTERNS = [
    "ok",
    "(?i)\\bok\\b",
    "^\\s*ok",
    ".*.*x",
    "\\d+\\.\\d+",
    "(?:ab|cd)?x",
    "(ab|cd){1}x",
    "(a+)x",
    "[(+*]+",
    "\\(a+\\)+",
    "a++b*?",
    "(?=.*ok).*",
    "(?#(a+)ok",
]
REFUSED_PATTERNS = [
    ("(a+)+$", "repeats a group"),
    ("(a|aa)*", "repeats a group"),
    ("((a|b)c)*", "repeats a group"),
    ("(?:a*){2}", "repeats a group"),
    ("(ab|cd){2,}", "repeats a group"),
    (".*.*.*x", "more than 2 repetitions"),
    ("a{2,}b{3,5}c+", "more than 2 repetitions"),
    ("[ab]*[ab]*[ab]*x", "more than 2 repetitions"),
    ("\\w+\\s+\\w+x", "more than 2 repetitions"),
    ("([ab]+)*", "repeats a group"),
    ("(a)\\1", "backreference"),
    ("(?P<x>a)(?P=x)", "backreference"),
    ("(a)?(?(1)b|c)", "backreference"),
]


@pytest.mark.parametrize("pattern", ACCEPTED_PATTERNS)
def test_expect_regex_accepts_bounded_patterns(pattern: str) -> None:
    """Literal text, classes, one or two flat repetitions, optional groups."""
    assert regex_backtracking_risk(pattern) == ""
    assert build_config(_minimal(), {"group": {"probe": {"expect_regex": pattern}}})


@pytest.mark.parametrize(("pattern", "why"), REFUSED_PATTERNS)
def test_expect_regex_refuses_backtracking_patterns(pattern: str, why: str) -> None:
    """Nested repetition, more than two repetitions and backreferences: refused with the rule."""
    assert why in regex_backtracking_risk(pattern)
    (issue,) = _issues({"group": {"probe": {"expect_regex": pattern}}})
    assert issue.startswith("group#1.probe.expect_regex: ")
    assert "at most 2 repetitions" in issue


# Accepted patterns that backtrack the most (two repetitions over the same characters, a
# repetition before a lookahead that fails), against texts built to make them fail late.
WORST_ACCEPTED = [".*.*x", "(.*)(.*)x", "\\s*\\S*x", "(?=.*.*x)", "[a ]*[a ]*x$", "(?:a|b)?.*.*x"]
HOSTILE_TEXTS = ["a" * 65536, " a" * 32768, "ab" * 32768]


@pytest.mark.parametrize("pattern", WORST_ACCEPTED)
def test_worst_accepted_regex_on_a_hostile_answer_is_fast(pattern: str) -> None:
    """On the 64 KiB a server may stream, each accepted worst case finishes in milliseconds,
    because only the first EXPECT_REGEX_TEXT_CHARS characters are searched."""
    assert regex_backtracking_risk(pattern) == ""
    probe = ProbeSection(expect_regex=pattern)
    for text in HOSTILE_TEXTS:
        # CPU time of this thread, not wall-clock time: other work on the machine does not count.
        started = time.thread_time()
        assert not probe.expect_matches(text)
        # Measured: under 10 ms on a loaded 2-core machine; the bound leaves room for noise.
        assert time.thread_time() - started < 0.25, (pattern, text[:4])


def test_expect_matches_searches_only_the_start_of_the_output() -> None:
    """The documented bound: text after EXPECT_REGEX_TEXT_CHARS characters is not searched."""
    probe = ProbeSection(expect_regex="ok")
    assert probe.expect_matches("x" * (EXPECT_REGEX_TEXT_CHARS - 2) + "ok")
    assert not probe.expect_matches("x" * EXPECT_REGEX_TEXT_CHARS + "ok")
    assert ProbeSection().expect_matches("anything")  # unset: every output matches


# --- the file itself --------------------------------------------------------------------------


def test_a_config_file_over_the_size_cap_is_refused(tmp_path: Path) -> None:
    """A file (or device) larger than MAX_CONFIG_BYTES is never read whole."""
    big = tmp_path / "big.toml"
    big.write_text("#" * (MAX_CONFIG_BYTES + 1))
    with pytest.raises(ConfigError, match=r"big.toml: \(file\): larger than 1 MiB"):
        load_config(big)
    with pytest.raises(ConfigError, match=r"/dev/zero: \(file\): larger than 1 MiB"):
        load_config("/dev/zero")


def test_nested_inline_tables_are_a_config_error(tmp_path: Path) -> None:
    """Deep inline tables overflow tomllib's recursion like deep arrays do."""
    path = tmp_path / "deep.toml"
    path.write_text("a = " + "{b = " * 10000 + "1" + "}" * 10000 + "\n")
    with pytest.raises(ConfigError, match=r"nested too deeply"):
        load_config(path)


def test_a_value_too_deep_for_its_key_is_reported_briefly() -> None:
    """Nesting that tomllib accepts but a key refuses: the message quotes a bounded excerpt."""
    deep: Any = "x"
    for _ in range(300):
        deep = [deep]
    data = _minimal()
    data["group"][0]["probe"] = {"model": deep}
    with pytest.raises(ConfigError) as caught:
        parse_config(data, "mem.toml")
    (issue,) = caught.value.issues
    assert issue.key == "group#1.probe.model"
    assert len(issue.reason) < 300


def test_group_section_keeps_its_defaults() -> None:
    """The bounds changed no default: the minimal file still loads with the documented values."""
    group: GroupSection = load_config(DATA / "valid-minimal.toml").group[0]
    assert group.probe.period_seconds == 5.0
    assert group.restart.backoff_seconds == 300.0


# --- pause --for ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90", 90.0), ("90s", 90.0), ("30m", 1800.0), ("1.5h", 5400.0), ("168h", MAX_PAUSE_SECONDS)],
)
def test_pause_durations_that_work(text: str, seconds: float) -> None:
    """Numbers with s, m or h up to a week."""
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("1e400s", "not a positive duration"),
        ("99999999999d", "not a positive duration"),
        ("-5m", "not a positive duration"),
        ("0", "not a positive duration"),
        ("0m", "not a positive duration"),
        ("nan", "not a positive duration"),
        ("inf", "not a positive duration"),
        ("5m\n", "not a positive duration"),
        ("\u0665m", "not a positive duration"),
        ("", "not a positive duration"),
        ("168.5h", "longer than the maximum lease of 7 days"),
        ("99999999999h", "longer than the maximum lease of 7 days"),
        ("9" * 400, "longer than the maximum lease of 7 days"),
    ],
)
def test_pause_durations_that_cannot_work_are_usage_errors(text: str, why: str) -> None:
    """Absurd leases are refused (exit 2 through the CLI) with the reason, quoting --for briefly."""
    with pytest.raises(UsageError) as caught:
        parse_duration(text)
    message = str(caught.value)
    assert message.startswith("--for ")
    assert why in message
    assert len(message) < 200
