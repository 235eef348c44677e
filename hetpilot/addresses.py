"""``host:port`` addresses from flags and config files, checked before use: gRPC
and sockets would take port 99999 modulo 65536 (34463) without a word."""

from __future__ import annotations

import ipaddress

__all__ = ["check_address", "is_loopback"]


def check_address(value: str, field: str, *, listen: bool = False) -> str:
    """``value`` if it is ``host:port`` with a port in 1..65535 (0 too when ``listen``:
    the OS picks); else ValueError naming ``field``."""
    host, sep, port = value.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{field}: must be host:port, got {value!r}")
    lowest = 0 if listen else 1
    if not port.isdigit() or not lowest <= int(port) <= 65535:
        raise ValueError(f"{field}: port must be an integer in {lowest}..65535, got {port!r}")
    return value


def is_loopback(listen: str) -> bool:
    """Whether ``host:port`` listens on this machine only (127.0.0.0/8, ::1, localhost)."""
    host = listen.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
