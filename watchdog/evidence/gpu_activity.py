"""Whether GPUs are busy or idle, from one reading, and which GPUs a process sees (pure)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from watchdog.evidence.records import GpuDevice

# The busy/idle rule (gpu_busy). utilization.gpu is the share of the sample period in which any
# kernel ran. A TP collective that never completes is a kernel that never ends, so a collective hang
# reads ~100 %; a GPU whose requests sit in PD transfer queues runs no kernel and reads 0 %.
BUSY_UTILIZATION_PERCENT = 50.0
IDLE_UTILIZATION_PERCENT = 10.0
# Power as a fraction of the enforced limit, for when utilisation is missing or in between. An idle
# GPU holding a loaded model draws 10-20 % of its limit (the incident: 165 W on a 1000 W Blackwell
# part while stalled; H100/H200 sit near 70-120 W of 700 W); busy-waiting NCCL kernels and real
# batches draw well over half. In between is honestly ambiguous.
BUSY_POWER_FRACTION = 0.5
IDLE_POWER_FRACTION = 0.3


DeviceActivity = Literal["busy", "idle", "unknown"]


def device_activity(device: GpuDevice) -> DeviceActivity:
    """busy, idle or unknown for one device, by the thresholds above."""
    util = device.utilization_percent
    fraction = None
    if device.power_watts is not None and device.power_limit_watts:
        fraction = device.power_watts / device.power_limit_watts
    if util is not None and util >= BUSY_UTILIZATION_PERCENT:
        return "busy"
    if fraction is not None and fraction >= BUSY_POWER_FRACTION:
        # High power with low reported utilisation contradicts itself unless util is missing or
        # in between; either way the GPU is not demonstrably idle.
        return "busy" if util is None or util > IDLE_UTILIZATION_PERCENT else "unknown"
    if util is not None:
        return "idle" if util <= IDLE_UTILIZATION_PERCENT else "unknown"
    if fraction is not None and fraction <= IDLE_POWER_FRACTION:
        return "idle"
    return "unknown"


def gpu_busy(devices: Sequence[GpuDevice]) -> bool | None:
    """True if any device is busy, False if every device is idle, None when it cannot be told."""
    activities = [device_activity(d) for d in devices]
    if "busy" in activities:
        return True
    if activities and all(a == "idle" for a in activities):
        return False
    return None


def select_devices(
    devices: Sequence[GpuDevice], cuda_visible_devices: str | None
) -> tuple[GpuDevice, ...] | None:
    """The devices a process sees through CUDA_VISIBLE_DEVICES (indices or GPU- UUIDs).

    None when the variable is unset or names something that cannot be mapped (MIG instances,
    unknown UUIDs): the caller then reports on every GPU of the host and says so.
    """
    if cuda_visible_devices is None:
        return None
    chosen: list[GpuDevice] = []
    for token in (t.strip() for t in cuda_visible_devices.split(",")):
        if not token:
            continue
        if token.lstrip("-").isdigit():
            if int(token) < 0:
                break  # CUDA stops at the first invalid ordinal
            match = next((d for d in devices if d.index == int(token)), None)
        else:
            match = next((d for d in devices if d.uuid and d.uuid.startswith(token)), None)
        if match is None:
            return None
        chosen.append(match)
    return tuple(chosen)


def _range(values: Sequence[float], unit: str) -> str:
    low, high = min(values), max(values)
    return f"{low:.0f}{unit}" if round(low) == round(high) else f"{low:.0f}–{high:.0f}{unit}"


def describe_devices(devices: Sequence[GpuDevice]) -> str:
    """A short human summary: "GPU 4: 0 % util, 165 W of 1000 W", ranges for more than two GPUs."""
    if not devices:
        return "no GPUs"
    if len(devices) > 2:
        utils = [d.utilization_percent for d in devices if d.utilization_percent is not None]
        powers = [d.power_watts for d in devices if d.power_watts is not None]
        limits = [d.power_limit_watts for d in devices if d.power_limit_watts]
        util = f"{_range(utils, ' %')} util" if utils else "? % util"
        power = _range(powers, " W") if powers else "? W"
        if powers and limits:
            power += f" of {_range(limits, ' W')}"
        indices = ",".join(str(d.index) for d in devices)
        return f"GPUs {indices}: {util}, {power}"
    parts = []
    for d in devices:
        util = "? % util" if d.utilization_percent is None else f"{d.utilization_percent:g} % util"
        if d.power_watts is None:
            power = "? W"
        elif d.power_limit_watts:
            power = f"{d.power_watts:.0f} W of {d.power_limit_watts:.0f} W"
        else:
            power = f"{d.power_watts:.0f} W"
        parts.append(f"GPU {d.index}: {util}, {power}")
    return "; ".join(parts)
