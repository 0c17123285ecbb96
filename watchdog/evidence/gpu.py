"""GPU state per device (utilisation, power, memory): NVML, else nvidia-smi, else unavailable.

Parsing is pure and tested with recorded outputs; only read_gpus() touches the driver.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import importlib
import io
from collections.abc import Callable, Sequence
from typing import Any

from watchdog.evidence.blocking import CommandRunner, run_command, wait_for_blocking
from watchdog.evidence.records import GpuDevice, GpuReading, GpuSource

# nvidia-smi's CSV columns, in query order. power.limit and uuid are beyond the bare minimum:
# the limit makes a power reading comparable across GPU generations, the uuid maps
# CUDA_VISIBLE_DEVICES=GPU-... to a device.
NVIDIA_SMI_FIELDS: tuple[str, ...] = (
    "index",
    "uuid",
    "name",
    "utilization.gpu",
    "power.draw",
    "power.limit",
    "memory.used",
    "memory.total",
)
NVIDIA_SMI_ARGS: tuple[str, ...] = (
    f"--query-gpu={','.join(NVIDIA_SMI_FIELDS)}",
    "--format=csv,noheader,nounits",
)
_MAX_TOOL_OUTPUT_BYTES = 64 * 1024

# --- nvidia-smi ------------------------------------------------------------------------------


def _smi_value(raw: str) -> float | None:
    value = raw.strip()
    # "[N/A]", "[Not Supported]", "[Unknown Error]", "N/A" depending on driver and GPU.
    if not value or value.startswith("[") or value.upper() == "N/A":
        return None
    return float(value)


def parse_nvidia_smi_csv(
    text: str, fields: Sequence[str] = NVIDIA_SMI_FIELDS
) -> tuple[GpuDevice, ...]:
    """Devices from `nvidia-smi --query-gpu=<fields> --format=csv,noheader,nounits` output.

    ValueError names the offending line when it does not have one value per field.
    """
    columns = list(fields)
    if "index" not in columns:
        raise ValueError("the query must include 'index'")
    devices = []
    for number, row in enumerate(csv.reader(io.StringIO(text), skipinitialspace=True), start=1):
        if not row or all(not cell.strip() for cell in row):
            continue
        if len(row) != len(columns):
            raise ValueError(
                f"nvidia-smi line {number} has {len(row)} values, expected {len(columns)} "
                f"({', '.join(columns)}): {','.join(row)!r}"
            )
        cells = {name: cell.strip() for name, cell in zip(columns, row, strict=True)}
        try:
            devices.append(
                GpuDevice(
                    index=int(cells["index"]),
                    uuid=cells.get("uuid", ""),
                    name=cells.get("name", ""),
                    utilization_percent=_smi_value(cells.get("utilization.gpu", "")),
                    power_watts=_smi_value(cells.get("power.draw", "")),
                    power_limit_watts=_smi_value(cells.get("power.limit", "")),
                    memory_used_mib=_smi_value(cells.get("memory.used", "")),
                    memory_total_mib=_smi_value(cells.get("memory.total", "")),
                )
            )
        except ValueError as exc:
            raise ValueError(f"nvidia-smi line {number}: {exc}: {','.join(row)!r}") from None
    return tuple(devices)


async def read_nvidia_smi(
    timeout_seconds: float, binary: str = "nvidia-smi", runner: CommandRunner = run_command
) -> tuple[tuple[GpuDevice, ...] | None, str]:
    """(devices, "") from nvidia-smi (run by `runner`: here, or on a remote host), or (None, why
    not); never raises for a failing tool."""
    result = await runner((binary, *NVIDIA_SMI_ARGS), timeout_seconds, _MAX_TOOL_OUTPUT_BYTES)
    if result.returncode is None:
        return None, result.error
    if result.returncode != 0:
        # e.g. "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver".
        message = (result.stderr or result.stdout)[:500].decode("utf-8", "replace").strip()
        return None, f"{binary} exited {result.returncode}: {message}"
    try:
        return parse_nvidia_smi_csv(result.stdout.decode("utf-8", "replace")), ""
    except ValueError as exc:
        return None, str(exc)


# --- NVML -------------------------------------------------------------------------------------


def _nvml_str(value: object) -> str:
    # nvidia-ml-py returns str since 11.515; older bindings returned bytes.
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def device_from_nvml(
    index: int,
    *,
    uuid: object = "",
    name: object = "",
    utilization_gpu: float | None,
    power_milliwatts: float | None,
    power_limit_milliwatts: float | None,
    memory_used_bytes: float | None,
    memory_total_bytes: float | None,
) -> GpuDevice:
    """A GpuDevice from NVML's raw units (milliwatts, bytes)."""
    mib = 1024 * 1024
    return GpuDevice(
        index=index,
        uuid=_nvml_str(uuid),
        name=_nvml_str(name),
        utilization_percent=None if utilization_gpu is None else float(utilization_gpu),
        power_watts=None if power_milliwatts is None else power_milliwatts / 1000.0,
        power_limit_watts=(
            None if power_limit_milliwatts is None else power_limit_milliwatts / 1000.0
        ),
        memory_used_mib=None if memory_used_bytes is None else memory_used_bytes / mib,
        memory_total_mib=None if memory_total_bytes is None else memory_total_bytes / mib,
    )


def read_nvml(nvml: Any) -> tuple[GpuDevice, ...]:
    """Every device through an initialised-on-demand NVML binding (the `pynvml` module or a fake).

    A value the GPU does not support (NVMLError on that call) becomes None; failing to initialise
    or to count devices raises the binding's NVMLError, which the caller turns into a fallback.
    """
    error_type: type[BaseException] = getattr(nvml, "NVMLError", Exception)

    def optional(call: Callable[[Any], Any], handle: Any) -> Any:
        try:
            return call(handle)
        except error_type:
            return None

    nvml.nvmlInit()
    try:
        devices = []
        for index in range(int(nvml.nvmlDeviceGetCount())):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            rates = optional(nvml.nvmlDeviceGetUtilizationRates, handle)
            memory = optional(nvml.nvmlDeviceGetMemoryInfo, handle)
            devices.append(
                device_from_nvml(
                    index,
                    uuid=optional(nvml.nvmlDeviceGetUUID, handle) or "",
                    name=optional(nvml.nvmlDeviceGetName, handle) or "",
                    utilization_gpu=None if rates is None else rates.gpu,
                    power_milliwatts=optional(nvml.nvmlDeviceGetPowerUsage, handle),
                    power_limit_milliwatts=optional(nvml.nvmlDeviceGetEnforcedPowerLimit, handle),
                    memory_used_bytes=None if memory is None else memory.used,
                    memory_total_bytes=None if memory is None else memory.total,
                )
            )
        return tuple(devices)
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def _load_pynvml() -> Any:
    # Imported lazily: nvidia-ml-py is the optional `gpu` extra; most test machines lack a driver.
    return importlib.import_module("pynvml")


async def read_gpus(
    timeout_seconds: float,
    *,
    load_nvml: Callable[[], Any] = _load_pynvml,
    nvidia_smi: str = "nvidia-smi",
) -> GpuReading:
    """The host's GPUs via NVML, else nvidia-smi, else unavailable (with both reasons)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_seconds
    notes: list[str] = []
    try:
        nvml = load_nvml()
    except ImportError:
        notes.append("NVML: nvidia-ml-py not installed (optional extra 'gpu')")
    else:
        try:
            devices = await wait_for_blocking(lambda: read_nvml(nvml), timeout_seconds)
        except TimeoutError:
            notes.append(f"NVML: no answer within {timeout_seconds:g} s")
        except Exception as exc:  # NVMLError and loader errors alike mean "fall back"
            notes.append(f"NVML: {type(exc).__name__}: {exc}")
        else:
            return GpuReading(GpuSource.NVML, devices)
    remaining = deadline - loop.time()
    if remaining <= 0:
        notes.append("nvidia-smi: not tried, no time left")
        return GpuReading(GpuSource.UNAVAILABLE, (), "; ".join(notes))
    smi_devices, why = await read_nvidia_smi(remaining, nvidia_smi)
    if smi_devices is not None:
        return GpuReading(GpuSource.NVIDIA_SMI, smi_devices, "; ".join(notes))
    notes.append(f"nvidia-smi: {why}")
    return GpuReading(GpuSource.UNAVAILABLE, (), "; ".join(notes))
