"""The generated polkit rule: exact units and verbs, safe escaping, the committed copy, the CLI."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

from watchdog.act.polkit import configured_units, render_polkit_rule
from watchdog.cli import main
from watchdog.config import Config, load_config, parse_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "configs" / "example.toml"
COMMITTED_RULE = ROOT / "systemd" / "polkit" / "50-sglang-watchdog.rules"


def group(name: str) -> dict[str, Any]:
    """One group's section with units named after the group."""
    return {
        "name": name,
        "prefill": {"unit": f"sglang-{name}-prefill.service", "url": "http://127.0.0.1:30000"},
        "decode": {"unit": f"sglang-{name}-decode.service", "url": "http://127.0.0.1:30002"},
        "router": {"unit": f"sglang-{name}-router.service", "url": "http://127.0.0.1:30001"},
    }


def two_groups() -> Config:
    """A config of two groups, listed out of name order."""
    return parse_config({"group": [group("b"), group("a")]}, "two.toml")


def test_committed_rule_matches_the_generator() -> None:
    """systemd/polkit/50-sglang-watchdog.rules is exactly what the generator makes of example.toml."""
    expected = render_polkit_rule(load_config(EXAMPLE), source="configs/example.toml")
    assert COMMITTED_RULE.read_text(encoding="utf-8") == expected, (
        "regenerate with: watchdog polkit-rule --config configs/example.toml "
        "--output systemd/polkit/50-sglang-watchdog.rules"
    )


def test_units_of_every_group_are_listed_once_sorted() -> None:
    """All three units of every group, sorted, so the rule is stable across config reorderings."""
    assert configured_units(two_groups()) == (
        "sglang-a-decode.service",
        "sglang-a-prefill.service",
        "sglang-a-router.service",
        "sglang-b-decode.service",
        "sglang-b-prefill.service",
        "sglang-b-router.service",
    )


def test_rule_names_action_user_and_verbs() -> None:
    """The rule checks the manage-units action, the user, and only restart/start/stop."""
    rule = render_polkit_rule(two_groups(), user="svc")
    assert 'action.id === "org.freedesktop.systemd1.manage-units"' in rule
    assert 'subject.user === "svc"' in rule
    assert 'var verbs = ["restart", "start", "stop"];' in rule


@pytest.mark.parametrize("user", ["", "Root", "a b", 'x";polkit.Result.YES;"', "1abc", "a" * 33])
def test_invalid_user_names_are_rejected(user: str) -> None:
    """A user name that is not a plain POSIX name never reaches the JavaScript."""
    with pytest.raises(ValueError, match="is not a valid user name"):
        render_polkit_rule(two_groups(), user=user)


def test_source_cannot_break_out_of_its_comment() -> None:
    """A config path with newlines or line separators stays inside the header comment."""
    plain = render_polkit_rule(two_groups(), source="a.toml")
    hostile = render_polkit_rule(two_groups(), source='x"\n polkit.Result.YES \u2028 \r')
    assert len(hostile.splitlines()) == len(plain.splitlines())
    assert all(line.startswith("//") for line in hostile.splitlines()[:6])
    assert "\u2028" not in hostile


NODE_HARNESS = """
const fs = require("fs");
let rule = null;
const polkit = {
  Result: {YES: "yes", NO: "no", NOT_HANDLED: "not_handled"},
  addRule(f) { rule = f; },
};
new Function("polkit", fs.readFileSync(process.argv[1], "utf8"))(polkit);
const cases = JSON.parse(process.argv[2]);
console.log(JSON.stringify(cases.map((c) => {
  const action = {id: c.id, lookup: (key) => c.details[key]};
  const result = rule(action, {user: c.user});
  return result === undefined ? "not_handled" : result;
})));
"""


@pytest.mark.skipif(
    shutil.which("node") is None, reason="node is not installed (Debian package: nodejs)"
)
def test_rule_decisions_when_evaluated() -> None:
    """Evaluated as JavaScript, the committed rule says YES only to its user, units and verbs."""
    manage = "org.freedesktop.systemd1.manage-units"
    user = "sglang-watchdog"

    def case(action: str, who: str, unit: str, verb: str) -> dict[str, Any]:
        return {"id": action, "user": who, "details": {"unit": unit, "verb": verb}}

    cases = [
        case(manage, user, "sglang-dsv4-prefill.service", "restart"),
        case(manage, user, "sglang-dsv4-decode.service", "start"),
        case(manage, user, "sglang-dsv4-router.service", "stop"),
        case(manage, "sglang", "sglang-dsv4-prefill.service", "restart"),
        case(manage, user, "sshd.service", "restart"),
        case(manage, user, "sglang-dsv4-decode.service", "kill"),
        case(manage, user, "sglang-dsv4-decode.service", "reload-or-restart"),
        case("org.freedesktop.systemd1.manage-unit-files", user, "", ""),
    ]
    completed = subprocess.run(
        ["node", "-e", NODE_HARNESS, str(COMMITTED_RULE), json.dumps(cases)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert json.loads(completed.stdout) == ["yes", "yes", "yes"] + ["not_handled"] * 5


def test_cli_prints_the_rule(capsys: pytest.CaptureFixture[str]) -> None:
    """`watchdog polkit-rule --config FILE` prints the rule for the default user."""
    assert main(["polkit-rule", "--config", str(EXAMPLE)]) == 0
    assert capsys.readouterr().out == render_polkit_rule(load_config(EXAMPLE), source=str(EXAMPLE))


def test_cli_writes_the_rule_world_readable(tmp_path: Path) -> None:
    """--output writes the file with mode 0644 (polkitd reads it as its own user)."""
    out = tmp_path / "50-sglang-watchdog.rules"
    assert (
        main(["polkit-rule", "--config", str(EXAMPLE), "--user", "sglang", "--output", str(out)])
        == 0
    )
    assert out.read_text(encoding="utf-8") == render_polkit_rule(
        load_config(EXAMPLE), user="sglang", source=str(EXAMPLE)
    )
    assert stat.S_IMODE(out.stat().st_mode) == 0o644
    assert [p.name for p in tmp_path.iterdir()] == [out.name]


def test_cli_rejects_a_bad_user(capsys: pytest.CaptureFixture[str]) -> None:
    """A bad --user is a usage error (exit 2) naming the value."""
    assert main(["polkit-rule", "--config", str(EXAMPLE), "--user", "Bad User"]) == 2
    assert "--user: 'Bad User' is not a valid user name" in capsys.readouterr().err


def test_cli_reports_an_unwritable_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An output directory that does not exist is a usage error naming the path (exit 2)."""
    out = tmp_path / "missing" / "rule"
    assert main(["polkit-rule", "--config", str(EXAMPLE), "--output", str(out)]) == 2
    assert f"--output: cannot write {out}: No such file or directory" in capsys.readouterr().err


def rule_text() -> str:
    """The polkit rule generated from the example config."""
    return render_polkit_rule(load_config(EXAMPLE), source=str(EXAMPLE))


def write_to_fifo(tmp_path: Path, output: Path, fifo: Path) -> bytes:
    """Run `polkit-rule --output output` while a thread reads `fifo`; what the reader got."""
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    try:
        assert main(["polkit-rule", "--config", str(EXAMPLE), "--output", str(output)]) == 0
    finally:
        if reader.is_alive() and not got:
            # Unblock a reader still waiting for a writer (the test failed before writing).
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(timeout=60)
    return got[0]


@pytest.mark.parametrize("through_link", [False, True], ids=["fifo", "link-to-fifo"])
def test_cli_writes_into_a_fifo_without_replacing_it(tmp_path: Path, through_link: bool) -> None:
    """A FIFO (or a link to one, as /dev/stdout is) is written into; the name stays what it was."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    output = fifo
    if through_link:
        output = tmp_path / "stdout"
        output.symlink_to(fifo)
    assert write_to_fifo(tmp_path, output, fifo) == rule_text().encode()
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert os.path.islink(output) is through_link
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({"pipe", output.name})


@pytest.mark.parametrize("kind", ["link-to-file", "link-to-dir", "directory", "dangling-link"])
def test_cli_refuses_links_and_directories(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    """A symbolic link to a file or directory, a dangling one and a directory are refused (exit 2)
    with a message naming the path; nothing is replaced or written."""
    target = tmp_path / "target"
    if kind == "link-to-file":
        target.write_text("keep me\n", encoding="utf-8")
    elif kind in ("link-to-dir", "directory"):
        target.mkdir()
    output = target if kind == "directory" else tmp_path / "rule"
    if kind != "directory":
        output.symlink_to(target)
    assert main(["polkit-rule", "--config", str(EXAMPLE), "--output", str(output)]) == 2
    err = capsys.readouterr().err
    assert f"--output: {output} is " in err
    assert "refusing to replace it" in err
    assert os.path.islink(output) is (kind != "directory")
    if kind == "link-to-file":
        assert target.read_text(encoding="utf-8") == "keep me\n"
    names = ({"target"} if kind != "dangling-link" else set()) | (
        {"rule"} if kind != "directory" else set()
    )
    assert {p.name for p in tmp_path.iterdir()} == names


def test_cli_writes_into_dev_null_and_leaves_the_device(tmp_path: Path) -> None:
    """--output /dev/null writes into the device; as root it used to be replaced by a file."""
    before = os.stat("/dev/null")
    assert main(["polkit-rule", "--config", str(EXAMPLE), "--output", "/dev/null"]) == 0
    after = os.lstat("/dev/null")
    assert stat.S_ISCHR(after.st_mode)
    assert (after.st_ino, after.st_rdev) == (before.st_ino, before.st_rdev)
