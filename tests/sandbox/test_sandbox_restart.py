"""The co-restart against a real systemd (PID 1 of a private namespace) driving real units.

The simulated prefill and decode and the real sglang-router run as units of the sandboxed systemd;
every restart here is a real RestartUnit over the sandbox's own system bus.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from pdsim.stack import REPO_ROOT
from sandbox.pdsandbox import PdSandbox
from tests.sandbox.fixtures import INSTANT_UNIT
from watchdog.act.plan import build_plan
from watchdog.act.restarters import open_restarter
from watchdog.act.systemd import SystemdClient
from watchdog.config import DECODE_ONLY_EXPLANATION, load_config
from watchdog.model import RestartOutcome, Role
from watchdog.statefiles import RestartHistory, RestartLock, read_refusal_counts

pytestmark = pytest.mark.sandbox

SLOW_START_SECONDS = 1.0


async def co_restart(pd: PdSandbox, client: SystemdClient | None = None) -> RestartOutcome:
    """Execute the group's co-restart plan with the real SystemdRestarter."""
    group = load_config(pd.config_path).group[0]
    async with open_restarter(
        dry_run=False, units=client, bus_address=pd.sandbox.bus_address, poll_seconds=0.1
    ) as restarter:
        return await restarter.execute(build_plan(group, "test"))


def run_cli(pd: PdSandbox, *args: str) -> subprocess.CompletedProcess[str]:
    """`python -m watchdog ARGS` against the sandbox's bus."""
    return subprocess.run(
        [sys.executable, "-m", "watchdog", "--log-format", "json", *args],
        cwd=REPO_ROOT,
        env=pd.env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


async def serves_a_completion(pd: PdSandbox) -> str:
    """Send one completion through the router; returns the generated text."""
    async with httpx.AsyncClient(trust_env=False, timeout=20) as http:
        response = await http.post(
            pd.stack.url("router") + "/v1/completions",
            json={"model": "pdsim", "prompt": "Reply with the word ok.", "max_tokens": 4},
        )
    assert response.status_code == 200, response.text
    text: str = response.json()["choices"][0]["text"]
    return text


def assert_outcome_ok(outcome: RestartOutcome, pd: PdSandbox) -> None:
    """Fail with every step's detail and the unit logs when the sequence did not succeed."""
    if outcome.ok:
        return
    details = "\n".join(f"{s.unit} {s.phase} {s.ok}: {s.detail}" for s in outcome.steps)
    logs = "\n".join(
        f"--- {unit}\n{pd.sandbox.unit_log(unit)[-2000:]}"
        for unit in (s.unit for s in outcome.steps)
    )
    pytest.fail(f"co-restart failed:\n{details}\n{logs}")


async def test_co_restart_order_is_visible_in_start_timestamps(pd_serving: PdSandbox) -> None:
    """Prefill, then decode, then router restart, each after the previous was ready; it serves."""
    before = pd_serving.start_times_us()
    outcome = await co_restart(pd_serving)
    assert_outcome_ok(outcome, pd_serving)
    after = pd_serving.start_times_us()
    assert all(after[role] > before[role] for role in before)
    assert after["prefill"] < after["decode"] < after["router"]
    prefill_ready_us = outcome.steps[0].finished_at * 1e6
    decode_ready_us = outcome.steps[1].finished_at * 1e6
    assert after["decode"] >= prefill_ready_us
    assert after["router"] >= decode_ready_us
    assert [s.phase for s in outcome.steps] == ["ready", "ready", "ready"]
    assert await serves_a_completion(pd_serving)


async def test_slow_start_prefill_delays_the_decode_step(pd_serving: PdSandbox) -> None:
    """A prefill whose /health stays 503 while it 'loads' holds the decode restart back."""
    pd_serving.stack.set_start_faults(
        "prefill", [{"kind": "slow_start", "seconds": SLOW_START_SECONDS}]
    )
    outcome = await co_restart(pd_serving)
    assert_outcome_ok(outcome, pd_serving)
    after = pd_serving.start_times_us()
    # Lower bounds only: /health is 503 for SLOW_START_SECONDS after prefill's process started.
    assert after["decode"] - after["prefill"] >= SLOW_START_SECONDS * 1e6
    assert after["decode"] >= outcome.steps[0].finished_at * 1e6
    assert await serves_a_completion(pd_serving)


async def test_unit_that_fails_to_start_stops_the_sequence(pd_serving: PdSandbox) -> None:
    """A decode that crashes at start fails its step; the router is not restarted."""
    before = pd_serving.start_times_us()
    pd_serving.stack.set_start_faults("decode", [{"kind": "crash_after", "seconds": 0}])
    outcome = await co_restart(pd_serving)
    after = pd_serving.start_times_us()
    assert not outcome.ok
    failed = outcome.failed_step
    assert failed is not None
    assert failed.role is Role.DECODE
    assert failed.phase in ("active", "ready")
    assert "failed" in failed.detail
    assert [s.phase for s in outcome.steps][2] == "not_started"
    assert after["prefill"] > before["prefill"]
    assert after["router"] == before["router"]
    # Recovery is another full co-restart, once the cause is gone.
    pd_serving.stack.set_start_faults("decode", [])
    assert_outcome_ok(await co_restart(pd_serving), pd_serving)
    assert await serves_a_completion(pd_serving)


async def test_decode_only_request_is_refused_and_nothing_restarts(pd_serving: PdSandbox) -> None:
    """`watchdog restart --unit decode` exits 3 with the explanation; no unit restarts."""
    before = pd_serving.start_times_us()
    config = str(pd_serving.config_path)
    result = run_cli(pd_serving, "restart", "--config", config, "--unit", "decode", "--yes")
    assert result.returncode == 3, result.stderr
    assert DECODE_ONLY_EXPLANATION in result.stderr
    assert f"watchdog restart --config {pd_serving.config_path} --group sbx" in result.stderr
    events = [json.loads(line)["event"] for line in result.stderr.splitlines() if line[:1] == "{"]
    assert "restart_refused" in events
    assert pd_serving.start_times_us() == before
    counts = read_refusal_counts(pd_serving.state_dir, "sbx", now=0.0)
    assert counts["decode_without_prefill"] >= 1


async def test_lock_contention_fails_fast_naming_the_holder(pd_serving: PdSandbox) -> None:
    """While the daemon holds the group lock, a manual restart exits 3 naming it; nothing moves."""
    before = pd_serving.start_times_us()
    with RestartLock(pd_serving.state_dir, "sbx", purpose="daemon") as lock:
        assert lock.held
        result = run_cli(pd_serving, "restart", "--config", str(pd_serving.config_path), "--yes")
    assert result.returncode == 3, result.stderr
    assert "another restart of group 'sbx' is in progress" in result.stderr
    assert "(daemon) since" in result.stderr
    assert pd_serving.start_times_us() == before


async def test_client_reconnects_when_the_bus_restarts_mid_run(pd_serving: PdSandbox) -> None:
    """The sandbox's dbus restarts while prefill is getting ready; the sequence still completes."""
    pd_serving.stack.set_start_faults(
        "prefill", [{"kind": "slow_start", "seconds": SLOW_START_SECONDS}]
    )
    before = pd_serving.start_times_us()
    async with SystemdClient(pd_serving.sandbox.bus_address) as client:
        task = asyncio.create_task(co_restart(pd_serving, client))
        prefill = pd_serving.stack.unit("prefill")

        async def prefill_start_us() -> int:
            return (await client.read_unit(Role.PREFILL, prefill)).exec_main_start_us

        # Wait until prefill has been restarted (its start time moved): it is in its slow start.
        while await prefill_start_us() == before["prefill"]:
            await asyncio.sleep(0.05)
        await asyncio.to_thread(pd_serving.sandbox.restart_dbus)
        outcome = await task
        assert_outcome_ok(outcome, pd_serving)
        assert client.connections >= 2
    after = pd_serving.start_times_us()
    assert after["prefill"] < after["decode"] < after["router"]
    assert await serves_a_completion(pd_serving)


async def test_instant_jobs_whose_result_precedes_the_reply(pd_serving: PdSandbox) -> None:
    """Jobs that finish at once (JobRemoved before the method reply) are neither lost nor hung."""
    unit = INSTANT_UNIT.name
    async with SystemdClient(pd_serving.sandbox.bus_address) as client:
        starts = set()
        for _ in range(10):
            assert await client.restart_unit(unit, timeout_seconds=10) == "done"
            starts.add((await client.read_unit(Role.ROUTER, unit)).exec_main_start_us)
        assert len(starts) == 10  # ten real restarts
        # StartUnit of an active unit is a no-op job: systemd emits its JobRemoved first.
        for _ in range(20):
            assert await client.start_unit(unit, timeout_seconds=10) == "done"
            if client.early_results:
                break
        assert client.early_results >= 1
        assert client._waiters == {}
        assert client._early == {}


def test_cli_plan_restart_pause_resume_reset(pd_serving: PdSandbox, tmp_path: Path) -> None:
    """The operator commands work against the sandbox; `restart --yes` is recorded in history."""
    config = str(pd_serving.config_path)
    plan = run_cli(pd_serving, "plan", "--config", config)
    assert plan.returncode == 0, plan.stderr
    assert "1. prefill  sglang-sbx-prefill.service" in plan.stdout
    before = pd_serving.start_times_us()
    restart = run_cli(pd_serving, "restart", "--config", config, "--yes")
    assert restart.returncode == 0, restart.stdout + restart.stderr
    assert restart.stdout.rstrip().endswith("co-restart of group sbx done")
    after = pd_serving.start_times_us()
    assert before["router"] < after["prefill"] < after["decode"] < after["router"]
    records = RestartHistory.load(pd_serving.state_dir, "sbx", now=0.0).records
    assert records[-1].trigger == "manual"
    assert records[-1].ok
    assert [s.phase for s in records[-1].steps] == ["ready", "ready", "ready"]
    for args in (["pause", "--for", "30m"], ["resume"], ["reset"]):
        result = run_cli(pd_serving, *args, "--config", config, "--group", "sbx")
        assert result.returncode == 0, result.stderr


async def test_a_restart_by_someone_else_is_announced_to_remembered_reads(
    pd_serving: PdSandbox,
) -> None:
    """Real systemd announces a unit's changes with PropertiesChanged: a read remembered (no
    D-Bus call) while nothing changed, and a restart queued by another client (busctl) seen
    by the next reads long before the safety net's full read (set to an hour here)."""
    unit = INSTANT_UNIT.name
    async with SystemdClient(pd_serving.sandbox.bus_address, unit_full_read_seconds=3600) as client:
        before = await client.read_unit(Role.ROUTER, unit)
        assert (await client.read_unit(Role.ROUTER, unit)) == before
        assert (client.unit_reads_full, client.unit_reads_remembered) == (1, 1)
        await asyncio.to_thread(pd_serving.sandbox.queue_unit_job, "RestartUnit", unit)
        async with asyncio.timeout(120):
            while True:
                state = await client.read_unit(Role.ROUTER, unit)
                if state.active_state == "active" and (
                    state.exec_main_start_us > before.exec_main_start_us
                ):
                    break
                await asyncio.sleep(0.05)
        assert state.main_pid != before.main_pid
        assert client.unit_reads_full >= 2
