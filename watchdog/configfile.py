"""Config files written, not read: a validated Config rendered as TOML, or built from overrides.

The one place that writes watchdog TOML. `build_config` deep-merges layers of overrides nested like
the file ({"watchdog": {...}, "group": [{"name": ..., "prefill": {...}}]}) and validates them with
the parser `load_config` uses, so a bad override fails loudly (ConfigError, with the key); every
default stays in watchdog/config.py. In a layer, "group" is either a list (the groups, merged by
position with earlier layers) or one table merged into every group; later layers win.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tomli_w

from watchdog.config import Config, effective_config, parse_config

Overrides = Mapping[str, Any]

_API_KEY_LINES = ("api_key_file = ", "admin_api_key_file = ")


def merge(base: Overrides, top: Overrides) -> dict[str, Any]:
    """`top` over `base`, tables merged key by key (neither argument is modified)."""
    out: dict[str, Any] = dict(base)
    for key, value in top.items():
        below = out.get(key)
        if isinstance(below, Mapping) and isinstance(value, Mapping):
            out[key] = merge(below, value)
        else:
            out[key] = value
    return out


def merge_layers(*layers: Overrides) -> dict[str, Any]:
    """One document from `layers`, later ones winning; see the module docstring for "group"."""
    document: dict[str, Any] = {}
    every_group: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    for layer in layers:
        rest = {key: value for key, value in layer.items() if key != "group"}
        document = merge(document, rest)
        if "group" not in layer:
            continue
        group = layer["group"]
        if isinstance(group, Mapping):
            every_group = merge(every_group, group)
            groups = [merge(existing, group) for existing in groups]
        elif isinstance(group, list | tuple):
            for index, entry in enumerate(group):
                below = groups[index] if index < len(groups) else every_group
                merged = merge(below, entry) if isinstance(entry, Mapping) else entry
                if index < len(groups):
                    groups[index] = merged
                else:
                    groups.append(merged)
        else:
            document["group"] = group  # not a list of tables: the parser says so
    if groups:
        document["group"] = groups
    return document


def build_config(*layers: Overrides, source: str = "<overrides>") -> Config:
    """The validated Config of the merged `layers`; ConfigError (naming `source`) if invalid."""
    return parse_config(merge_layers(*layers), source)


def _without_none(value: Any) -> Any:
    # TOML has no null: an unset optional key (None) is simply left out.
    if isinstance(value, Mapping):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple):
        return [_without_none(v) for v in value]
    return value


def render_toml(config: Config) -> str:
    """The whole config as TOML, every default written out; it loads back to an equal Config."""
    return tomli_w.dumps(_without_none(config.model_dump(mode="json", by_alias=True)))


def config_text(*layers: Overrides) -> str:
    """The TOML of the validated, merged `layers` (see `build_config`)."""
    return render_toml(build_config(*layers))


def write_config(path: Path, *layers: Overrides) -> Path:
    """Validate the merged `layers` and write them to `path` as TOML; returns `path`."""
    path.write_text(config_text(*layers), encoding="utf-8")
    return path


def effective_toml(config: Config) -> str:
    """What `watchdog validate` prints: the config with defaults filled in and secrets masked.

    It is itself a valid config file; only masked URL passwords differ from the original.
    """
    lines = [
        "# Effective config: defaults filled in, passwords in URLs shown as ***.",
        *tomli_w.dumps(_without_none(effective_config(config))).splitlines(),
    ]
    # The key file is named, its contents are never read into the output.
    shown = [
        f"{line}  # contents never shown" if line.startswith(_API_KEY_LINES) else line
        for line in lines
    ]
    return "\n".join(shown) + "\n"
