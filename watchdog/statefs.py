"""Files in state_dir: never opened through a symlink, owned by its owner whoever writes them.

The daemon runs as the service user and owns state_dir; operators run the CLI as root (`sudo
watchdog pause`). Two rules keep that combination safe:

- Every open of a state file carries O_NOFOLLOW (a symlink planted in state_dir is refused, never
  followed: run as root, following one would write into any file on the machine), temp files are
  also O_EXCL under an unpredictable name, and they are renamed into place (a rename replaces a
  link, it never writes through it). state_dir itself is configuration and trusted.
- A file created or rewritten by root is handed to state_dir's owner and group (fchown before the
  rename), so the daemon can still read and write it. Any other user who is not the owner cannot
  do that and is refused up front, naming the user to run as.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pwd
import secrets
import stat
from pathlib import Path

from watchdog.errors import StateFileError

NEW_FILE_MODE = 0o644  # before the umask: the service's UMask=0077 makes it 0600


class UnsafeStateFile(StateFileError):
    """A state file name is a symbolic link, a hard link or not a regular file: never used."""

    def __init__(self, path: Path, what: str, advice: str = "remove it") -> None:
        self.what = what
        super().__init__(f"{path} is {what}; refusing to use it ({advice})")


class WrongUser(StateFileError):
    """This process cannot give the files it writes to state_dir's owner (exit 3)."""


def _owner_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def check_writer(directory: Path) -> os.stat_result:
    """state_dir's stat, after checking that this process may write there for its owner.

    Root may (it chowns what it writes); the owner may; anyone else would leave files the daemon
    cannot read or write, so WrongUser names the user to run as instead.
    """
    try:
        owner = os.stat(directory)
    except OSError as exc:
        raise StateFileError(f"cannot use state_dir {directory}: {exc.strerror or exc}") from None
    euid = os.geteuid()
    if euid not in (0, owner.st_uid):
        name = _owner_name(owner.st_uid)
        raise WrongUser(
            f"state_dir {directory} belongs to {name} (uid {owner.st_uid}); files written by "
            f"uid {euid} could not be read or rewritten by the watchdog. Run as {name}: "
            f"sudo -u {name} watchdog ..."
        )
    return owner


def adopt(fd: int, owner: os.stat_result, *, mode: int | None = None) -> None:
    """Give an open state file to `owner`'s uid and gid (root only: others already are the owner),
    and set `mode` if given (so a rewrite keeps the mode of the file it replaces)."""
    if os.geteuid() == 0:
        st = os.fstat(fd)
        if (st.st_uid, st.st_gid) != (owner.st_uid, owner.st_gid):
            os.fchown(fd, owner.st_uid, owner.st_gid)
    if mode is not None:
        os.fchmod(fd, mode)


def open_nofollow(path: Path, flags: int, mode: int = NEW_FILE_MODE) -> int:
    """os.open with O_NOFOLLOW | O_CLOEXEC; UnsafeStateFile for a symlink, a file with more than
    one hard link or a non-regular file.

    O_NONBLOCK keeps a FIFO planted under the name from blocking the open; it does not change
    how a regular file behaves.
    """
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeStateFile(
                path, "a symbolic link", f"never followed; remove it: rm {path}"
            ) from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        # A hard link would let whoever can write state_dir aim root's writes (and chown) at
        # another file, as a symlink would.
        what = "not a regular file" if not stat.S_ISREG(st.st_mode) else "hard-linked elsewhere"
        raise UnsafeStateFile(path, what)
    return fd


def _existing_mode(path: Path) -> int | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return stat.S_IMODE(st.st_mode) if stat.S_ISREG(st.st_mode) else None


def write_all(fd: int, payload: bytes) -> None:
    """os.write until every byte is written (a short write is not an error for os.write)."""
    view = memoryview(payload)
    while view:
        view = view[os.write(fd, view) :]


def write_atomic(path: Path, payload: bytes) -> None:
    """Replace `path` with `payload`: O_EXCL temp, chown for the owner, fsync, rename, dir fsync.

    Raises OSError (or StateFileError for a refusal); the temp file never outlives a failure.
    """
    directory = path.parent
    directory.mkdir(parents=True, exist_ok=True)
    owner = check_writer(directory)
    tmp = directory / f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    fd = open_nofollow(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        try:
            adopt(fd, owner, mode=_existing_mode(path))
            write_all(fd, payload)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)  # unlink removes a name, never what a link points to
        raise
    # The rename is durable only once the directory entry is on disk.
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def read_bounded(path: Path, max_bytes: int) -> bytes | None:
    """A state file's bytes without following a link; None when absent.

    Raises UnsafeStateFile for a link or non-regular file, ValueError when larger than
    `max_bytes` (a corrupt file to set aside), OSError otherwise.
    """
    try:
        fd = open_nofollow(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        if os.fstat(fd).st_size > max_bytes:
            raise ValueError(f"larger than {max_bytes} bytes")
        chunks: list[bytes] = []
        size = 0
        while chunk := os.read(fd, 1 << 20):
            size += len(chunk)
            if size > max_bytes:
                raise ValueError(f"larger than {max_bytes} bytes")
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
