"""SystemdClient against a real dbus-daemon and a scripted fake systemd: races, errors, reconnects."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest
from dbus_fast import Message, MessageType
from dbus_fast.aio import MessageBus

from tests.unit.fake_systemd import SYSTEMD_PATH, FakeSystemd, FakeUnit, PrivateBus, can_run
from watchdog.act.systemd import POLKIT_RULE, SystemdClient
from watchdog.errors import AccessDenied, JobFailed, NoSuchUnit, SystemdError
from watchdog.model import Role

pytestmark = pytest.mark.skipif(can_run() is not None, reason=str(can_run()))


@pytest.fixture
def bus() -> Iterator[PrivateBus]:
    """A private dbus-daemon, stopped by PID afterwards."""
    private = PrivateBus()
    private.start()
    yield private
    private.close()


@pytest.fixture
async def fake(bus: PrivateBus) -> AsyncIterator[FakeSystemd]:
    """A fake systemd on the private bus with units a.service and b.service."""
    state = FakeSystemd()
    state.add(FakeUnit("a.service"))
    state.add(FakeUnit("b.service", main_pid=200))
    await state.attach(bus.address)
    yield state
    state.detach()


@pytest.fixture
async def client(bus: PrivateBus, fake: FakeSystemd) -> AsyncIterator[SystemdClient]:
    """A connected SystemdClient with a short reconnect budget."""
    async with SystemdClient(bus.address, reconnect_timeout_seconds=10) as connected:
        yield connected


async def test_job_removed_before_reply_is_not_lost(
    client: SystemdClient, fake: FakeSystemd
) -> None:
    """JobRemoved arriving before RestartUnit's reply is buffered and returned, not waited for."""
    assert await client.restart_unit("a.service", timeout_seconds=5) == "done"
    assert client.early_results == 1
    assert fake.calls == [("RestartUnit", "a.service")]
    assert fake.subscribes == 1


async def test_job_removed_after_reply_is_awaited(client: SystemdClient, fake: FakeSystemd) -> None:
    """The usual order (reply, then JobRemoved) is awaited through the registered waiter."""
    fake.units["a.service"].mode = "after_reply"
    assert await client.restart_unit("a.service", timeout_seconds=5) == "done"
    assert client.early_results == 0


async def test_failed_job_raises_job_failed(client: SystemdClient, fake: FakeSystemd) -> None:
    """Any result but 'done' is a JobFailed naming the unit and the result."""
    fake.units["a.service"].result = "failed"
    with pytest.raises(JobFailed) as info:
        await client.restart_unit("a.service", timeout_seconds=5)
    assert (info.value.unit, info.value.result) == ("a.service", "failed")


async def test_concurrent_jobs_get_their_own_results(
    client: SystemdClient, fake: FakeSystemd
) -> None:
    """Two restarts in flight at once each get their own job's result."""
    fake.units["a.service"].mode = "after_reply"
    fake.units["b.service"].result = "timeout"
    results = await asyncio.gather(
        client.restart_unit("a.service", timeout_seconds=5),
        client.restart_unit("b.service", timeout_seconds=5),
        return_exceptions=True,
    )
    assert results[0] == "done"
    assert isinstance(results[1], JobFailed)
    assert results[1].result == "timeout"


async def test_no_result_within_timeout_raises_timeout(
    client: SystemdClient, fake: FakeSystemd
) -> None:
    """A job whose JobRemoved never comes ends in TimeoutError, and its waiter is dropped."""
    fake.units["a.service"].mode = "hold"
    with pytest.raises(TimeoutError):
        await client.restart_unit("a.service", timeout_seconds=0.2)
    assert client._waiters == {}


async def test_spoofed_job_removed_from_another_peer_is_ignored(
    bus: PrivateBus, client: SystemdClient, fake: FakeSystemd
) -> None:
    """A JobRemoved sent by anyone but systemd (here a unicast 'done') does not count."""
    fake.units["a.service"].mode = "hold"
    fake.units["a.service"].result = "failed"
    task = asyncio.create_task(client.restart_unit("a.service", timeout_seconds=5))
    while not client._waiters:  # the client read the reply and registered its waiter
        await asyncio.sleep(0.01)
    (job_path,) = fake.pending
    impostor = await MessageBus(bus_address=bus.address).connect()
    try:
        client_bus = client._bus
        assert client_bus is not None
        target = client_bus.unique_name
        await impostor.send(
            Message(
                message_type=MessageType.SIGNAL,
                destination=target,
                path=SYSTEMD_PATH,
                interface="org.freedesktop.systemd1.Manager",
                member="JobRemoved",
                signature="uoss",
                body=[1, job_path, "a.service", "done"],
            )
        )
        # The bus delivers one sender's messages in order: once the ping is answered, the client
        # has seen the spoofed signal.
        await impostor.call(
            Message(
                destination=target,
                path="/",
                interface="org.freedesktop.DBus.Peer",
                member="Ping",
            )
        )
        assert not task.done()
        fake.finish(job_path)
        with pytest.raises(JobFailed):
            await task
    finally:
        impostor.disconnect()


async def test_unknown_unit_raises_no_such_unit(client: SystemdClient) -> None:
    """RestartUnit of a unit systemd does not know raises NoSuchUnit naming it."""
    with pytest.raises(NoSuchUnit) as info:
        await client.restart_unit("nope.service", timeout_seconds=5)
    assert str(info.value) == (
        "systemd has no unit 'nope.service' (RestartUnit: Unit nope.service not found.)"
    )


async def test_access_denied_names_the_polkit_rule(
    client: SystemdClient, fake: FakeSystemd
) -> None:
    """A polkit refusal becomes AccessDenied telling the operator which rule to install."""
    fake.units["a.service"].error = (
        "org.freedesktop.DBus.Error.InteractiveAuthorizationRequired",
        "Interactive authentication required.",
    )
    with pytest.raises(AccessDenied) as info:
        await client.restart_unit("a.service", timeout_seconds=5)
    assert str(info.value) == (
        "RestartUnit a.service was refused (org.freedesktop.DBus.Error."
        "InteractiveAuthorizationRequired: Interactive authentication required.); the watchdog's "
        "user may not manage this unit. Install the polkit rule: watchdog polkit-rule --config "
        f"FILE --output {POLKIT_RULE}"
    )


async def test_read_unit_reads_typed_properties(client: SystemdClient) -> None:
    """read_unit returns load/active/sub state, MainPID, start timestamp, NRestarts and Result."""
    state = await client.read_unit(Role.DECODE, "b.service")
    assert state.ok
    assert (state.role, state.unit, state.load_state, state.active_state, state.sub_state) == (
        Role.DECODE,
        "b.service",
        "loaded",
        "active",
        "running",
    )
    assert (state.main_pid, state.exec_main_start_us, state.n_restarts) == (200, 1_000_000, 0)
    assert state.result == "success"


async def test_read_unit_never_raises_for_a_missing_unit(client: SystemdClient) -> None:
    """A unit that is not loaded reads as ok=False with the LoadState in the error."""
    state = await client.read_unit(Role.ROUTER, "ghost.service")
    assert not state.ok
    assert state.error == "unit ghost.service is not loaded (LoadState=not-found)"


async def test_read_unit_never_raises_when_systemd_is_gone(
    bus: PrivateBus, fake: FakeSystemd
) -> None:
    """With systemd off the bus, read_unit reports the failure instead of raising."""
    async with SystemdClient(bus.address, reconnect_timeout_seconds=0.3) as client:
        fake.detach()
        await asyncio.sleep(0.05)
        state = await client.read_unit(Role.PREFILL, "a.service")
    assert not state.ok
    assert "systemd is not reachable on the bus" in state.error


async def test_read_unit_while_the_bus_is_down_does_not_wait_for_reconnect(
    bus: PrivateBus, fake: FakeSystemd
) -> None:
    """Observation reads make one reconnect attempt, not the hour-long reconnect budget."""
    async with SystemdClient(bus.address, reconnect_timeout_seconds=3600) as client:
        fake.detach()
        bus.stop()
        state = await client.read_unit(Role.PREFILL, "a.service")
        assert not state.ok
        assert state.error.startswith(f"cannot connect to {bus.address}: ")


async def test_reconnects_and_resubscribes_after_bus_restart(
    bus: PrivateBus, client: SystemdClient, fake: FakeSystemd
) -> None:
    """After the bus daemon restarts, the next call opens a new connection and subscribes again."""
    assert await client.restart_unit("a.service", timeout_seconds=5) == "done"
    fake.detach()
    bus.stop()
    bus.start()
    await fake.attach(bus.address)
    state = await client.read_unit(Role.PREFILL, "a.service")
    assert state.ok
    assert client.connections == 2
    assert fake.subscribes == 2
    assert await client.restart_unit("a.service", timeout_seconds=5) == "done"


@pytest.mark.parametrize(
    "case",
    [
        (True, "active", "done"),  # the job is still queued: wait for its JobRemoved again
        (False, "active", "done"),  # the job finished while we were off the bus: unit is active
        (False, "failed", "unknown"),  # finished, unit failed: the lost result is a failure
    ],
)
async def test_bus_restart_during_job_wait(
    bus: PrivateBus,
    client: SystemdClient,
    fake: FakeSystemd,
    case: tuple[bool, str, str],
) -> None:
    """A bus restart while waiting for JobRemoved: reconnect, then find the job's fate."""
    still_queued, unit_after, expect = case
    unit = fake.units["a.service"]
    unit.mode = "hold"
    task = asyncio.create_task(client.restart_unit("a.service", timeout_seconds=10))
    while not client._waiters:  # the client read the reply and registered its waiter
        await asyncio.sleep(0.01)
    (job_path,) = fake.pending
    fake.detach()
    bus.stop()
    if not still_queued:
        del fake.pending[job_path]
        unit.active_state = unit_after
    bus.start()
    await fake.attach(bus.address)
    if still_queued:
        while fake.subscribes < 2:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        fake.finish(job_path)
    if expect == "done":
        assert await task == "done"
    else:
        with pytest.raises(JobFailed) as info:
            await task
        assert info.value.result == (
            "unknown (the bus dropped before the job result; the unit is now failed)"
        )
    assert client.connections == 2


async def test_unit_processes_lists_the_pids_left_in_the_unit(
    client: SystemdClient, fake: FakeSystemd
) -> None:
    """GetUnitProcesses: the PIDs of the unit's control group; an unloaded unit has none."""
    fake.units["a.service"].processes = [
        ("/system.slice/a.service", 4242, "/usr/bin/python3 -m sglang.launch_server"),
        ("/system.slice/a.service", 4243, "sglang::scheduler"),
    ]
    assert await client.unit_processes("a.service") == (4242, 4243)
    assert await client.unit_processes("b.service") == ()
    assert await client.unit_processes("gone.service") == ()


async def _read_until(
    client: SystemdClient, unit: str, start_us: int, *, seconds: float = 60.0
) -> None:
    """Read `unit` until it shows ExecMainStartTimestamp `start_us` (the signal was delivered)."""
    async with asyncio.timeout(seconds):
        while (await client.read_unit(Role.DECODE, unit)).exec_main_start_us != start_us:
            await asyncio.sleep(0.01)


async def test_unit_reads_are_remembered_until_systemd_announces_a_change(
    client: SystemdClient, fake: FakeSystemd
) -> None:
    """A second read with no PropertiesChanged in between asks systemd nothing; once systemd
    announces a change on the unit's object, the next read is a full one and sees it."""
    first = await client.read_unit(Role.DECODE, "b.service")
    again = await client.read_unit(Role.PREFILL, "b.service")
    assert (client.unit_reads_full, client.unit_reads_remembered) == (1, 1)
    assert again.role is Role.PREFILL  # remembered per unit, answered for the caller's role
    assert again.exec_main_start_us == first.exec_main_start_us
    unit = fake.units["b.service"]
    unit.start_us, unit.main_pid = 5_000_000, 201  # changed without a signal: not asked again
    assert (await client.read_unit(Role.DECODE, "b.service")).exec_main_start_us == 1_000_000
    fake.changed("b.service")
    await _read_until(client, "b.service", 5_000_000)
    state = await client.read_unit(Role.DECODE, "b.service")
    assert (state.main_pid, state.exec_main_start_us) == (201, 5_000_000)
    assert client.unit_reads_full == 2


async def test_a_restart_job_is_seen_by_the_next_read(
    client: SystemdClient, fake: FakeSystemd
) -> None:
    """A unit restarted (by us or anyone) announces its new state: the read after the job sees
    the new start time without waiting for the safety net."""
    before = await client.read_unit(Role.DECODE, "a.service")
    assert await client.restart_unit("a.service", timeout_seconds=5) == "done"
    await _read_until(client, "a.service", before.exec_main_start_us + 1_000_000)


async def test_a_change_on_another_unit_leaves_the_reading_remembered(
    client: SystemdClient, fake: FakeSystemd
) -> None:
    """A signal for one unit's object invalidates only that unit."""
    await client.read_unit(Role.PREFILL, "a.service")
    await client.read_unit(Role.DECODE, "b.service")
    fake.units["b.service"].start_us = 7_000_000
    fake.changed("b.service")
    await _read_until(client, "b.service", 7_000_000)
    full = client.unit_reads_full
    await client.read_unit(Role.PREFILL, "a.service")
    assert client.unit_reads_full == full


async def test_the_safety_net_reads_in_full_after_its_interval(
    bus: PrivateBus, fake: FakeSystemd
) -> None:
    """With no time allowed from memory every read is a full one: a change systemd never
    announced is still seen within UNIT_FULL_READ_SECONDS."""
    async with SystemdClient(bus.address, unit_full_read_seconds=0.0) as client:
        await client.read_unit(Role.DECODE, "b.service")
        fake.units["b.service"].start_us = 9_000_000
        state = await client.read_unit(Role.DECODE, "b.service")
        assert state.exec_main_start_us == 9_000_000
        assert (client.unit_reads_full, client.unit_reads_remembered) == (2, 0)


async def test_a_new_connection_reads_in_full(
    bus: PrivateBus, client: SystemdClient, fake: FakeSystemd
) -> None:
    """A bus restart loses the match rules and any signal in flight: the first read on the new
    connection asks systemd, and is remembered again after."""
    await client.read_unit(Role.DECODE, "b.service")
    fake.detach()
    bus.stop()
    fake.units["b.service"].start_us = 3_000_000  # changed while we were off the bus
    bus.start()
    await fake.attach(bus.address)
    state = await client.read_unit(Role.DECODE, "b.service")
    assert state.exec_main_start_us == 3_000_000
    assert client.connections == 2
    await client.read_unit(Role.DECODE, "b.service")
    assert (client.unit_reads_full, client.unit_reads_remembered) == (2, 1)


async def test_wait_for_active_reads_in_full(client: SystemdClient, fake: FakeSystemd) -> None:
    """The restart path's waits never answer from memory."""
    await client.read_unit(Role.DECODE, "b.service")
    fake.units["b.service"].active_state = "failed"  # not announced
    with pytest.raises(SystemdError):
        await client.wait_for_active(Role.DECODE, "b.service", timeout_seconds=5)
