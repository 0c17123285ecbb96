"""A private dbus-daemon and a scripted fake of systemd's Manager on it, for SystemdClient tests.

The fake emits JobRemoved *before* returning RestartUnit's reply by default: the ordering the real
systemd produces for jobs that finish at once, and the one that loses results in naive clients.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from dbus_fast.aio import MessageBus
from dbus_fast.annotations import (
    DBusObjectPath,
    DBusSignature,
    DBusStr,
    DBusUInt32,
    DBusUInt64,
)
from dbus_fast.constants import PropertyAccess
from dbus_fast.errors import DBusError
from dbus_fast.service import (
    ServiceInterface,
    dbus_method,
    dbus_property,
    dbus_signal,
)

DBUS_DAEMON = shutil.which("dbus-daemon")
SYSTEMD_PATH = "/org/freedesktop/systemd1"


_BUS_CONFIG = """<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>session</type>
  <listen>unix:path={socket}</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow send_destination="*" eavesdrop="true"/>
    <allow eavesdrop="true"/>
    <allow own="*"/>
  </policy>
</busconfig>
"""


class PrivateBus:
    """A `dbus-daemon --session` on a private socket, started and stopped by its PID."""

    def __init__(self) -> None:
        # Short path: unix socket paths are limited to 108 bytes.
        self.dir = Path(tempfile.mkdtemp(prefix="wd-bus-"))
        self.socket = self.dir / "bus.sock"
        self.address = f"unix:path={self.socket}"  # what clients connect to
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start the daemon and wait until it has printed its address (it is listening then)."""
        assert DBUS_DAEMON is not None
        self.socket.unlink(missing_ok=True)
        # Our own config: no service directories, so nothing is ever activated on this bus.
        config = self.dir / "bus.conf"
        config.write_text(_BUS_CONFIG.format(socket=self.socket))
        self._proc = subprocess.Popen(
            [DBUS_DAEMON, f"--config-file={config}", "--nofork", "--print-address"],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
        )
        assert self._proc.stdout is not None
        if not self._proc.stdout.readline():
            raise RuntimeError("dbus-daemon did not start")

    def stop(self) -> None:
        """Terminate the daemon by PID (every connection drops)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()

    def close(self) -> None:
        """Stop and remove the socket directory."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def unit_path(name: str) -> str:
    """systemd's object path of a unit (bus_label_escape)."""
    escaped = "".join(c if c.isalnum() and c.isascii() else f"_{ord(c):02x}" for c in name)
    return f"{SYSTEMD_PATH}/unit/{escaped}"


@dataclass
class FakeUnit:
    """Scripted state of one unit."""

    name: str
    load_state: str = "loaded"
    active_state: str = "active"
    sub_state: str = "running"
    main_pid: int = 100
    start_us: int = 1_000_000
    n_restarts: int = 0
    service_result: str = "success"  # the Service's Result property
    result: str = "done"  # of the next job on this unit
    mode: str = "before_reply"  # or "after_reply", "hold" (the test emits it by hand)
    error: tuple[str, str] | None = None  # RestartUnit raises DBusError(name, text)
    # GetUnitProcesses: (control group, PID, command line) of each process left in the unit
    processes: list[tuple[str, int, str]] = field(default_factory=list)


@dataclass
class FakeSystemd:
    """The shared state behind every connection of the fake (it survives a bus restart)."""

    units: dict[str, FakeUnit] = field(default_factory=dict)
    calls: list[tuple[str, str]] = field(default_factory=list)
    subscribes: int = 0
    next_job: int = 1
    pending: dict[str, tuple[int, str, str]] = field(
        default_factory=dict
    )  # path -> id, unit, result
    manager: FakeManager | None = None
    bus: MessageBus | None = None
    # The exported Unit and Service objects of each unit, for their PropertiesChanged.
    objects: dict[str, tuple[FakeUnitInterface, FakeServiceInterface]] = field(default_factory=dict)

    def add(self, unit: FakeUnit) -> FakeUnit:
        self.units[unit.name] = unit
        return unit

    async def attach(self, address: str) -> None:
        """Connect to the bus at `address`, export the objects and own org.freedesktop.systemd1."""
        bus = await MessageBus(bus_address=address).connect()
        self.manager = FakeManager(self)
        bus.export(SYSTEMD_PATH, self.manager)
        for unit in self.units.values():
            objects = (FakeUnitInterface(unit), FakeServiceInterface(unit))
            for interface in objects:
                bus.export(unit_path(unit.name), interface)
            self.objects[unit.name] = objects
        for path in self.pending:
            bus.export(path, FakeJob())
        await bus.request_name("org.freedesktop.systemd1")
        self.bus = bus

    def detach(self) -> None:
        """Forget the (dead) connection."""
        if self.bus is not None and self.bus.connected:
            self.bus.disconnect()
        self.bus = None

    def changed(self, name: str) -> None:
        """Announce a change of the unit's state, as systemd does: PropertiesChanged on its
        Unit object (ActiveState, SubState) and its Service object (the rest)."""
        if self.bus is None or name not in self.objects:
            return
        unit_object, service_object = self.objects[name]
        unit = self.units[name]
        unit_object.emit_properties_changed(
            {"ActiveState": unit.active_state, "SubState": unit.sub_state}
        )
        service_object.emit_properties_changed(
            {
                "MainPID": unit.main_pid,
                "ExecMainStartTimestamp": unit.start_us,
                "NRestarts": unit.n_restarts,
                "Result": unit.service_result,
            }
        )

    def queue_job(self, method: str, name: str) -> str:
        self.calls.append((method, name))
        unit = self.units.get(name)
        if unit is None:
            raise DBusError("org.freedesktop.systemd1.NoSuchUnit", f"Unit {name} not found.")
        if unit.error is not None:
            raise DBusError(*unit.error)
        job_id = self.next_job
        self.next_job += 1
        path = f"{SYSTEMD_PATH}/job/{job_id}"
        self.pending[path] = (job_id, name, unit.result)
        assert self.bus is not None
        self.bus.export(path, FakeJob())
        if unit.mode == "before_reply":
            self.finish(path)
        elif unit.mode == "after_reply":
            asyncio.get_running_loop().call_later(0.05, self.finish, path)
        return path

    def finish(self, path: str) -> None:
        """Emit JobRemoved for a pending job and apply its effect on the unit."""
        job_id, name, result = self.pending.pop(path)
        unit = self.units[name]
        if result == "done":
            unit.active_state, unit.sub_state = "active", "running"
            unit.main_pid += 1
            unit.start_us += 1_000_000
        else:
            unit.active_state, unit.sub_state = "failed", "failed"
        self.changed(name)
        if self.bus is not None:
            self.bus.unexport(path)
        if self.manager is not None:
            self.manager.JobRemoved(job_id, path, name, result)


class FakeManager(ServiceInterface):
    """org.freedesktop.systemd1.Manager, the parts SystemdClient calls."""

    def __init__(self, state: FakeSystemd) -> None:
        super().__init__("org.freedesktop.systemd1.Manager")
        self.state = state

    @dbus_method()
    def Subscribe(self):  # type: ignore[no-untyped-def]  # dbus-fast reads "-> None" as a signature
        self.state.subscribes += 1

    @dbus_method()
    def LoadUnit(self, name: DBusStr) -> DBusObjectPath:
        if name not in self.state.units:
            self.state.add(FakeUnit(name, load_state="not-found", active_state="inactive"))
            assert self.state.bus is not None
            unit = self.state.units[name]
            self.state.bus.export(unit_path(name), FakeUnitInterface(unit))
            self.state.bus.export(unit_path(name), FakeServiceInterface(unit))
        return unit_path(name)

    @dbus_method()
    def RestartUnit(self, name: DBusStr, mode: DBusStr) -> DBusObjectPath:
        return self.state.queue_job("RestartUnit", name)

    @dbus_method()
    def StartUnit(self, name: DBusStr, mode: DBusStr) -> DBusObjectPath:
        return self.state.queue_job("StartUnit", name)

    @dbus_method()
    def GetUnitProcesses(
        self, name: DBusStr
    ) -> Annotated[list[list[Any]], DBusSignature("a(sus)")]:
        unit = self.state.units.get(name)
        if unit is None or unit.load_state != "loaded":
            raise DBusError("org.freedesktop.systemd1.NoSuchUnit", f"Unit {name} not loaded.")
        return [list(process) for process in unit.processes]

    @dbus_signal()
    def JobRemoved(
        self, job_id: DBusUInt32, job: DBusObjectPath, unit: DBusStr, result: DBusStr
    ) -> Annotated[list[Any], DBusSignature("uoss")]:
        return [job_id, job, unit, result]


class FakeUnitInterface(ServiceInterface):
    """org.freedesktop.systemd1.Unit of one fake unit."""

    def __init__(self, unit: FakeUnit) -> None:
        super().__init__("org.freedesktop.systemd1.Unit")
        self.unit = unit

    @dbus_property(access=PropertyAccess.READ)
    def LoadState(self) -> DBusStr:
        return self.unit.load_state

    @dbus_property(access=PropertyAccess.READ)
    def ActiveState(self) -> DBusStr:
        return self.unit.active_state

    @dbus_property(access=PropertyAccess.READ)
    def SubState(self) -> DBusStr:
        return self.unit.sub_state


class FakeServiceInterface(ServiceInterface):
    """org.freedesktop.systemd1.Service of one fake unit."""

    def __init__(self, unit: FakeUnit) -> None:
        super().__init__("org.freedesktop.systemd1.Service")
        self.unit = unit

    @dbus_property(access=PropertyAccess.READ)
    def MainPID(self) -> DBusUInt32:
        return self.unit.main_pid

    @dbus_property(access=PropertyAccess.READ)
    def ExecMainStartTimestamp(self) -> DBusUInt64:
        return self.unit.start_us

    @dbus_property(access=PropertyAccess.READ)
    def NRestarts(self) -> DBusUInt32:
        return self.unit.n_restarts

    @dbus_property(access=PropertyAccess.READ)
    def Result(self) -> DBusStr:
        return self.unit.service_result


class FakeJob(ServiceInterface):
    """org.freedesktop.systemd1.Job of a queued job (exists until JobRemoved)."""

    def __init__(self) -> None:
        super().__init__("org.freedesktop.systemd1.Job")

    @dbus_property(access=PropertyAccess.READ)
    def State(self) -> DBusStr:
        return "running"


def can_run() -> str | None:
    """Why the fake-bus tests cannot run here, or None."""
    if DBUS_DAEMON is None or not os.access(DBUS_DAEMON, os.X_OK):
        return "dbus-daemon is not installed (Debian package: dbus)"
    return None
