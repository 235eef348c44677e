"""Exit codes of hetpilot's commands for the gRPC status a call to the daemon ended
with: 2 bad input (INVALID_ARGUMENT, RESOURCE_EXHAUSTED), 3 no such job (NOT_FOUND),
4 not authenticated or not allowed, 5 daemon unreachable or too slow (UNAVAILABLE,
DEADLINE_EXCEEDED), 6 the job's state forbids it (FAILED_PRECONDITION); any other
failure is 1. Shared by the client and the trainer's command line."""

from __future__ import annotations

import grpc

__all__ = ["EXIT"]

EXIT = {
    grpc.StatusCode.INVALID_ARGUMENT: 2, grpc.StatusCode.RESOURCE_EXHAUSTED: 2,
    grpc.StatusCode.NOT_FOUND: 3, grpc.StatusCode.UNAUTHENTICATED: 4,
    grpc.StatusCode.PERMISSION_DENIED: 4, grpc.StatusCode.UNAVAILABLE: 5,
    grpc.StatusCode.DEADLINE_EXCEEDED: 5, grpc.StatusCode.FAILED_PRECONDITION: 6,
}
"""The exit code of each gRPC status a command maps (others: 1)."""
