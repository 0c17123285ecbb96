"""No secret leaves the watchdog: `check`, `plan`, `validate`, incident files and logs, each run
with credentials in the router URL, a key file, an echoing endpoint, a journal and an environ."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdsim.payloads import sglang_payload
from tests.unit import configs
from tests.unit.evidence_helpers import (
    NOW,
    UNITS,
    FakeJournal,
    FakeUnitReader,
    make_group,
    observation,
    tools,
    unit_state,
)
from tests.unit.fakerouter import FakeStack, fake_in_thread
from watchdog.cli import main
from watchdog.evidence.capture import capture_evidence
from watchdog.evidence.incident import IncidentStore
from watchdog.evidence.procinfo import read_process_tree
from watchdog.logs import configure_logging
from watchdog.model import RestartOutcome, RestartPlan, RestartStep, Role, StepResult
from watchdog.observe.probes import load_api_key

PASSWORD = "hunter2-url-pass"
API_KEY = "sk-watchdog-5c1d9e"
ADMIN_KEY = "sk-admin-77aa01"
BASIC = base64.b64encode(f"user:{PASSWORD}".encode()).decode()


def _assert_clean(text: str, *secrets: str) -> None:
    for secret in secrets:
        assert secret not in text, f"{secret!r} leaked"


@pytest.fixture
def echoing() -> Iterator[FakeStack]:
    """A fake stack whose completions answer 401 with the request's Authorization header."""
    with fake_in_thread(sglang_payload("0.5.5", "prefill", tp=2)) as stack:
        stack.mode = "echo_auth"
        yield stack


def _secret_config(tmp_path: Path, base_url: str, userinfo: bool = True) -> Path:
    key = tmp_path / "api-key"
    key.write_text(API_KEY + "\n")
    admin = tmp_path / "admin-key"
    admin.write_text(ADMIN_KEY)
    url = base_url.replace("http://", f"http://user:{PASSWORD}@", 1) if userinfo else base_url
    probe = {
        "timeout_seconds": 3,
        "stream_idle_seconds": 2,
        "api_key_file": str(key),
        "admin_api_key_file": str(admin),
    }
    return configs.write_config(
        tmp_path / "secret.toml", {"group": [configs.group("g1", url=url, probe=probe)]}
    )


@pytest.mark.parametrize("as_json", [True, False])
@pytest.mark.parametrize("userinfo", [True, False])
def test_check_output_and_logs_hold_no_secret(
    echoing: FakeStack,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    as_json: bool,
    userinfo: bool,
) -> None:
    """`check` against an endpoint echoing the request's credential, bare and in its header
    (Basic from the URL's userinfo, else Bearer with the key), prints and logs none of them."""
    config = _secret_config(tmp_path, echoing.base_url, userinfo)
    argv = ["--log-format", "json", "check", "--config", str(config)]
    code = main([*argv, "--json"] if as_json else argv)
    captured = capsys.readouterr()
    assert code == 1
    (completion,) = echoing.requests_to("/v1/completions")
    sent = completion.headers["authorization"]
    assert sent == (f"Basic {BASIC}" if userinfo else f"Bearer {API_KEY}")
    assert "rejected ***" in captured.out  # the echoed body is shown, masked
    _assert_clean(captured.out + captured.err, PASSWORD, BASIC, API_KEY, ADMIN_KEY, "user:")


@pytest.mark.parametrize("as_json", [True, False])
def test_plan_prints_no_url_credentials(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], as_json: bool
) -> None:
    """`plan` names every readiness URL without its userinfo."""
    config = _secret_config(tmp_path, "http://127.0.0.1:30001")
    assert main(["plan", "--config", str(config), *(["--json"] if as_json else [])]) == 0
    out = capsys.readouterr().out
    assert "http://***@127.0.0.1:30001/health" in out
    _assert_clean(out, PASSWORD, "user:", API_KEY)


def test_validate_and_config_errors_print_no_url_credentials(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`validate` masks the whole userinfo, and so does a config error quoting the URL."""
    assert main(["validate", "--config", str(_secret_config(tmp_path, "http://127.0.0.1:1"))]) == 0
    out = capsys.readouterr().out
    _assert_clean(out, PASSWORD, "user:", API_KEY, ADMIN_KEY)
    bad = configs.write_config(tmp_path / "ok.toml", {"group": [configs.group("g1")]})
    bad.write_text(bad.read_text().replace("http://127.0.0.1:30001", f"ftp://tok-{PASSWORD}@h"))
    assert main(["validate", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "ftp://***@h" in err
    _assert_clean(err, PASSWORD)


# ------------------------------------------------------------------ an incident, end to end

SERVER_ARGS_LINE = (
    "2026-11-29T07:40:00+0000 h python[2]: server_args=ServerArgs(model_path='/m', "
    "tokenizer_path='/m', api_key='sk-123', admin_api_key='sk-admin-77aa01', max_total_tokens=None)"
)


@pytest.fixture
def secret_process() -> Iterator[subprocess.Popen[bytes]]:
    """A serving-like process with credentials in its environ and on its command line."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HF_TOKEN": "hf_envtoken_1",
        "AWS_SECRET_ACCESS_KEY": "aws_secret_1",
        "SGLANG_HF_TOKEN": "hf_envtoken_2",
        "MC_ETCD_PASS": "mc_etcd_pass_1",
        "MC_METADATA_SERVER": "etcd://mc:mc_url_pass_1@127.0.0.1:2379",
        "NIXL_ROUTER_JWT": "nixl_jwt_1",
    }
    child = (
        f"{sys.executable} -c 'import time; time.sleep(60)' --api-key argv_key_1 --auth argv_auth_1"
    )
    proc = subprocess.Popen(["/bin/sh", "-c", f"{child} & wait"], env=env)
    try:
        # The child has exec'd python (until then its cmdline is the shell's); up to 30 s.
        for _ in range(1500):
            if any("--api-key" in p.cmdline for p in read_process_tree(proc.pid)):
                break
            time.sleep(0.02)
        yield proc
    finally:
        for pid in [p.pid for p in read_process_tree(proc.pid)][::-1]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        proc.wait()


ENV_SECRETS = (
    "hf_envtoken_1",
    "aws_secret_1",
    "hf_envtoken_2",
    "mc_etcd_pass_1",
    "mc_url_pass_1",
    "nixl_jwt_1",
    "argv_key_1",
    "argv_auth_1",
)


def _echo(request: httpx.Request) -> httpx.Response:
    return httpx.Response(401, text=f"401 Unauthorized: Authorization: Bearer {API_KEY}")


async def test_incident_files_and_logs_hold_no_secret(
    secret_process: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    """Every file written for an incident, the audit log and the log output are free of the
    journal's keys, the environ's and argv's credentials, echoed headers and URL passwords."""
    key_file = tmp_path / "key"
    key_file.write_text(API_KEY)
    load_api_key(key_file)  # as the daemon does at start: the key is now known to the policy
    logs = io.StringIO()
    configure_logging("json", "debug", stream=logs)
    journal = f"{SERVER_ARGS_LINE}\n2026-11-29T07:40:01+0000 h python[2]: saw {API_KEY}\n"
    states = {role: unit_state(role, pid=secret_process.pid) for role in Role}
    async with httpx.AsyncClient(transport=httpx.MockTransport(_echo)) as client:
        evidence = await capture_evidence(
            make_group(router={"url": f"http://user:{PASSWORD}@127.0.0.1:30001"}),
            observation(),
            client=client,
            raw_metrics={Role.DECODE: b"sglang:x 1\n"},
            unit_reader=FakeUnitReader(states),
            total_timeout_seconds=10.0,
            journal_lines=50,
            tools=tools(journal=FakeJournal({UNITS[Role.DECODE]: journal})),
            clock=lambda: NOW,
        )
    store = IncidentStore(tmp_path / "state", keep=5, max_mib=10, clock=lambda: NOW)
    incident = store.open_incident(group="dsv4", evidence=evidence, now=NOW)
    assert incident.written
    url = f"http://user:{PASSWORD}@127.0.0.1:30001"
    steps = (RestartStep(Role.ROUTER, UNITS[Role.ROUTER], f"{url}/readiness", 60),)
    failed = StepResult(
        Role.ROUTER,
        UNITS[Role.ROUTER],
        False,
        "ready",
        f"GET {url}/readiness -> 401: Authorization: Bearer {API_KEY}",
        NOW + 1,
        NOW + 2,
    )
    outcome = RestartOutcome(
        RestartPlan("dsv4", "manual", steps), False, False, (failed,), NOW, NOW + 2
    )
    store.record_action(incident, outcome)
    store.record_verification(incident, False, f"probe: HTTP 401 api_key={API_KEY}", NOW + 3)

    written = sorted(p for p in (tmp_path / "state").rglob("*") if p.is_file())
    names = {p.name for p in written}
    assert {"journal-decode.txt", "processes.json", "http.json", "summary.json"} <= names
    assert "audit.jsonl" in names
    everything = "\n".join(p.read_text() for p in written) + logs.getvalue()
    _assert_clean(everything, "sk-123", ADMIN_KEY, API_KEY, PASSWORD, *ENV_SECRETS)
    journal_file = (incident.path / "journal-decode.txt").read_text()
    assert "api_key='***'" in journal_file
    environ = json.loads((incident.path / "processes.json").read_text())[0]["environ"]
    assert environ["MC_METADATA_SERVER"] == "etcd://***@127.0.0.1:2379"  # kept, masked
    assert environ["SGLANG_HF_TOKEN"] == "***"
    assert "HF_TOKEN" not in environ  # outside the allowlist: not captured at all
    assert "Bearer ***" in (incident.path / "http.json").read_text()
    assert "http://***@127.0.0.1:30001/readiness" in (incident.path / "report.md").read_text()
