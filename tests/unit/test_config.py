"""Config loading: every validation rule has a bad file and an exact message naming file and key."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import pytest

import watchdog
from watchdog.cli import main
from watchdog.config import (
    DECODE_ONLY_EXPLANATION,
    effective_config,
    load_config,
    mask_url,
    parse_config,
)
from watchdog.configfile import (
    build_config,
    config_text,
    effective_toml,
    merge_layers,
    render_toml,
    write_config,
)
from watchdog.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data"

# One file per rule: (file, [messages after "FILE: "]).
INVALID = [
    (
        "invalid-admin-api-key-file.toml",
        [
            "group#1.probe.admin_api_key_file: '/nonexistent/sglang-watchdog/admin-api-key' is not a readable file"
        ],
    ),
    (
        "invalid-api-key-file.toml",
        [
            "group#1.probe.api_key_file: '/nonexistent/sglang-watchdog/api-key' is not a readable file"
        ],
    ),
    (
        "invalid-decode-only-policy.toml",
        [
            "group#1.stall.on_decode_only_restart: Input should be 'co-restart' or 'alert' (got 'restart-decode')"
        ],
    ),
    (
        "invalid-duplicate-group.toml",
        ["group#2.name: 'dsv4' is already used by group#1; group names must be unique"],
    ),
    (
        "invalid-duplicate-unit.toml",
        [
            "group#2.decode.unit: 'sglang-dsv4-decode.service' is already used by group#1.decode.unit"
        ],
    ),
    ("invalid-empty-groups.toml", ["group: at least one [[group]] is required"]),
    (
        "invalid-expect-regex.toml",
        [
            "group#1.probe.expect_regex: not a valid regular expression: missing ), unterminated subpattern at position 2"
        ],
    ),
    (
        "invalid-group-name.toml",
        [
            "group#1.name: '../etc' is not a safe group name (1-63 of letters, digits, '_', '.', '-', starting with a letter or digit)"
        ],
    ),
    (
        "invalid-metrics-listen.toml",
        ["watchdog.metrics_listen: '0.0.0.0' is not HOST:PORT (e.g. 127.0.0.1:9464)"],
    ),
    (
        "invalid-health-timeout.toml",
        [
            "group#1.probe.health_timeout_seconds: 1 is below 2: SGLang's /health sleeps 1 s before its first check and answers a healthy server in 1.00-1.05 s, so a shorter deadline times healthy workers out (docs/sglang.md §7.1)"
        ],
    ),
    ("invalid-missing-decode.toml", ["group#1.decode: required key is missing"]),
    (
        "invalid-negative-duration.toml",
        ["watchdog.cycle_seconds: Input should be greater than 0 (got -1)"],
    ),
    ("invalid-no-groups.toml", ["group: required key is missing"]),
    (
        "invalid-order-decode-first.toml",
        [
            "group#1.restart.order: ['decode', 'prefill', 'router'] is not prefill before decode before router; decode must never be restarted without prefill before it: a decode restarted against a long-running prefill degrades the KV-transfer bootstrap state (transfers fail or hang while /health stays 200); the safe action is the co-restart prefill -> decode -> router"
        ],
    ),
    (
        "invalid-order-missing-prefill.toml",
        [
            'group#1.restart.order: [\'decode\', \'router\'] omits prefill; the order must be ["prefill", "decode", "router"] because decode must never be restarted without prefill before it: a decode restarted against a long-running prefill degrades the KV-transfer bootstrap state (transfers fail or hang while /health stays 200); the safe action is the co-restart prefill -> decode -> router'
        ],
    ),
    (
        "invalid-order-unknown-role.toml",
        ["group#1.restart.order: unknown role(s) ['gpu']; roles are prefill, decode, router"],
    ),
    (
        "invalid-probe-timeout-vs-ready.toml",
        [
            "group#1.restart.ready_timeout_seconds: 45 must be greater than probe.timeout_seconds (60)"
        ],
    ),
    (
        "invalid-probe-timeout-vs-verify.toml",
        [
            "group#1.restart.verify_timeout_seconds: 30 must be greater than probe.timeout_seconds (30)"
        ],
    ),
    (
        "invalid-several.toml",
        [
            "group#1.name: 'a b' is not a safe group name (1-63 of letters, digits, '_', '.', '-', starting with a letter or digit)",
            "group#1.prefill.extra: unknown key",
        ],
    ),
    (
        "invalid-stream-idle.toml",
        [
            "group#1.probe.stream_idle_seconds: 30 must not exceed timeout_seconds (20), the hard deadline of the whole probe"
        ],
    ),
    (
        "invalid-transfer-failure-ratio.toml",
        ["group#1.stall.transfer_failure_ratio: Input should be less than or equal to 1 (got 1.5)"],
    ),
    (
        "invalid-transfer-min-attempts.toml",
        ["group#1.stall.transfer_min_attempts: Input should be greater than 0 (got 0)"],
    ),
    (
        "invalid-toml-syntax.toml",
        [
            "(file): invalid TOML: Expected ']' at the end of a table declaration (at line 12, column 13)"
        ],
    ),
    (
        "invalid-unit-name.toml",
        [
            "group#1.decode.unit: 'sglang dsv4 decode' is not a valid systemd service unit name (letters, digits, ':', '_', '.', '-', an optional '@instance', ending in '.service')"
        ],
    ),
    (
        "invalid-unit-suffix.toml",
        [
            "group#1.router.unit: 'sglang-dsv4-router.socket' is not a valid systemd service unit name (letters, digits, ':', '_', '.', '-', an optional '@instance', ending in '.service')"
        ],
    ),
    ("invalid-unknown-key.toml", ["group#1.probe.timeout: unknown key"]),
    ("invalid-url-no-host.toml", ["group#1.router.url: 'http://:30001' has no host"]),
    (
        "invalid-url-scheme.toml",
        ["group#1.decode.url: 'ftp://127.0.0.1:30002' is not an http(s) URL"],
    ),
    (
        "invalid-wrong-type.toml",
        [
            "group#1.restart.max_restarts: Input should be a valid integer, unable to parse string as an integer (got 'three')"
        ],
    ),
    # Values the parser used to accept but the daemon could not run with (crashes, busy loops).
    (
        "invalid-toml-nesting.toml",
        ["(file): invalid TOML: arrays or inline tables nested too deeply"],
    ),
    (
        "invalid-state-dir-nul.toml",
        [
            "watchdog.state_dir: '/var/lib/sglang-watchdog\\x00x' contains a NUL byte, which no file name can"
        ],
    ),
    (
        "invalid-metrics-listen-port.toml",
        ["watchdog.metrics_listen: '127.0.0.1:99999': the port must be a number from 1 to 65535"],
    ),
    (
        "invalid-metrics-listen-host.toml",
        [
            "watchdog.metrics_listen: 'exa mple:9464': 'exa mple' is not an IP address or host name (ASCII letters, digits, '-' and '.')"
        ],
    ),
    (
        "invalid-metrics-listen-ipv6.toml",
        ["watchdog.metrics_listen: '::1:9464': an IPv6 host goes in brackets, e.g. [::1]:9464"],
    ),
    (
        "invalid-group-name-newline.toml",
        [
            "group#1.name: 'dsv4\\n' is not a safe group name (1-63 of letters, digits, '_', '.', '-', starting with a letter or digit)"
        ],
    ),
    (
        "invalid-unit-newline.toml",
        [
            "group#1.decode.unit: 'sglang-dsv4-decode.service\\n' is not a valid systemd service unit name (letters, digits, ':', '_', '.', '-', an optional '@instance', ending in '.service')"
        ],
    ),
    (
        "invalid-url-tab.toml",
        [
            "group#1.decode.url: 'http://127.0.0.1:30002\\t' contains whitespace or a control character"
        ],
    ),
    (
        "invalid-duration-tiny.toml",
        [
            "group#1.probe.period_seconds: 1e-300 is below the minimum of 0.05 s: shorter periods spin the loop and shorter timeouts fail every request"
        ],
    ),
    (
        "invalid-duration-huge.toml",
        ["group#1.restart.backoff_seconds: 1e+300 is above the maximum of 604800 s (a week)"],
    ),
    (
        "invalid-duration-nan.toml",
        ["watchdog.cycle_seconds: Input should be a finite number (got nan)"],
    ),
    (
        "invalid-expect-regex-nested.toml",
        [
            "group#1.probe.expect_regex: '(a+)+$' repeats a group that itself repeats or alternates (exponential backtracking); Python's re has no timeout, so an expect_regex may have at most 2 repetitions (*, + or {m,n}), none of a group that itself contains a repetition or an alternation (|), and no backreferences"
        ],
    ),
    (
        "invalid-expect-regex-repeats.toml",
        [
            "group#1.probe.expect_regex: '.*.*.*ok' has more than 2 repetitions; Python's re has no timeout, so an expect_regex may have at most 2 repetitions (*, + or {m,n}), none of a group that itself contains a repetition or an alternation (|), and no backreferences"
        ],
    ),
    (
        "invalid-expect-regex-backreference.toml",
        [
            "group#1.probe.expect_regex: '(o)\\\\1k' uses a backreference; Python's re has no timeout, so an expect_regex may have at most 2 repetitions (*, + or {m,n}), none of a group that itself contains a repetition or an alternation (|), and no backreferences"
        ],
    ),
]


@pytest.mark.parametrize(("name", "messages"), INVALID, ids=[row[0] for row in INVALID])
def test_invalid_file_is_rejected_with_exact_messages(
    name: str,
    messages: list[str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`watchdog validate` prints every issue as 'error: FILE: KEY: reason' and exits 2."""
    monkeypatch.chdir(REPO)
    path = f"tests/data/{name}"
    code = main(["validate", "--config", path])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err == [f"error: {path}: {message}" for message in messages]


def test_there_is_a_bad_file_for_at_least_ten_rules() -> None:
    """The rule table covers at least ten distinct validation rules."""
    assert len({row[0] for row in INVALID}) >= 10
    assert sorted(p.name for p in DATA.glob("invalid-*.toml")) == sorted(r[0] for r in INVALID)


@pytest.mark.parametrize(
    "name", ["invalid-order-decode-first.toml", "invalid-order-missing-prefill.toml"]
)
def test_decode_only_order_is_refused_with_the_reason(name: str) -> None:
    """An order that restarts decode without prefill first explains the bootstrap degradation."""
    with pytest.raises(ConfigError) as caught:
        load_config(DATA / name)
    (issue,) = caught.value.issues
    assert issue.key == "group#1.restart.order"
    assert DECODE_ONLY_EXPLANATION in issue.reason


def test_example_config_validates_and_prints_effective_config(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shipped example validates, and validate prints the config with defaults filled in."""
    monkeypatch.chdir(REPO)
    assert main(["validate", "--config", "configs/example.toml"]) == 0
    printed = tomllib.loads(capsys.readouterr().out)
    group = printed["group"][0]
    assert group["prefill"]["url"] == "http://127.0.0.1:30000"
    assert group["decode"]["url"] == "http://127.0.0.1:30002"
    assert group["router"]["url"] == "http://127.0.0.1:30001"
    assert group["restart"]["order"] == ["prefill", "decode", "router"]


def test_defaults_are_filled_in_for_a_minimal_file() -> None:
    """A file with only the required keys gets the documented defaults."""
    config = load_config(DATA / "valid-minimal.toml")
    group = config.group[0]
    assert config.watchdog.cycle_seconds == 5
    assert group.probe.path == "/v1/completions"
    assert group.probe.max_in_flight == 4
    assert group.stall.probe_failures == 3
    assert group.restart.max_restarts == 3


def test_secrets_are_masked_in_the_effective_config(tmp_path: Path) -> None:
    """URL userinfo is masked and the API key file's contents are never shown."""
    path = _with_secrets(tmp_path)
    shown = json.dumps(effective_config(load_config(path)))
    assert "hunter2" not in shown
    assert "sk-very-secret" not in shown
    assert "sk-admin-secret" not in shown
    assert "http://***@127.0.0.1:30001" in shown  # the user name goes too: it may be a token
    assert "//user" not in shown


def _with_secrets(tmp_path: Path) -> Path:
    """valid-minimal.toml with a password in the router URL and an API key file."""
    key = tmp_path / "key"
    key.write_text("sk-very-secret")
    admin_key = tmp_path / "admin-key"
    admin_key.write_text("sk-admin-secret")
    secrets = {
        "group": {
            "router": {"url": "http://user:hunter2@127.0.0.1:30001"},
            "probe": {"api_key_file": str(key), "admin_api_key_file": str(admin_key)},
        }
    }
    return write_config(tmp_path / "c.toml", _minimal(), secrets)


def _minimal() -> dict[str, Any]:
    return tomllib.loads((DATA / "valid-minimal.toml").read_text())


def test_mask_url_leaves_plain_urls_alone() -> None:
    """A URL without a password is printed unchanged."""
    assert mask_url("http://127.0.0.1:30000") == "http://127.0.0.1:30000"


def test_missing_file_names_the_file() -> None:
    """A config path that does not exist is a ConfigError naming the path."""
    with pytest.raises(ConfigError, match=r"nope.toml: \(file\): cannot read"):
        load_config("nope.toml")


def test_every_issue_is_reported_at_once() -> None:
    """Several problems in one document are all listed, not only the first."""
    with pytest.raises(ConfigError) as caught:
        parse_config({"watchdog": {"cycle_seconds": 0, "bogus": 1}}, "mem.toml")
    keys = sorted(issue.key for issue in caught.value.issues)
    assert keys == ["group", "watchdog.bogus", "watchdog.cycle_seconds"]


def test_import_watchdog_is_this_project() -> None:
    """`import watchdog` resolves to this package, not the PyPI filesystem-events library."""
    assert Path(watchdog.__file__).resolve().parent == REPO / "watchdog"
    assert hasattr(watchdog, "__version__")


def test_version_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """`watchdog --version` prints the distribution name and version."""
    with pytest.raises(SystemExit) as caught:
        main(["--version"])
    assert caught.value.code == 0
    assert capsys.readouterr().out.strip() == f"sglang-watchdog {watchdog.__version__}"


def test_daemon_with_a_missing_config_exits_2_naming_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Without a subcommand the daemon starts; a config file that does not exist exits 2."""
    missing = tmp_path / "watchdog.toml"
    assert main(["--config", str(missing), "--once"]) == 2
    assert f"{missing}: (file): cannot read" in capsys.readouterr().err


# --- rendering and building -------------------------------------------------------------------

ROUND_TRIP = sorted(
    [*(REPO / "configs").glob("*.toml"), DATA / "valid-minimal.toml"], key=lambda p: p.name
)


@pytest.mark.parametrize("path", ROUND_TRIP, ids=[p.name for p in ROUND_TRIP])
def test_render_round_trips(path: Path, tmp_path: Path) -> None:
    """load(render(load(file))) == load(file) for the shipped configs and the minimal one."""
    config = load_config(path)
    rendered = tmp_path / "rendered.toml"
    rendered.write_text(render_toml(config))
    assert load_config(rendered) == config


def test_round_trip_covers_the_example() -> None:
    """The example (every key) is among the round-tripped files."""
    assert REPO / "configs" / "example.toml" in ROUND_TRIP


def test_validate_output_is_itself_a_valid_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`watchdog validate` prints TOML that loads to the same Config as the file it checked."""
    monkeypatch.chdir(REPO)
    assert main(["validate", "--config", "configs/example.toml"]) == 0
    printed = tmp_path / "printed.toml"
    printed.write_text(capsys.readouterr().out)
    assert load_config(printed) == load_config(REPO / "configs" / "example.toml")


def test_validate_output_with_secrets_masks_them_and_still_validates(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Masked fields aside (the URL password), validate's output loads to the same Config."""
    path = _with_secrets(tmp_path)
    assert main(["validate", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "hunter2" not in out
    assert "sk-very-secret" not in out
    assert 'url = "http://***@127.0.0.1:30001"' in out
    assert f'api_key_file = "{tmp_path / "key"}"  # contents never shown' in out
    assert "sk-admin-secret" not in out
    assert f'admin_api_key_file = "{tmp_path / "admin-key"}"  # contents never shown' in out
    printed = tmp_path / "printed.toml"
    printed.write_text(out)
    reloaded = load_config(printed)
    original = load_config(path)
    assert reloaded != original  # the password is gone
    assert effective_config(reloaded) == effective_config(original)
    assert reloaded.group[0].probe == original.group[0].probe


def test_effective_toml_is_the_masked_config(tmp_path: Path) -> None:
    """effective_toml() is effective_config() as TOML, unset keys left out (TOML has no null)."""
    config = load_config(_with_secrets(tmp_path))
    effective = effective_config(config)
    assert effective["group"][0]["router"]["metrics_url"] is None
    del effective["group"][0]["router"]["metrics_url"]
    assert tomllib.loads(effective_toml(config)) == effective


def test_builder_fills_in_only_the_parser_defaults() -> None:
    """Overrides with only the required keys build the same Config as the minimal file."""
    assert build_config(_minimal()) == load_config(DATA / "valid-minimal.toml")


def test_builder_rejects_a_bad_override_loudly() -> None:
    """An unknown key or a bad value is a ConfigError naming the key, never a silent file."""
    with pytest.raises(ConfigError) as caught:
        config_text(
            _minimal(), {"group": {"probe": {"timeout": 3}}, "watchdog": {"journal_lines": 0}}
        )
    keys = sorted(issue.key for issue in caught.value.issues)
    assert keys == ["group#1.probe.timeout", "watchdog.journal_lines"]
    assert "<overrides>" in str(caught.value)


def test_builder_without_groups_is_rejected() -> None:
    """No group anywhere in the layers: the parser's 'required key is missing'."""
    with pytest.raises(ConfigError, match=r"group: required key is missing"):
        build_config({"watchdog": {"cycle_seconds": 1}})


def test_layers_merge_tables_and_apply_a_group_table_to_every_group() -> None:
    """Later layers win key by key; "group" as a table reaches every group, as a list by position."""
    first = {"name": "a", "probe": {"model": "m"}}
    second = {"name": "b"}
    timings = {"watchdog": {"cycle_seconds": 1}, "group": {"probe": {"timeout_seconds": 3}}}
    layers = (
        timings,
        {"watchdog": {"journal_lines": 7}, "group": [first, second]},
        {"group": [{}, {"probe": {"timeout_seconds": 4}}]},
    )
    document = merge_layers(*layers)
    assert document == {
        "watchdog": {"cycle_seconds": 1, "journal_lines": 7},
        "group": [
            {"name": "a", "probe": {"timeout_seconds": 3, "model": "m"}},
            {"name": "b", "probe": {"timeout_seconds": 4}},
        ],
    }
    assert first == {"name": "a", "probe": {"model": "m"}}  # inputs untouched
    assert timings == {"watchdog": {"cycle_seconds": 1}, "group": {"probe": {"timeout_seconds": 3}}}
    late = merge_layers({"group": [first]}, {"group": {"probe": {"model": "z"}}})
    assert late["group"][0]["probe"] == {"model": "z"}


def test_write_config_writes_what_load_config_reads(tmp_path: Path) -> None:
    """The written file is the rendered, validated config."""
    path = write_config(
        tmp_path / "w.toml", _minimal(), {"group": {"stall": {"probe_failures": 5}}}
    )
    config = load_config(path)
    assert config.group[0].stall.probe_failures == 5
    assert path.read_text() == render_toml(config)


def _leaves(overrides: Any, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    if isinstance(overrides, dict):
        return [leaf for k, v in overrides.items() for leaf in _leaves(v, (*prefix, k))]
    return [(prefix, overrides)]


def _timing_sets() -> list[tuple[str, dict[str, Any]]]:
    from bench.harness import COMPRESSED_TIMINGS, DEFAULT_TIMINGS
    from demo.config import DEMO_TIMINGS
    from tests.e2e.daemon import TIMINGS

    return [
        ("bench-compressed", dict(COMPRESSED_TIMINGS)),
        ("bench-default", dict(DEFAULT_TIMINGS)),
        ("demo", dict(DEMO_TIMINGS)),
        ("e2e", dict(TIMINGS)),
    ]


@pytest.mark.parametrize(("name", "timings"), _timing_sets(), ids=[n for n, _ in _timing_sets()])
def test_timing_overrides_name_only_keys_that_differ_from_the_defaults(
    name: str, timings: dict[str, Any]
) -> None:
    """The compressed timings of bench, demo and e2e restate no default: config.py holds them."""
    defaults = effective_config(build_config(_minimal()))
    config = effective_config(build_config(_minimal(), timings))
    for path, value in _leaves(timings):
        section, key = path[0], path[-1]
        where = config["watchdog"] if section == "watchdog" else config["group"][0][path[1]]
        default = defaults["watchdog"] if section == "watchdog" else defaults["group"][0][path[1]]
        assert where[key] == value, (name, path)
        assert default[key] != value, f"{name}: {'.'.join(path)} = {value!r} is the default"
