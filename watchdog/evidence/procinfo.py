"""Read a process tree from /proc: cmdline, environ filtered to an allowlist, secrets redacted."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from watchdog import redact
from watchdog.redact import is_secret_name, redact_argv, redact_text

DEFAULT_PROC_ROOT = Path("/proc")

# The settings that decide how SGLang PD moves KV caches; everything else in a serving process's
# environment is noise in a report, and may hold credentials. Inside the allowlist, names are
# denied by pattern too (watchdog/redact.py: `*TOKEN`, `*SECRET*`, `*_KEY`, `*_PASS`, `*PASSWORD*`,
# `*JWT*`, ...), and every kept value is redacted, since Mooncake and NIXL take metadata-server
# URLs that may carry credentials.
ENV_PREFIXES: tuple[str, ...] = ("SGLANG_", "NCCL_", "NIXL_", "CUDA_", "UCX_", "MC_")
REDACTED = redact.REDACTED

# A runaway fork bomb or a huge worker pool must not turn evidence into a full /proc dump.
MAX_PROCESSES = 64


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    """One process of a unit's tree; `cmdline` has secret-looking option values redacted."""

    pid: int
    ppid: int
    name: str  # /proc/PID/comm as seen in stat
    cmdline: tuple[str, ...]
    error: str = ""  # why cmdline could not be read (permission, exited)


def is_secret_key(key: str) -> bool:
    """True when an environment variable or option name looks like it holds a credential."""
    return is_secret_name(key)


def filter_environ(
    environ: Mapping[str, str], prefixes: Sequence[str] = ENV_PREFIXES
) -> dict[str, str]:
    """The allowlisted variables, sorted by name: values of secret-named ones replaced, the
    others with credentials in them (`etcd://user:pass@host`) masked."""
    kept = {k: v for k, v in environ.items() if k.startswith(tuple(prefixes))}
    return {k: (REDACTED if is_secret_key(k) else redact_text(kept[k])) for k in sorted(kept)}


def redact_cmdline(argv: Sequence[str]) -> tuple[str, ...]:
    """argv with secret option values (`--api-key X`, `--api-key=X`, in `sh -c` too) hidden."""
    return redact_argv(argv)


def read_cmdline(pid: int, proc_root: Path = DEFAULT_PROC_ROOT) -> tuple[str, ...]:
    """The raw argv of `pid` (empty for kernel threads and zombies); OSError if unreadable."""
    return parse_cmdline((proc_root / str(pid) / "cmdline").read_bytes())


def parse_cmdline(raw: bytes) -> tuple[str, ...]:
    """argv from the bytes of a /proc/PID/cmdline (read here, or fetched from a remote host)."""
    if not raw:
        return ()
    return tuple(part.decode("utf-8", "replace") for part in raw.rstrip(b"\0").split(b"\0"))


def read_environ(pid: int, proc_root: Path = DEFAULT_PROC_ROOT) -> dict[str, str]:
    """The full environment of `pid`; OSError (often PermissionError) if unreadable."""
    return parse_environ((proc_root / str(pid) / "environ").read_bytes())


def parse_environ(raw: bytes) -> dict[str, str]:
    """The full environment from the bytes of a /proc/PID/environ (here or remote); unfiltered."""
    environ: dict[str, str] = {}
    for entry in raw.split(b"\0"):
        key, sep, value = entry.decode("utf-8", "replace").partition("=")
        if sep and key:
            environ[key] = value
    return environ


def read_stat(pid: int, proc_root: Path = DEFAULT_PROC_ROOT) -> tuple[str, int]:
    """(comm, ppid) of `pid` from /proc/PID/stat; OSError if the process is gone."""
    return parse_stat((proc_root / str(pid) / "stat").read_text("utf-8", "replace"))


def parse_stat(text: str) -> tuple[str, int]:
    """(comm, ppid) from the text of a /proc/PID/stat; ValueError or IndexError if malformed."""
    # comm is in parentheses and may itself contain spaces and ')': split at the last one.
    head, _, tail = text.rpartition(")")
    comm = head.partition("(")[2]
    fields = tail.split()
    return comm, int(fields[1])


def _children_from_task_files(pid: int, proc_root: Path) -> list[int] | None:
    task_dir = proc_root / str(pid) / "task"
    children: list[int] = []
    found = False
    try:
        tasks = list(task_dir.iterdir())
    except OSError:
        return None
    for task in tasks:
        try:
            text = (task / "children").read_text()
        except FileNotFoundError:
            continue  # thread exited, or a kernel without CONFIG_PROC_CHILDREN
        except OSError:
            continue
        found = True
        children.extend(int(c) for c in text.split())
    return children if found else None


def _children_from_scan(pid: int, proc_root: Path) -> list[int]:
    children = []
    for entry in proc_root.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            _, ppid = read_stat(int(entry.name), proc_root)
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            children.append(int(entry.name))
    return children


def children_of(pid: int, proc_root: Path = DEFAULT_PROC_ROOT) -> list[int]:
    """Direct children of `pid`: /proc/PID/task/*/children, else a scan of every /proc/*/stat."""
    children = _children_from_task_files(pid, proc_root)
    if children is None:
        children = _children_from_scan(pid, proc_root)
    return sorted(set(children))


def read_process_tree(
    pid: int, proc_root: Path = DEFAULT_PROC_ROOT, max_processes: int = MAX_PROCESSES
) -> tuple[ProcessInfo, ...]:
    """`pid` and its descendants, breadth first, cmdlines redacted; OSError if `pid` is gone."""
    comm, ppid = read_stat(pid, proc_root)
    out = [_process_info(pid, comm, ppid, proc_root)]
    queue: list[int] = [pid]
    seen = {pid}
    while queue and len(out) < max_processes:
        parent = queue.pop(0)
        for child in children_of(parent, proc_root):
            if child in seen or len(out) >= max_processes:
                continue
            seen.add(child)
            try:
                child_comm, child_ppid = read_stat(child, proc_root)
            except (OSError, ValueError, IndexError):
                continue  # exited between listing and reading
            out.append(_process_info(child, child_comm, child_ppid, proc_root))
            queue.append(child)
    return tuple(out)


def _process_info(pid: int, comm: str, ppid: int, proc_root: Path) -> ProcessInfo:
    try:
        cmdline = redact_cmdline(read_cmdline(pid, proc_root))
    except OSError as exc:
        return ProcessInfo(pid, ppid, comm, (), error=f"cmdline unreadable: {exc.strerror}")
    return ProcessInfo(pid, ppid, comm, cmdline)
