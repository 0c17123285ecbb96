"""`host = "ssh://..."` and expect_regex braces are validated by parsing, in linear time.

Hostile inputs run in a child process under RLIMIT_CPU: a backtracking validator is killed by
SIGXCPU (the test fails) instead of hanging the test run, and a busy machine slows the wall clock
but not the CPU time the child is charged, so the bound cannot flake.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import tomli_w
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError

from tests.unit.configs import group
from watchdog import config
from watchdog.config import SshHostUrl, regex_backtracking_risk

REPO = Path(__file__).resolve().parents[2]
# CPU seconds a child may use: imports take well under one; the old host pattern needed longer
# than the age of the universe on these inputs, the old brace pattern minutes.
CPU_SECONDS = 20
_HOST_URL: TypeAdapter[str] = TypeAdapter(SshHostUrl)

LABEL_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-"
BAD_CHARS = ";!_ /\\$`'\"@*~\x00\x1b\u00e9\u0661"


def _ssh_host_ok(host: str) -> bool:
    """Whether ssh://w@<host>:22 validates (False on a refusal, which must be a ValueError)."""
    try:
        _HOST_URL.validate_python(f"ssh://w@{host}:22")
    except ValidationError:
        return False
    return True


hostile_hosts = st.one_of(
    # A long run of valid characters, dots sprinkled in, then one bad character.
    st.builds(
        lambda run, bad, tail: run + bad + tail,
        st.text(alphabet=LABEL_CHARS + ".", min_size=30, max_size=3000),
        st.sampled_from(BAD_CHARS),
        st.text(alphabet=LABEL_CHARS, max_size=3),
    ),
    # Labels of every length, some over 63, joined by single or double dots.
    st.lists(
        st.text(alphabet=LABEL_CHARS, min_size=0, max_size=80), min_size=1, max_size=40
    ).flatmap(lambda labels: st.sampled_from([".".join(labels), "..".join(labels)])),
    st.text(max_size=300),
)


@settings(max_examples=300, derandomize=True, database=None)
@given(hostile_hosts)
def fuzz_hostile_hosts(host: str) -> None:
    """Every hostile host is decided, and never accepted when it breaks RFC 1123 (run in a child
    under a CPU limit by the test below)."""
    accepted = _ssh_host_ok(host)
    name = host.removesuffix(".")
    if accepted and not name.startswith("["):
        assert len(name) <= 253, host
        assert all(0 < len(label) <= 63 for label in name.split(".")), host
        assert set(name) <= set(LABEL_CHARS + "."), host


def _run_with_cpu_limit(code: str) -> subprocess.CompletedProcess[str]:
    # The child sets its own limit first (no preexec_fn: pytest's process may have threads).
    limited = f"import resource\nresource.setrlimit(resource.RLIMIT_CPU, ({CPU_SECONDS}, {CPU_SECONDS}))\n"
    return subprocess.run(
        [sys.executable, "-c", limited + textwrap.dedent(code)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
        # Only a safety net should the CPU limit not apply; the limit decides.
        timeout=600,
    )


def test_fuzzed_hostile_hosts_all_finish_within_a_cpu_budget() -> None:
    """Hundreds of hostile host strings are each accepted or refused within the child's CPU
    budget (the nested-repetition pattern would exhaust it on the first long one)."""
    done = _run_with_cpu_limit(
        """
        from tests.unit.test_config_host_parsing import fuzz_hostile_hosts
        fuzz_hostile_hosts()
        print("all decided")
        """
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "all decided" in done.stdout


def test_validate_refuses_a_10k_hostile_host_with_exit_2(tmp_path: Path) -> None:
    """`watchdog validate` on a 10 000-character host with one bad character exits 2 naming the
    key, within the CPU budget: no kill-and-restart loop under the unit's start timeout."""
    data = {"group": [group("g")]}
    hostile = "a" * 10_000 + "!"
    data["group"][0]["decode"]["host"] = f"ssh://w@{hostile}:22"
    path = tmp_path / "w.toml"
    path.write_text(tomli_w.dumps(data))
    done = _run_with_cpu_limit(
        f"""
        import sys
        from watchdog.cli import main
        sys.exit(main(["validate", "--config", {str(path)!r}]))
        """
    )
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert "group#1.decode.host" in done.stderr + done.stdout
    assert "has no valid host name or address" in done.stderr + done.stdout


def test_expect_regex_braces_are_scanned_in_linear_time() -> None:
    """A pattern with an unclosed brace before a long run of digits (a literal to re) is judged
    within the CPU budget: the brace scanner does not backtrack over the digits."""
    done = _run_with_cpu_limit(
        """
        from watchdog.config import regex_backtracking_risk
        for pattern in ("x{" + "1" * 300_000, "x{1," + "2" * 300_000, "{" * 300_000 + "}"):
            assert regex_backtracking_risk(pattern) == "", pattern[:8]
        print("judged")
        """
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "judged" in done.stdout


@pytest.mark.parametrize(
    ("pattern", "risky"),
    [
        ("a{2}", False),
        ("a{1}", False),
        ("(a{2})+", True),
        ("(a{1,})+", True),
        ("(a{,3})*", True),
        ("(a{})*", False),
        ("(a{1,x})*", False),
        ("(a{12", False),
    ],
)
def test_expect_regex_braces_are_read_as_before(pattern: str, risky: bool) -> None:
    """The hand-written brace reader reads {m}, {m,}, {,n}, {m,n} as quantifiers and anything
    else as literal text, as re does."""
    assert bool(regex_backtracking_risk(pattern)) is risky


@pytest.mark.parametrize(
    "host",
    [
        "h",
        "gpu-b.example",
        "gpu-b.example.",
        "10.0.0.12",
        "[::1]",
        "[fe80::1]",
        "[2001:db8::10.0.0.1]",
        "a" * 63,
        ".".join(["a" * 63] * 3 + ["a" * 61]),  # 253 characters
        "x-1.y2",
        "123abc.example",
    ],
)
def test_valid_host_names_and_literals_are_accepted(host: str) -> None:
    """Host names of RFC 1123, dotted IPv4 and bracketed IPv6 literals pass."""
    assert config.is_host_name_or_address(host)
    assert _ssh_host_ok(host)


@pytest.mark.parametrize(
    "host",
    [
        "",
        ".",
        "a" * 64,  # a label over 63
        ".".join(["a" * 63] * 3 + ["a" * 62]),  # 254 characters
        "a..b",
        ".a",
        "-a",
        "a-",
        "a_b",
        "a;id",
        "[::1",
        "[not-ipv6]",
        "[fe80::1%eth0]",
        "[10.0.0.1]",
        "999.0.0.1",
        "10.0.0",
        "\u0661\u0662",  # Unicode digits are not ASCII digits
        "h\u00e9",
    ],
)
def test_invalid_host_names_and_literals_are_refused(host: str) -> None:
    """Labels over 63, names over 253, empty labels, edge hyphens, other characters, IP
    literals that do not parse, and zone indexes are refused."""
    assert not config.is_host_name_or_address(host)
    assert not _ssh_host_ok(host)


@pytest.mark.parametrize("url", ["ssh://w\n@h:22", "ssh://w@h\t:22", "ssh://w@h:22 ", "ssh://w\n"])
def test_ssh_urls_with_whitespace_or_controls_are_refused(url: str) -> None:
    """urlsplit drops tabs and newlines silently, so they are refused before it runs."""
    with pytest.raises(ValidationError, match="whitespace or a control character"):
        _HOST_URL.validate_python(url)
