"""List answers that fit in one message (ListJobs, ListNodes).

A list call answered with everything it has would outgrow the message size limit
(``max_message_bytes``, and the 4 MiB a gRPC client receives by default) once enough
was accepted: 40 jobs each allowing 1024 hosts of 128 characters, or 250 hosts of 64
devices, and every later call failed with RESOURCE_EXHAUSTED. So an answer takes items
in order while they fit, and names the last one as the token of the next page.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["CLIENT_RECEIVE_BYTES", "budget", "fitting"]

CLIENT_RECEIVE_BYTES = 4 * 1024 * 1024
"""What a gRPC client receives at most unless told otherwise."""


def budget(max_message_bytes: int) -> int:
    """Bytes of items one answer may carry: the smaller of the two limits, less room for
    the answer's other fields."""
    return min(max_message_bytes, CLIENT_RECEIVE_BYTES) * 15 // 16


def fitting(sizes: Sequence[int], limit: int) -> int:
    """How many of the leading items (serialised sizes in bytes) one answer takes: all
    that fit in ``limit``, and at least one (a single item over it fails on its own)."""
    total = 0
    for n, size in enumerate(sizes):
        total += size + 6  # a repeated field's tag and length
        if total > limit and n > 0:
            return n
    return len(sizes)
