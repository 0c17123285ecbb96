"""Fault catalogue of the simulated workers: parsing, validation and the active set of one process.

A fault is `{"kind": KIND, **params}`. It can be set at run time (`POST /_sim/fault`), from a
fault file (`--fault-file PATH`, JSON) or from the `PDSIM_FAULTS` environment variable (JSON, or
the short form `kind[:key=value...][,kind...]` that fits in a systemd `Environment=` line).
Faults read at start, and those set with `"persist": true`, are written back to the fault file so
that they survive a restart of the process.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# kind -> {param: (type, default)}; a param without a default (None) is optional.
FAULT_PARAMS: dict[str, dict[str, tuple[type, Any]]] = {
    "transfer_stall": {},
    "degraded_bootstrap": {"fraction": (float, 0.5)},
    "decode_hang_before_headers": {},
    # dp_rank: only the requests of that DP rank stall (pdsim/dp.py); unset, every request.
    "decode_stall_midstream": {"after_tokens": (int, 2), "dp_rank": (int, None)},
    "collective_hang": {},
    "pinned_request": {"count": (int, 1)},
    "slow_start": {"seconds": (float, 30.0), "listen": (bool, True)},
    "crash_after": {"seconds": (float, 5.0), "exit_code": (int, 1), "signal": (int, 0)},
    "metrics_garbage": {},
    "health_hang": {},
    # Decode steps at this rate: each running request gets tokens_per_s tokens a second, serving
    # but slow (a huge context, an overloaded GPU); --max-running-requests keeps every slot busy.
    # dp_rank: only that DP rank's scheduler steps at this rate, the others at theirs.
    "slow_decode": {"tokens_per_s": (float, 1.0), "dp_rank": (int, None)},
    # /v1/loads answers 404, as before 0.5.9: the watchdog reads /metrics alone.
    "loads_absent": {},
}

FAULT_KINDS = tuple(FAULT_PARAMS)


class FaultError(ValueError):
    """A fault description that is not valid; the message says which part and why."""


@dataclass(frozen=True)
class Fault:
    """One validated fault: kind, parameters with defaults filled in, and when it was set."""

    kind: str
    params: Mapping[str, Any]
    persist: bool = False
    set_at_monotonic: float = field(default_factory=time.monotonic)

    def param(self, name: str) -> Any:
        return self.params[name]

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, **self.params, "persist": self.persist}


def _coerce(kind: str, name: str, typ: type, value: Any) -> Any:
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        raise FaultError(f"{kind}.{name}: expected a boolean, got {value!r}")
    if isinstance(value, bool):
        raise FaultError(f"{kind}.{name}: expected {typ.__name__}, got {value!r}")
    try:
        return typ(value)
    except (TypeError, ValueError):
        raise FaultError(f"{kind}.{name}: expected {typ.__name__}, got {value!r}") from None


def parse_fault(obj: Any, *, set_at_monotonic: float | None = None) -> Fault:
    """Validate one fault object; unknown kinds and unknown parameters are errors."""
    if not isinstance(obj, Mapping):
        raise FaultError(f"a fault must be a JSON object, got {obj!r}")
    kind = obj.get("kind")
    if kind not in FAULT_PARAMS:
        raise FaultError(f"unknown fault kind {kind!r}; known: {', '.join(FAULT_KINDS)}")
    spec = FAULT_PARAMS[kind]
    unknown = sorted(set(obj) - set(spec) - {"kind", "persist"})
    if unknown:
        raise FaultError(f"{kind}: unknown parameter(s) {', '.join(unknown)}")
    params = {
        name: _coerce(kind, name, typ, obj.get(name, default))
        for name, (typ, default) in spec.items()
        if obj.get(name, default) is not None  # an optional param left unset stays out
    }
    if kind == "degraded_bootstrap" and not 0.0 <= params["fraction"] <= 1.0:
        raise FaultError("degraded_bootstrap.fraction: must be within [0, 1]")
    if kind == "slow_decode" and not 0.0 < params["tokens_per_s"] < float("inf"):
        raise FaultError("slow_decode.tokens_per_s: must be a positive number")
    persist = _coerce(kind, "persist", bool, obj.get("persist", False))
    return Fault(
        kind=kind,
        params=params,
        persist=persist,
        set_at_monotonic=time.monotonic() if set_at_monotonic is None else set_at_monotonic,
    )


def parse_fault_list(obj: Any, *, set_at_monotonic: float | None = None) -> list[Fault]:
    """Accept one fault object, a list of them, or `{"faults": [...]}`."""
    if isinstance(obj, Mapping) and "faults" in obj and "kind" not in obj:
        obj = obj["faults"]
    items = obj if isinstance(obj, list) else [obj]
    return [parse_fault(item, set_at_monotonic=set_at_monotonic) for item in items]


def _short_value(text: str) -> Any:
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def parse_fault_text(text: str, *, set_at_monotonic: float | None = None) -> list[Fault]:
    """Parse the env-var form: JSON, or `kind[:key=value...][,kind...]`."""
    text = text.strip()
    if not text:
        return []
    if text[0] in "[{":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise FaultError(f"fault JSON does not parse: {exc}") from None
        return parse_fault_list(data, set_at_monotonic=set_at_monotonic)
    faults = []
    for item in text.split(","):
        kind, *pairs = item.strip().split(":")
        obj: dict[str, Any] = {"kind": kind}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep:
                raise FaultError(f"{kind}: expected key=value, got {pair!r}")
            obj[key] = _short_value(value)
        faults.append(parse_fault(obj, set_at_monotonic=set_at_monotonic))
    return faults


def read_fault_file(path: Path, *, set_at_monotonic: float | None = None) -> list[Fault]:
    """A missing or empty file means no faults, so units can always name one."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    faults = parse_fault_text(text, set_at_monotonic=set_at_monotonic)
    # Everything that came from the file is persistent by definition.
    return [Fault(f.kind, f.params, True, f.set_at_monotonic) for f in faults]


def write_fault_file(path: Path, faults: Iterable[Fault]) -> None:
    """Write atomically so a process starting meanwhile never reads half a file."""
    data = [{"kind": f.kind, **f.params} for f in faults]
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


class FaultSet:
    """The faults active in one worker process, at most one per kind."""

    def __init__(self, fault_file: Path | None = None) -> None:
        self._faults: dict[str, Fault] = {}
        self._fault_file = fault_file

    def load_startup(self, env_text: str | None) -> None:
        """Read the fault file, then the env var; both count from process start."""
        start = time.monotonic()
        if self._fault_file is not None:
            for fault in read_fault_file(self._fault_file, set_at_monotonic=start):
                self._faults[fault.kind] = fault
        if env_text:
            for fault in parse_fault_text(env_text, set_at_monotonic=start):
                self._faults[fault.kind] = fault

    def get(self, kind: str) -> Fault | None:
        return self._faults.get(kind)

    def active(self, kind: str) -> bool:
        return kind in self._faults

    def set(self, faults: Iterable[Fault]) -> None:
        changed_persistent = False
        for fault in faults:
            self._faults[fault.kind] = fault
            changed_persistent |= fault.persist
        if changed_persistent:
            self._write_back()

    def clear(self, kind: str | None = None) -> list[Fault]:
        """Clear one kind or all; returns what was cleared."""
        if kind is None:
            cleared = list(self._faults.values())
            self._faults.clear()
        else:
            if kind not in FAULT_PARAMS:
                raise FaultError(f"unknown fault kind {kind!r}")
            removed = self._faults.pop(kind, None)
            cleared = [removed] if removed else []
        if any(f.persist for f in cleared):
            self._write_back()
        return cleared

    def to_json(self) -> list[dict[str, Any]]:
        return [f.to_json() for f in self._faults.values()]

    def _write_back(self) -> None:
        if self._fault_file is None:
            return
        write_fault_file(self._fault_file, [f for f in self._faults.values() if f.persist])
