"""The host secret: what binds this agent's host name at the daemon.

The cluster token only bootstraps a host (as a kubelet's bootstrap token does):
the first Register of a name binds it to the secret it carries, and every later
Register of the name must carry the same secret (RegisterRequest.host_secret).
The agent makes its secret itself, before its first Register, and keeps it in
its state dir (``host.secret``, mode 0600): a Register whose answer was lost is
simply sent again with the same secret. A lost file locks the name until an
operator runs ``hetpilot nodes forget HOST``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

__all__ = ["FILE", "HostSecret"]

FILE = "host.secret"


class HostSecret:
    """The secret in ``state_dir/host.secret``, made on first use."""

    def __init__(self, state_dir: Path) -> None:
        self.path = Path(state_dir) / FILE
        self._value = ""

    def value(self) -> str:
        """The secret: read from the file, else made and written there (0600) first."""
        if not self._value:
            try:
                self._value = self.path.read_text().strip()
            except FileNotFoundError:
                self.replace(secrets.token_urlsafe(32))
            if not self._value:
                raise OSError(f"{self.path} is empty: remove it, and have an operator run "
                              "`hetpilot nodes forget HOST` if the daemon knows this host")
        return self._value

    def replace(self, secret: str) -> None:
        """Keep ``secret`` (written whole, 0600, then renamed over the old file)."""
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = self.path.with_name(f".{FILE}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(secret + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        self._value = secret
