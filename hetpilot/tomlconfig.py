"""Reading the daemon's and agents' TOML config files (one shared loader)."""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

__all__ = ["ConfigError", "build", "check_types", "read_tables", "table"]


class ConfigError(ValueError):
    """A config file or option that cannot be used; the message names it."""


def read_tables(path: str | Path | None, allowed: set[str]) -> dict[str, Any]:
    """The file's top-level tables (empty without a file); unknown tables are an error."""
    if path is None:
        return {}
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    unknown = set(data) - allowed
    if unknown:
        raise ConfigError(f"{path}: unknown table(s) {', '.join(sorted(unknown))}")
    return data


def table(data: dict[str, Any], name: str) -> dict[str, Any]:
    """A copy of the ``[name]`` table of ``data`` (empty when absent)."""
    value = data.get(name, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{name}: must be a table ([{name}]), got {value!r}")
    return dict(value)


def build(cls: type, data: dict[str, Any], path: str) -> Any:
    """``cls(**data)`` for one table: an unknown key, or a value whose TOML type is not the
    field's, is an error naming ``path.key``. Checked before the dataclass sees it, because
    Python would take ``allow_unauthenticated = "false"`` as true."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: must be a table, got {data!r}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {', '.join(sorted(unknown))}")
    check_types(typing.get_type_hints(cls), data, path)
    try:
        return cls(**data)
    except TypeError as exc:
        raise ConfigError(f"{path}: {exc}") from None


_PLURAL = {str: "strings (in quotes)", int: "integers", float: "numbers", bool: "true/false"}


def check_types(expected: dict[str, Any], data: dict[str, Any], path: str) -> None:
    """Each key of ``data`` that ``expected`` names must have a value of that TOML type
    (bool, int, float, str, ``list[str]``, ``dict[str, T]``, unions of these); the error
    names ``path.key``. A string is not taken as a list of its letters, nor "no" as true."""
    for key, value in data.items():
        if key in expected:
            want = _type_problem(expected[key], value)
            if want is not None:
                raise ConfigError(f"{path}.{key}: must be {want}, got {value!r}")


def _type_problem(tp: Any, value: Any) -> str | None:
    """What ``value`` should have been for a field of type ``tp`` (None: it is)."""
    if tp is bool:
        return None if isinstance(value, bool) else "true or false"
    if tp is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "an integer"
    if tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if ok else "a number"
    if tp is str:
        return None if isinstance(value, str) else "a string (in quotes)"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        wants = [_type_problem(a, value) for a in args]
        return None if None in wants else " or ".join(w for w in wants if w)
    if origin is list:
        ok = isinstance(value, list) and all(_type_problem(args[0], v) is None for v in value)
        return None if ok else f"a list of {_PLURAL.get(args[0], 'values')}"
    if origin is dict:
        ok = isinstance(value, dict) and all(
            isinstance(k, str) and _type_problem(args[1], v) is None for k, v in value.items())
        return None if ok else ("a table of name = \"string\" entries" if args[1] is str
                                else f"a table of {_PLURAL.get(args[1], 'values')}")
    if origin is tuple:
        return None if isinstance(value, tuple) else "a list"
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return None if isinstance(value, tp) else "a table"
    return None
