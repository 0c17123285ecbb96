"""Run code, or a command, inside another network namespace (a sandbox's private one).

A network namespace is a property of a thread (setns(2)), and a socket keeps the namespace it was
created in: `in_netns(path, fn)` runs `fn` on a fresh thread that first joins `path`, so every
connection it opens (urllib, httpx, asyncio.run inside) lives there while the caller's thread stays
in the host's. Commands go through `nsenter --net=PATH` (util-linux). Python 3.11 has no
os.setns, hence ctypes.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

CLONE_NEWNET = 0x40000000  # <sched.h>
_libc = ctypes.CDLL(None, use_errno=True)


def join_netns(path: Path) -> None:
    """Move the calling thread into the network namespace at `path` (e.g. /proc/PID/ns/net)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


def in_netns(path: Path, fn: Callable[[], T]) -> T:
    """`fn()` run on a new thread inside the network namespace at `path`; its result or error."""
    box: dict[str, T] = {}
    errors: list[BaseException] = []

    def run() -> None:
        try:
            join_netns(path)
            box["result"] = fn()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, name=f"netns:{path}", daemon=True)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return box["result"]


def nsenter(path: Path, argv: Sequence[str]) -> list[str]:
    """`argv` prefixed to run inside the network namespace at `path`."""
    return ["nsenter", f"--net={path}", "--", *argv]
