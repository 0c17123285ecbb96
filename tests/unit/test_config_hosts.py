"""Multi-host config: `host = "ssh://..."` on a role or a group, with its key and known_hosts files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import tomli_w

from tests.unit.configs import group
from watchdog.cli import main
from watchdog.config import Config, SshTarget, load_config, parse_config
from watchdog.configfile import write_config
from watchdog.errors import ConfigError
from watchdog.model import Role


def _issues(data: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_config(data, "w.toml")
    return [str(issue) for issue in caught.value.issues]


def _config(**sections: Any) -> dict[str, Any]:
    return {"group": [group("g", **sections)]}


def test_units_without_a_host_stay_local() -> None:
    """Without any host setting every unit is local, reached over the local system bus."""
    config = parse_config(_config(), "w.toml")
    g = config.group[0]
    assert [g.host_of(g.workers(r)[0]) for r in Role] == [None, None, None]


def test_a_role_host_with_its_files(files: tuple[Path, Path]) -> None:
    """A role's ssh:// host, with its key and known_hosts files, applies to that role only."""
    key, known = files
    data = _config()
    data["group"][0]["decode"].update(
        host="ssh://sglang-watchdog@10.0.0.12:2222",
        ssh_key_file=str(key),
        known_hosts_file=str(known),
    )
    g = parse_config(data, "w.toml").group[0]
    assert g.host_of(g.workers(Role.PREFILL)[0]) is None
    assert g.host_of(g.workers(Role.DECODE)[0]) == SshTarget(
        "sglang-watchdog", "10.0.0.12", 2222, key, known
    )
    assert g.host_of(g.workers(Role.DECODE)[0]) is not None
    assert g.host_of(g.workers(Role.DECODE)[0]).label == "sglang-watchdog@10.0.0.12:2222"  # type: ignore[union-attr]


def test_group_files_serve_the_role_hosts_and_port_defaults_to_22(
    files: tuple[Path, Path],
) -> None:
    """A group's key and known_hosts serve its roles' hosts; the SSH port defaults to 22."""
    key, known = files
    data = _config(ssh_key_file=str(key), known_hosts_file=str(known))
    data["group"][0]["decode"]["host"] = "ssh://w@gpu-b.example"
    g = parse_config(data, "w.toml").group[0]
    target = g.host_of(g.workers(Role.DECODE)[0])
    assert target == SshTarget("w", "gpu-b.example", 22, key, known)


def test_a_group_host_covers_every_role(files: tuple[Path, Path]) -> None:
    """A host set on the group puts every role on that host."""
    key, known = files
    data = _config(host="ssh://w@10.0.0.12", ssh_key_file=str(key), known_hosts_file=str(known))
    g = parse_config(data, "w.toml").group[0]
    assert {g.host_of(g.workers(r)[0]).label for r in Role} == {"w@10.0.0.12:22"}  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("host", "reason"),
    [
        ("http://w@h:22", "is not an ssh:// URL (ssh://user@host:22)"),
        ("ssh://h:22", "must name a valid user (ssh://user@host:22)"),
        ("ssh://w:pw@h:22", "carries a password; only key authentication is used"),
        ("ssh://w@h:99999", "has an invalid port"),
        ("ssh://w@h:22/x", "must not have a path, query or fragment"),
        ("ssh://w@h;id:22", "has no valid host name or address"),
        ("ssh://$(id)@h", "must name a valid user (ssh://user@host:22)"),
    ],
)
def test_a_bad_host_is_refused_naming_the_key(
    host: str, reason: str, files: tuple[Path, Path]
) -> None:
    """A malformed host is refused with the file and the key path that hold it."""
    key, known = files
    data = _config()
    data["group"][0]["decode"].update(host=host, ssh_key_file=str(key), known_hosts_file=str(known))
    assert _issues(data) == [f"w.toml: group#1.decode.host: {host!r} {reason}"]


def test_a_remote_role_needs_both_files(files: tuple[Path, Path]) -> None:
    """A remote role without a known_hosts file is refused: no host key is ever trusted blindly."""
    key, _ = files
    data = _config()
    data["group"][0]["decode"].update(host="ssh://w@h", ssh_key_file=str(key))
    assert _issues(data) == [
        "w.toml: group#1.decode.known_hosts_file: required for a remote unit (host "
        "'ssh://w@h'): set it on the role (or worker) or on the group"
    ]


def test_files_without_any_host_are_refused(files: tuple[Path, Path]) -> None:
    """SSH files without any host are refused, so a forgotten host is not silently local."""
    key, _ = files
    assert _issues(_config(ssh_key_file=str(key))) == [
        'w.toml: group#1.ssh_key_file: only meaningful together with host = "ssh://..."'
    ]
    data = _config()
    data["group"][0]["router"]["ssh_key_file"] = str(key)
    assert _issues(data) == [
        'w.toml: group#1.router.ssh_key_file: only meaningful together with host = "ssh://..."'
    ]


def test_a_key_others_can_read_is_refused_like_ssh_does(files: tuple[Path, Path]) -> None:
    """A private key others can read is refused like ssh refuses it, before any connection."""
    key, known = files
    key.chmod(0o644)
    data = _config()
    data["group"][0]["decode"].update(
        host="ssh://w@h", ssh_key_file=str(key), known_hosts_file=str(known)
    )
    assert _issues(data) == [
        f"w.toml: group#1.decode.ssh_key_file: '{key}' is accessible by group or others "
        "(mode 644); a private key must be mode 600 or stricter"
    ]


@pytest.mark.parametrize("mode", [0o664, 0o646, 0o666])
def test_a_known_hosts_file_others_may_write_is_refused(
    files: tuple[Path, Path], mode: int
) -> None:
    """Whoever may write the pinned host keys may stand in for the host (ssh's StrictModes)."""
    key, known = files
    known.chmod(mode)
    data = _config()
    data["group"][0]["decode"].update(
        host="ssh://w@h", ssh_key_file=str(key), known_hosts_file=str(known)
    )
    assert _issues(data) == [
        f"w.toml: group#1.decode.known_hosts_file: '{known}' is writable by group or others "
        f"(mode {mode:o}); known_hosts_file must be writable by its owner only (chmod go-w)"
    ]


def test_validate_exits_2_for_a_known_hosts_file_others_may_write(
    tmp_path: Path, files: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """`watchdog validate` reports it like any config error: exit 2, the file and key named."""
    key, known = files
    known.chmod(0o666)
    data = _config(ssh_key_file=str(key), known_hosts_file=str(known))
    data["group"][0]["decode"]["host"] = "ssh://w@10.0.0.12:22"
    path = tmp_path / "w.toml"
    path.write_text(tomli_w.dumps(data))
    assert main(["validate", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "known_hosts_file" in err
    assert f"'{known}' is writable by group or others (mode 666)" in err


def test_missing_files_are_refused(tmp_path: Path) -> None:
    """Missing key and known_hosts files are refused at config time, not at the first restart."""
    data = _config()
    data["group"][0]["decode"].update(
        host="ssh://w@h",
        ssh_key_file=str(tmp_path / "nokey"),
        known_hosts_file=str(tmp_path / "nohosts"),
    )
    assert _issues(data) == [
        f"w.toml: group#1.decode.ssh_key_file: '{tmp_path / 'nokey'}' is not a readable file",
        f"w.toml: group#1.decode.known_hosts_file: '{tmp_path / 'nohosts'}' is not a readable file",
    ]


def test_validate_exits_2_naming_file_and_key(tmp_path: Path, files: tuple[Path, Path]) -> None:
    """`watchdog validate` exits 2 on a multi-host config error."""
    _, known = files
    data = _config()
    data["group"][0]["decode"].update(host="ssh://w@h", known_hosts_file=str(known))
    path = tmp_path / "w.toml"
    path.write_text(tomli_w.dumps(data))  # write_config would refuse it
    assert main(["validate", "--config", str(path)]) == 2


def test_validate_round_trips_a_multi_host_config(
    tmp_path: Path, files: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """`watchdog validate` prints a multi-host config that loads back to the same config."""
    key, known = files
    data = _config(ssh_key_file=str(key), known_hosts_file=str(known))
    data["group"][0]["decode"]["host"] = "ssh://w@10.0.0.12:22"
    path = tmp_path / "w.toml"
    write_config(path, data)
    assert main(["validate", "--config", str(path)]) == 0
    printed = tmp_path / "printed.toml"
    printed.write_text(capsys.readouterr().out)
    reloaded: Config = load_config(printed)
    assert reloaded == load_config(path)


def test_plan_prints_the_hosts_in_the_sequence(
    tmp_path: Path, files: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """`watchdog plan` prints which host each role is on, in restart order, in text and in JSON."""
    key, known = files
    data = _config(ssh_key_file=str(key), known_hosts_file=str(known))
    data["group"][0]["decode"]["host"] = "ssh://w@10.0.0.12:22"
    path = write_config(tmp_path / "w.toml", data)
    assert main(["plan", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert (
        "Hosts, in the sequence:\n  prefill  local\n  decode   w@10.0.0.12:22\n  router   local\n"
        in out
    )
    assert main(["plan", "--config", str(path), "--json"]) == 0
    assert '"decode": "w@10.0.0.12:22"' in capsys.readouterr().out


def test_a_one_host_plan_prints_as_before(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A plan whose units are all local prints no hosts section, exactly as before hosts existed."""
    path = write_config(tmp_path / "w.toml", _config())
    assert main(["plan", "--config", str(path)]) == 0
    assert "Hosts" not in capsys.readouterr().out
