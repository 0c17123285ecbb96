"""State files the daemon reads every cycle, parsed again only when a stat says they changed."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

T = TypeVar("T")

# A file modified this recently may change again within the same timestamp tick and keep its
# size (a count going from 1 to 2): it is read again until it is older than this ("racy git").
_SETTLE_NS = 2_000_000_000

_Key = tuple[int, int, int, int] | None  # inode, mtime, ctime, size; None when absent


def _stat_key(path: Path) -> _Key:
    try:
        st = os.lstat(path)  # a planted link is judged (and set aside) by load(), never followed
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)


class StatCached(Generic[T]):
    """`load()`'s result for `path`, loaded again only when the file's stat key changes.

    The key (inode, mtime, ctime, size) changes on every atomic replace and on every write
    that a reader could see; absent is a key of its own. `load` keeps its own error handling:
    a stat error other than "absent" is not cached and `load` runs as before.
    """

    def __init__(self, path: Path, load: Callable[[], T]) -> None:
        self.path = path
        self._load = load
        self._key: _Key = None
        self._value: T | None = None
        self._valid = False
        self.loads = 0  # how many times load() ran

    def get(self) -> T:
        """The current content."""
        try:
            key = _stat_key(self.path)
        except OSError:
            self._valid = False
            return self._fresh(None)
        if self._valid and key == self._key:
            return self._value  # type: ignore[return-value]  # set together with _valid
        return self._fresh(key)

    def _fresh(self, key: _Key) -> T:
        value = self._load()
        self.loads += 1
        settled = key is None or time.time_ns() - key[1] > _SETTLE_NS
        self._key, self._value, self._valid = key, value, settled
        return value
