"""StatCached: a state file is parsed again only when its stat key changes."""

from __future__ import annotations

import os
from pathlib import Path

from watchdog.run.filecache import StatCached
from watchdog.statefiles import (
    read_refusal_counts,
    record_refusal,
    refusals_path,
    write_json_atomic,
)


def _age(path: Path, seconds: float = 60.0) -> None:
    """Backdate the file, so it counts as settled (not modified within the last tick)."""
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns - int(seconds * 1e9)))


def test_unchanged_file_is_loaded_once(tmp_path: Path) -> None:
    """An unchanged state file is parsed once however often it is read."""
    path = tmp_path / "f.json"
    write_json_atomic(path, {"a": 1})
    _age(path)
    cache = StatCached(path, path.read_text)
    assert cache.get() == cache.get() == cache.get()
    assert cache.loads == 1


def test_replaced_file_is_loaded_again(tmp_path: Path) -> None:
    """A file replaced by an atomic write of the same size is parsed again."""
    path = tmp_path / "f.json"
    write_json_atomic(path, {"a": 1})
    _age(path)
    cache = StatCached(path, path.read_text)
    first = cache.get()
    write_json_atomic(path, {"a": 2})  # same size, new inode and times
    assert cache.get() != first
    assert cache.loads == 2


def test_recently_modified_file_is_read_every_time(tmp_path: Path) -> None:
    """A file written within the timestamp tick may change again unseen by its stat: no cache."""
    path = tmp_path / "f.json"
    write_json_atomic(path, {"a": 1})
    cache = StatCached(path, path.read_text)
    cache.get()
    cache.get()
    assert cache.loads == 2


def test_absent_file_is_cached_until_it_appears(tmp_path: Path) -> None:
    """An absent file is cached as absent until it appears; rewrites in one tick are seen."""
    state_dir = tmp_path
    cache = StatCached(
        refusals_path(state_dir, "g"), lambda: read_refusal_counts(state_dir, "g", now=0.0)
    )
    assert cache.get() == {}
    assert cache.get() == {}
    assert cache.loads == 1
    record_refusal(state_dir, "g", "lock_held", now=1.0)
    assert cache.get() == {"lock_held": 1}
    record_refusal(state_dir, "g", "lock_held", now=2.0)  # same size, within the same tick
    assert cache.get() == {"lock_held": 2}


def test_stat_error_is_not_cached(tmp_path: Path) -> None:
    """A path whose parent is a file raises NotADirectoryError on stat: load runs every time."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cache = StatCached(blocker / "child", lambda: "loaded")
    assert cache.get() == "loaded"
    assert cache.get() == "loaded"
    assert cache.loads == 2
