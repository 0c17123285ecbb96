"""Several prefill and decode workers per group: the two shapes of a role, and their validation."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from watchdog.act.polkit import configured_units
from watchdog.cli import main
from watchdog.config import PrefillSection, load_config
from watchdog.configfile import render_toml
from watchdog.errors import ConfigError
from watchdog.model import Role, worker_name

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "configs" / "example-2p2d.toml"

HEAD = '[[group]]\nname = "g"\n'
ROUTER = '[group.router]\nunit = "r.service"\nurl = "http://127.0.0.1:9000"\n'


def _worker(role: str, n: int, *, array: bool = True, extra: str = "") -> str:
    table = f"[[group.{role}]]" if array else f"[group.{role}]"
    port = 9000 + n + (10 if role == "decode" else 0)
    return f'{table}\nunit = "{role}-{n}.service"\nurl = "http://127.0.0.1:{port}"\n{extra}'


def _issues(tmp_path: Path, text: str) -> list[str]:
    path = tmp_path / "w.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    return [f"{issue.key}: {issue.reason}" for issue in caught.value.issues]


def test_example_2p2d_validates_with_every_worker(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shipped 2P2D example: two workers per role in file order, first ones as before."""
    group = load_config(EXAMPLE).group[0]
    assert [w.unit for w in group.workers(Role.PREFILL)] == [
        "sglang-dsv4-prefill-1.service",
        "sglang-dsv4-prefill-2.service",
    ]
    assert [w.unit for w in group.workers(Role.DECODE)] == [
        "sglang-dsv4-decode-1.service",
        "sglang-dsv4-decode-2.service",
    ]
    assert group.workers(Role.ROUTER) == (group.router,)
    assert group.prefill == group.prefills[0] == group.workers(Role.PREFILL)[0]
    assert group.decode.url == "http://10.0.0.3:30000"
    assert isinstance(group.prefills[1], PrefillSection)
    assert group.prefills[1].bootstrap_port == 8998
    monkeypatch.chdir(REPO)
    assert main(["validate", "--config", "configs/example-2p2d.toml"]) == 0
    printed = tomllib.loads(capsys.readouterr().out)["group"][0]
    assert [w["url"] for w in printed["prefill"]] == [
        "http://10.0.0.1:30000",
        "http://10.0.0.2:30000",
    ]
    assert [w["unit"] for w in printed["decode"]] == [
        "sglang-dsv4-decode-1.service",
        "sglang-dsv4-decode-2.service",
    ]


def test_one_worker_shapes_are_equivalent(tmp_path: Path) -> None:
    """A table and a one-element array of tables are the same config; a table renders as one."""
    (tmp_path / "a.toml").write_text(
        HEAD + _worker("prefill", 1, array=False) + _worker("decode", 1, array=False) + ROUTER
    )
    (tmp_path / "b.toml").write_text(HEAD + _worker("prefill", 1) + _worker("decode", 1) + ROUTER)
    table, array = load_config(tmp_path / "a.toml"), load_config(tmp_path / "b.toml")
    assert table == array
    assert len(table.group[0].workers(Role.PREFILL)) == 1
    rendered = tomllib.loads(render_toml(table))["group"][0]
    assert rendered["prefill"]["unit"] == "prefill-1.service"
    assert "bootstrap_port" not in rendered["prefill"]


def test_mixed_shapes_and_round_trip(tmp_path: Path) -> None:
    """Two prefills as an array, one decode as a table: rendered in the same shapes, reloads equal."""
    path = tmp_path / "w.toml"
    path.write_text(
        HEAD
        + _worker("prefill", 1, extra="bootstrap_port = 8998\n")
        + _worker("prefill", 2, extra="bootstrap_port = 8999\n")
        + _worker("decode", 1, array=False)
        + ROUTER
    )
    config = load_config(path)
    rendered = render_toml(config)
    document = tomllib.loads(rendered)["group"][0]
    assert [w["bootstrap_port"] for w in document["prefill"]] == [8998, 8999]
    assert isinstance(document["decode"], dict)
    again = tmp_path / "again.toml"
    again.write_text(rendered)
    assert load_config(again) == config


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            _worker("prefill", 1) + _worker("decode", 1) + _worker("decode", 1) + ROUTER,
            "group#1.decode#2.unit: 'decode-1.service' is already used by decode#1.unit",
        ),
        (
            _worker("prefill", 1)
            + _worker("prefill", 2)
            + '[[group.decode]]\nunit = "prefill-2.service"\nurl = "http://127.0.0.1:9100"\n'
            + ROUTER,
            "group#1.decode.unit: 'prefill-2.service' is already used by prefill#2.unit",
        ),
        (
            _worker("prefill", 1)
            + '[[group.prefill]]\nunit = "other.service"\nurl = "http://127.0.0.1:9001/"\n'
            + _worker("decode", 1)
            + ROUTER,
            "group#1.prefill#2.url: 'http://127.0.0.1:9001' is already used by prefill#1.url",
        ),
        (
            _worker("prefill", 1, extra="bootstrap_port = 8998\n")
            + _worker("prefill", 2, extra="bootstrap_port = 8998\n")
            + _worker("decode", 1)
            + ROUTER,
            "group#1.prefill#2.bootstrap_port: 8998 is already used on 127.0.0.1 by "
            "prefill#1.bootstrap_port",
        ),
        (
            _worker("prefill", 1)
            + _worker("prefill", 2, extra="extra = 1\n")
            + _worker("decode", 1)
            + ROUTER,
            "group#1.prefill#2.extra: unknown key",
        ),
        (
            _worker("prefill", 1) + _worker("decode", 1, extra="bootstrap_port = 8998\n") + ROUTER,
            "group#1.decode.bootstrap_port: unknown key",
        ),
        (
            "decode = []\n" + _worker("prefill", 1) + ROUTER,
            "group#1.decode: at least one worker is required",
        ),
        (
            _worker("prefill", 1, extra="bootstrap_port = 70000\n") + _worker("decode", 1) + ROUTER,
            "group#1.prefill.bootstrap_port: Input should be less than 65536 (got 70000)",
        ),
    ],
    ids=[
        "duplicate-unit-in-role",
        "duplicate-unit-across-roles",
        "duplicate-url-in-role",
        "duplicate-bootstrap-port",
        "unknown-key",
        "decode-bootstrap-port",
        "no-workers",
        "port-range",
    ],
)
def test_worker_lists_are_validated_naming_the_key(
    tmp_path: Path, body: str, expected: str
) -> None:
    """Every rule of a worker list names the worker's own key."""
    assert _issues(tmp_path, HEAD + body) == [expected]


def test_units_are_unique_across_groups_per_worker(tmp_path: Path) -> None:
    """A worker unit of one group used again in another names the exact worker key."""
    second = (
        '[[group]]\nname = "h"\n'
        + _worker("prefill", 5)
        + _worker("decode", 5)
        + _worker("decode", 2)
        + '[group.router]\nunit = "r2.service"\nurl = "http://127.0.0.1:9000"\n'
    )
    first = HEAD + _worker("prefill", 1) + _worker("decode", 1) + _worker("decode", 2) + ROUTER
    assert _issues(tmp_path, first + second) == [
        "group#2.decode#2.unit: 'decode-2.service' is already used by group#1.decode#2.unit"
    ]


def test_config_errors_name_a_worker_as_reports_and_logs_do(tmp_path: Path) -> None:
    """A config error names the second decode `decode#2` and the first group `group#1`, counted
    from 1 as reports, logs and metrics count them, so one worker has one name everywhere."""
    body = HEAD + _worker("prefill", 1) + _worker("decode", 1)
    body += _worker("decode", 2, extra="extra = 1\n") + ROUTER
    (issue,) = _issues(tmp_path, body)
    assert issue == f"group#1.{worker_name(Role.DECODE, 1, 2)}.extra: unknown key"
    assert issue == "group#1.decode#2.extra: unknown key"


def test_a_lone_worker_is_named_by_its_role_whatever_its_shape(tmp_path: Path) -> None:
    """A role's only worker is the role alone in errors, as in reports: a table and an array of
    one table give the same key."""
    for array in (True, False):
        body = HEAD + _worker("prefill", 1) + _worker("decode", 1, array=array, extra="x = 1\n")
        assert _issues(tmp_path, body + ROUTER) == ["group#1.decode.x: unknown key"]


def test_polkit_rule_allows_every_worker_unit() -> None:
    """The polkit rule lists the units of every worker, not only the first of a role."""
    assert configured_units(load_config(EXAMPLE)) == (
        "sglang-dsv4-decode-1.service",
        "sglang-dsv4-decode-2.service",
        "sglang-dsv4-prefill-1.service",
        "sglang-dsv4-prefill-2.service",
        "sglang-dsv4-router.service",
    )
