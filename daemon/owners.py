"""The owner tokens file (``auth.owner_tokens_file``): who may submit jobs, and as
which unix user their ranks run on launching hosts.

Two forms, mixable in one file::

    bob = "bob-token"            # a token only: bob's jobs launch only on agents
                                 # that run every launch as themselves
    [alice]
    token = "alice-token"
    unix_user = "alice"          # alice's ranks run as this user (uid, gid, groups, HOME)

The unix user is a name, resolved on each launching host by its agent (it need not
exist on the daemon's host).
"""

from __future__ import annotations

import re
from typing import Any

from hetpilot.tomlconfig import ConfigError

__all__ = ["check_unix_user", "read_owners"]

_UNIX_USER = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}\$?")
"""What useradd accepts (POSIX portable names, up to 32 characters)."""


def check_unix_user(user: object, where: str) -> str:
    """``user`` as a valid unix user name; a ConfigError naming ``where`` if not. Root is
    refused: ranks never run as root on the daemon's say-so."""
    if not isinstance(user, str) or not _UNIX_USER.fullmatch(user):
        raise ConfigError(f"{where}: must be a unix user name (letters, digits, '_', '.', "
                          f"'-'; up to 32), got {user!r}")
    if user == "root":
        raise ConfigError(f"{where}: ranks never run as root; give the owner her own user")
    return user


def read_owners(data: dict[str, Any], where: str) -> tuple[dict[str, str], dict[str, str]]:
    """(owner -> token, owner -> unix user) from a parsed owner tokens file."""
    tokens: dict[str, str] = {}
    users: dict[str, str] = {}
    for owner, value in data.items():
        here = f"{where}: {owner}"
        if isinstance(value, dict):
            unknown = set(value) - {"token", "unix_user"}
            if unknown:
                raise ConfigError(f"{here}: unknown key(s) {', '.join(sorted(unknown))} "
                                  "(an owner's table has token and unix_user)")
            token = value.get("token")
            if token is None:
                raise ConfigError(f"{here}: the table has no token")
            if "unix_user" in value:
                users[owner] = check_unix_user(value["unix_user"], f"{here}.unix_user")
        else:
            token = value
        if not isinstance(token, str):
            raise ConfigError(f"{here}: the token must be a string, got {type(token).__name__}")
        tokens[owner] = token
    return tokens, users
