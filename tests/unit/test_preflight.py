"""Preflight of a live deployment from fake /proc trees: each finding names process, flag and fix."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from pdsim.payloads import sglang_payload
from tests.unit import configs
from tests.unit.evidence_helpers import FakeUnitReader, unit_state
from tests.unit.fakerouter import FakeStack, fake_in_thread
from watchdog.cli import build_parser, main
from watchdog.commands import check
from watchdog.config import GroupSection, parse_config
from watchdog.evidence.preflight import (
    CHAT_PATH_WARNING,
    PreflightFinding,
    config_warnings,
    effective_argv,
    preflight_group,
    router_findings,
    worker_findings,
)
from watchdog.model import Role, UnitState
from watchdog.observe.observer import UnitReader

PREFILL_PID, DECODE_PID, ROUTER_PID = 4100, 4200, 4300

GOOD_PREFILL = (
    "/opt/sglang/venv/bin/python",
    "-m",
    "sglang.launch_server",
    "--model-path",
    "/models/dsv4",
    "--disaggregation-mode",
    "prefill",
    "--enable-metrics",
    "--port",
    "30000",
)
BARE_DECODE = (
    "/opt/sglang/venv/bin/python",
    "-m",
    "sglang.launch_server",
    "--model-path",
    "/models/dsv4",
    "--disaggregation-mode",
    "decode",
    "--admin-api-key",
    "sk-admin-secret",
    "--port",
    "30002",
)
ROUTER_ARGV = (
    "/opt/sglang/venv/bin/python",
    "-m",
    "sglang_router.launch_router",
    "--pd-disaggregation",
    "--prefill",
    "http://127.0.0.1:30000",
    "8998",
    "--decode",
    "http://127.0.0.1:30002",
    "--health-check-timeout-secs",
    "1",
)
SMG_ARGV = ("/opt/smg/bin/smg", "launch", "--pd-disaggregation", "--health-check-timeout-secs=5")


def make_group(path: str = "/v1/completions", **probe: Any) -> GroupSection:
    """One group whose probe uses the given path and settings."""
    data = {
        "group": [
            configs.group(
                "dsv4",
                units=("prefill.service", "decode.service", "router.service"),
                probe={"path": path, **probe},
            )
        ]
    }
    return parse_config(data, "<test>").group[0]


def fake_process(
    root: Path,
    pid: int,
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    *,
    ppid: int = 1,
    children: Sequence[int] = (),
) -> None:
    """/proc/PID with cmdline, environ, stat and task/PID/children, as the kernel lays them out."""
    proc = root / str(pid)
    (proc / "task" / str(pid)).mkdir(parents=True)
    (proc / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    environ = {"PATH": "/usr/bin", **(env or {})}
    (proc / "environ").write_bytes(b"".join(f"{k}={v}\0".encode() for k, v in environ.items()))
    comm = Path(argv[0]).name[:15]
    (proc / "stat").write_text(f"{pid} ({comm}) S {ppid} {pid} {pid} 0 -1 4194560\n")
    (proc / "task" / str(pid) / "children").write_text(" ".join(str(c) for c in children))


def _states(**pids: int) -> dict[Role, UnitState]:
    return {Role(role): unit_state(Role(role), pid=pid) for role, pid in pids.items()}


def _flags(findings: Sequence[PreflightFinding]) -> list[str]:
    return [f.flag for f in findings]


# ------------------------------------------------------------------ pure rules


def test_a_fully_configured_worker_has_no_findings(tmp_path: Path) -> None:
    """Metrics on, health generation on, the admin key configured: nothing to say."""
    admin = tmp_path / "admin"
    admin.write_text("sk-admin")
    group = make_group(admin_api_key_file=str(admin))
    argv = (*GOOD_PREFILL, "--admin-api-key", "x")
    env = {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "true"}
    assert worker_findings(group, Role.PREFILL, 42, argv, env) == ()


def test_worker_findings_name_process_flag_and_fix() -> None:
    """No --enable-metrics, static /health, an admin key the watchdog lacks: three findings."""
    group = make_group()
    env = {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"}
    findings = worker_findings(group, Role.DECODE, DECODE_PID, BARE_DECODE, env)
    assert _flags(findings) == [
        "--enable-metrics",
        "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0",
        "--admin-api-key",
    ]
    metrics, health, admin = findings
    assert metrics.message.startswith(
        f"decode decode.service (PID {DECODE_PID}): --enable-metrics: "
    )
    assert metrics.fix == "add --enable-metrics to the server's command line"
    assert "static 200" in health.problem
    assert health.fix.startswith("unset SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION")
    assert "probe.admin_api_key_file" in admin.fix
    assert all("sk-admin-secret" not in f.message for f in findings)


@pytest.mark.parametrize("value", ["false", "False", "no", "N", "0"])
def test_every_false_spelling_of_health_generation_is_caught(value: str) -> None:
    """SGLang's EnvBool reads false/0/no/n in any case."""
    env = {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": value}
    findings = worker_findings(make_group(), Role.PREFILL, 1, GOOD_PREFILL, env)
    assert _flags(findings) == [f"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION={value}"]


def test_an_api_key_on_the_worker_needs_api_key_file(tmp_path: Path) -> None:
    """--api-key on a worker without probe.api_key_file: /v1/loads and aborts would get 401."""
    argv = (*GOOD_PREFILL, "--api-key=sk-x")
    assert _flags(worker_findings(make_group(), Role.PREFILL, 1, argv, {})) == ["--api-key"]
    key = tmp_path / "key"
    key.write_text("sk-x")
    assert worker_findings(make_group(api_key_file=str(key)), Role.PREFILL, 1, argv, {}) == ()


def test_flags_inside_a_shell_wrapper_count() -> None:
    """`sh -c "exec python -m sglang.launch_server ... --enable-metrics"` is one argument."""
    argv = ("/bin/sh", "-c", "exec " + " ".join(GOOD_PREFILL))
    assert "--enable-metrics" in effective_argv(argv)
    assert worker_findings(make_group(), Role.PREFILL, 1, argv, {}) == ()


@pytest.mark.parametrize(
    ("flag", "low"),
    [
        (("--health-check-timeout-secs", "1"), True),
        (("--health-check-timeout-secs=1",), True),
        (("--health-check-timeout-secs", "2"), False),
        ((), False),  # the default, 5 s
    ],
)
def test_router_health_check_timeout(flag: tuple[str, ...], low: bool) -> None:
    """A router health-check timeout under 2 s times real SGLang /health out."""
    argv = (*ROUTER_ARGV[:-2], *flag)
    findings = router_findings(make_group(), ROUTER_PID, argv)
    assert bool(findings) is low
    if low:
        (finding,) = findings
        assert finding.flag == "--health-check-timeout-secs 1"
        assert finding.role == Role.ROUTER
        assert finding.fix.startswith("use --health-check-timeout-secs 2 or more")


def test_chat_probes_behind_sglang_router_cannot_be_aborted() -> None:
    """sglang-router drops rid on chat completions; smg forwards it."""
    chat = make_group(path="/v1/chat/completions")
    argv = (*ROUTER_ARGV[:-2], "--health-check-timeout-secs", "5")
    (finding,) = router_findings(chat, ROUTER_PID, argv)
    assert finding.flag == "probe.path /v1/chat/completions"
    assert "/v1/completions" in finding.fix
    assert "/generate" in finding.fix
    assert router_findings(chat, ROUTER_PID, SMG_ARGV) == ()
    assert router_findings(make_group(), ROUTER_PID, argv) == ()


def test_config_warning_for_chat_probes() -> None:
    """The config alone can say a chat probe may not be abortable."""
    assert config_warnings(make_group(path="/v1/chat/completions").probe) == (CHAT_PATH_WARNING,)
    assert config_warnings(make_group().probe) == ()
    assert config_warnings(make_group(path="/generate").probe) == ()


# ------------------------------------------------------------------ fake /proc trees


@pytest.fixture
def proc(tmp_path: Path) -> Path:
    """A /proc with a prefill under a shell wrapper, a bare decode and a router with 1 s health."""
    root = tmp_path / "proc"
    fake_process(root, PREFILL_PID, ("/bin/bash", "/opt/sglang/run-prefill.sh"), children=[4101])
    fake_process(
        root,
        4101,
        GOOD_PREFILL,
        {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0", "CUDA_VISIBLE_DEVICES": "0,1,2,3"},
        ppid=PREFILL_PID,
    )
    fake_process(root, DECODE_PID, BARE_DECODE, {"CUDA_VISIBLE_DEVICES": "4,5,6,7"})
    fake_process(root, ROUTER_PID, ROUTER_ARGV)
    return root


async def test_preflight_of_a_fake_proc_tree(proc: Path) -> None:
    """The serving process under a wrapper is found; each unit's findings name its own PID."""
    group = make_group(path="/v1/chat/completions")
    reader = FakeUnitReader(_states(prefill=PREFILL_PID, decode=DECODE_PID, router=ROUTER_PID))
    prefill, decode, router = await preflight_group(group, reader, proc_root=proc)
    assert (prefill.checked, prefill.pid) == (True, 4101)
    assert _flags(prefill.findings) == ["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0"]
    assert prefill.findings[0].message.startswith("prefill prefill.service (PID 4101): ")
    assert (decode.pid, _flags(decode.findings)) == (
        DECODE_PID,
        ["--enable-metrics", "--admin-api-key"],
    )
    assert _flags(router.findings) == [
        "--health-check-timeout-secs 1",
        "probe.path /v1/chat/completions",
    ]


async def test_units_that_cannot_be_preflighted_say_why(proc: Path) -> None:
    """No MainPID, a vanished PID, a tree running neither SGLang nor a router: not checked."""
    fake_process(proc, 4500, ("/usr/bin/sleep", "infinity"))
    reader = FakeUnitReader(_states(prefill=0, decode=999_999, router=4500))
    prefill, decode, router = await preflight_group(make_group(), reader, proc_root=proc)
    assert (prefill.checked, prefill.detail) == (False, "no MainPID to check")
    assert not decode.checked
    assert decode.detail.startswith("MainPID 999999: ")
    assert (router.checked, router.detail) == (
        False,
        "MainPID 4500: no process of its tree runs a router",
    )


# ------------------------------------------------------------------ watchdog check / validate


@pytest.fixture
def fake() -> Iterator[FakeStack]:
    """A fake stack served from its own thread and loop, since the command runs asyncio.run()."""
    with fake_in_thread(sglang_payload("0.5.23", "prefill", tp=2)) as stack:
        yield stack


class _Units:
    """Units of the fake /proc tree, all active."""

    async def read_unit(self, role: Role, unit: str) -> UnitState:
        pid = {Role.PREFILL: PREFILL_PID, Role.DECODE: DECODE_PID, Role.ROUTER: ROUTER_PID}[role]
        return unit_state(role, pid=pid)


@contextlib.asynccontextmanager
async def _factory() -> AsyncIterator[UnitReader | None]:
    yield _Units()


def _check_args(tmp_path: Path, base_url: str, *extra: str, path: str) -> Any:
    probe = {"timeout_seconds": 3, "stream_idle_seconds": 2, "path": path}
    config = configs.write_config(
        tmp_path / "c.toml", {"group": [configs.group("g1", url=base_url, probe=probe)]}
    )
    return build_parser().parse_args(["check", "--config", str(config), *extra])


def test_check_table_shows_preflight_findings_and_warnings(
    fake: FakeStack, proc: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Findings go in the table, one line each; the exit code stays the probes' verdict."""
    args = _check_args(tmp_path, fake.base_url, path="/v1/chat/completions")
    assert check.run(args, unit_reader_factory=_factory, proc_root=proc) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("  preflight ")]
    assert len(lines) == 5
    assert any("decode d.service (PID 4200): --enable-metrics: " in line for line in lines)
    assert any(
        "router r.service (PID 4300): --health-check-timeout-secs 1: " in line for line in lines
    )
    assert f"  warning   {CHAT_PATH_WARNING}" in out
    assert "sk-admin-secret" not in out


def test_check_json_has_the_preflight(
    fake: FakeStack, proc: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--json carries every finding with role, unit, PID, flag, problem and fix."""
    args = _check_args(tmp_path, fake.base_url, "--json", path="/v1/completions")
    assert check.run(args, unit_reader_factory=_factory, proc_root=proc) == 0
    (group,) = json.loads(capsys.readouterr().out)["groups"]
    findings = group["preflight"]["findings"]
    assert [(f["role"], f["pid"], f["flag"]) for f in findings] == [
        ("prefill", 4101, "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0"),
        ("decode", 4200, "--enable-metrics"),
        ("decode", 4200, "--admin-api-key"),
        ("router", 4300, "--health-check-timeout-secs 1"),
    ]
    assert all(f["fix"] and f["problem"] and f["unit"] for f in findings)
    assert group["warnings"] == []
    assert [u["checked"] for u in group["preflight"]["units"]] == [True, True, True]


def test_check_without_units_says_nothing_about_preflight(
    fake: FakeStack, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No unit reader (no system bus): no processes to preflight, only the config's warnings."""
    code = main(
        ["check", "--config", str(_check_args(tmp_path, fake.base_url, path="/generate").config)]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "preflight" not in out
    assert "warning" not in out


def test_validate_warns_about_chat_probes_and_still_exits_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A chat probe path is valid but gets a warning line on stderr; stdout stays a config."""
    config = configs.write_config(
        tmp_path / "c.toml",
        {"group": [configs.group("g1", probe={"path": "/v1/chat/completions"})]},
    )
    assert main(["validate", "--config", str(config)]) == 0
    captured = capsys.readouterr()
    reason = CHAT_PATH_WARNING.partition(": ")[2]
    assert captured.err.splitlines() == [f"warning: {config}: group#1.probe.path: {reason}"]
    assert 'path = "/v1/chat/completions"' in captured.out
    assert (
        main(
            [
                "validate",
                "--config",
                str(configs.write_config(tmp_path / "d.toml", {"group": [configs.group("g1")]})),
            ]
        )
        == 0
    )
    assert capsys.readouterr().err == ""
