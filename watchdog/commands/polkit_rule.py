"""`watchdog polkit-rule`: write the polkit rule for the units named in a config file."""

from __future__ import annotations

import argparse
import os
import stat
import sys
import tempfile
from pathlib import Path

from watchdog.act.hosts import targets_of
from watchdog.act.polkit import DEFAULT_USER, render_host_rules, render_polkit_rule
from watchdog.commands.common import add_config_argument, config_from_args
from watchdog.errors import EXIT_OK, UsageError


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `polkit-rule` subcommand."""
    parser = subparsers.add_parser(
        "polkit-rule",
        help="print (or write) the polkit rule allowing the watchdog user to restart its units",
    )
    add_config_argument(parser)
    parser.add_argument(
        "--user",
        default=DEFAULT_USER,
        help=f"the user the watchdog service runs as (default: {DEFAULT_USER})",
    )
    parser.add_argument(
        "--host",
        metavar="USER@HOST:PORT",
        help="with units on other hosts: only the rule for this host ('local' for this one)",
    )
    parser.add_argument(
        "--output",
        type=Path,
        help="write the rule to this file (mode 0644, replaced atomically) instead of stdout; "
        "a character device or FIFO (/dev/stdout) is written into, never replaced; a symbolic "
        "link to anything else or a directory is refused",
    )
    parser.set_defaults(func=run)


def _write_atomically(path: Path, text: str) -> None:
    # polkitd watches rules.d and reloads on change: it must never read a half-written file.
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise UsageError(f"--output: cannot write {path}: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise UsageError(f"--output: cannot write {path}: {exc.strerror}") from None


def _refuse(path: Path, what: str) -> UsageError:
    return UsageError(
        f"--output: {path} is {what}; refusing to replace it or write through it (name the "
        "file itself, or leave out --output to print the rule)"
    )


def _write_into(path: Path, text: str) -> None:
    """Write into an existing character device or FIFO (/dev/stdout, a pipe): opened without
    O_CREAT and checked again once open, so a name swapped for a file meanwhile is not written."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise UsageError(f"--output: cannot write {path}: {exc.strerror}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not (stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)):
            raise _refuse(path, "no longer a character device or FIFO")
        view = memoryview(text.encode("utf-8"))
        while view:
            view = view[os.write(fd, view) :]
    except OSError as exc:
        raise UsageError(f"--output: cannot write {path}: {exc.strerror}") from None
    finally:
        os.close(fd)


def _write_output(path: Path, text: str) -> None:
    """A regular file (or a new name) is replaced atomically; a character device or FIFO, also
    behind a symbolic link (/dev/stdout), is written into; anything else is refused.

    Run as root, a rename over /dev/null would replace the device node for the whole machine,
    and one over a symbolic link would drop the link an administrator made.
    """
    try:
        own = os.lstat(path)
    except FileNotFoundError:
        _write_atomically(path, text)
        return
    except OSError as exc:
        raise UsageError(f"--output: cannot write {path}: {exc.strerror}") from None
    if stat.S_ISREG(own.st_mode):
        _write_atomically(path, text)
        return
    link = stat.S_ISLNK(own.st_mode)
    try:
        mode = os.stat(path).st_mode if link else own.st_mode
    except OSError:
        raise _refuse(path, "a dangling symbolic link") from None
    if stat.S_ISCHR(mode) or stat.S_ISFIFO(mode):
        _write_into(path, text)
    elif stat.S_ISDIR(mode):
        raise _refuse(path, "a directory" if not link else "a symbolic link to a directory")
    else:
        raise _refuse(path, "a symbolic link" if link else "not a regular file")


def run(args: argparse.Namespace) -> int:
    """Render the rule from --config for --user (one per host when units span hosts); print it or
    write it to --output."""
    config = config_from_args(args)
    multihost = bool(targets_of(config.group))
    if args.output is not None and multihost and args.host is None:
        raise UsageError("--output: the units span hosts; choose one rule with --host")
    try:
        if multihost:
            rule = render_host_rules(
                config, user=args.user, source=str(args.config), host=args.host
            )
        elif args.host not in (None, "local"):
            raise ValueError(f"no unit runs on {args.host!r}; hosts: local")
        else:
            rule = render_polkit_rule(config, user=args.user, source=str(args.config))
    except ValueError as exc:
        flag = "--host" if "no unit runs on" in str(exc) else "--user"
        raise UsageError(f"{flag}: {exc}") from None
    if args.output is None:
        sys.stdout.write(rule)
    else:
        _write_output(args.output, rule)
    return EXIT_OK
