"""A daemon that works on one machine as started, without writing any config.

Why: a daemon with no tokens configured would start and then refuse every
call (UNAUTHENTICATED), which looks like a broken install. Two ways out,
both loud about what they do:

* ``--insecure-local`` (:func:`insecure_auth`): no tokens at all, for a trial
  on one machine. Only a loopback listen address is accepted (a config
  naming another is refused, exit 2), and the daemon says on stderr and in
  its log that every local caller is owner "anonymous" and may act as any
  agent or trainer.
* otherwise, when the config names neither owner tokens nor a cluster token
  (:func:`generated_auth`): the first start writes an owner token (owner
  "admin") and a cluster token into the state dir (0600), later starts
  reuse them, and the daemon prints the exact commands that use them.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
from dataclasses import replace
from pathlib import Path

from .config import AuthConfig

__all__ = ["GENERATED_OWNER", "announce_generated", "generated_auth", "insecure_auth"]

log = logging.getLogger("hetpilot.daemon")

GENERATED_OWNER = "admin"
OWNER_TOKEN_FILE = "owner.token"
CLUSTER_TOKEN_FILE = "cluster.token"


def _say(message: str) -> None:
    """Both on stderr (the person who started it) and in the log (the journal)."""
    print(f"hetpilot daemon: {message}", file=sys.stderr, flush=True)
    log.warning("%s", message)


def insecure_auth(auth: AuthConfig, listen: str) -> AuthConfig:
    """``auth`` with authentication off, announced loudly."""
    _say(f"WARNING: --insecure-local: NO AUTHENTICATION. Listening on {listen} only; every "
         "caller on this machine is job owner 'anonymous' and may act as any agent or "
         "trainer. For a trial on one machine: deploy with tokens (and TLS) as "
         "docs/operating.md shows.")
    return replace(auth, allow_unauthenticated=True)


def _token(path: Path) -> str:
    """The token in ``path``, made (0600, atomically) when the file does not exist."""
    if not path.exists():
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_hex(24) + "\n")
        tmp.replace(path)
    lines = path.read_text().strip().splitlines()
    if not lines or len(lines[0].strip()) < 8:
        raise OSError(f"{path}: holds no token of >= 8 characters; delete it to make a new one")
    return lines[0].strip()


def generated_auth(auth: AuthConfig, state_dir: Path) -> tuple[AuthConfig, list[Path]] | None:
    """When ``auth`` (resolved) has no token at all and is not open: an owner token and a
    cluster token from files in ``state_dir`` (made on the first start), and the files.
    None when the config names tokens (nothing is generated then)."""
    if auth.allow_unauthenticated or auth.owner_tokens or auth.cluster_token:
        return None
    state_dir = state_dir.resolve()  # the commands printed must work from anywhere
    owner_file, cluster_file = state_dir / OWNER_TOKEN_FILE, state_dir / CLUSTER_TOKEN_FILE
    owner, cluster = _token(owner_file), _token(cluster_file)
    if owner == cluster:  # never, short of a broken random source
        raise OSError(f"{owner_file} and {cluster_file} hold the same token; delete both")
    return replace(auth, owner_tokens={GENERATED_OWNER: owner},
                   cluster_token=cluster), [owner_file, cluster_file]


def _local(address: str) -> str:
    """The address a client on this machine dials for a wildcard listen address."""
    host, _, port = address.rpartition(":")
    return {"0.0.0.0": f"127.0.0.1:{port}", "[::]": f"[::1]:{port}",
            "::": f"[::1]:{port}"}.get(host, address)


def announce_generated(files: list[Path], address: str) -> None:
    """The commands that use the generated tokens, with the address the daemon serves on."""
    owner_file, cluster_file = files
    addr = _local(address)
    _say(f"no tokens configured: using {owner_file} (job owner {GENERATED_OWNER!r}) and "
         f"{cluster_file} (agents, drain and resume), made on the first start. Use them:\n"
         f"  export HETPILOT_ADDRESS={addr} HETPILOT_TOKEN=\"$(cat {owner_file})\"\n"
         f"  hetpilot agent --daemon {addr} --token-file {cluster_file} "
         "--run-as agent --emulate tflops=50,memory_gb=24\n"
         f"  hetpilot drain HOST --token-file {cluster_file}\n"
         "Set [auth] owner_tokens_file and cluster_token_file in a config to use your own.")
