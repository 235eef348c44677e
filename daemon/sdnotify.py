"""systemd notify protocol (sd_notify(3)) over $NOTIFY_SOCKET: READY, STATUS,
WATCHDOG, STOPPING. A few lines of socket code; a no-op outside systemd."""

from __future__ import annotations

import os
import socket

__all__ = ["Notifier"]


class Notifier:
    def __init__(self, address: str | None = None) -> None:
        self._address = address if address is not None else os.environ.get("NOTIFY_SOCKET", "")
        if self._address.startswith("@"):  # abstract namespace
            self._address = "\0" + self._address[1:]
        self._sock: socket.socket | None = None
        if self._address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def notify(self, **fields: str | int) -> bool:
        """Send ``KEY=value`` lines, e.g. ``notify(READY=1, STATUS="serving")``."""
        if self._sock is None:
            return False
        text = "\n".join(f"{k}={v}" for k, v in fields.items())
        try:
            self._sock.sendto(text.encode(), self._address)
        except OSError:
            return False
        return True

    @staticmethod
    def watchdog_interval_s() -> float | None:
        """Half of $WATCHDOG_USEC when systemd asks for pings to this process."""
        usec = os.environ.get("WATCHDOG_USEC")
        pid = os.environ.get("WATCHDOG_PID")
        if not usec or (pid and pid != str(os.getpid())):
            return None
        try:
            return int(usec) / 2e6
        except ValueError:
            return None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
