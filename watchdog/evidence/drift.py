"""Config drift: does the live process run with the flags and environment the config expects?"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import structlog

from watchdog.config import UnitSection
from watchdog.evidence.procinfo import REDACTED, is_secret_key
from watchdog.evidence.records import DriftFinding, DriftKind
from watchdog.model import Worker


def _split_equals(args: Sequence[str]) -> list[str]:
    # `--tp=8` and `--tp 8` mean the same to argparse; compare them in one spelling.
    out: list[str] = []
    for arg in args:
        if arg.startswith("--") and "=" in arg:
            flag, _, value = arg.partition("=")
            out.extend((flag, value))
        else:
            out.append(arg)
    return out


def _contains_sequence(haystack: Sequence[str], needle: Sequence[str]) -> bool:
    if not needle:
        return True
    width = len(needle)
    return any(
        list(haystack[i : i + width]) == list(needle) for i in range(len(haystack) - width + 1)
    )


def cmdline_contains(cmdline: Sequence[str], expected: str) -> bool:
    """True when `expected` ("--flag", "--flag value", "--flag=value") is there as whole args."""
    return _contains_sequence(_split_equals(cmdline), _split_equals(expected.split()))


def _shown(key: str, value: str | None) -> str | None:
    if value is None:
        return None
    return REDACTED if is_secret_key(key) else value


def check_drift(
    section: UnitSection, cmdline: Sequence[str], environ: Mapping[str, str]
) -> tuple[DriftFinding, ...]:
    """Every expectation of `section` that a process with this cmdline and environ does not meet."""
    findings: list[DriftFinding] = []
    for expected in section.expect_cmdline_contains:
        if not cmdline_contains(cmdline, expected):
            findings.append(
                DriftFinding(
                    unit=section.unit,
                    kind=DriftKind.CMDLINE_MISSING,
                    expected=expected,
                    actual=None,
                    message=f"{section.unit}: {expected!r} is not in the running process's cmdline",
                )
            )
    for key, value in sorted(section.expect_env.items()):
        actual = environ.get(key)
        if actual == value:
            continue
        kind = DriftKind.ENV_MISSING if actual is None else DriftKind.ENV_MISMATCH
        shown_expected = _shown(key, value) or ""
        shown_actual = _shown(key, actual)
        message = (
            f"{section.unit}: {key} is not set in the running process (expected {shown_expected!r})"
            if actual is None
            else f"{section.unit}: {key}={shown_actual!r} in the running process, "
            f"expected {shown_expected!r}"
        )
        findings.append(
            DriftFinding(
                unit=section.unit,
                kind=kind,
                expected=f"{key}={shown_expected}",
                actual=None if shown_actual is None else f"{key}={shown_actual}",
                message=message,
            )
        )
    return tuple(findings)


def log_drift(group: str, worker: Worker, findings: Sequence[DriftFinding]) -> None:
    """Log each finding as `config_drift` (a contract event name: docs/architecture.md)."""
    log = structlog.get_logger()
    for finding in findings:
        log.warning(
            "config_drift",
            group=group,
            role=str(worker.role),
            worker=worker.name,
            unit=finding.unit,
            kind=str(finding.kind),
            expected=finding.expected,
            actual=finding.actual,
            message=finding.message,
        )
