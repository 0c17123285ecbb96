"""The shipped systemd units: required settings, `systemd-analyze verify`, and the exposure rating."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from watchdog.act.polkit import DEFAULT_USER

ROOT = Path(__file__).resolve().parents[2]
SERVICE = ROOT / "systemd" / "sglang-watchdog.service"
EXAMPLES = sorted((ROOT / "systemd" / "examples").iterdir())
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_systemd_analyze = pytest.mark.skipif(
    SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed (Debian package: systemd)"
)
# Executables the install instructions put under /opt; verify insists that ExecStart= exists.
_OPT_EXECUTABLE = re.compile(r"^(Exec[A-Za-z]+=[-@:+!]*)/opt/\S+", re.MULTILINE)


def directives(path: Path) -> dict[str, list[str]]:
    """Key -> values of a unit file (keys may repeat; continuation lines joined)."""
    out: dict[str, list[str]] = {}
    text = path.read_text(encoding="utf-8").replace("\\\n", " ")
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        out.setdefault(key, []).append(value.strip())
    return out


def verifiable_copies(paths: list[Path], directory: Path) -> list[Path]:
    """Copies of the units with /opt executables pointed at /bin/true, so verify can run here."""
    copies = []
    for path in paths:
        copy = directory / path.name
        copy.write_text(
            _OPT_EXECUTABLE.sub(r"\1/bin/true", path.read_text(encoding="utf-8")), encoding="utf-8"
        )
        copies.append(copy)
    return copies


def test_service_has_the_required_settings() -> None:
    """Type=notify, the watchdog timer, restarts, a fixed user and the required hardening."""
    found = directives(SERVICE)
    required = {
        "Type": "notify",
        "Restart": "on-failure",
        "User": DEFAULT_USER,
        "StateDirectory": "sglang-watchdog",
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "CapabilityBoundingSet": "",
        "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
        "SystemCallFilter": "@system-service",
        "SupplementaryGroups": "systemd-journal",
        "UMask": "0077",
    }
    for key, value in required.items():
        assert value in found.get(key, []), f"{key}={value} missing from {SERVICE.name}"
    assert found["WatchdogSec"]
    assert "DynamicUser" not in found
    assert "ExecStart" in found


def test_polkit_user_is_the_service_user() -> None:
    """The polkit rule's default user is the user the service runs as."""
    assert directives(SERVICE)["User"] == [DEFAULT_USER]


def test_example_units_keep_decode_from_restarting_alone() -> None:
    """The example decode unit never restarts itself, and every unit is part of the target."""
    units = {path.name: directives(path) for path in EXAMPLES}
    assert units["sglang-dsv4-decode.service"]["Restart"] == ["no"]
    for name in ("prefill", "decode", "router"):
        unit = units[f"sglang-dsv4-{name}.service"]
        assert unit["PartOf"] == ["sglang-pd.target"]
        assert "Requires" not in unit, "Requires= would propagate restarts between the units"
    assert "--enable-metrics" in units["sglang-dsv4-decode.service"]["ExecStart"][0]
    router = units["sglang-dsv4-router.service"]["ExecStart"][0]
    assert "--host 127.0.0.1" in router
    assert "--prometheus-host 127.0.0.1" in router


@needs_systemd_analyze
def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    """`systemd-analyze verify` accepts the service and the examples without a single warning."""
    assert SYSTEMD_ANALYZE is not None
    copies = verifiable_copies([SERVICE, *EXAMPLES], tmp_path)
    completed = subprocess.run(
        [SYSTEMD_ANALYZE, "verify", "--man=no", *map(str, copies)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    # verify exits 0 on unknown keys and bad values (it only logs them), so the output must be empty.
    assert (completed.returncode, completed.stdout + completed.stderr) == (0, "")


@needs_systemd_analyze
def test_service_exposure_is_ok_or_better(tmp_path: Path) -> None:
    """`systemd-analyze security --offline=true` rates the service OK, SAFE or PERFECT."""
    assert SYSTEMD_ANALYZE is not None
    (copy,) = verifiable_copies([SERVICE], tmp_path)
    completed = subprocess.run(
        [SYSTEMD_ANALYZE, "security", "--offline=true", "--no-pager", str(copy)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    if "--offline" in completed.stderr and "unrecognized" in completed.stderr:
        pytest.skip("this systemd-analyze has no --offline (systemd < 250)")
    match = re.search(r"Overall exposure level for \S+: ([\d.]+) (\w+)", completed.stdout)
    assert match, completed.stdout + completed.stderr
    assert match.group(2) in {"PERFECT", "SAFE", "OK"}, match.group(0)
