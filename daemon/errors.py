"""Domain errors of the daemon; the servicers map each to one gRPC status."""

from __future__ import annotations

from hetpilot.planner.errors import ValidationError

__all__ = [
    "DamagedStore",
    "FailedPrecondition",
    "NotFound",
    "PermissionDenied",
    "StorageError",
    "StorageFull",
    "StorageUnavailable",
    "TooLarge",
    "ValidationError",
]


class NotFound(LookupError):
    """No such job or agent for this caller (another owner's job included)."""


class TooLarge(ValueError):
    """A request over a size limit (RESOURCE_EXHAUSTED)."""


class PermissionDenied(PermissionError):
    """The caller is known but its token does not reach this object (another job's)."""


class FailedPrecondition(RuntimeError):
    """The request is well formed but the object's state forbids it (a cancelled job)."""


class StorageError(RuntimeError):
    """The state store failed to read or write; nothing of the failed write was committed."""


class StorageFull(StorageError):
    """The store cannot write: its disk or quota is full (RESOURCE_EXHAUSTED)."""


class StorageUnavailable(StorageError):
    """Any other storage fault: I/O error, damaged pages, locked past the busy timeout,
    read-only file (UNAVAILABLE)."""


class StateDirInUse(StorageError):
    """Another daemon holds the state directory's lock: two daemons on one state.db would
    each run every job's control loop and overwrite each other's writes."""


class DamagedStore(StorageError):
    """Opening refused: the database is empty (0 bytes), not a database, or fails
    ``PRAGMA quick_check``. The message is one line: path, problem, what to do."""
