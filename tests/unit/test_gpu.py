"""GPU evidence: nvidia-smi and NVML parsing from recorded outputs, the fallback chain, busy/idle."""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any, cast

import pytest

from watchdog.evidence.gpu import parse_nvidia_smi_csv, read_gpus, read_nvidia_smi, read_nvml
from watchdog.evidence.gpu_activity import (
    describe_devices,
    device_activity,
    gpu_busy,
    select_devices,
)
from watchdog.evidence.records import GpuDevice, GpuSource

DATA = Path(__file__).parent.parent / "data" / "gpu"


def _text(name: str) -> str:
    return (DATA / name).read_text()


def test_parses_the_incidents_b200_readings() -> None:
    """Eight B200s at 0 % and ~165 W parse with index, uuid, name, watts and MiB."""
    devices = parse_nvidia_smi_csv(_text("smi-b200-transfer-stall.csv"))
    assert len(devices) == 8
    assert devices[4] == GpuDevice(
        index=4,
        uuid="GPU-1a6e8c3f-7d29-4b0e-a5c1-9f4d2e8b7a03",
        name="NVIDIA B200",
        utilization_percent=0.0,
        power_watts=165.12,
        power_limit_watts=1000.0,
        memory_used_mib=176128.0,
        memory_total_mib=183359.0,
    )


def test_not_available_cells_become_none() -> None:
    """`[N/A]` and `[Not Supported]` cells are None, the other values still parse."""
    first, second = parse_nvidia_smi_csv(_text("smi-h200-not-supported.csv"))
    assert first.utilization_percent is None
    assert first.power_watts is None
    assert first.power_limit_watts is None
    assert first.memory_total_mib == 143771.0
    assert second.utilization_percent is None
    assert second.power_watts == 98.5


def test_the_short_query_parses_with_its_field_list() -> None:
    """The five-column query (no uuid, name or limit) parses when its fields are named."""
    fields = ("index", "utilization.gpu", "power.draw", "memory.used", "memory.total")
    idle, busy = parse_nvidia_smi_csv(_text("smi-5col-b200.csv"), fields)
    assert (idle.utilization_percent, idle.power_watts, idle.power_limit_watts) == (0, 165.27, None)
    assert busy.utilization_percent == 97


def test_a_line_with_the_wrong_column_count_is_named() -> None:
    """A short line raises ValueError quoting the line number and the expected columns."""
    with pytest.raises(ValueError, match=r"line 2 has 3 values, expected 8"):
        parse_nvidia_smi_csv(_text("smi-h100-collective-hang.csv").splitlines()[0] + "\n0, 1, 2\n")


def test_a_non_numeric_value_is_named() -> None:
    """A garbled number raises ValueError naming the line."""
    line = "0, GPU-x, NVIDIA H100, lots, 1, 700, 1, 2\n"
    with pytest.raises(ValueError, match="nvidia-smi line 1"):
        parse_nvidia_smi_csv(line)


class FakeNvml:
    """Replays a recorded nvml-*.json as the pynvml module would answer."""

    class NVMLError(Exception):
        """pynvml's base error."""

    def __init__(self, recording: dict[str, Any], fail_init: bool = False) -> None:
        self.devices = recording["devices"]
        self.as_bytes = recording.get("bytes_strings", False)
        self.fail_init = fail_init
        self.shutdown_called = False

    def _str(self, value: str) -> str | bytes:
        return value.encode() if self.as_bytes else value

    def _get(self, handle: int, call: str, value: Any) -> Any:
        if call in self.devices[handle].get("unsupported", ()):
            raise self.NVMLError("Not Supported")
        return value

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise self.NVMLError("Driver Not Loaded")

    def nvmlShutdown(self) -> None:
        self.shutdown_called = True

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetUUID(self, h: int) -> str | bytes:
        return cast(
            "str | bytes", self._get(h, "nvmlDeviceGetUUID", self._str(self.devices[h]["uuid"]))
        )

    def nvmlDeviceGetName(self, h: int) -> str | bytes:
        return cast(
            "str | bytes", self._get(h, "nvmlDeviceGetName", self._str(self.devices[h]["name"]))
        )

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        rates = self.devices[h]["utilization"]
        return self._get(h, "nvmlDeviceGetUtilizationRates", _Struct(**rates))

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        return int(self._get(h, "nvmlDeviceGetPowerUsage", self.devices[h]["power_mw"]))

    def nvmlDeviceGetEnforcedPowerLimit(self, h: int) -> int:
        return int(
            self._get(h, "nvmlDeviceGetEnforcedPowerLimit", self.devices[h]["power_limit_mw"])
        )

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        return self._get(h, "nvmlDeviceGetMemoryInfo", _Struct(**self.devices[h]["memory"]))


class _Struct:
    """A stand-in for pynvml's ctypes structures (attribute access only)."""

    def __init__(self, **values: Any) -> None:
        self.__dict__.update(values)


def _nvml(name: str, **kwargs: Any) -> FakeNvml:
    return FakeNvml(json.loads(_text(name)), **kwargs)


def test_nvml_values_are_converted_to_watts_and_mib() -> None:
    """NVML milliwatts and bytes become watts and MiB; the binding is shut down afterwards."""
    nvml = _nvml("nvml-b200-decode-idle.json")
    idle, busy = read_nvml(nvml)
    assert idle.power_watts == pytest.approx(165.12)
    assert idle.power_limit_watts == 1000.0
    assert idle.memory_used_mib == pytest.approx(176128.0)
    assert idle.utilization_percent == 0
    assert busy.utilization_percent == 100
    assert nvml.shutdown_called


def test_old_bindings_bytes_and_unsupported_calls() -> None:
    """bytes names are decoded and a NotSupported call leaves that value None."""
    (device,) = read_nvml(_nvml("nvml-old-bindings-bytes.json"))
    assert device.name == "Tesla V100-SXM2-32GB"
    assert device.uuid.startswith("GPU-0d7e")
    assert device.power_limit_watts is None
    assert device.power_watts == pytest.approx(42.213)


def _fake_smi(tmp_path: Path, body: str) -> str:
    script = tmp_path / "nvidia-smi"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


async def test_nvidia_smi_output_is_read_from_the_tool(tmp_path: Path) -> None:
    """A real nvidia-smi process is run with the query and its CSV parsed."""
    recorded = DATA / "smi-h100-collective-hang.csv"
    binary = _fake_smi(tmp_path, f'case "$1" in --query-gpu=index,uuid*) cat {recorded};; esac')
    devices, why = await read_nvidia_smi(30.0, binary)
    assert why == ""
    assert devices is not None
    assert [d.utilization_percent for d in devices] == [100.0, 100.0]


async def test_nvidia_smi_failure_keeps_its_message(tmp_path: Path) -> None:
    """A driver failure (exit 9) is reported with nvidia-smi's own message."""
    binary = _fake_smi(tmp_path, f"cat {DATA / 'smi-driver-failed.txt'}; exit 9")
    devices, why = await read_nvidia_smi(30.0, binary)
    assert devices is None
    assert "exited 9" in why
    assert "couldn't communicate with the NVIDIA driver" in why


async def test_a_hanging_nvidia_smi_is_killed_at_its_deadline(tmp_path: Path) -> None:
    """nvidia-smi that never answers yields 'timed out' instead of blocking."""
    binary = _fake_smi(tmp_path, "exec sleep 30")
    devices, why = await read_nvidia_smi(0.2, binary)
    assert devices is None
    assert "timed out" in why


async def test_nvml_first() -> None:
    """With a working NVML binding, the reading comes from NVML."""
    reading = await read_gpus(30.0, load_nvml=lambda: _nvml("nvml-b200-decode-idle.json"))
    assert reading.source is GpuSource.NVML
    assert len(reading.devices) == 2


async def test_falls_back_to_nvidia_smi_when_nvml_is_missing(tmp_path: Path) -> None:
    """No nvidia-ml-py: nvidia-smi answers, and the note says why NVML was skipped."""

    def missing() -> Any:
        raise ImportError("No module named 'pynvml'")

    binary = _fake_smi(tmp_path, f"cat {DATA / 'smi-b200-transfer-stall.csv'}")
    reading = await read_gpus(30.0, load_nvml=missing, nvidia_smi=binary)
    assert reading.source is GpuSource.NVIDIA_SMI
    assert len(reading.devices) == 8
    assert "nvidia-ml-py not installed" in reading.detail


async def test_unavailable_with_both_reasons(tmp_path: Path) -> None:
    """NVML failing to initialise and no nvidia-smi give 'unavailable' naming both causes."""
    reading = await read_gpus(
        5.0,
        load_nvml=lambda: _nvml("nvml-b200-decode-idle.json", fail_init=True),
        nvidia_smi=str(tmp_path / "absent-nvidia-smi"),
    )
    assert reading.source is GpuSource.UNAVAILABLE
    assert not reading.ok
    assert "Driver Not Loaded" in reading.detail
    assert "not found" in reading.detail


def _dev(util: float | None, watts: float | None, limit: float | None = 1000.0) -> GpuDevice:
    return GpuDevice(0, utilization_percent=util, power_watts=watts, power_limit_watts=limit)


@pytest.mark.parametrize(
    ("device", "expected"),
    [
        # The incident: a stalled decode GPU, 0 % and 165 W of 1000 W.
        (_dev(0, 165), "idle"),
        # A spinning TP collective: a kernel that never ends reads 100 %.
        (_dev(100, 310, 700), "busy"),
        (_dev(50, 200), "busy"),  # at the utilisation threshold
        (_dev(10, 150), "idle"),  # at the idle threshold
        (_dev(30, 200), "unknown"),  # in between, moderate power: cannot tell
        (_dev(30, 600), "busy"),  # in between, but drawing over half the limit
        (_dev(0, 700), "unknown"),  # 0 % yet 70 % power: contradictory, not demonstrably idle
        (_dev(None, 600), "busy"),  # no utilisation: power decides
        (_dev(None, 250), "idle"),  # 25 % of the limit
        (_dev(None, 400), "unknown"),  # 40 %: ambiguous
        (_dev(None, 165, None), "unknown"),  # power without a limit is not comparable
        (_dev(None, None), "unknown"),
        (_dev(5, None, None), "idle"),  # utilisation alone suffices for idle
    ],
)
def test_device_activity_table(device: GpuDevice, expected: str) -> None:
    """Each reading maps to busy, idle or unknown by the documented thresholds."""
    assert device_activity(device) == expected


@pytest.mark.parametrize(
    ("devices", "expected"),
    [
        ((), None),
        ((_dev(0, 165), _dev(0, 170)), False),
        ((_dev(0, 165), _dev(100, 600)), True),  # any busy GPU makes the set busy
        ((_dev(0, 165), _dev(None, None)), None),  # one unknown spoils "idle"
        ((_dev(30, 200), _dev(100, 600)), True),
    ],
)
def test_gpu_busy_table(devices: tuple[GpuDevice, ...], expected: bool | None) -> None:
    """A set of GPUs is busy if any is, idle only if all are, else unknown."""
    assert gpu_busy(devices) is expected


def test_cuda_visible_devices_selects_by_index_and_uuid() -> None:
    """Indices and GPU- UUID prefixes pick devices; unmappable or unset yields None."""
    devices = parse_nvidia_smi_csv(_text("smi-b200-transfer-stall.csv"))
    assert [d.index for d in select_devices(devices, "4,5,6,7") or ()] == [4, 5, 6, 7]
    assert [d.index for d in select_devices(devices, "GPU-1a6e8c3f") or ()] == [4]
    assert select_devices(devices, "") == ()
    assert select_devices(devices, None) is None
    assert select_devices(devices, "MIG-3f2a") is None
    assert select_devices(devices, "9") is None


def test_descriptions_for_the_report() -> None:
    """One or two GPUs are listed each; more are summarised as ranges."""
    devices = parse_nvidia_smi_csv(_text("smi-b200-transfer-stall.csv"))
    assert describe_devices(devices[4:5]) == "GPU 4: 0 % util, 165 W of 1000 W"
    assert describe_devices(devices[4:]) == "GPUs 4,5,6,7: 0 % util, 165–166 W of 1000 W"
    assert describe_devices(()) == "no GPUs"
