"""Reading the daemon's and agents' TOML config files (one shared loader)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

__all__ = ["ConfigError", "read_tables"]


class ConfigError(ValueError):
    """A config file or option that cannot be used; the message names it."""


def read_tables(path: str | Path | None, allowed: set[str]) -> dict[str, Any]:
    """The file's top-level tables (empty without a file); unknown tables are an error."""
    if path is None:
        return {}
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    unknown = set(data) - allowed
    if unknown:
        raise ConfigError(f"{path}: unknown table(s) {', '.join(sorted(unknown))}")
    return data
