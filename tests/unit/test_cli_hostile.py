"""Every subcommand, run as a real process on hostile input: a clear error and exit 2/3, never a
Python traceback (a traceback under systemd's Restart=on-failure is a crash loop, and in a terminal
it hides the one line the operator needs)."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from watchdog.errors import EXIT_INTERNAL, EXIT_USAGE

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data"


@dataclass(frozen=True)
class Case:
    """One command line, the exit code it must end with and what stderr must name."""

    argv: tuple[str, ...]
    code: int
    names: tuple[str, ...]

    @property
    def label(self) -> str:
        return " ".join(Path(a).name if a.startswith("/") else a for a in self.argv)


# Every subcommand (and the daemon), each needing nothing but its config to get that far.
COMMANDS: tuple[tuple[str, ...], ...] = (
    ("validate",),
    ("check",),
    ("check", "--json"),
    ("polkit-rule",),
    ("incidents",),
    ("incidents", "show", "20260101T000000Z-x"),
    ("plan",),
    ("plan", "--json"),
    ("restart", "--yes", "--dry-run"),
    ("reset",),
    ("pause", "--for", "30m"),
    ("resume",),
    ("replay", "RECORDING"),
    ("--once",),
    ("--dry-run", "--once"),
)
# The TOML bomb goes through every command; the NUL state_dir through those that use the state dir.
NESTED = (
    "invalid-toml-nesting.toml",
    "(file): invalid TOML: arrays or inline tables nested too deeply",
)
NUL_STATE_DIR = ("invalid-state-dir-nul.toml", "watchdog.state_dir: ")
STATE_COMMANDS: tuple[tuple[str, ...], ...] = (
    ("incidents",),
    ("restart", "--yes", "--dry-run"),
    ("reset",),
    ("pause", "--for", "30m"),
    ("resume",),
    ("--once",),
)
# The other refusals, through validate (and two through the daemon): every command loads the
# config the same way, so one command per refusal shows the CLI side.
VALIDATE_ONLY = (
    ("invalid-metrics-listen-port.toml", "watchdog.metrics_listen: "),
    ("invalid-metrics-listen-host.toml", "watchdog.metrics_listen: "),
    ("invalid-metrics-listen-ipv6.toml", "watchdog.metrics_listen: "),
    ("invalid-group-name-newline.toml", "group#1.name: "),
    ("invalid-unit-newline.toml", "group#1.decode.unit: "),
    ("invalid-url-tab.toml", "group#1.decode.url: "),
    ("invalid-duration-tiny.toml", "group#1.probe.period_seconds: "),
    ("invalid-duration-huge.toml", "group#1.restart.backoff_seconds: "),
    ("invalid-duration-nan.toml", "watchdog.cycle_seconds: "),
    ("invalid-expect-regex-nested.toml", "group#1.probe.expect_regex: "),
)
DURATIONS = ("1e400s", "99999999999d", "-5m", "0", "nan", "169h")


def _argv(command: tuple[str, ...], config: Path, recording: Path) -> tuple[str, ...]:
    return ("--config", str(config), *(str(recording) if a == "RECORDING" else a for a in command))


def _cases(tmp: Path) -> list[Case]:
    recording = tmp / "empty.jsonl"
    recording.write_text("")
    valid = DATA / "valid-minimal.toml"
    cases = [
        Case(_argv(command, DATA / name, recording), EXIT_USAGE, (name, reason))
        for (name, reason), commands in ((NESTED, COMMANDS), (NUL_STATE_DIR, STATE_COMMANDS))
        for command in commands
    ]
    cases += [
        Case(_argv(command, DATA / name, recording), EXIT_USAGE, (name, key))
        for index, (name, key) in enumerate(VALIDATE_ONLY)
        for command in ((("validate",), ("--once",)) if index < 2 else (("validate",),))
    ]
    cases += [
        Case(("--config", str(valid), "pause", f"--for={text}"), EXIT_USAGE, ("--for", text))
        for text in DURATIONS
    ]
    cases += [
        Case(("--config", "/dev/zero", "validate"), EXIT_USAGE, ("/dev/zero", "larger than")),
        Case(("--config", str(tmp), "check"), EXIT_USAGE, (str(tmp), "cannot read")),
        Case(("pause", "--for"), EXIT_USAGE, ("--for",)),
        Case(("no-such-command",), EXIT_USAGE, ("invalid choice",)),
    ]
    return cases


def _run(case: Case, env: dict[str, str]) -> tuple[Case, subprocess.CompletedProcess[str]]:
    done = subprocess.run(
        [sys.executable, "-m", "watchdog", *case.argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        timeout=120,
        check=False,
    )
    return case, done


def _env(tmp: Path) -> dict[str, str]:
    # No bus: whatever would reach systemd fails fast and cleanly instead of touching the host.
    env = {k: v for k, v in os.environ.items() if not k.startswith("DBUS_")}
    env["DBUS_SYSTEM_BUS_ADDRESS"] = f"unix:path={tmp / 'no-bus'}"
    return env


@pytest.mark.slow
def test_every_subcommand_refuses_hostile_input_without_a_traceback(tmp_path: Path) -> None:
    """Each case exits with its code, names the file/key/option, and prints no traceback."""
    cases = _cases(tmp_path)
    env = _env(tmp_path)
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda c: _run(c, env), cases))
    failures = []
    for case, done in results:
        problems = []
        if "Traceback" in done.stderr or "Traceback" in done.stdout:
            problems.append("traceback")
        if done.returncode != case.code:
            problems.append(f"exit {done.returncode}, expected {case.code}")
        problems += [f"{name!r} not named" for name in case.names if name not in done.stderr]
        if problems:
            failures.append(f"{case.label}: {', '.join(problems)}\n{done.stderr[-600:]}")
    assert not failures, "\n\n".join(failures)
    assert len(results) >= 40


def test_an_unexpected_exception_is_one_line_and_exit_3(tmp_path: Path) -> None:
    """A bug anywhere (here: the parser itself raising) ends with one line and exit 3, and the
    traceback only when asked for with --log-level debug."""
    boom = (
        "import sys, watchdog.cli as cli\n"
        "def boom(*a, **k): raise RuntimeError('boom\\nsecond line')\n"
        "cli.configure_logging = (lambda f, l, c=cli.configure_logging: (c(f, l), boom()))\n"
        "raise SystemExit(cli.main(sys.argv[1:]))\n"
    )
    for level, traceback_logged in (("info", False), ("debug", True)):
        done = subprocess.run(
            [sys.executable, "-c", boom, "--log-level", level, "validate"],
            capture_output=True,
            text=True,
            env=_env(tmp_path),
            cwd=REPO,
            timeout=120,
            check=False,
        )
        assert done.returncode == EXIT_INTERNAL
        shown = [line for line in done.stderr.splitlines() if line.startswith("watchdog: ")]
        assert shown[0] == "watchdog: internal error: RuntimeError: boom"  # first line only
        assert "please report it" in shown[1]
        assert ("Traceback" in done.stderr) is traceback_logged, done.stderr


def test_internal_error_in_process(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """In-process too: main() returns 3 rather than raising, for any command's bug."""
    from watchdog import cli
    from watchdog.commands import validate

    def broken(args: object) -> int:
        raise KeyError("no such thing")

    monkeypatch.setattr(validate, "run", broken)
    assert cli.main(["validate"]) == EXIT_INTERNAL
    err = capsys.readouterr().err
    assert err.startswith("watchdog: internal error: KeyError: 'no such thing'\n")
    assert "Traceback" not in err


def test_ctrl_c_is_exit_130_without_a_traceback(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C at a prompt (restart's confirmation) ends quietly with the shell's convention."""
    from watchdog import cli
    from watchdog.commands import validate

    def interrupted(args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(validate, "run", interrupted)
    assert cli.main(["validate"]) == 130
    assert capsys.readouterr().err == "watchdog: interrupted\n"


def test_a_closed_stdout_is_not_a_traceback(tmp_path: Path) -> None:
    """`watchdog validate | head -1`: the reader leaves early; no traceback, no second error."""
    reader = subprocess.Popen(
        [sys.executable, "-m", "watchdog", "validate", "--config", "configs/example.toml"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
        env=_env(tmp_path),
    )
    assert reader.stdout is not None
    assert reader.stderr is not None
    reader.stdout.close()  # before anything is read: the first write gets EPIPE
    err = reader.stderr.read().decode()
    assert reader.wait(timeout=120) in (0, EXIT_INTERNAL)
    assert "Traceback" not in err
    assert "Exception ignored" not in err
