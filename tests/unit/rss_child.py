"""Peak memory measured in a child Python process, for the bounded-memory tests.

The code under test runs in a fresh interpreter (the test process's own high-water mark says
nothing about it) against servers in the test process; the child reports its peak with vm_hwm().
run_python runs it to its end under a generous deadline (no assertion depends on speed) and
kills it by its own PID past the deadline.
"""

from __future__ import annotations

import asyncio
import os
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class ChildRun:
    """What a finished child printed, and how it exited."""

    out: bytes
    err: bytes
    returncode: int


async def run_python(*args: str, timeout_seconds: float, few_arenas: bool = False) -> ChildRun:
    """Run `python ARGS` in the repository root (so it imports watchdog and tests) to its end.
    `few_arenas` caps malloc at two arenas: the address space reserved per thread then stays
    out of an RLIMIT_AS the child sets itself."""
    env = {**os.environ, "MALLOC_ARENA_MAX": "2"} if few_arenas else None
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        *args,
        cwd=REPO,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(child.communicate(), timeout=timeout_seconds)
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()
    assert child.returncode is not None
    return ChildRun(out, err, child.returncode)


def vm_hwm() -> int:
    """This process's peak resident set size in bytes (Linux /proc), for a child to report."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")
