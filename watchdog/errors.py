"""The project's exception tree; third-party errors are translated into these at the module edge.

    WatchdogError
    ├── ConfigError            bad configuration file (exit 2); carries every ConfigIssue found
    ├── UsageError             bad command-line usage (exit 2)
    ├── StartupError           the daemon could not start (exit 3)
    ├── RestartRefused         an unsafe restart was asked for, e.g. decode without prefill (exit 3)
    ├── LockHeld               another restart sequence holds the group's lock (exit 3)
    ├── StateFileError         a persisted state file is corrupt or unwritable (set aside)
    └── SystemdError           a D-Bus / systemd failure
        ├── NoSuchUnit         the unit is not loaded / does not exist
        ├── AccessDenied       polkit refused the call (install the generated rule)
        ├── BusDisconnected    the bus connection dropped; the client reconnects
        └── JobFailed          a systemd job finished with a result other than "done"

Probes, scrapes and evidence collectors never raise for a failing *target*: they return results.
These exceptions are for conditions the caller must act on.
"""

from __future__ import annotations

from dataclasses import dataclass

EXIT_OK = 0
EXIT_UNHEALTHY = 1
EXIT_USAGE = 2
EXIT_STARTUP = 3
# An exception no code path expected: reported like a startup failure (not 1, which means
# "unhealthy" to `check` and `--once`); systemd's Restart=on-failure restarts the daemon.
EXIT_INTERNAL = EXIT_STARTUP
EXIT_INTERRUPTED = 130  # Ctrl-C: the shell convention, 128 + SIGINT


class WatchdogError(Exception):
    """Base of every error this project raises on purpose."""

    exit_code = EXIT_STARTUP


@dataclass(frozen=True)
class ConfigIssue:
    """One problem in a config file: where (file and dotted key path) and why."""

    file: str
    key: str
    reason: str

    def __str__(self) -> str:
        return f"{self.file}: {self.key}: {self.reason}"


class ConfigError(WatchdogError):
    """The configuration file is missing, unparsable or invalid; lists every issue."""

    exit_code = EXIT_USAGE

    def __init__(self, issues: list[ConfigIssue]) -> None:
        self.issues = tuple(issues)
        super().__init__("\n".join(str(issue) for issue in issues))


class UsageError(WatchdogError):
    """The command line asks for something that does not exist or does not fit together."""

    exit_code = EXIT_USAGE


class StartupError(WatchdogError):
    """The daemon cannot start: bus unreachable, port taken, state directory unwritable."""

    exit_code = EXIT_STARTUP


class RestartRefused(WatchdogError):
    """A restart was asked for that the watchdog refuses to perform."""

    exit_code = EXIT_STARTUP

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        super().__init__(message)


class LockHeld(WatchdogError):
    """Another process holds the restart lock of this state directory."""

    exit_code = EXIT_STARTUP


class StateFileError(WatchdogError):
    """A persisted state file could not be read or written."""


class SystemdError(WatchdogError):
    """A systemd or D-Bus operation failed."""


class NoSuchUnit(SystemdError):
    """The unit does not exist or is not loaded."""


class AccessDenied(SystemdError):
    """polkit (or bus policy) refused the call."""


class BusDisconnected(SystemdError):
    """The connection to the system bus was lost."""


class JobFailed(SystemdError):
    """A systemd job ended with a result other than "done"."""

    def __init__(self, unit: str, result: str) -> None:
        self.unit = unit
        self.result = result
        super().__init__(
            f"systemd job for {unit} finished with result {result!r} (expected 'done')"
        )
