"""Typed, frozen, strict configuration: load_config(path) parses TOML, pydantic validates it.

Every problem is reported as a ConfigIssue naming the file, the dotted key path and the reason;
all of them are collected before failing, so an operator fixes a file in one pass.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    SerializationInfo,
    Tag,
    ValidationError,
    field_serializer,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from watchdog.errors import ConfigError, ConfigIssue
from watchdog.model import Role, Worker, worker_name
from watchdog.redact import redact_url, remember_url_credentials

DEFAULT_CONFIG_PATH = Path("/etc/sglang-watchdog/watchdog.toml")

# Every role of a group, in the only safe co-restart order (see DECODE_ONLY_EXPLANATION).
ROLES: tuple[Role, Role, Role] = (Role.PREFILL, Role.DECODE, Role.ROUTER)

# systemd.unit(5): unit names are at most 255 bytes of [A-Za-z0-9:_.\-] with an optional @instance.
# Template names ("foo@.service") cannot be restarted, so an instance is required after "@".
# Both names are matched with fullmatch: "$" would also accept a trailing newline.
_UNIT_NAME = re.compile(r"[A-Za-z0-9:_.\\-]+(@[A-Za-z0-9:_.\\-]+)?\.service", re.ASCII)
# Group names become parts of file names (incident directories, state files) and metric labels.
_GROUP_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}", re.ASCII)

# The config is operator-written and small (the example with every key is a few KiB); the cap
# keeps `--config /dev/zero` or a mistaken multi-GiB path from exhausting memory.
MAX_CONFIG_BYTES = 1 << 20

# Every duration is a finite number of seconds within bounds the daemon can run with:
# - at least MIN_SECONDS: the probe scheduler and the group loop sleep one period between starts,
#   and a period of 1e-300 s adds nothing to the clock (a busy loop at 100 % CPU); timeouts that
#   short fail every request. 0.05 s is a floor against that, not a recommendation.
# - periods and timeouts at most MAX_TIMEOUT_SECONDS (a day): a probe, a restart step or a
#   shutdown that may take longer is not a liveness check any more.
# - windows, backoffs and graces at most MAX_WINDOW_SECONDS (a week): deadlines are `now + value`,
#   rendered as dates in messages and state files; a week is far past any restart budget and keeps
#   every such date (and a doubled backoff) well inside what datetime can represent.
MIN_SECONDS = 0.05
MAX_ALERTMANAGER_TIMEOUT_SECONDS = 10.0
MAX_TIMEOUT_SECONDS = 86400.0
MAX_WINDOW_SECONDS = 7 * 86400.0

# expect_regex runs on the event loop, and Python's `re` has no timeout. Two guards, both needed:
# - the rule below refuses the patterns whose backtracking is exponential (a repetition of a group
#   that itself repeats or alternates, e.g. "(a+)+$", "(a|aa)*") or polynomial of a high degree
#   (more than two repetitions, backreferences). A small scanner over the pattern text is used
#   rather than re's private parser, whose internals change between Python versions.
# - the match runs on the first EXPECT_REGEX_TEXT_CHARS characters of the output only (see
#   ProbeSection.expect_matches): even ".*ok.*" takes seconds on the 64 KiB a server may send.
#   The worst accepted pattern, two repetitions over the same characters before a failing tail
#   ("(.*)(.*)x"), is cubic in the text: ~4 ms at 128 characters, ~30 ms at 256 (measured on
#   a loaded 2-core machine; tests/unit/test_config_hardening.py checks it). A probe answer is
#   max_tokens tokens, a few words: 128 characters hold it whole.
EXPECT_REGEX_MAX_REPEATS = 2
EXPECT_REGEX_TEXT_CHARS = 128
EXPECT_REGEX_RULE = (
    "at most 2 repetitions (*, + or {m,n}), none of a group that itself contains a repetition "
    "or an alternation (|), and no backreferences"
)

# SGLang's /health sleeps 1 s before its first check, then checks once a second: a healthy server
# answers in 1.00-1.05 s (docs/sglang.md §7.1). A deadline under 2 s leaves less headroom than the
# handler's own check interval, so any delay of its one-token health batch (a prefill batch running
# when /health arrives, a busy tokenizer loop) turns a healthy worker into a timeout; at ~1.2 s and
# below, every real server times out. The router's own default is 5 s.
MIN_HEALTH_TIMEOUT_SECONDS = 2.0

DECODE_ONLY_EXPLANATION = (
    "decode must never be restarted without prefill before it: a decode restarted against a "
    "long-running prefill degrades the KV-transfer bootstrap state (transfers fail or hang while "
    "/health stays 200); the safe action is the co-restart prefill -> decode -> router"
)


class KeyedValueError(ValueError):
    """A cross-field rule failure that knows the sub-key it is about (appended to the location)."""

    def __init__(self, key: str, reason: str) -> None:
        self.key = key
        self.reason = reason
        super().__init__(reason)


def _shown(value: object, limit: int = 120) -> str:
    """repr(value), cut to `limit` characters: messages quote the value, never a whole file."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 5]}...{text[-1]}"


def _has_control_or_space(value: str) -> bool:
    return any(ch.isspace() or ord(ch) < 0x20 or ord(ch) == 0x7F for ch in value)


def _check_url(value: str) -> str:
    # urlsplit silently drops tabs and newlines (so the check would pass) while the HTTP client
    # refuses the URL at every request: refuse here, where the key can be named.
    if _has_control_or_space(value):
        raise ValueError(f"{_shown(value)} contains whitespace or a control character")
    parts = urlsplit(value)
    shown = redact_url(value)  # an error message must not print the URL's credentials
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"{shown!r} is not an http(s) URL")
    if not parts.hostname:
        raise ValueError(f"{shown!r} has no host")
    try:
        _ = parts.port
    except ValueError as exc:
        raise ValueError(f"{shown!r} has an invalid port") from exc
    if parts.query or parts.fragment:
        raise ValueError(f"{shown!r} must not have a query or fragment")
    return value.rstrip("/")


def _check_unit(value: str) -> str:
    if len(value) > 255 or not _UNIT_NAME.fullmatch(value):
        raise ValueError(
            f"{_shown(value)} is not a valid systemd service unit name "
            "(letters, digits, ':', '_', '.', '-', an optional '@instance', ending in '.service')"
        )
    return value


def _check_group_name(value: str) -> str:
    if not _GROUP_NAME.fullmatch(value):
        raise ValueError(
            f"{_shown(value)} is not a safe group name (1-63 of letters, digits, '_', '.', '-', "
            "starting with a letter or digit)"
        )
    return value


# ssh://user@host[:port]: a POSIX user name and a host name or IP literal, nothing else (no
# password, no path, no options): the parts go into SSH connection parameters, never a shell.
# Both are checked by parsing or by patterns without nested repetition: a backtracking pattern
# over a long host name with one bad character takes exponential time, and `watchdog validate`
# would then be killed by the unit's start timeout instead of exiting 2.
_SSH_USER = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}", re.ASCII)
_MAX_HOST_NAME = 253  # RFC 1035, without the trailing dot


def is_host_name_or_address(host: str) -> bool:
    """Whether `host` is an RFC 1123 host name, a dotted IPv4 address or `[IPv6]`.

    Linear in len(host): labels are split on dots and checked one by one, IP literals are left
    to the ipaddress module. A trailing dot (the fully qualified form) is allowed.
    """
    if host.startswith("[") and host.endswith("]"):
        literal = host[1:-1]
        if "%" in literal:  # a zone index names a local interface, not a host
            return False
        try:
            ipaddress.IPv6Address(literal)
        except ValueError:
            return False
        return True
    name = host.removesuffix(".")
    if not name or len(name) > _MAX_HOST_NAME:
        return False
    labels = name.split(".")
    if not all(_HOST_LABEL.fullmatch(label) for label in labels):
        return False
    if all(label.isdigit() for label in labels):  # all-numeric: only as an IPv4 address
        try:
            ipaddress.IPv4Address(name)
        except ValueError:
            return False
    return True


def _check_ssh_host(value: str) -> str:
    # urlsplit drops tabs and newlines silently: refuse them here, as _check_url does.
    if _has_control_or_space(value):
        raise ValueError(f"{_shown(value)} contains whitespace or a control character")
    try:
        parts = urlsplit(value)
    except ValueError:  # an unbalanced '[' or ']'
        raise ValueError(f"{_shown(value)} has no valid host name or address") from None
    if parts.scheme != "ssh":
        raise ValueError(f"{_shown(value)} is not an ssh:// URL (ssh://user@host:22)")
    if parts.password is not None:
        raise ValueError(f"{_shown(value)} carries a password; only key authentication is used")
    if not parts.username or not _SSH_USER.fullmatch(parts.username):
        raise ValueError(f"{_shown(value)} must name a valid user (ssh://user@host:22)")
    host = parts.netloc.rpartition("@")[2]
    host = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    if not is_host_name_or_address(host):
        raise ValueError(f"{_shown(value)} has no valid host name or address")
    try:
        _ = parts.port
    except ValueError as exc:
        raise ValueError(f"{_shown(value)} has an invalid port") from exc
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"{_shown(value)} must not have a path, query or fragment")
    return value.rstrip("/")


def _check_private_file(value: Path) -> Path:
    if not (value.is_file() and os.access(value, os.R_OK)):
        raise ValueError(f"{str(value)!r} is not a readable file")
    return value


def _check_key_file(value: Path) -> Path:
    _check_private_file(value)
    # Like ssh itself: a private key others can read is refused, not used.
    if value.stat().st_mode & 0o077:
        raise ValueError(
            f"{str(value)!r} is accessible by group or others (mode "
            f"{value.stat().st_mode & 0o777:o}); a private key must be mode 600 or stricter"
        )
    return value


def _check_known_hosts_file(value: Path) -> Path:
    _check_private_file(value)
    # Whoever can write the pinned host keys can stand in for the host (ssh's StrictModes).
    mode = value.stat().st_mode
    if mode & 0o022:
        raise ValueError(
            f"{str(value)!r} is writable by group or others (mode {mode & 0o777:o}); "
            "known_hosts_file must be writable by its owner only (chmod go-w)"
        )
    return value


def _check_path(value: Path) -> Path:
    text = str(value)
    if "\x00" in text:
        raise ValueError(f"{_shown(text)} contains a NUL byte, which no file name can")
    if text in ("", "."):
        raise ValueError("is empty; name a directory or file")
    return value


# Alertmanager's label matchers in the syntax amtool and its web UI use: a label name, an operator
# (=, !=, =~, !~) and a double-quoted value; `\"` and `\\` are the value's only escapes, any other
# backslash is kept for the regular expression. `{group}` in a value is the group's name.
_MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*\"(.*)\"", re.ASCII | re.DOTALL)
GROUP_PLACEHOLDER = "{group}"
MATCHER_SYNTAX = 'name="value", name!="value", name=~"regex" or name!~"regex"'


@dataclass(frozen=True, slots=True)
class LabelMatcher:
    """One Alertmanager label matcher (API v2: name, value, isRegex, isEqual)."""

    name: str
    value: str
    regex: bool
    equal: bool

    def matches_empty(self) -> bool:
        """Whether an alert without the label matches (Alertmanager refuses a silence whose
        matchers all do: it would silence every alert)."""
        hit = re.fullmatch(self.value, "") is not None if self.regex else self.value == ""
        return hit == self.equal

    def for_group(self, group: str) -> LabelMatcher:
        """The matcher with `{group}` in its value replaced by the group's name."""
        return dataclasses.replace(self, value=self.value.replace(GROUP_PLACEHOLDER, group))

    def text(self) -> str:
        """The matcher as written in the config (name, operator, quoted value)."""
        op = ("=" if self.equal else "!") + ("~" if self.regex else "")
        op = "!=" if op == "!" else op
        quoted = self.value.replace("\\", "\\\\").replace('"', '\\"')
        return f'{self.name}{op}"{quoted}"'


def _unquote_matcher_value(raw: str) -> str:
    out: list[str] = []
    i = 0
    while i < len(raw):
        ch = raw[i]
        if ch == "\\" and raw[i + 1 : i + 2] in ('"', "\\"):
            out.append(raw[i + 1])
            i += 2
            continue
        if ch == '"':
            raise ValueError('has an unescaped " inside its value (write \\")')
        out.append(ch)
        i += 1
    return "".join(out)


def parse_matcher(text: str) -> LabelMatcher:
    """A matcher written `name="value"` (or !=, =~, !~); ValueError says what is wrong."""
    found = _MATCHER.fullmatch(text.strip())
    if found is None:
        raise ValueError(f"{_shown(text)} is not a label matcher ({MATCHER_SYNTAX})")
    name, op, raw = found.groups()
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in raw):
        raise ValueError(f"{_shown(text)} contains a control character")
    try:
        value = _unquote_matcher_value(raw)
    except ValueError as exc:
        raise ValueError(f"{_shown(text)} {exc}") from None
    matcher = LabelMatcher(name, value, regex="~" in op, equal=not op.startswith("!"))
    if matcher.regex:
        try:
            re.compile(value.replace(GROUP_PLACEHOLDER, "group"))
        except re.error as exc:
            raise ValueError(f"{_shown(text)}: not a valid regular expression: {exc}") from None
    return matcher


def _check_matcher(value: str) -> str:
    parse_matcher(value)
    return value


def _bounded(high: float, *, zero_is_off: bool = False) -> AfterValidator:
    """Seconds within [MIN_SECONDS, high] (or exactly 0 where 0 switches the feature off)."""

    def check(value: float) -> float:
        if zero_is_off and value == 0:
            return value
        if value < MIN_SECONDS:
            off = " (or 0 to switch it off)" if zero_is_off else ""
            raise ValueError(
                f"{value:g} is below the minimum of {MIN_SECONDS:g} s{off}: shorter periods "
                "spin the loop and shorter timeouts fail every request"
            )
        if value > high:
            span = "a day" if high == MAX_TIMEOUT_SECONDS else "a week"
            raise ValueError(f"{value:g} is above the maximum of {high:g} s ({span})")
        return value

    return AfterValidator(check)


# RFC 1123 host names: dot-separated labels of ASCII letters, digits and inner hyphens.
_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)", re.ASCII)
_PORT = re.compile(r"[0-9]{1,5}", re.ASCII)


def parse_listen(value: str) -> tuple[str, int]:
    """`HOST:PORT` as (host, port); HOST is an IPv4 address, a host name or `[IPv6]`.

    ValueError says what is wrong. The brackets are removed from an IPv6 host.
    """
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port:
        raise ValueError(f"{_shown(value)} is not HOST:PORT (e.g. 127.0.0.1:9464)")
    if not _PORT.fullmatch(port) or not 0 < int(port) < 65536:
        raise ValueError(f"{_shown(value)}: the port must be a number from 1 to 65535")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise ValueError(f"{_shown(value)}: {host} is not an IPv6 address") from None
        return host[1:-1], int(port)
    if ":" in host:
        raise ValueError(f"{_shown(value)}: an IPv6 host goes in brackets, e.g. [::1]:9464")
    labels = host.removesuffix(".").split(".")
    if len(host) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels):
        raise ValueError(
            f"{_shown(value)}: {_shown(host)} is not an IP address or host name "
            "(ASCII letters, digits, '-' and '.')"
        )
    return host, int(port)


def regex_backtracking_risk(pattern: str) -> str:
    """Why `pattern` (which compiles) may backtrack for too long, or "" when it may not.

    Scans the pattern text atom by atom: escapes and character classes are skipped whole, every
    group is a frame that remembers whether it contains a repetition or an alternation, and the
    quantifier after each atom is read. See EXPECT_REGEX_RULE.
    """
    frames: list[list[bool]] = [[False, False]]  # per open group: [repeats inside, alternates]
    repeats = 0
    i = 0
    try:
        while i < len(pattern):
            i, closed = _atom(pattern, i, frames)
            i, repeating = _quantifier(pattern, i)
            if not repeating:
                continue
            if closed is not None and (closed[0] or closed[1]):
                return (
                    "repeats a group that itself repeats or alternates (exponential backtracking)"
                )
            repeats += 1
            frames[-1][0] = True
            if repeats > EXPECT_REGEX_MAX_REPEATS:
                return f"has more than {EXPECT_REGEX_MAX_REPEATS} repetitions"
    except _BackreferenceError:
        return "uses a backreference"
    return ""


class _BackreferenceError(Exception):
    """The scanned pattern refers back to a group."""


def _atom(pattern: str, i: int, frames: list[list[bool]]) -> tuple[int, list[bool] | None]:
    """The index after the atom at `i` and, when the atom closes a group, that group's frame."""
    ch = pattern[i]
    if ch == "\\":
        if pattern[i + 1 : i + 2].isdigit() and pattern[i + 1] != "0":
            raise _BackreferenceError
        return i + 2, None
    if ch == "[":
        return _class_end(pattern, i), None
    if ch == "(":
        if pattern.startswith("(?#", i):
            return pattern.index(")", i) + 1, None
        if pattern.startswith(("(?P=", "(?("), i):
            raise _BackreferenceError
        frames.append([False, False])
        return i + 1, None
    if ch == ")" and len(frames) > 1:  # (an unbalanced one does not compile anyway)
        closed = frames.pop()
        frames[-1][0] = frames[-1][0] or closed[0]
        frames[-1][1] = frames[-1][1] or closed[1]
        return i + 1, closed
    if ch == "|":
        frames[-1][1] = True
    return i + 1, None


def _class_end(pattern: str, start: int) -> int:
    """The index after the character class opened at `start` (a `]` first in it is literal)."""
    i = start + 1
    if pattern[i : i + 1] == "^":
        i += 1
    if pattern[i : i + 1] == "]":
        i += 1
    while i < len(pattern) and pattern[i] != "]":
        i += 2 if pattern[i] == "\\" else 1
    return i + 1


def _braces(pattern: str, i: int) -> tuple[int, str, bool, str] | None:
    """The `{m}`, `{m,}`, `{,n}` or `{m,n}` at `i` as (end, m, comma, n); None when the text
    there is not one (re then reads the brace as a literal).

    Parsed by hand: a pattern like `\\{([0-9]*)(,?)([0-9]*)\\}` backtracks quadratically over a
    long run of digits with no closing brace, and this runs on operator input.
    """
    low_end = _digits_end(pattern, i + 1)
    comma = pattern[low_end : low_end + 1] == ","
    high_end = _digits_end(pattern, low_end + 1) if comma else low_end
    if pattern[high_end : high_end + 1] != "}":
        return None
    return high_end + 1, pattern[i + 1 : low_end], comma, pattern[low_end + 1 : high_end]


def _digits_end(pattern: str, i: int) -> int:
    """The index after the run of ASCII digits starting at `i`."""
    while i < len(pattern) and "0" <= pattern[i] <= "9":
        i += 1
    return i


def _quantifier(pattern: str, i: int) -> tuple[int, bool]:
    """(end of the quantifier at `i`, whether it can match more than once); (i, False) if none."""
    ch = pattern[i : i + 1]
    if ch in ("*", "+", "?"):
        end, repeating = i + 1, ch != "?"
    elif ch == "{" and (braces := _braces(pattern, i)) and (braces[1] or braces[3]):
        end, low, comma, high = braces
        most = (high or "inf") if comma else low
        repeating = most == "inf" or int(most) > 1
    else:
        return i, False
    if pattern[end : end + 1] in ("?", "+"):  # lazy or possessive: the same repetition
        end += 1
    return end, repeating


HttpUrl = Annotated[str, AfterValidator(_check_url)]
SshHostUrl = Annotated[str, AfterValidator(_check_ssh_host)]
SshKeyFile = Annotated[Path, AfterValidator(_check_key_file)]
KnownHostsFile = Annotated[Path, AfterValidator(_check_known_hosts_file)]
UnitName = Annotated[str, AfterValidator(_check_unit)]
GroupName = Annotated[str, AfterValidator(_check_group_name)]
SafePath = Annotated[Path, AfterValidator(_check_path)]
MatcherText = Annotated[str, AfterValidator(_check_matcher)]
# The `gt=0`/`ge=0` constraints run first, so a negative value keeps pydantic's plain message.
PositiveSeconds = Annotated[float, Field(gt=0, allow_inf_nan=False), _bounded(MAX_TIMEOUT_SECONDS)]
WindowSeconds = Annotated[float, Field(gt=0, allow_inf_nan=False), _bounded(MAX_WINDOW_SECONDS)]
NonNegativeSeconds = Annotated[
    float, Field(ge=0, allow_inf_nan=False), _bounded(MAX_WINDOW_SECONDS, zero_is_off=True)
]
OptionalPeriodSeconds = Annotated[
    float, Field(ge=0, allow_inf_nan=False), _bounded(MAX_TIMEOUT_SECONDS, zero_is_off=True)
]
PositiveInt = Annotated[int, Field(gt=0)]
Fraction = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]


def _role_name(value: Any) -> Any:
    # TOML gives names; anything else gets the same error as any other string setting.
    if not isinstance(value, str):
        raise PydanticCustomError("string_type", "Input should be a valid string")
    return value


RoleName = Annotated[Role, BeforeValidator(_role_name)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=False, validate_default=True)


class WatchdogSection(_Strict):
    """Process-wide settings."""

    state_dir: SafePath = Path("/var/lib/sglang-watchdog")
    metrics_listen: str = "127.0.0.1:9464"
    cycle_seconds: PositiveSeconds = 5.0
    shutdown_timeout_seconds: PositiveSeconds = 30.0
    evidence_timeout_seconds: PositiveSeconds = 15.0
    journal_lines: PositiveInt = 200
    incidents_keep: PositiveInt = 50
    incidents_max_mib: PositiveInt = 200

    @field_validator("metrics_listen")
    @classmethod
    def _listen(cls, value: str) -> str:
        parse_listen(value)
        return value


def _matcher_list(value: tuple[str, ...]) -> tuple[str, ...]:
    if not value:
        raise ValueError("at least one matcher is required (e.g. 'group=\"{group}\"')")
    return value


MatcherList = Annotated[tuple[MatcherText, ...], AfterValidator(_matcher_list)]


class AlertmanagerSection(_Strict):
    """Optional: a silence over a group's own alerts while it is co-restarted, and the
    watchdog's own alerts (docs/decisions.md, "Alertmanager silences")."""

    url: HttpUrl
    # Sent as `Authorization: Bearer ...`; read like api_key_file, never logged.
    bearer_token_file: SafePath | None = None
    # The silence's matchers for every group (a group's own [group.alertmanager] replaces them).
    silence_matchers: MatcherList = ('group="{group}"',)
    # The silence's own lifetime: renewed while the group restarts and verifies, so it lapses by
    # itself this long after the watchdog stops renewing it (dies). Also the held alert's.
    silence_seconds: WindowSeconds = 300.0
    # Every request's whole deadline: a co-restart waits at most this long for Alertmanager.
    # At most 10 s: a cycle sends at most two requests, and a cycle that takes longer than half
    # the unit's WatchdogSec= (60 s) would stop the liveness pings while Alertmanager hangs.
    timeout_seconds: Annotated[
        float, Field(gt=0, le=MAX_ALERTMANAGER_TIMEOUT_SECONDS, allow_inf_nan=False)
    ] = 3.0

    @field_validator("bearer_token_file")
    @classmethod
    def _readable(cls, value: Path | None) -> Path | None:
        if value is not None:
            _check_private_file(value)
        return value

    @field_validator("timeout_seconds")
    @classmethod
    def _long_enough(cls, value: float) -> float:
        if value < MIN_SECONDS:
            raise ValueError(f"{value:g} is below the minimum of {MIN_SECONDS:g} s")
        return value

    def matchers_for(self, group: GroupSection) -> tuple[LabelMatcher, ...]:
        """The matchers of `group`'s silence, `{group}` replaced by its name."""
        texts = group.alertmanager.silence_matchers if group.alertmanager else self.silence_matchers
        return tuple(parse_matcher(text).for_group(group.name) for text in texts)


class GroupAlertmanagerSection(_Strict):
    """A group's own silence matchers, in place of [alertmanager]'s."""

    silence_matchers: MatcherList


class FleetSection(_Strict):
    """Limits across the daemon's groups (docs/decisions.md, "Fleet budget and storms").

    Each group decides alone; these bound what the daemon does to all of them together, so a
    shared cause (a router, the network, a bad deploy) never co-restarts the whole fleet at once.
    A daemon with one group is governed by that group's [group.restart] budget alone.
    """

    # One: a co-restart drops the group's in-flight requests and its capacity until it serves
    # again; one at a time loses at most one group's share, and a shared cause shows itself (the
    # first restart does not help) before a second group is dropped. Two independent stalls
    # within one restart's duration are rare; the second waits one backoff_seconds.
    max_concurrent_restarts: PositiveInt = 1
    max_restarts_per_hour: PositiveInt = 6
    storm_share: Fraction = 0.5
    storm_window_seconds: WindowSeconds = 120.0
    storm_min_groups: PositiveInt = 3


@dataclass(frozen=True, slots=True)
class SshTarget:
    """Where a remote role's systemd is reached: one SSH connection per distinct target."""

    user: str
    hostname: str
    port: int
    key_file: Path
    known_hosts_file: Path

    @classmethod
    def parse(cls, url: str, key_file: Path, known_hosts_file: Path) -> SshTarget:
        """A target from a validated `host` URL and its two files."""
        parts = urlsplit(url)
        # Both validated by _check_ssh_host.
        assert parts.username, url
        assert parts.hostname, url
        return cls(parts.username, parts.hostname, parts.port or 22, key_file, known_hosts_file)

    @property
    def label(self) -> str:
        """user@host:port, for messages, metrics labels and reports."""
        host = f"[{self.hostname}]" if ":" in self.hostname else self.hostname
        return f"{self.user}@{host}:{self.port}"


class HostFields(_Strict):
    """Where units run: absent = the local system bus; `host` = over SSH (README: "Multi-host")."""

    host: SshHostUrl | None = None
    ssh_key_file: SshKeyFile | None = None
    known_hosts_file: KnownHostsFile | None = None


class UnitSection(HostFields):
    """One serving process: its systemd unit, base URL and optional drift expectations."""

    unit: UnitName
    url: HttpUrl
    expect_cmdline_contains: tuple[str, ...] = ()
    expect_env: dict[str, str] = Field(default_factory=dict)


class PrefillSection(UnitSection):
    """A prefill worker: like any worker, plus the bootstrap port the router hands to decode."""

    # The KV bootstrap listener (SGLang's --disaggregation-bootstrap-port, 8998 by default): the
    # router's `--prefill URL PORT` pairs it with the URL, and no two prefills on a host share one.
    bootstrap_port: Annotated[int, Field(gt=0, lt=65536)] | None = None


class DecodeSection(UnitSection):
    """A decode worker: like any worker, plus its DP-attention size (docs/sglang.md §7.10)."""

    # SGLang's --dp-size with --enable-dp-attention: that many schedulers in one server, each
    # probed on its own by a pinned direct PD probe (docs/decisions.md, "DP-attention ranks").
    dp_size: Annotated[int, Field(ge=1, le=1024)] = 1


# A role's table names one worker ([group.prefill]); an array of tables ([[group.prefill]]) names
# several. The shape is told apart before validation (a tagged union); both become a tuple.
# Errors name a worker as reports do (group#1.prefill.unit, group#1.prefill#2.unit).
_ONE_WORKER, _WORKER_LIST = "_one_worker", "_worker_list"
_SHAPE_TAGS = frozenset({_ONE_WORKER, _WORKER_LIST})
# The keys of the roles that may list several workers.
_WORKER_ROLES = frozenset({"prefill", "decode"})


def _worker_shape(value: Any) -> str:
    return _WORKER_LIST if isinstance(value, list | tuple) else _ONE_WORKER


def _as_workers(value: Any) -> Any:
    if not isinstance(value, tuple):
        return (value,)
    if not value:
        raise ValueError("at least one worker is required")
    return value


if TYPE_CHECKING:  # what the fields hold, once validated
    PrefillWorkers = tuple[PrefillSection, ...]
    DecodeWorkers = tuple[DecodeSection, ...]
else:
    PrefillWorkers = Annotated[
        Annotated[PrefillSection, Tag(_ONE_WORKER)]
        | Annotated[tuple[PrefillSection, ...], Tag(_WORKER_LIST)],
        Discriminator(_worker_shape),
        AfterValidator(_as_workers),
    ]
    DecodeWorkers = Annotated[
        Annotated[DecodeSection, Tag(_ONE_WORKER)]
        | Annotated[tuple[DecodeSection, ...], Tag(_WORKER_LIST)],
        Discriminator(_worker_shape),
        AfterValidator(_as_workers),
    ]


class RouterSection(UnitSection):
    """The router: like a worker, plus its separate Prometheus listener."""

    metrics_url: HttpUrl | None = None


class ProbeSection(_Strict):
    """The synthetic end-to-end completion sent through the router."""

    path: Literal["/v1/completions", "/v1/chat/completions", "/generate"] = "/v1/completions"
    model: str = "default"
    prompt: str = "Reply with the word ok."
    max_tokens: PositiveInt = 4
    period_seconds: PositiveSeconds = 5.0
    # 12 s and 8 s: a stuck probe fails within them, so probe_failures (3) failures land within
    # 2 periods + 12 s = 22 s of the first stuck start, inside no_progress_seconds (25 s); a
    # healthy 4-token probe answers in well under a second (configs/example.toml explains each).
    timeout_seconds: PositiveSeconds = 12.0
    connect_timeout_seconds: PositiveSeconds = 3.0
    stream_idle_seconds: PositiveSeconds = 8.0
    max_in_flight: PositiveInt = 4
    expect_regex: str = ""
    api_key_file: SafePath | None = None
    # SGLang requires the admin key on /abort_request when a worker runs with --admin-api-key.
    admin_api_key_file: SafePath | None = None
    multiround_every_seconds: OptionalPeriodSeconds = 300.0
    multiround_rounds: PositiveInt = 5
    # Direct PD probes (README "Restart rungs"): one request to a prefill and its twin to a decode,
    # paired as the router pairs them, for every prefill/decode pair. They localise a failure:
    # router probes failing while direct ones pass point at the router alone.
    direct_on_failure: bool = True  # a round while router probes fail (at most one per period)
    direct_every_seconds: OptionalPeriodSeconds = 0.0  # also a round this often (0: off)
    # Pinned direct probes, one per DP rank of each decode with dp_size > 1 (docs/decisions.md,
    # "DP-attention ranks"): a round this often (0: off), and once a period while router probes
    # fail (with direct_on_failure). The field that pins a request depends on the SGLang version
    # (docs/sglang.md §7.10): routed_dp_rank from 0.5.16, data_parallel_rank up to 0.5.9.
    dp_probe_every_seconds: OptionalPeriodSeconds = 60.0
    dp_rank_field: Literal["routed_dp_rank", "data_parallel_rank"] = "routed_dp_rank"
    health_timeout_seconds: PositiveSeconds = 5.0
    scrape_timeout_seconds: PositiveSeconds = 5.0
    # Fetch cadences, in cycles, while nothing is in doubt (watchdog/observe/cadence.py); every
    # cycle while something is. /health: a passing probe proves what it would, and each costs
    # SGLang a generation. /v1/loads dates the no-progress clock: above 1 it delays a stall
    # decision by up to that many cycles. Worker /metrics wait their cadence only while /v1/loads
    # reads every decode's tokens, else come every cycle (configs/example.toml).
    health_every_cycles: PositiveInt = 6
    metrics_every_cycles: PositiveInt = 3
    router_metrics_every_cycles: PositiveInt = 3
    loads_every_cycles: PositiveInt = 1

    @field_validator("expect_regex")
    @classmethod
    def _regex(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"not a valid regular expression: {exc}") from exc
        problem = regex_backtracking_risk(value)
        if problem:
            raise ValueError(
                f"{_shown(value)} {problem}; Python's re has no timeout, so an expect_regex may "
                f"have {EXPECT_REGEX_RULE}"
            )
        return value

    def expect_matches(self, text: str) -> bool:
        """Whether the probe output `text` matches expect_regex (always true when unset).

        Only the first EXPECT_REGEX_TEXT_CHARS characters are searched: the bound that keeps a
        validated pattern fast on whatever a server sends (see EXPECT_REGEX_TEXT_CHARS).
        """
        if not self.expect_regex:
            return True
        return re.search(self.expect_regex, text[:EXPECT_REGEX_TEXT_CHARS]) is not None

    @field_validator("api_key_file", "admin_api_key_file")
    @classmethod
    def _readable(cls, value: Path | None) -> Path | None:
        if value is not None and not (value.is_file() and os.access(value, os.R_OK)):
            raise ValueError(f"{str(value)!r} is not a readable file")
        return value

    @field_validator("health_timeout_seconds")
    @classmethod
    def _health_timeout_meetable(cls, value: float) -> float:
        if value < MIN_HEALTH_TIMEOUT_SECONDS:
            raise ValueError(
                f"{value:g} is below {MIN_HEALTH_TIMEOUT_SECONDS:g}: SGLang's /health sleeps 1 s "
                "before its first check and answers a healthy server in 1.00-1.05 s, so a shorter "
                "deadline times healthy workers out (docs/sglang.md §7.1)"
            )
        return value

    @model_validator(mode="after")
    def _stream_idle_within_deadline(self) -> ProbeSection:
        if self.stream_idle_seconds > self.timeout_seconds:
            raise KeyedValueError(
                "stream_idle_seconds",
                f"{self.stream_idle_seconds:g} must not exceed timeout_seconds "
                f"({self.timeout_seconds:g}), the hard deadline of the whole probe",
            )
        return self


class StallSection(_Strict):
    """Thresholds of the stall detector."""

    probe_failures: PositiveInt = 3
    # Bounds silent-stall detection (~25-30 s after the fault at the default 5 s cycle). Not
    # lower: the hung-worker rule shares it, and a 25 s pause keeps /health failing for up to
    # 4 cycles (20 s) as observed, which must stay below it (configs/example.toml).
    no_progress_seconds: WindowSeconds = 25.0
    transfer_failures: PositiveInt = 5
    # A transfer path failing this share of the transfers attempted in the window is degraded even
    # while probes pass (router retries hide it), once at least transfer_min_attempts were made.
    transfer_failure_ratio: Fraction = 0.5
    transfer_min_attempts: PositiveInt = 20
    window_seconds: WindowSeconds = 300.0
    pinned_inflight_seconds: WindowSeconds = 600.0
    startup_timeout_seconds: PositiveSeconds = 1200.0
    # Also the wait, once a prefill restarted alone serves, before the survivor rung
    # (docs/decisions.md, "Restart rungs").
    decode_only_grace_seconds: NonNegativeSeconds = 60.0
    on_decode_only_restart: Literal["co-restart", "alert"] = "co-restart"
    # A prefill restarted alone: "act" takes the survivor rung after the grace; "judge" only
    # alerts where the direct PD probes of every affected pair pass after the grace and each of
    # their decodes runs an SGLang that refreshes stale prefill metadata by itself
    # (docs/decisions.md, "Restart rungs"; docs/sglang.md §7.11).
    on_prefill_only_restart: Literal["act", "judge"] = "act"


class RestartSection(_Strict):
    """The co-restart sequence and its budget."""

    order: tuple[RoleName, ...] = ROLES
    ready_timeout_seconds: PositiveSeconds = 900.0
    max_restarts: PositiveInt = 3
    budget_window_seconds: WindowSeconds = 3600.0
    backoff_seconds: NonNegativeSeconds = 300.0
    verify_probes: PositiveInt = 8
    verify_timeout_seconds: PositiveSeconds = 300.0
    # Verification is a soak (docs/decisions.md, "Verification is a soak"): after the first
    # verify_probes successes it goes on until soak_probes probes passed (counted from the
    # co-restart) and soak_seconds went by, with no relapse. A server may pass /health and a few
    # requests after a forced restart and hang after ~100 completions: at the default 5 s
    # period 100 passing probes take at least 500 s, and 600 s hold about 120 completion probes
    # and two multi-round probes (10 requests), ~100 requests even with no client traffic.
    soak_probes: PositiveInt = 100
    soak_seconds: NonNegativeSeconds = 600.0
    # Between a unit's stop and its start: how long to wait for its old processes to be gone and
    # its ports free before starting it anyway (watchdog/act/clear.py).
    clear_timeout_seconds: PositiveSeconds = 60.0

    @field_validator("order", mode="before")
    @classmethod
    def _safe_order(cls, order: Any) -> Any:
        # Checked on the names as written, before they become Roles, so messages quote the file.
        if not isinstance(order, list | tuple) or not all(isinstance(r, str) for r in order):
            return order  # not a list of names: the type check reports it
        unknown = [role for role in order if role not in ROLES]
        if unknown:
            raise ValueError(f"unknown role(s) {unknown}; roles are prefill, decode, router")
        if len(set(order)) != len(order):
            raise ValueError(f"{list(order)} lists a role twice")
        missing = [role for role in ROLES if role not in order]
        if missing:
            raise ValueError(
                f"{list(order)} omits {', '.join(missing)}; the order must be "
                f'["prefill", "decode", "router"] because {DECODE_ONLY_EXPLANATION}'
            )
        if list(order) != list(ROLES):
            raise ValueError(
                f"{list(order)} is not prefill before decode before router; "
                f"{DECODE_ONLY_EXPLANATION}"
            )
        return order


class GroupSection(HostFields):
    """One PD deployment: its prefill and decode workers and router, probed and restarted together.

    `prefills` and `decodes` are the `prefill` and `decode` keys of the file (one table or an
    array of tables); `prefill` and `decode` are their first (or only) worker.
    """

    name: GroupName
    prefills: PrefillWorkers = Field(alias="prefill")
    decodes: DecodeWorkers = Field(alias="decode")
    router: RouterSection
    probe: ProbeSection = Field(default_factory=ProbeSection)
    stall: StallSection = Field(default_factory=StallSection)
    restart: RestartSection = Field(default_factory=RestartSection)
    alertmanager: GroupAlertmanagerSection | None = None

    @model_validator(mode="after")
    def _judge_has_direct_probes(self) -> GroupSection:
        if self.stall.on_prefill_only_restart == "judge" and self.probe.direct_every_seconds <= 0:
            # Router retries can hide the one failed room, so router probes need not fail and
            # start direct rounds: without periodic ones nothing would be judged.
            raise KeyedValueError(
                "stall.on_prefill_only_restart",
                '"judge" needs probe.direct_every_seconds > 0: the direct PD probes judge it',
            )
        return self

    @model_validator(mode="after")
    def _timeouts_fit(self) -> GroupSection:
        probe_timeout = self.probe.timeout_seconds
        for key in ("verify_timeout_seconds", "ready_timeout_seconds"):
            value = getattr(self.restart, key)
            if value <= probe_timeout:
                raise KeyedValueError(
                    f"restart.{key}",
                    f"{value:g} must be greater than probe.timeout_seconds ({probe_timeout:g})",
                )
        restart = self.restart
        soak_limit = restart.soak_seconds + restart.verify_timeout_seconds
        if restart.soak_probes * self.probe.period_seconds > soak_limit:
            raise KeyedValueError(
                "restart.soak_probes",
                f"{restart.soak_probes} probes every {self.probe.period_seconds:g}s take longer "
                f"than the soak may last (soak_seconds + verify_timeout_seconds = "
                f"{soak_limit:g}s): no verification could pass",
            )
        # Units are unique in the group; URLs within a role (one server may fake several roles
        # in tests, but two workers of one role at one URL are one worker counted twice).
        units: dict[str, str] = {}
        for role in ROLES:
            urls: dict[str, str] = {}
            for index, worker in enumerate(self.workers(role)):
                key = self.worker_key(role, index)
                for seen, value, field in ((units, worker.unit, "unit"), (urls, worker.url, "url")):
                    if value in seen:
                        raise KeyedValueError(
                            f"{key}.{field}", f"{value!r} is already used by {seen[value]}"
                        )
                    seen[value] = f"{key}.{field}"
        bootstrap: dict[tuple[str | None, int], str] = {}
        for index, prefill in enumerate(self.prefills):
            if prefill.bootstrap_port is None:
                continue
            key = f"{self.worker_key(Role.PREFILL, index)}.bootstrap_port"
            where = (urlsplit(prefill.url).hostname, prefill.bootstrap_port)
            if where in bootstrap:
                raise KeyedValueError(
                    key, f"{where[1]} is already used on {where[0]} by {bootstrap[where]}"
                )
            bootstrap[where] = key
        self._hosts_complete()
        return self

    def _hosts_complete(self) -> None:
        # A worker's own host keys win over the group's; every remote worker needs both files.
        workers = [
            (self.worker_key(role, index), worker)
            for role in ROLES
            for index, worker in enumerate(self.workers(role))
        ]
        remote = {key for key, worker in workers if (worker.host or self.host) is not None}
        scopes: list[tuple[str, HostFields, bool]] = [("", self, bool(remote))]
        scopes += [(f"{key}.", worker, key in remote) for key, worker in workers]
        for prefix, fields, used in scopes:
            for name in ("ssh_key_file", "known_hosts_file"):
                if not used and getattr(fields, name) is not None:
                    raise KeyedValueError(
                        f"{prefix}{name}", 'only meaningful together with host = "ssh://..."'
                    )
        for key, worker in workers:
            if key not in remote:
                continue
            for name in ("ssh_key_file", "known_hosts_file"):
                if getattr(worker, name) is None and getattr(self, name) is None:
                    raise KeyedValueError(
                        f"{key}.{name}",
                        f"required for a remote unit (host {worker.host or self.host!r}): "
                        "set it on the role (or worker) or on the group",
                    )

    def host_of(self, section: UnitSection) -> SshTarget | None:
        """Where one worker's unit runs: None for the local bus, else its SSH target."""
        url = section.host or self.host
        if url is None:
            return None
        key = section.ssh_key_file or self.ssh_key_file
        known = section.known_hosts_file or self.known_hosts_file
        # Both checked by _hosts_complete.
        assert key is not None
        assert known is not None
        return SshTarget.parse(url, key, known)

    @property
    def prefill(self) -> PrefillSection:
        """The first (or only) prefill worker."""
        return self.prefills[0]

    @property
    def decode(self) -> UnitSection:
        """The first (or only) decode worker."""
        return self.decodes[0]

    def model_copy(
        self, *, update: Mapping[str, Any] | None = None, deep: bool = False
    ) -> GroupSection:
        """pydantic's model_copy, where `prefill`/`decode` replace the first worker of the role.

        `prefill` and `decode` are properties over the `prefills`/`decodes` tuples: without this,
        an update naming them would be silently ignored.
        """
        changes = dict(update or {})
        for name, field in (("prefill", "prefills"), ("decode", "decodes")):
            if name in changes:
                workers = changes.get(field, getattr(self, field))
                changes[field] = (changes.pop(name), *workers[1:])
        return super().model_copy(update=changes, deep=deep)

    def workers(self, role: Role) -> tuple[UnitSection, ...]:
        """Every process of `role`, in file order (the router is one)."""
        match role:
            case Role.PREFILL:
                return self.prefills
            case Role.DECODE:
                return self.decodes
            case Role.ROUTER:
                return (self.router,)

    def members(self) -> tuple[tuple[Worker, UnitSection], ...]:
        """Every process of the group with its Worker key: prefills, decodes, then the router."""
        return tuple(
            (Worker(role, index, worker_name(role, index, len(workers))), section)
            for role in (Role.PREFILL, Role.DECODE, Role.ROUTER)
            for workers in (self.workers(role),)
            for index, section in enumerate(workers)
        )

    def worker_key(self, role: Role, index: int) -> str:
        """The key of one worker in messages, spelled as reports name it: `prefill` alone,
        `prefill#2` (1-based) among several."""
        return worker_name(role, index, len(self.workers(role)))

    @field_serializer("prefills", "decodes")
    def _one_or_many(self, workers: tuple[UnitSection, ...], info: SerializationInfo) -> Any:
        # Written back in the shape it has: a table for one worker, an array for several; an
        # unset bootstrap_port (and a dp_size of 1) is left out, as a file that never had one.
        dumped = [
            w.model_dump(mode=info.mode, by_alias=info.by_alias, exclude=_unset_keys(w))
            for w in workers
        ]
        return dumped[0] if len(dumped) == 1 else dumped


def _unset_keys(worker: UnitSection) -> set[str]:
    """Optional worker keys at their default, which a dump leaves out."""
    if isinstance(worker, PrefillSection) and worker.bootstrap_port is None:
        return {"bootstrap_port"}
    if isinstance(worker, DecodeSection) and worker.dp_size == 1:
        return {"dp_size"}
    return set()


class Config(_Strict):
    """The whole file."""

    watchdog: WatchdogSection = Field(default_factory=WatchdogSection)
    alertmanager: AlertmanagerSection | None = None

    fleet: FleetSection = Field(default_factory=FleetSection)
    group: tuple[GroupSection, ...]

    @field_validator("group", mode="before")
    @classmethod
    def _at_least_one(cls, value: Any) -> Any:
        # Checked before item validation: pydantic's min_length would count only the valid items
        # and add a misleading second error to every file with one bad group.
        if isinstance(value, list | tuple) and not value:
            raise ValueError("at least one [[group]] is required")
        return value

    @model_validator(mode="after")
    def _unique(self) -> Config:
        seen: dict[str, int] = {}
        for index, group in enumerate(self.group):
            if group.name in seen:
                raise KeyedValueError(
                    f"{_entry('group', index)}.name",
                    f"{group.name!r} is already used by {_entry('group', seen[group.name])}; "
                    "group names must be unique",
                )
            seen[group.name] = index
        owners: dict[str, str] = {}
        for index, group in enumerate(self.group):
            for role in ROLES:
                for worker_index, worker in enumerate(group.workers(role)):
                    key = f"{_entry('group', index)}.{group.worker_key(role, worker_index)}.unit"
                    if worker.unit in owners:
                        raise KeyedValueError(
                            key, f"{worker.unit!r} is already used by {owners[worker.unit]}"
                        )
                    owners[worker.unit] = key
        return self

    @model_validator(mode="after")
    def _alertmanager_fits(self) -> Config:
        am = self.alertmanager
        for index, group in enumerate(self.group):
            if am is None:
                if group.alertmanager is not None:
                    raise KeyedValueError(
                        f"group[{index}].alertmanager",
                        "only meaningful together with an [alertmanager] section (its url)",
                    )
                continue
            if all(m.matches_empty() for m in am.matchers_for(group)):
                key = (
                    f"group[{index}].alertmanager.silence_matchers"
                    if group.alertmanager
                    else "alertmanager.silence_matchers"
                )
                raise KeyedValueError(
                    key,
                    f"for group {group.name!r} every matcher also matches alerts without the "
                    "label: the silence would silence every alert (Alertmanager refuses it)",
                )
        if am is not None:
            # Renewed once a cycle when less than half is left: that half must hold two cycles
            # and a renewal that times out, or the silence lapses while the group restarts.
            least = 4 * self.watchdog.cycle_seconds + 2 * am.timeout_seconds
            if am.silence_seconds < least:
                raise KeyedValueError(
                    "alertmanager.silence_seconds",
                    f"{am.silence_seconds:g} is shorter than 4 x watchdog.cycle_seconds + "
                    f"2 x alertmanager.timeout_seconds ({least:g}): it is renewed once a cycle "
                    "when less than half is left, so it would lapse while the group restarts",
                )
        return self

    def group_named(self, name: str) -> GroupSection:
        """The group called `name`; KeyError lists the known names."""
        for group in self.group:
            if group.name == name:
                return group
        known = ", ".join(g.name for g in self.group)
        raise KeyError(f"no group named {name!r} (known: {known})")


def _entry(key: str, index: int) -> str:
    """One entry of an array in the file, counted from 1 as reports count workers: `group#1`."""
    return f"{key}#{index + 1}"


def _child(node: object, part: int | str) -> object:
    """The value at `part` of a parsed TOML value, None where the file has none."""
    if isinstance(node, dict):
        return node.get(part)
    if isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
        return node[part]
    return None


def _format_location(loc: tuple[int | str, ...], data: object) -> str:
    """A pydantic location as a key of the file: `group#1.decode#2.unit`. An array's entries are
    counted from 1 (`#N`, the spelling of workers in reports and logs), and a role's only worker
    is the role alone, as in reports, whether the file wrote it as a table or an array of one."""
    out, key, node = "", "", data
    for part in loc:
        if part in _SHAPE_TAGS:
            continue  # which shape of a role's workers was validated: not a key of the file
        if isinstance(part, int):
            alone = key in _WORKER_ROLES and isinstance(node, list) and len(node) == 1
            out = out if alone else _entry(out, part)
        else:
            out, key = (f"{out}.{part}" if out else part), part
        node = _child(node, part)
    return out or "(top level)"


def _issue_from_pydantic(file: str, error: Any, data: object) -> ConfigIssue:
    loc: tuple[int | str, ...] = tuple(error["loc"])
    kind = error["type"]
    cause = error.get("ctx", {}).get("error")
    if isinstance(cause, KeyedValueError):
        prefix = _format_location(loc, data)
        key = f"{prefix}.{cause.key}" if loc else cause.key
        return ConfigIssue(file, key, cause.reason)
    if kind == "extra_forbidden":
        reason = "unknown key"
    elif kind == "missing":
        reason = "required key is missing"
    elif isinstance(cause, Exception):
        reason = str(cause)
    else:
        reason = str(error["msg"])
        if error.get("input") is not None and kind not in ("model_type", "dict_type"):
            reason = f"{reason} (got {_shown(error['input'])})"
    return ConfigIssue(file, _format_location(loc, data), reason)


def parse_config(data: dict[str, Any], file: str) -> Config:
    """Validate an already-parsed TOML document; raises ConfigError with every issue."""
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        issues = [_issue_from_pydantic(file, err, data) for err in exc.errors(include_url=False)]
        raise ConfigError(issues) from None
    for group in config.group:  # masked wherever they show up, bare or as a Basic credential
        urls = [w.url for role in ROLES for w in group.workers(role)]
        for url in (*urls, group.router.metrics_url):
            if url:
                remember_url_credentials(url)
    if config.alertmanager is not None:
        remember_url_credentials(config.alertmanager.url)
    return config


def load_config(path: Path | str) -> Config:
    """Read and validate a TOML config file; raises ConfigError naming the file and key."""
    file = str(path)
    raw = _read_capped(file)
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError([ConfigIssue(file, "(file)", "not UTF-8 text")]) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([ConfigIssue(file, "(file)", f"invalid TOML: {exc}")]) from None
    except RecursionError:
        # tomllib parses arrays and inline tables recursively: `a = [[[...]]]` thousands deep
        # exhausts the interpreter's stack. No config nests more than a few levels.
        raise ConfigError(
            [ConfigIssue(file, "(file)", "invalid TOML: arrays or inline tables nested too deeply")]
        ) from None
    return parse_config(data, file)


def _read_capped(file: str) -> bytes:
    def refuse(reason: str) -> ConfigError:
        return ConfigError([ConfigIssue(file, "(file)", reason)])

    if "\x00" in file:
        raise refuse("cannot read: the path contains a NUL byte")
    try:
        with open(file, "rb") as stream:
            raw = stream.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise refuse(f"cannot read: {exc.strerror or exc}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise refuse(f"larger than {MAX_CONFIG_BYTES >> 20} MiB; not a watchdog config file")
    return raw


def mask_url(url: str) -> str:
    """The URL with its userinfo (user and password, or a token as the user) replaced by ***."""
    return redact_url(url)


def effective_config(config: Config) -> dict[str, Any]:
    """The config with defaults filled in and URL passwords masked (api_key_file names a file;
    its contents are never part of the config), ready to render as TOML."""
    data = config.model_dump(mode="json", by_alias=True)
    # Optional sections left unset are left out, as a file that never had them.
    if data.get("alertmanager") is None:
        data.pop("alertmanager", None)
    else:
        data["alertmanager"]["url"] = mask_url(data["alertmanager"]["url"])
        if data["alertmanager"].get("bearer_token_file") is None:
            data["alertmanager"].pop("bearer_token_file", None)
    for group in data["group"]:
        if group.get("alertmanager") is None:
            group.pop("alertmanager", None)
        for role in ROLES:
            workers = group[role.value]
            for worker in workers if isinstance(workers, list) else [workers]:
                worker["url"] = mask_url(worker["url"])
        # Single-host configs stay as they were: unset host keys are left out, not null.
        sections = [group]
        for role in ROLES:
            workers = group[role.value]
            sections += workers if isinstance(workers, list) else [workers]
        for fields in sections:
            for key in HostFields.model_fields:
                if fields.get(key) is None:
                    fields.pop(key, None)
        if group["router"].get("metrics_url"):
            group["router"]["metrics_url"] = mask_url(group["router"]["metrics_url"])
    return data
