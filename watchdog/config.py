"""Typed, frozen, strict configuration: load_config(path) parses TOML, pydantic validates it.

Every problem is reported as a ConfigIssue naming the file, the dotted key path and the reason;
all of them are collected before failing, so an operator fixes a file in one pass.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from watchdog.errors import ConfigError, ConfigIssue
from watchdog.model import Role

DEFAULT_CONFIG_PATH = Path("/etc/sglang-watchdog/watchdog.toml")

# Every role of a group, in the only safe co-restart order (see DECODE_ONLY_EXPLANATION).
ROLES: tuple[Role, Role, Role] = (Role.PREFILL, Role.DECODE, Role.ROUTER)

# systemd.unit(5): unit names are at most 255 bytes of [A-Za-z0-9:_.\-] with an optional @instance.
# Template names ("foo@.service") cannot be restarted, so an instance is required after "@".
_UNIT_NAME = re.compile(r"^[A-Za-z0-9:_.\\-]+(@[A-Za-z0-9:_.\\-]+)?\.service$")
# Group names become parts of file names (incident directories, state files) and metric labels.
_GROUP_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")

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


def _check_url(value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"{value!r} is not an http(s) URL")
    if not parts.hostname:
        raise ValueError(f"{value!r} has no host")
    try:
        _ = parts.port
    except ValueError as exc:
        raise ValueError(f"{value!r} has an invalid port") from exc
    if parts.query or parts.fragment:
        raise ValueError(f"{value!r} must not have a query or fragment")
    return value.rstrip("/")


def _check_unit(value: str) -> str:
    if len(value) > 255 or not _UNIT_NAME.match(value):
        raise ValueError(
            f"{value!r} is not a valid systemd service unit name "
            "(letters, digits, ':', '_', '.', '-', an optional '@instance', ending in '.service')"
        )
    return value


def _check_group_name(value: str) -> str:
    if not _GROUP_NAME.match(value):
        raise ValueError(
            f"{value!r} is not a safe group name (1-63 of letters, digits, '_', '.', '-', "
            "starting with a letter or digit)"
        )
    return value


HttpUrl = Annotated[str, AfterValidator(_check_url)]
UnitName = Annotated[str, AfterValidator(_check_unit)]
GroupName = Annotated[str, AfterValidator(_check_group_name)]
PositiveSeconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegativeSeconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]
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

    state_dir: Path = Path("/var/lib/sglang-watchdog")
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
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{value!r} is not HOST:PORT (e.g. 127.0.0.1:9464)")
        return value


class UnitSection(_Strict):
    """One serving process: its systemd unit, base URL and optional drift expectations."""

    unit: UnitName
    url: HttpUrl
    expect_cmdline_contains: tuple[str, ...] = ()
    expect_env: dict[str, str] = Field(default_factory=dict)


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
    api_key_file: Path | None = None
    # SGLang requires the admin key on /abort_request when a worker runs with --admin-api-key.
    admin_api_key_file: Path | None = None
    multiround_every_seconds: NonNegativeSeconds = 300.0
    multiround_rounds: PositiveInt = 5
    health_timeout_seconds: PositiveSeconds = 5.0
    scrape_timeout_seconds: PositiveSeconds = 5.0

    @field_validator("expect_regex")
    @classmethod
    def _regex(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"not a valid regular expression: {exc}") from exc
        return value

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
    no_progress_seconds: PositiveSeconds = 25.0
    transfer_failures: PositiveInt = 5
    # A transfer path failing this share of the transfers attempted in the window is degraded even
    # while probes pass (router retries hide it), once at least transfer_min_attempts were made.
    transfer_failure_ratio: Fraction = 0.5
    transfer_min_attempts: PositiveInt = 20
    window_seconds: PositiveSeconds = 300.0
    pinned_inflight_seconds: PositiveSeconds = 600.0
    startup_timeout_seconds: PositiveSeconds = 1200.0
    decode_only_grace_seconds: NonNegativeSeconds = 60.0
    on_decode_only_restart: Literal["co-restart", "alert"] = "co-restart"


class RestartSection(_Strict):
    """The co-restart sequence and its budget."""

    order: tuple[RoleName, ...] = ROLES
    ready_timeout_seconds: PositiveSeconds = 900.0
    max_restarts: PositiveInt = 3
    budget_window_seconds: PositiveSeconds = 3600.0
    backoff_seconds: NonNegativeSeconds = 300.0
    verify_probes: PositiveInt = 8
    verify_timeout_seconds: PositiveSeconds = 300.0

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


class GroupSection(_Strict):
    """One PD deployment: prefill + decode + router, probed and restarted together."""

    name: GroupName
    prefill: UnitSection
    decode: UnitSection
    router: RouterSection
    probe: ProbeSection = Field(default_factory=ProbeSection)
    stall: StallSection = Field(default_factory=StallSection)
    restart: RestartSection = Field(default_factory=RestartSection)

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
        units = [self.prefill.unit, self.decode.unit, self.router.unit]
        if len(set(units)) != len(units):
            raise KeyedValueError(
                "router.unit", f"prefill, decode and router share a unit: {units}"
            )
        return self

    def unit_for(self, role: Role) -> UnitSection:
        """The section of `role`."""
        match role:
            case Role.PREFILL:
                return self.prefill
            case Role.DECODE:
                return self.decode
            case Role.ROUTER:
                return self.router


class Config(_Strict):
    """The whole file."""

    watchdog: WatchdogSection = Field(default_factory=WatchdogSection)
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
                    f"group[{index}].name",
                    f"{group.name!r} is already used by group[{seen[group.name]}]; "
                    "group names must be unique",
                )
            seen[group.name] = index
        owners: dict[str, str] = {}
        for index, group in enumerate(self.group):
            for role in ROLES:
                unit = group.unit_for(role).unit
                if unit in owners:
                    raise KeyedValueError(
                        f"group[{index}].{role}.unit",
                        f"{unit!r} is already used by {owners[unit]}",
                    )
                owners[unit] = f"group[{index}].{role}.unit"
        return self

    def group_named(self, name: str) -> GroupSection:
        """The group called `name`; KeyError lists the known names."""
        for group in self.group:
            if group.name == name:
                return group
        known = ", ".join(g.name for g in self.group)
        raise KeyError(f"no group named {name!r} (known: {known})")


def _format_location(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out or "(top level)"


def _issue_from_pydantic(file: str, error: Any) -> ConfigIssue:
    loc: tuple[int | str, ...] = tuple(error["loc"])
    kind = error["type"]
    cause = error.get("ctx", {}).get("error")
    if isinstance(cause, KeyedValueError):
        prefix = _format_location(loc)
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
            reason = f"{reason} (got {error['input']!r})"
    return ConfigIssue(file, _format_location(loc), reason)


def parse_config(data: dict[str, Any], file: str) -> Config:
    """Validate an already-parsed TOML document; raises ConfigError with every issue."""
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        issues = [_issue_from_pydantic(file, err) for err in exc.errors(include_url=False)]
        raise ConfigError(issues) from None


def load_config(path: Path | str) -> Config:
    """Read and validate a TOML config file; raises ConfigError naming the file and key."""
    file = str(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError([ConfigIssue(file, "(file)", f"cannot read: {exc.strerror}")]) from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError([ConfigIssue(file, "(file)", "not UTF-8 text")]) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([ConfigIssue(file, "(file)", f"invalid TOML: {exc}")]) from None
    return parse_config(data, file)


def mask_url(url: str) -> str:
    """The URL with any password in its userinfo replaced by ***."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def effective_config(config: Config) -> dict[str, Any]:
    """The config with defaults filled in and URL passwords masked (api_key_file names a file;
    its contents are never part of the config), ready to render as TOML."""
    data = config.model_dump(mode="json")
    for group in data["group"]:
        for role in ROLES:
            group[role.value]["url"] = mask_url(group[role.value]["url"])
        if group["router"].get("metrics_url"):
            group["router"]["metrics_url"] = mask_url(group["router"]["metrics_url"])
    return data
