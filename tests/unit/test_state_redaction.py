"""One redaction pass for everything the daemon writes: a dry-run cycle with a secret in every
config string that can hold one leaves none in state_dir, the recording, the logs or /metrics."""

from __future__ import annotations

import io
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from pdsim.stack import free_ports
from tests.unit import configs
from tests.unit.rawhttp import refused_url
from tests.unit.test_app import FAST, NO_BUS, StopAfter
from watchdog.config import GroupSection, load_config
from watchdog.decide import Decision, GroupState, Verdict, decide
from watchdog.logs import configure_logging
from watchdog.model import Action, Observation, State
from watchdog.run import cycle
from watchdog.run.daemon import run_daemon

# Each distinctive, each long enough to be a known secret (redact.MIN_KNOWN_SECRET_LENGTH).
SECRETS = {
    "prefill_password": "pfpass-8c1e2d",
    "decode_password": "dcpass-93ab7f",
    "router_token_user": "rttoken-41d0e6",
    "metrics_password": "mtpass-5b77c2",
    "api_key": "sk-apikey-0f3a9b",
    "admin_api_key": "sk-admin-6e2d14",
    "expect_env": "envpass-d41c08",
    "expect_cmdline": "argkey-72b9e1",
}


@pytest.fixture(autouse=True)
def _no_systemd(monkeypatch: pytest.MonkeyPatch) -> None:
    """No bus and no notify socket of whoever runs pytest."""
    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", NO_BUS)
    for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        monkeypatch.delenv(name, raising=False)


def secret_config(tmp_path: Path) -> Path:
    """A group whose URLs, key files and expectations each carry one of SECRETS."""
    base = refused_url()  # nothing listens: every probe and scrape fails at once
    host = base.removeprefix("http://")
    (tmp_path / "api-key").write_text(SECRETS["api_key"] + "\n")
    (tmp_path / "admin-key").write_text(SECRETS["admin_api_key"])
    group = configs.group(
        "g1",
        url=base,
        probe={
            **FAST["probe"],
            "api_key_file": str(tmp_path / "api-key"),
            "admin_api_key_file": str(tmp_path / "admin-key"),
        },
        restart=FAST["restart"],
    )
    group["prefill"]["url"] = f"http://user:{SECRETS['prefill_password']}@{host}"
    group["decode"]["url"] = f"http://user:{SECRETS['decode_password']}@{host}"
    group["decode"]["expect_env"] = {"MC_ETCD_PASS": SECRETS["expect_env"]}
    group["decode"]["expect_cmdline_contains"] = [f"--api-key={SECRETS['expect_cmdline']}"]
    group["router"]["url"] = f"http://{SECRETS['router_token_user']}@{host}"
    group["router"]["metrics_url"] = f"http://m:{SECRETS['metrics_password']}@{host}/metrics"
    settings = {
        "state_dir": str(tmp_path / "state"),
        "metrics_listen": f"127.0.0.1:{free_ports(1)[0]}",
        "cycle_seconds": 0.05,
        "shutdown_timeout_seconds": 5,
    }
    return configs.write_config(tmp_path / "g1.toml", {"watchdog": settings, "group": [group]})


async def test_a_dry_run_co_restart_writes_no_secret_anywhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stall acted on in a dry run writes history, an incident, the audit log, a recording,
    logs and metrics; none of them holds any configured secret."""
    real_decide = decide
    stalled: list[bool] = []

    def decide_stall_once(
        state: GroupState, observation: Observation, group: GroupSection, now: float
    ) -> Decision:
        decision = real_decide(state, observation, group, now)
        if not stalled:
            stalled.append(True)
            restarting = replace(decision.state, state=State.RESTARTING, since=now)
            return Decision(restarting, Verdict.SILENT_STALL, Action.CO_RESTART, ())
        return decision

    monkeypatch.setattr(cycle, "decide", decide_stall_once)
    logs = io.StringIO()
    configure_logging("json", "debug", stream=logs)
    config = load_config(secret_config(tmp_path))
    registry = CollectorRegistry()
    recording = tmp_path / "state" / "recording.jsonl"
    daemon = StopAfter(
        config, dry_run=True, registry=registry, bus_address=NO_BUS, record_path=recording
    )
    daemon.limit = 3
    assert await run_daemon(daemon) == 0
    state_dir = tmp_path / "state"
    written = sorted(p for p in state_dir.rglob("*") if p.is_file())
    names = {p.name for p in written}
    assert {"g1.history.json", "audit.jsonl", "summary.json", "recording.jsonl"} <= names
    everything = {str(p): p.read_text(encoding="utf-8", errors="replace") for p in written}
    everything["logs"] = logs.getvalue()
    everything["/metrics"] = generate_latest(registry).decode()
    leaks = sorted(
        f"{what} in {where}"
        for where, text in everything.items()
        for what, secret in SECRETS.items()
        if secret in text
    )
    assert leaks == [], "\n".join(leaks)
