"""Config drift: expected flags and environment against a running process's cmdline and environ."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from watchdog.config import UnitSection
from watchdog.evidence.drift import check_drift, cmdline_contains, log_drift
from watchdog.evidence.records import DriftKind
from watchdog.model import Role, Worker

DECODE_ARGV = (
    "/opt/sglang/bin/python",
    "-m",
    "sglang.launch_server",
    "--model-path",
    "/models/dsv4",
    "--disaggregation-mode",
    "decode",
    "--tp=8",
    "--disable-overlap-schedule",
)


def _section(cmdline: tuple[str, ...] = (), env: dict[str, str] | None = None) -> UnitSection:
    return UnitSection(
        unit="sglang-dsv4-decode.service",
        url="http://127.0.0.1:30002",
        expect_cmdline_contains=cmdline,
        expect_env=env or {},
    )


@pytest.mark.parametrize(
    ("expected", "present"),
    [
        ("--disable-overlap-schedule", True),
        ("--disaggregation-mode decode", True),
        ("--disaggregation-mode=decode", True),  # either spelling matches either spelling
        ("--tp 8", True),
        ("--tp=8", True),
        ("--tp 4", False),
        ("--disaggregation-mode prefill", False),
        ("--disable-overlap", False),  # whole arguments only, never a prefix
        ("decode", True),
        ("--enable-dp-attention", False),
    ],
)
def test_cmdline_contains_table(expected: str, present: bool) -> None:
    """An expectation matches whole consecutive arguments, `--k v` and `--k=v` alike."""
    assert cmdline_contains(DECODE_ARGV, expected) is present


def test_no_expectations_no_findings() -> None:
    """A unit without expectations never drifts."""
    assert check_drift(_section(), DECODE_ARGV, {}) == ()


def test_missing_flag_is_a_finding() -> None:
    """The incident's first question: is --disable-overlap-schedule really live?"""
    argv = DECODE_ARGV[:-1]
    (finding,) = check_drift(_section(("--disable-overlap-schedule",)), argv, {})
    assert finding.kind is DriftKind.CMDLINE_MISSING
    assert finding.expected == "--disable-overlap-schedule"
    assert "is not in the running process's cmdline" in finding.message
    assert "sglang-dsv4-decode.service" in finding.message


def test_env_missing_and_mismatch() -> None:
    """An unset variable and a different value are two distinct findings, sorted by name."""
    section = _section(env={"SGLANG_A": "1", "SGLANG_B": "2", "SGLANG_C": "3"})
    findings = check_drift(section, DECODE_ARGV, {"SGLANG_A": "1", "SGLANG_B": "5"})
    assert [(f.kind, f.expected, f.actual) for f in findings] == [
        (DriftKind.ENV_MISMATCH, "SGLANG_B=2", "SGLANG_B=5"),
        (DriftKind.ENV_MISSING, "SGLANG_C=3", None),
    ]


def test_secret_values_never_appear_in_findings() -> None:
    """Expected and actual values of secret-looking keys are redacted in fields and message."""
    section = _section(env={"NIXL_AUTH_TOKEN": "expected-secret"})
    (finding,) = check_drift(section, DECODE_ARGV, {"NIXL_AUTH_TOKEN": "live-secret"})
    text = f"{finding.expected} {finding.actual} {finding.message}"
    assert "secret" not in text.replace("SECRET", "")
    assert finding.expected == "NIXL_AUTH_TOKEN=***"


def test_drift_is_logged_as_config_drift() -> None:
    """Each finding is logged with the contract event name `config_drift`."""
    findings = check_drift(_section(("--disable-overlap-schedule",)), (), {})
    with capture_logs() as logs:
        log_drift("dsv4", Worker(Role.DECODE, 1, "decode#2"), findings)
    assert [e["event"] for e in logs] == ["config_drift"]
    assert logs[0]["group"] == "dsv4"
    assert (logs[0]["role"], logs[0]["worker"]) == ("decode", "decode#2")
    assert logs[0]["kind"] == "cmdline_missing"
